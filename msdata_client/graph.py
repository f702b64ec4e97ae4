"""DGraph: the job's declarative data strategy (sources, mixture, cost, packing, mesh) and its frozen JobSpec.

A job is written in Python with the DGraph builder or in TOML (DESIGN 4.3); both give the same frozen,
validated JobSpec, whose digest every rank registers with its node server.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

from msdata_client.errors import ConfigError
from msdata_client.mesh import AXES, DISTRIBUTE, PP_STAGES, ClientPlaceTree

__all__ = [
    "BalanceSpec",
    "DGraph",
    "JobSpec",
    "MixSpec",
    "SourceFormat",
    "SourceSpec",
]

logger = logging.getLogger(__name__)

SourceFormat = Literal["parquet", "arrow", "jsonl", "synthetic"]
FORMATS: tuple[str, ...] = get_args(SourceFormat)
FILE_FORMATS: tuple[str, ...] = tuple(f for f in FORMATS if f != "synthetic")
LONG_DOCS: tuple[str, ...] = ("split", "truncate")
METHODS: tuple[str, ...] = ("karmarkar_karp", "greedy", "none")
INTERPOLATE: tuple[str, ...] = ("step", "linear")
BROADCAST_AXES: tuple[str, ...] = ("tp", "pp", "cp")
DEFAULT_TRANSFORM = "msdata_server.transforms:byte_tokens"
ATTENTION_COST = "attention"

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}", re.ASCII)
_IMPORT_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
_INT64_MAX = (1 << 63) - 1
_SYNTHETIC_DEFAULTS: dict[str, Any] = {"samples": 10000, "median": 512.0, "sigma": 1.0, "min_len": 16, "max_len": 65536}


# -- small immutable mapping ------------------------------------------------------------------------


class _FrozenMap(Mapping[str, Any]):
    """An immutable, hashable mapping that keeps insertion order; equal to any mapping with the same items."""

    __slots__ = ("_d",)

    def __init__(self, items: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()) -> None:
        self._d = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(frozenset(self._d.items()))

    def __repr__(self) -> str:
        return repr(self._d)


# -- validators (messages carry the bad value and the fix) ------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(where: str, value: Any, *, low: int, high: int = _INT64_MAX, fix: str) -> int:
    if not _is_int(value) or not low <= value <= high:
        bound = f">= {low}" if high == _INT64_MAX else f"in {low}..{high}"
        raise ConfigError(f"{where}={value!r} must be an integer {bound}; {fix}")
    return value


def _float(where: str, value: Any, *, low: float = 0.0, strict: bool = False, fix: str) -> float:
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if ok:
        ok = value > low if strict else value >= low
    if not ok:
        raise ConfigError(f"{where}={value!r} must be a finite number {'>' if strict else '>='} {low:g}; {fix}")
    return float(value)


def _choice(where: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{where}={value!r} is not one of {allowed}; use one of: {', '.join(allowed)}")
    return value


def _name(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ConfigError(
            f"{where}={value!r} is not a valid name; use 1 to 128 characters from [A-Za-z0-9_.-] (e.g. 'web_en')"
        )
    return value


def _import_path(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _IMPORT_RE.fullmatch(value):
        raise ConfigError(f"{where}={value!r} must have the form 'module:function' (e.g. {DEFAULT_TRANSFORM!r})")
    return value


def _str_tuple(where: str, value: Any, *, fix: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}={value!r} must be a list of non-empty strings; {fix}")
    return tuple(value)


def _check_keys(table: str, d: Any, allowed: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{table} must be a table of keys ({', '.join(allowed)}), got {type(d).__name__}: {d!r}")
    for key in d:
        if key not in allowed:
            raise ConfigError(f"unknown key {key!r} in {table}; allowed keys: {', '.join(allowed)}")
    return d


def _weights(where: str, value: Any) -> _FrozenMap:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"{where}={value!r} must be a non-empty table of source = weight (e.g. {{ web = 0.7 }})")
    out: dict[str, float] = {}
    for key, w in value.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where} key {key!r} must be a source name (a string)")
        if not (_is_int(w) or isinstance(w, float)) or not math.isfinite(w):
            raise ConfigError(f"{where}[{key!r}]={w!r} must be a finite number >= 0")
        if w < 0:
            raise ConfigError(
                f"{where}[{key!r}]={w!r} is a negative weight; weights must be >= 0 (0 leaves a source out)"
            )
        out[key] = float(w)
    if math.fsum(out.values()) <= 0:
        raise ConfigError(
            f"{where}={dict(out)!r} sums to 0 (all weights are zero); give at least one source a weight > 0"
        )
    return _FrozenMap(out)


def _normalise(weights: Mapping[str, float]) -> dict[str, float]:
    total = math.fsum(weights.values())
    return {k: v / total for k, v in weights.items()}


def _resolve(path: str, base_dir: str | None) -> str:
    path = os.path.expanduser(path)
    if not os.path.isabs(path):
        path = os.path.join(base_dir if base_dir is not None else os.getcwd(), path)
    return os.path.normpath(path)


# -- specs ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceSpec:
    """One data source: where its samples live and how each becomes tokens.

    Relative `paths` become absolute (against the TOML's directory, or the working directory). A synthetic
    source reads no files and its records are already token ids, so its transform defaults to None.
    """

    name: str
    format: str
    paths: tuple[str, ...] = ()
    column: str = "text"
    transform: str | None = DEFAULT_TRANSFORM
    max_sample_bytes: int = 64 << 20
    samples: int = 10000
    median: float = 512.0
    sigma: float = 1.0
    min_len: int = 16
    max_len: int = 65536

    def __post_init__(self) -> None:
        name = _name("source name", self.name)
        where = f"source {name!r}"
        fmt = _choice(f"{where} format", self.format, FORMATS)
        paths = _str_tuple(f"{where} paths", self.paths, fix="list files, dirs or globs")
        paths = tuple(_resolve(p, None) for p in paths)
        if fmt in FILE_FORMATS and not paths:
            raise ConfigError(
                f"{where} has format {fmt!r} but no paths; set paths = [...] to its files, directories or globs"
            )
        if fmt == "synthetic" and paths:
            raise ConfigError(f"{where} is synthetic and reads no files, but paths={list(paths)!r}; remove paths")
        if not isinstance(self.column, str) or not self.column:
            raise ConfigError(f"{where} column={self.column!r} must be a non-empty column or field name")
        if fmt == "synthetic" and self.column != "text":
            raise ConfigError(f"{where} is synthetic and has no columns, but column={self.column!r}; remove column")
        transform = self.transform
        if transform == "" or (fmt == "synthetic" and transform == DEFAULT_TRANSFORM):
            transform = None
        if transform is not None:
            _import_path(f"{where} transform", transform)
        _int(f"{where} max_sample_bytes", self.max_sample_bytes, low=1, fix="give a size in bytes such as 67108864")
        if fmt == "synthetic":
            _int(f"{where} samples", self.samples, low=1, fix="set samples to the documents per epoch")
            median = _float(f"{where} median", self.median, strict=True, fix="set median to a length in tokens")
            sigma = _float(f"{where} sigma", self.sigma, fix="set sigma to 0 (fixed length) or more")
            _int(f"{where} min_len", self.min_len, low=1, fix="set min_len to at least 1 token")
            _int(f"{where} max_len", self.max_len, low=self.min_len, fix=f"keep min_len={self.min_len} <= max_len")
            object.__setattr__(self, "median", median)
            object.__setattr__(self, "sigma", sigma)
        else:
            extra = [k for k, v in _SYNTHETIC_DEFAULTS.items() if getattr(self, k) != v]
            if extra:
                raise ConfigError(
                    f"{where} has format {fmt!r} but sets {', '.join(extra)}, options of synthetic sources only; "
                    f"remove them or use format = 'synthetic'"
                )
        object.__setattr__(self, "paths", paths)
        object.__setattr__(self, "transform", transform)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the shape of a TOML `[[source]]` table (a file source's transform None is written as "")."""
        d: dict[str, Any] = {"name": self.name, "format": self.format}
        if self.format == "synthetic":
            if self.transform is not None:
                d["transform"] = self.transform
            d["max_sample_bytes"] = self.max_sample_bytes
            d.update({k: getattr(self, k) for k in _SYNTHETIC_DEFAULTS})
            return d
        d.update(
            paths=list(self.paths),
            column=self.column,
            transform=self.transform or "",
            max_sample_bytes=self.max_sample_bytes,
        )
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, base_dir: str | None = None, table: str = "[[source]]") -> SourceSpec:
        """Strict inverse of `to_dict`; relative paths resolve against `base_dir` (default: working directory)."""
        allowed = [f.name for f in fields(cls)]
        _check_keys(table, d, allowed)
        if "name" not in d or "format" not in d:
            raise ConfigError(
                f"{table} needs both name and format (one of: {', '.join(FORMATS)}); got keys {sorted(d)}"
            )
        if d["format"] != "synthetic":
            extra = [k for k in _SYNTHETIC_DEFAULTS if k in d]
            if extra:
                raise ConfigError(
                    f"{table} ({d['name']!r}) has format {d['format']!r} but sets {', '.join(extra)}, options of "
                    f"synthetic sources only; remove them or use format = 'synthetic'"
                )
        kwargs = dict(d)
        if "paths" in kwargs:
            paths = _str_tuple(f"source {d['name']!r} paths", kwargs["paths"], fix="list files, dirs or globs")
            kwargs["paths"] = tuple(_resolve(p, base_dir) for p in paths)
        return cls(**kwargs)


@dataclass(frozen=True, slots=True, kw_only=True)
class MixSpec:
    """The mixture: share of tokens per source, constant (`weights`) or over steps (`schedule`)."""

    weights: Mapping[str, float] | None = None
    schedule: tuple[tuple[int, Mapping[str, float]], ...] = ()
    interpolate: str = "step"

    def __post_init__(self) -> None:
        _choice("mix interpolate", self.interpolate, INTERPOLATE)
        if (self.weights is None) == (not self.schedule):
            raise ConfigError(
                "[mix] needs exactly one of weights = { source = share, ... } or "
                "schedule = [{ step = 0, weights = {...} }, ...]; "
                f"got weights={self.weights!r} and schedule={self.schedule!r}"
            )
        if self.weights is not None:
            if self.interpolate != "step":
                raise ConfigError(
                    f"mix interpolate={self.interpolate!r} applies to a schedule only; "
                    f"remove it or use schedule = [...]"
                )
            object.__setattr__(self, "weights", _weights("mix weights", self.weights))
            return
        if isinstance(self.schedule, (str, Mapping)) or not isinstance(self.schedule, Sequence):
            raise ConfigError(f"mix schedule={self.schedule!r} must be a list of (step, weights) points")
        points: list[tuple[int, _FrozenMap]] = []
        for i, point in enumerate(self.schedule):
            if not isinstance(point, Sequence) or len(point) != 2:
                raise ConfigError(f"mix schedule[{i}]={point!r} must be a (step, weights) pair")
            step = _int(f"mix schedule[{i}] step", point[0], low=0, fix="steps count from 0")
            points.append((step, _weights(f"mix schedule[{i}] (step {step}) weights", point[1])))
        steps = [s for s, _ in points]
        if steps[0] != 0:
            raise ConfigError(
                f"mix schedule must start at step 0, but its first step is {steps[0]}; add a point at step 0"
            )
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ConfigError(f"mix schedule steps {steps} are not strictly increasing; sort the points by step")
        names = set(points[0][1])
        for step, w in points[1:]:
            if set(w) != names:
                raise ConfigError(
                    f"mix schedule point at step {step} names {sorted(w)} but step 0 names {sorted(names)}; "
                    f"every point must weigh the same sources (use 0 to leave one out)"
                )
        object.__setattr__(self, "schedule", tuple(points))

    def weight_tables(self) -> tuple[Mapping[str, float], ...]:
        """Every weights table of the mixture (one, or one per schedule point)."""
        if self.weights is not None:
            return (self.weights,)
        return tuple(w for _, w in self.schedule)

    def weights_at(self, step: int) -> dict[str, float]:
        """The mixture in force at `step`, normalised to sum 1."""
        _int("step", step, low=0, fix="steps count from 0")
        if self.weights is not None:
            return _normalise(self.weights)
        steps = [s for s, _ in self.schedule]
        i = bisect.bisect_right(steps, step) - 1
        here = _normalise(self.schedule[i][1])
        if self.interpolate == "step" or i == len(steps) - 1:
            return here
        s0, s1 = steps[i], steps[i + 1]
        nxt = _normalise(self.schedule[i + 1][1])
        t = (step - s0) / (s1 - s0)
        return _normalise({k: here[k] + t * (nxt[k] - here[k]) for k in here})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the shape of the TOML `[mix]` table."""
        if self.weights is not None:
            return {"weights": dict(self.weights)}
        schedule = [{"step": s, "weights": dict(w)} for s, w in self.schedule]
        return {"schedule": schedule, "interpolate": self.interpolate}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MixSpec:
        """Strict inverse of `to_dict`."""
        _check_keys("[mix]", d, ("weights", "schedule", "interpolate"))
        schedule = d.get("schedule", ())
        if isinstance(schedule, Sequence) and not isinstance(schedule, str):
            points = []
            for i, p in enumerate(schedule):
                _check_keys(f"[mix] schedule[{i}]", p, ("step", "weights"))
                if "step" not in p or "weights" not in p:
                    raise ConfigError(f"[mix] schedule[{i}]={dict(p)!r} needs both step and weights")
                points.append((p["step"], p["weights"]))
            schedule = tuple(points)
        return cls(weights=d.get("weights"), schedule=schedule, interpolate=d.get("interpolate", "step"))


@dataclass(frozen=True, slots=True, kw_only=True)
class BalanceSpec:
    """Per-document cost and the method that balances it across DP ranks and micro-batches."""

    cost: str = ATTENTION_COST
    alpha: float = 1.0
    beta: float = 4096.0
    method: str = "karmarkar_karp"

    def __post_init__(self) -> None:
        if self.cost != ATTENTION_COST:
            if not isinstance(self.cost, str) or not _IMPORT_RE.fullmatch(self.cost):
                raise ConfigError(
                    f"balance cost={self.cost!r} must be {ATTENTION_COST!r} (alpha*len**2 + beta*len) "
                    f"or a function path 'module:function'"
                )
        object.__setattr__(self, "alpha", _float("balance alpha", self.alpha, fix="use alpha >= 0 (1.0 by default)"))
        object.__setattr__(self, "beta", _float("balance beta", self.beta, fix="use beta >= 0 (4096.0 by default)"))
        _choice("balance method", self.method, METHODS)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the shape of the TOML `[balance]` table."""
        return {"cost": self.cost, "alpha": self.alpha, "beta": self.beta, "method": self.method}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BalanceSpec:
        """Strict inverse of `to_dict`."""
        return cls(**_check_keys("[balance]", d, [f.name for f in fields(cls)]))


_JOB_TABLE_KEYS = (
    "name",
    "seed",
    "seq_len",
    "micro_batches",
    "rows",
    "pad_id",
    "long_docs",
    "distribute",
    "broadcast_at",
    "prefetch_steps",
    "pp_fields",
)
_TOP_KEYS = ("job", "mesh", "source", "mix", "balance")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """A validated, frozen job: what the ranks register and the planner runs."""

    name: str
    seed: int = 0
    seq_len: int = 8192
    micro_batches: int = 1
    rows: int = 1
    pad_id: int = 257
    long_docs: str = "split"
    distribute: str = "dp"
    broadcast_at: tuple[str, ...] = ("tp",)
    prefetch_steps: int = 2
    pp_fields: Mapping[str, tuple[str, ...]] | None = None
    sources: tuple[SourceSpec, ...]
    mix: MixSpec
    balance: BalanceSpec = field(default_factory=BalanceSpec)
    mesh: ClientPlaceTree = field(default_factory=ClientPlaceTree)

    def __post_init__(self) -> None:
        _name("job name", self.name)
        _int("job seed", self.seed, low=0, fix="use a non-negative integer seed")
        _int("job seq_len", self.seq_len, low=1, fix="set [job] seq_len to the tokens per packed row, e.g. 8192")
        _int("job micro_batches", self.micro_batches, low=1, fix="set the micro-batches per DP rank per step")
        _int("job rows", self.rows, low=1, fix="set the packed rows per micro-batch")
        _int("job pad_id", self.pad_id, low=0, fix="use a non-negative token id (257 by default)")
        _choice("job long_docs", self.long_docs, LONG_DOCS)
        _choice("job distribute", self.distribute, DISTRIBUTE)
        _int("job prefetch_steps", self.prefetch_steps, low=1, fix="plan at least 1 step ahead (2 by default)")
        self._check_broadcast()
        self._check_pp_fields()
        self._check_parts()

    def _check_broadcast(self) -> None:
        axes = _str_tuple("job broadcast_at", self.broadcast_at, fix=f"choose axes from {BROADCAST_AXES}")
        for axis in axes:
            _choice("job broadcast_at axis", axis, BROADCAST_AXES)
        if len(set(axes)) != len(axes):
            raise ConfigError(f"job broadcast_at={list(axes)!r} names an axis twice; list each axis once")
        object.__setattr__(self, "broadcast_at", tuple(a for a in BROADCAST_AXES if a in axes))

    def _check_pp_fields(self) -> None:
        if self.pp_fields is None:
            return
        _check_keys("[job] pp_fields", self.pp_fields, PP_STAGES)
        out = {}
        for stage, names in self.pp_fields.items():
            names = _str_tuple(f"job pp_fields.{stage}", names, fix="list batch keys such as 'tokens'")
            if len(set(names)) != len(names):
                raise ConfigError(f"job pp_fields.{stage}={list(names)!r} names a field twice; list each once")
            out[stage] = names
        object.__setattr__(self, "pp_fields", _FrozenMap(out))

    def _check_parts(self) -> None:
        sources = self.sources
        if isinstance(sources, SourceSpec) or not isinstance(sources, Sequence) or not sources:
            raise ConfigError(f"job sources={sources!r} must be a non-empty list of SourceSpec; add a [[source]]")
        for s in sources:
            if not isinstance(s, SourceSpec):
                raise ConfigError(f"job source {s!r} must be a SourceSpec")
        names = [s.name for s in sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"duplicate source names {dup}; every [[source]] needs a unique name")
        object.__setattr__(self, "sources", tuple(sources))
        if not isinstance(self.mix, MixSpec):
            raise ConfigError(f"job mix={self.mix!r} must be a MixSpec; add a [mix] table")
        for table in self.mix.weight_tables():
            unknown = [k for k in table if k not in names]
            if unknown:
                raise ConfigError(
                    f"[mix] weights name unknown source {unknown[0]!r}; known sources: {', '.join(names)}"
                )
            for n in names:
                if n not in table:
                    raise ConfigError(
                        f"source {n!r} has no weight in [mix]; give every source a weight (0 leaves it out)"
                    )
        if not isinstance(self.balance, BalanceSpec):
            raise ConfigError(f"job balance={self.balance!r} must be a BalanceSpec")
        if not isinstance(self.mesh, ClientPlaceTree):
            raise ConfigError(f"job mesh={self.mesh!r} must be a ClientPlaceTree")
        cp = self.mesh.cp
        if cp > 1 and self.seq_len % (2 * cp):
            raise ConfigError(
                f"job seq_len={self.seq_len} must be divisible by 2*cp={2 * cp} for zig-zag context parallelism; "
                f"use a multiple such as {(self.seq_len // (2 * cp) + 1) * 2 * cp}"
            )

    # -- helpers ------------------------------------------------------------------------------------

    def source_names(self) -> tuple[str, ...]:
        """Source names in declaration order (a source's index is its id in plans and batches)."""
        return tuple(s.name for s in self.sources)

    def data_groups(self) -> int:
        """Number of distinct data streams under this job's `distribute`."""
        return self.mesh.data_groups(self.distribute)

    def group_of(self, rank: int) -> int:
        """The data stream `rank` reads under this job's `distribute`."""
        return self.mesh.group_of(rank, self.distribute)

    def readers(self, group: int) -> tuple[int, ...]:
        """Ranks that read data stream `group`, sorted."""
        return self.mesh.readers(group, self.distribute)

    def fields(self, rank: int, all_fields: Sequence[str]) -> tuple[str, ...]:
        """Batch fields `rank` receives, applying this job's `pp_fields` overrides."""
        return self.mesh.fields(rank, all_fields, self.pp_fields)

    # -- serialisation ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict in the shape of the job TOML (DESIGN 4.3)."""
        job: dict[str, Any] = {
            "name": self.name,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "micro_batches": self.micro_batches,
            "rows": self.rows,
            "pad_id": self.pad_id,
            "long_docs": self.long_docs,
            "distribute": self.distribute,
            "broadcast_at": list(self.broadcast_at),
            "prefetch_steps": self.prefetch_steps,
        }
        if self.pp_fields is not None:
            job["pp_fields"] = {k: list(v) for k, v in self.pp_fields.items()}
        return {
            "job": job,
            "mesh": self.mesh.to_dict(),
            "source": [s.to_dict() for s in self.sources],
            "mix": self.mix.to_dict(),
            "balance": self.balance.to_dict(),
        }

    def to_toml(self) -> str:
        """The job as TOML text that `DGraph.from_toml` reads back into an equal spec."""
        return _toml_dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, base_dir: str | None = None) -> JobSpec:
        """Strict inverse of `to_dict`; relative source paths resolve against `base_dir` (default: cwd)."""
        _check_keys("the job file (top level)", d, _TOP_KEYS)
        for key in ("job", "source", "mix"):
            if key not in d:
                example = {"job": "[job] name = ...", "source": "[[source]]", "mix": "[mix] weights = {...}"}[key]
                raise ConfigError(f"the job has no [{key}] table; add {example}")
        job = dict(_check_keys("[job]", d["job"], _JOB_TABLE_KEYS))
        if "name" not in job:
            raise ConfigError("[job] has no name; add name = \"...\"")
        if isinstance(job.get("broadcast_at"), list):
            job["broadcast_at"] = tuple(job["broadcast_at"])
        sources = d["source"]
        if isinstance(sources, Mapping) or not isinstance(sources, list):
            raise ConfigError(f"source must be an array of tables ([[source]]), got {type(sources).__name__}")
        specs = tuple(
            SourceSpec.from_dict(s, base_dir=base_dir, table=f"[[source]] #{i + 1}") for i, s in enumerate(sources)
        )
        return cls(
            **job,
            sources=specs,
            mix=MixSpec.from_dict(d["mix"]),
            balance=BalanceSpec.from_dict(d.get("balance", {})),
            mesh=ClientPlaceTree.from_dict(d.get("mesh", {})),
        )

    def digest(self) -> str:
        """sha256 hex of the canonical JSON of `to_dict()`: ranks of one run must agree on it."""
        return _sha256(self.to_dict())

    def data_digest(self) -> str:
        """sha256 hex of the data identity (name, seed, sources, transforms, mixture, cost); not the layout.

        A state restores into any job with the same data digest (a reshard when the mesh differs).
        """
        identity = {
            "version": 1,
            "name": self.name,
            "seed": self.seed,
            "sources": [s.to_dict() for s in self.sources],
            "mix": self.mix.to_dict(),
            "cost": {"cost": self.balance.cost, "alpha": self.balance.alpha, "beta": self.balance.beta},
        }
        return _sha256(identity)


def _sha256(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- builder ----------------------------------------------------------------------------------------


class DGraph:
    """The paper's declarative builder; methods return self for chaining; plan() validates and freezes."""

    __slots__ = ("_balance", "_job", "_mesh", "_mix", "_sources")

    def __init__(self, name: str, *, seed: int = 0) -> None:
        self._job: dict[str, Any] = {"name": _name("job name", name), "seed": seed}
        self._sources: list[SourceSpec] = []
        self._mix: MixSpec | None = None
        self._balance = BalanceSpec()
        self._mesh = ClientPlaceTree()

    def source(
        self,
        name: str,
        format: str,
        paths: str | Sequence[str] = (),
        *,
        column: str = "text",
        transform: Any = ...,
        max_sample_bytes: int = 64 << 20,
        **synthetic_opts: Any,
    ) -> DGraph:
        """Add a source; `transform` defaults to byte tokens for files and None for synthetic data."""
        unknown = sorted(set(synthetic_opts) - set(_SYNTHETIC_DEFAULTS))
        if unknown:
            raise ConfigError(
                f"source {name!r}: unknown option(s) {', '.join(unknown)}; synthetic options are "
                f"{', '.join(_SYNTHETIC_DEFAULTS)}"
            )
        if synthetic_opts and format != "synthetic":
            raise ConfigError(
                f"source {name!r} has format {format!r} but sets {', '.join(synthetic_opts)}, options of synthetic "
                f"sources only; remove them or use format='synthetic'"
            )
        if any(s.name == name for s in self._sources):
            raise ConfigError(f"duplicate source names [{name!r}]; every source needs a unique name")
        if transform is ...:
            transform = None if format == "synthetic" else DEFAULT_TRANSFORM
        spec = SourceSpec(
            name=name,
            format=format,
            paths=(paths,) if isinstance(paths, str) else tuple(paths),
            column=column,
            transform=transform,
            max_sample_bytes=max_sample_bytes,
            **synthetic_opts,
        )
        self._sources.append(spec)
        return self

    def mix(
        self,
        weights: Mapping[str, float] | None = None,
        *,
        schedule: Sequence[tuple[int, Mapping[str, float]] | Mapping[str, Any]] | None = None,
        interpolate: str = "step",
    ) -> DGraph:
        """Set the mixture: constant `weights`, or a `schedule` of (step, weights) or {step, weights} points."""
        points: tuple[Any, ...] = ()
        if schedule is not None:
            if isinstance(schedule, (str, Mapping)) or not isinstance(schedule, Sequence):
                raise ConfigError(f"mix schedule={schedule!r} must be a list of (step, weights) points")
            points = tuple(
                (_check_keys(f"mix schedule[{i}]", p, ("step", "weights")).get("step"), p.get("weights"))
                if isinstance(p, Mapping)
                else p
                for i, p in enumerate(schedule)
            )
        self._mix = MixSpec(weights=weights, schedule=points, interpolate=interpolate)
        return self

    def distribute(self, axis: str = "dp") -> DGraph:
        """Which mesh axis receives distinct data: "dp", "cp" (slices of one build) or "world"."""
        self._job["distribute"] = _choice("job distribute", axis, DISTRIBUTE)
        return self

    def cost(self, fn: str = ATTENTION_COST, *, alpha: float = 1.0, beta: float = 4096.0) -> DGraph:
        """Per-document cost: "attention" (alpha*len**2 + beta*len) or a 'module:function' path."""
        self._balance = replace(self._balance, cost=fn, alpha=alpha, beta=beta)
        return self

    def balance(self, method: str = "karmarkar_karp") -> DGraph:
        """How documents are partitioned across DP ranks and micro-batches."""
        self._balance = replace(self._balance, method=method)
        return self

    def pack(
        self,
        seq_len: int,
        *,
        rows: int = 1,
        micro_batches: int = 1,
        pad_id: int = 257,
        long_docs: str = "split",
    ) -> DGraph:
        """Pack documents into `rows` rows of `seq_len` tokens per micro-batch."""
        self._job.update(seq_len=seq_len, rows=rows, micro_batches=micro_batches, pad_id=pad_id, long_docs=long_docs)
        return self

    def broadcast_at(self, *axes: str) -> DGraph:
        """Axes whose ranks receive identical copies of one build ("tp" by default)."""
        self._job["broadcast_at"] = axes
        return self

    def prefetch(self, steps: int) -> DGraph:
        """How many steps the planner may run ahead of the slowest rank."""
        self._job["prefetch_steps"] = steps
        return self

    def pp_fields(
        self,
        *,
        first: Sequence[str] | None = None,
        middle: Sequence[str] | None = None,
        last: Sequence[str] | None = None,
    ) -> DGraph:
        """Override the batch fields of pipeline stages (those not given keep the defaults of DESIGN 4.4)."""
        given = {k: v for k, v in (("first", first), ("middle", middle), ("last", last)) if v is not None}
        self._job["pp_fields"] = given or None
        return self

    def mesh(
        self,
        dp: int = 1,
        pp: int = 1,
        cp: int = 1,
        tp: int = 1,
        order: Sequence[str] = AXES,
    ) -> DGraph:
        """The ClientPlaceTree: axis sizes and their nesting (outermost first)."""
        self._mesh = ClientPlaceTree(dp=dp, pp=pp, cp=cp, tp=tp, order=tuple(order))
        return self

    def plan(self) -> JobSpec:
        """Validate everything and return the frozen JobSpec."""
        if not self._sources:
            raise ConfigError(f"job {self._job['name']!r} has no sources; call .source(name, format, paths) first")
        if self._mix is None:
            raise ConfigError(f"job {self._job['name']!r} has no mixture; call .mix({{source: weight, ...}})")
        return JobSpec(
            **self._job,
            sources=tuple(self._sources),
            mix=self._mix,
            balance=self._balance,
            mesh=self._mesh,
        )

    @property
    def spec(self) -> JobSpec:
        """The frozen JobSpec (same as plan())."""
        return self.plan()

    @classmethod
    def from_spec(cls, spec: JobSpec) -> DGraph:
        """A builder holding `spec`, to inspect or modify it."""
        if not isinstance(spec, JobSpec):
            raise ConfigError(f"spec={spec!r} must be a JobSpec")
        g = cls(spec.name, seed=spec.seed)
        g._job.update(
            seq_len=spec.seq_len,
            micro_batches=spec.micro_batches,
            rows=spec.rows,
            pad_id=spec.pad_id,
            long_docs=spec.long_docs,
            distribute=spec.distribute,
            broadcast_at=spec.broadcast_at,
            prefetch_steps=spec.prefetch_steps,
            pp_fields=spec.pp_fields,
        )
        g._sources = list(spec.sources)
        g._mix = spec.mix
        g._balance = spec.balance
        g._mesh = spec.mesh
        return g

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base_dir: str | None = None) -> DGraph:
        """Parse and validate a job dict (the TOML's shape); `.spec` holds the JobSpec."""
        return cls.from_spec(JobSpec.from_dict(d, base_dir=base_dir))

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> DGraph:
        """Parse and validate a job TOML; relative source paths resolve against the file's directory."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read job file {path!r}: {e.strerror or e}; check the path") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"job file {path!r} is not valid TOML: {e}; fix the syntax") from e
        return cls.from_dict(data, base_dir=os.path.dirname(os.path.abspath(path)))

    def to_dict(self) -> dict[str, Any]:
        """The validated job as a plain dict (the TOML's shape)."""
        return self.plan().to_dict()

    def to_toml(self) -> str:
        """The validated job as TOML text; from_toml reads it back into an equal spec."""
        return self.plan().to_toml()

    def digest(self) -> str:
        """sha256 hex of the validated job (see JobSpec.digest)."""
        return self.plan().digest()

    def __repr__(self) -> str:
        names = [s.name for s in self._sources]
        return f"DGraph({self._job['name']!r}, sources={names}, mesh={self._mesh})"


# -- a tiny TOML emitter (enough for the job's shape; tomllib reads it back) -------------------------

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+", re.ASCII)
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _toml_str(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"cannot write {v!r} to TOML; use a finite number")
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, Mapping):
        if not v:
            return "{}"
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {type(v).__name__} {v!r} to TOML")


def _toml_entries(table: Mapping[str, Any]) -> list[str]:
    lines = []
    for k, v in table.items():
        if isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
            lines.append(f"{_toml_key(k)} = [")
            lines.extend(f"    {_toml_value(x)}," for x in v)
            lines.append("]")
        else:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    return lines


def _toml_dumps(doc: Mapping[str, Any]) -> str:
    """Write a dict of tables / arrays of tables (values: scalars, lists, inline tables) as TOML."""

    def is_table_array(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, Mapping) for x in v)

    lines = _toml_entries({k: v for k, v in doc.items() if not isinstance(v, Mapping) and not is_table_array(v)})
    for k, v in doc.items():
        if isinstance(v, Mapping):
            lines += ["", f"[{_toml_key(k)}]", *_toml_entries(v)]
        elif is_table_array(v):
            for x in v:
                lines += ["", f"[[{_toml_key(k)}]]", *_toml_entries(x)]
    return "\n".join(lines).lstrip("\n") + "\n"
