"""DGraph: the job's declarative data strategy (sources, mixture, cost, packing, mesh), built in Python.

A job is written in Python with the DGraph builder or in TOML (ARCHITECTURE §4.3); both give the same frozen,
validated JobSpec (`msdata_client.spec`), whose digest every rank registers with its node server.
The spec types and the tables of choices are importable from here too.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from msdata_client._validate import check_name
from msdata_client.choices import ATTENTION_COST, DEFAULT_TRANSFORM, Distribute, Method, SourceFormat
from msdata_client.errors import ConfigError
from msdata_client.mesh import AXES, ClientPlaceTree
from msdata_client.mix import schedule_points
from msdata_client.source import SYNTHETIC_DEFAULTS, synthetic_only
from msdata_client.spec import (
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_ALPHA,
    VISION_BETA,
    BalanceSpec,
    JobSpec,
    MixSpec,
    SourceSpec,
)

__all__ = ["BalanceSpec", "DGraph", "JobSpec", "MixSpec", "SourceFormat", "SourceSpec"]

# the tables of choices as tuples of values, as error messages list them
FORMATS: tuple[str, ...] = SourceFormat.values()
METHODS: tuple[str, ...] = Method.values()


class DGraph:
    """The paper's declarative builder; methods return self for chaining; plan() validates and freezes."""

    __slots__ = ("_balance", "_job", "_mesh", "_mix", "_sources")

    def __init__(self, name: str, *, seed: int = 0) -> None:
        self._job: dict[str, Any] = {"name": check_name("job name", name), "seed": seed}
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
        columns: Sequence[str] | None = None,
        transform: Any = ...,
        max_sample_bytes: int = 64 << 20,
        **synthetic_opts: Any,
    ) -> DGraph:
        """Add a source; `transform` defaults to byte tokens for files and None for synthetic data. `columns`
        selects several columns (a WebDataset sample's extensions): the transform gets a dict by name."""
        unknown = sorted(set(synthetic_opts) - set(SYNTHETIC_DEFAULTS))
        if unknown:
            raise ConfigError(
                f"source {name!r}: unknown option(s) {', '.join(unknown)}; synthetic options are "
                f"{', '.join(SYNTHETIC_DEFAULTS)}"
            )
        if synthetic_opts and format != SourceFormat.SYNTHETIC:
            raise synthetic_only(f"source {name!r}", format, synthetic_opts, use="format='synthetic'")
        if any(s.name == name for s in self._sources):
            raise ConfigError(f"duplicate source names [{name!r}]; every source needs a unique name")
        if transform is ...:
            transform = None if format == SourceFormat.SYNTHETIC else DEFAULT_TRANSFORM
        spec = SourceSpec(
            name=name,
            format=format,
            paths=(paths,) if isinstance(paths, str) else tuple(paths),
            column=column,
            columns=None if columns is None else (columns,) if isinstance(columns, str) else tuple(columns),
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
        points = () if schedule is None else schedule_points(schedule)
        self._mix = MixSpec(weights=weights, schedule=points, interpolate=interpolate)
        return self

    def distribute(self, axis: str = "dp") -> DGraph:
        """Which mesh axis receives distinct data: "dp", "cp" (slices of one build) or "world"."""
        Distribute.parse(axis, "job distribute")
        self._job["distribute"] = axis
        return self

    def cost(
        self,
        fn: str = ATTENTION_COST,
        *,
        alpha: float = 1.0,
        beta: float = 4096.0,
        alpha_v: float = VISION_ALPHA,
        beta_v: float = VISION_BETA,
    ) -> DGraph:
        """Per-document cost: "attention" (alpha*len**2 + beta*len), "vlm" (that for the backbone, and the vision
        encoder's alpha_v*p**2 + beta_v*p per image of p patches, both stages balanced) or a 'module:function'."""
        self._balance = replace(self._balance, cost=fn, alpha=alpha, beta=beta, alpha_v=alpha_v, beta_v=beta_v)
        return self

    def balance(self, method: str = Method.KARMARKAR_KARP.value) -> DGraph:
        """How documents are partitioned across DP ranks and micro-batches."""
        self._balance = replace(self._balance, method=method)
        return self

    def pack(
        self,
        seq_len: int,
        *,
        rows: int = 1,
        micro_batches: int = 1,
        pad_id: int | None = None,
        long_docs: str = "split",
        image_token_id: int = IMAGE_TOKEN_ID,
        video_token_id: int = VIDEO_TOKEN_ID,
    ) -> DGraph:
        """Pack documents into `rows` rows of `seq_len` tokens per micro-batch (`image_token_id`, `video_token_id`:
        the ids of a picture document's image and video placeholders)."""
        self._job.update(
            seq_len=seq_len,
            rows=rows,
            micro_batches=micro_batches,
            long_docs=long_docs,
            image_token_id=image_token_id,
            video_token_id=video_token_id,
        )
        if pad_id is not None:  # None: the tokenizer's pad token when it has one, else 257
            self._job["pad_id"] = pad_id
        else:
            self._job.pop("pad_id", None)
        return self

    def broadcast_at(self, *axes: str) -> DGraph:
        """Axes whose ranks receive identical copies of one build ("tp" by default)."""
        self._job["broadcast_at"] = axes
        return self

    def prefetch(self, steps: int) -> DGraph:
        """How many steps the planner may run ahead of the slowest rank."""
        self._job["prefetch_steps"] = steps
        return self

    def shadow_loaders(self, n: int) -> DGraph:
        """Hot standbys per source partition on other nodes of a cluster (0: none; no effect on one node)."""
        self._job["shadow_loaders"] = n
        return self

    def pp_fields(
        self,
        *,
        first: Sequence[str] | None = None,
        middle: Sequence[str] | None = None,
        last: Sequence[str] | None = None,
    ) -> DGraph:
        """Override the batch fields of pipeline stages (those not given keep the defaults of ARCHITECTURE §4.4)."""
        given = {k: v for k, v in (("first", first), ("middle", middle), ("last", last)) if v is not None}
        self._job["pp_fields"] = given or None
        return self

    def mesh(self, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, order: Sequence[str] = AXES) -> DGraph:
        """The ClientPlaceTree: axis sizes and their nesting (outermost first)."""
        self._mesh = ClientPlaceTree(dp=dp, pp=pp, cp=cp, tp=tp, order=tuple(order))
        return self

    def plan(self) -> JobSpec:
        """Validate everything and return the frozen JobSpec."""
        if not self._sources:
            raise ConfigError(f"job {self._job['name']!r} has no sources; call .source(name, format, paths) first")
        if self._mix is None:
            raise ConfigError(f"job {self._job['name']!r} has no mixture; call .mix({{source: weight, ...}})")
        return JobSpec(**self._job, sources=tuple(self._sources), mix=self._mix, balance=self._balance, mesh=self._mesh)

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
            image_token_id=spec.image_token_id,
            video_token_id=spec.video_token_id,
            shadow_loaders=spec.shadow_loaders,
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
