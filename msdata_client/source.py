"""SourceSpec: one data source of a job (a `[[source]]` table): where its samples live and how each becomes tokens."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from msdata_client._validate import (
    check_float,
    check_int,
    check_keys,
    check_name,
    check_shuffle,
    check_str_tuple,
    check_transform,
    resolve_path,
)
from msdata_client.choices import DEFAULT_TRANSFORM, SHUFFLE_SPREAD, SHUFFLE_WINDOW, ShuffleMode, SourceFormat
from msdata_client.errors import ConfigError
from msdata_client.tokenizer import resolve_tokenizer

__all__ = ["SYNTHETIC_DEFAULTS", "Shuffle", "SourceSpec", "synthetic_only"]

# options of synthetic sources only, with their defaults
SYNTHETIC_DEFAULTS: dict[str, Any] = {"samples": 10000, "median": 512.0, "sigma": 1.0, "min_len": 16, "max_len": 65536}
_PATHS_FIX = "list files, dirs or globs"


def synthetic_only(where: str, fmt: Any, options: Any, *, use: str) -> ConfigError:
    """The error for a source of format `fmt` that sets `options` of synthetic sources."""
    return ConfigError(
        f"{where} has format {fmt!r} but sets {', '.join(options)}, options of synthetic sources only; "
        f"remove them or use {use}"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Shuffle:
    """A source's read order, resolved from `[[source]] shuffle` (README "The order of a source").

    `mode` "mix" (the default) interleaves the rows of `spread` files; "file" reads one file at a time;
    "none" is a fixed order (files in path order, rows in file order). `window` rows are shuffled together.
    """

    mode: ShuffleMode = ShuffleMode.MIX
    spread: int = SHUFFLE_SPREAD
    window: int = SHUFFLE_WINDOW

    @classmethod
    def of(cls, value: bool | Mapping[str, Any]) -> Shuffle:
        """The settings of a checked `shuffle` value (true, false or a table)."""
        if value is True:
            return cls()
        if value is False:
            return cls(mode=ShuffleMode.NONE)
        mode = ShuffleMode(value.get("mode", ShuffleMode.MIX.value))
        return cls(mode=mode, spread=value.get("spread", SHUFFLE_SPREAD), window=value.get("window", SHUFFLE_WINDOW))


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceSpec:
    """One data source: where its samples live and how each becomes tokens.

    Relative `paths` become absolute (against the TOML's directory, or the working directory), and so does a
    relative tokenizer file in the transform (``hf_tokenizer("tok.json")``, ``vlm(tokenizer="tok.json")``). A synthetic
    source reads no files and its records are already token ids, so its transform defaults to None.
    `columns` selects several columns (fields; a WebDataset sample's extensions, "jpg;png" for either) and
    the transform gets a dict keyed by their names; without it a record is the value of `column` (a
    WebDataset sample without `columns` is a dict of the extensions most of its samples have).
    `shuffle` picks the read order (see `Shuffle`): true (rows mixed across files), false (a fixed order)
    or a table such as { spread = 64 } or { mode = "file" }.
    """

    name: str
    format: str
    paths: tuple[str, ...] = ()
    column: str = "text"
    transform: str | None = DEFAULT_TRANSFORM
    max_sample_bytes: int = 64 << 20
    columns: tuple[str, ...] | None = None
    samples: int = 10000
    median: float = 512.0
    sigma: float = 1.0
    min_len: int = 16
    max_len: int = 65536
    shuffle: bool | Mapping[str, Any] = True

    def __post_init__(self) -> None:
        name = check_name("source name", self.name)
        where = f"source {name!r}"
        fmt = SourceFormat.parse(self.format, f"{where} format").value
        synthetic = fmt == SourceFormat.SYNTHETIC
        paths = check_str_tuple(f"{where} paths", self.paths, fix=_PATHS_FIX)
        paths = tuple(resolve_path(p, None) for p in paths)
        if not synthetic and not paths:
            raise ConfigError(
                f"{where} has format {fmt!r} but no paths; set paths = [...] to its files, directories or globs"
            )
        if synthetic and paths:
            raise ConfigError(f"{where} is synthetic and reads no files, but paths={list(paths)!r}; remove paths")
        if not isinstance(self.column, str) or not self.column:
            raise ConfigError(f"{where} column={self.column!r} must be a non-empty column or field name")
        if synthetic and self.column != "text":
            raise ConfigError(f"{where} is synthetic and has no columns, but column={self.column!r}; remove column")
        columns = self._check_columns(where, synthetic)
        transform = self.transform
        if transform == "" or (synthetic and transform == DEFAULT_TRANSFORM):
            transform = None
        if transform is not None:
            check_transform(f"{where} transform", transform)
            transform = resolve_tokenizer(transform, None)  # a relative tokenizer file: as a relative path
        fix = "give a size in bytes such as 67108864"
        check_int(f"{where} max_sample_bytes", self.max_sample_bytes, low=1, fix=fix)
        if synthetic:
            check_int(f"{where} samples", self.samples, low=1, fix="set samples to the documents per epoch")
            median = check_float(f"{where} median", self.median, strict=True, fix="set median to a length in tokens")
            sigma = check_float(f"{where} sigma", self.sigma, fix="set sigma to 0 (fixed length) or more")
            check_int(f"{where} min_len", self.min_len, low=1, fix="set min_len to at least 1 token")
            check_int(f"{where} max_len", self.max_len, low=self.min_len, fix=f"keep min_len={self.min_len} <= max_len")
            object.__setattr__(self, "median", median)
            object.__setattr__(self, "sigma", sigma)
        else:
            extra = [k for k, v in SYNTHETIC_DEFAULTS.items() if getattr(self, k) != v]
            if extra:
                raise synthetic_only(where, fmt, extra, use="format = 'synthetic'")
        object.__setattr__(self, "paths", paths)
        object.__setattr__(self, "columns", columns)
        object.__setattr__(self, "transform", transform)
        shuffle = check_shuffle(f"{where} shuffle", self.shuffle)
        object.__setattr__(self, "shuffle", True if shuffle == {} else shuffle)

    def shuffle_settings(self) -> Shuffle:
        """The read order `shuffle` asks for, with the defaults filled in."""
        return Shuffle.of(self.shuffle)

    def _check_columns(self, where: str, synthetic: bool) -> tuple[str, ...] | None:
        if self.columns is None:
            return None
        fix = 'list distinct column names, e.g. columns = ["image", "caption"]'
        cols = check_str_tuple(f"{where} columns", self.columns, fix=fix)
        if not cols or len(set(cols)) != len(cols):
            raise ConfigError(f"{where} columns={list(cols)!r} must be a non-empty list of distinct names; {fix}")
        if synthetic:
            raise ConfigError(f"{where} is synthetic and has no columns, but columns={list(cols)!r}; remove columns")
        if self.column != "text":
            raise ConfigError(
                f"{where} sets both column={self.column!r} and columns={list(cols)!r}; keep column for one "
                f"column (the transform gets its value) or columns for several (it gets a dict by name)"
            )
        return cols

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the shape of a TOML `[[source]]` table (a file source's transform None is written as "")."""
        d: dict[str, Any] = {"name": self.name, "format": self.format}
        if self.format == SourceFormat.SYNTHETIC:
            if self.transform is not None:
                d["transform"] = self.transform
            d["max_sample_bytes"] = self.max_sample_bytes
            d.update({k: getattr(self, k) for k in SYNTHETIC_DEFAULTS})
            return self._with_shuffle(d)
        d.update(paths=list(self.paths), column=self.column)
        if self.columns is not None:  # written only when set: the digests of one-column jobs stay as they were
            d["columns"] = list(self.columns)
        d.update(transform=self.transform or "", max_sample_bytes=self.max_sample_bytes)
        return self._with_shuffle(d)

    def _with_shuffle(self, d: dict[str, Any]) -> dict[str, Any]:
        """`d` with `shuffle`, written only when not the default (the digests of older jobs stay as they were)."""
        if self.shuffle is not True:
            d["shuffle"] = self.shuffle if isinstance(self.shuffle, bool) else dict(self.shuffle)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, base_dir: str | None = None, table: str = "[[source]]") -> SourceSpec:
        """Strict inverse of `to_dict`; relative paths resolve against `base_dir` (default: working directory)."""
        check_keys(table, d, [f.name for f in fields(cls)])
        if "name" not in d or "format" not in d:
            raise ConfigError(
                f"{table} needs both name and format (one of: {', '.join(SourceFormat.values())}); got keys {sorted(d)}"
            )
        if d["format"] != SourceFormat.SYNTHETIC:
            extra = [k for k in SYNTHETIC_DEFAULTS if k in d]
            if extra:
                raise synthetic_only(f"{table} ({d['name']!r})", d["format"], extra, use="format = 'synthetic'")
        kwargs = dict(d)
        if "paths" in kwargs:
            paths = check_str_tuple(f"source {d['name']!r} paths", kwargs["paths"], fix=_PATHS_FIX)
            kwargs["paths"] = tuple(resolve_path(p, base_dir) for p in paths)
        if isinstance(kwargs.get("transform"), str):  # its tokenizer file resolves like paths, not on the server
            kwargs["transform"] = resolve_tokenizer(kwargs["transform"], base_dir)
        if isinstance(kwargs.get("columns"), list):
            kwargs["columns"] = tuple(kwargs["columns"])
        return cls(**kwargs)
