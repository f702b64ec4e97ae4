"""JobSpec: a validated, frozen job (ARCHITECTURE §4.3), with BalanceSpec and the digests ranks compare.

Its parts, SourceSpec (`[[source]]`) and MixSpec (`[mix]`), live in `source.py` and `mix.py`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from msdata_client import _toml
from msdata_client._validate import FrozenMap, check_float, check_int, check_keys, check_name, check_str_tuple
from msdata_client.choices import (
    ATTENTION_COST,
    BroadcastAxis,
    CostKind,
    Distribute,
    LongDocs,
    Method,
    OnDataChange,
    OnReadError,
    is_import_path,
)
from msdata_client.errors import ConfigError
from msdata_client.mesh import PP_STAGES, ClientPlaceTree
from msdata_client.mix import MixSpec
from msdata_client.source import SourceSpec
from msdata_client.tokenizer import default_pad

__all__ = [
    "BalanceSpec",
    "IMAGE_TOKEN_ID",
    "JobSpec",
    "MAX_PREFETCH_STEPS",
    "MixSpec",
    "SourceSpec",
    "VIDEO_TOKEN_ID",
    "VISION_ALPHA",
    "VISION_BETA",
]

IMAGE_TOKEN_ID = 258  # [job] image_token_id by default (byte tokens are 0..255, EOS 256, padding 257)
VIDEO_TOKEN_ID = 259  # [job] video_token_id by default
VISION_ALPHA, VISION_BETA = 1.0, 2048.0  # [balance] alpha_v, beta_v by default


class _Unset(int):
    """An int default told apart by identity: a pad_id the job did not set (a user's -1 is still refused)."""


PAD_FROM_TOKENIZER = _Unset(-1)  # [job] pad_id unset: the tokenizer's pad token when it has one, else 257

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
    "image_token_id",
    "video_token_id",
    "shadow_loaders",
    "on_data_change",
    "on_read_error",
)
_TOP_KEYS = ("job", "mesh", "source", "mix", "balance")


@dataclass(frozen=True, slots=True, kw_only=True)
class BalanceSpec:
    """Per-document cost and the method that balances it across DP ranks and micro-batches."""

    cost: str = ATTENTION_COST
    alpha: float = 1.0
    beta: float = 4096.0
    method: str = Method.KARMARKAR_KARP.value
    # cost = "vlm" only: the vision encoder's alpha_v * p**2 + beta_v * p per image of p patches
    alpha_v: float = VISION_ALPHA
    beta_v: float = VISION_BETA
    # what a padded token costs a rank (fixed-shape trainers run the padding through the linear layers): none
    # (unset) is beta with the built-in costs and 0 with a 'module:function' cost; 0 for unpadded (varlen) trainers
    pad_cost: float | None = None

    def __post_init__(self) -> None:
        if self.cost not in CostKind.values() and not is_import_path(self.cost):
            raise ConfigError(
                f"balance cost={self.cost!r} must be {ATTENTION_COST!r} (alpha*len**2 + beta*len), "
                f"{CostKind.VLM.value!r} (that for the backbone and alpha_v*p**2 + beta_v*p per image of p patches "
                f"for the vision encoder) or a function path 'module:function'"
            )
        alpha = check_float("balance alpha", self.alpha, fix="use alpha >= 0 (1.0 by default)")
        beta = check_float("balance beta", self.beta, fix="use beta >= 0 (4096.0 by default)")
        alpha_v = check_float("balance alpha_v", self.alpha_v, fix=f"use alpha_v >= 0 ({VISION_ALPHA} by default)")
        beta_v = check_float("balance beta_v", self.beta_v, fix=f"use beta_v >= 0 ({VISION_BETA} by default)")
        if self.cost != CostKind.VLM and (alpha_v, beta_v) != (VISION_ALPHA, VISION_BETA):
            raise ConfigError(
                f"balance alpha_v={alpha_v!r} / beta_v={beta_v!r} price the vision encoder and apply only to "
                f'cost = "vlm", but cost={self.cost!r}; set cost = "vlm" or remove alpha_v and beta_v'
            )
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "beta", beta)
        object.__setattr__(self, "alpha_v", alpha_v)
        object.__setattr__(self, "beta_v", beta_v)
        if self.pad_cost is not None:
            fix = "use 0 (an unpadded trainer) up to beta (the default: padding runs through the linear layers)"
            pad = check_float("balance pad_cost", self.pad_cost, fix=fix)
            if self.cost in CostKind.values() and pad > beta:
                raise ConfigError(f"balance pad_cost={pad!r} is more than beta={beta!r} (a real token's cost); {fix}")
            object.__setattr__(self, "pad_cost", pad)
        Method.parse(self.method, "balance method")

    @property
    def padding_cost(self) -> float:
        """pad_cost in force: as set, else beta with a built-in cost and 0 with a 'module:function' one."""
        if self.pad_cost is not None:
            return self.pad_cost
        return self.beta if self.cost in CostKind.values() else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the shape of the TOML `[balance]` table (alpha_v and beta_v with cost = "vlm" only, pad_cost
        when set)."""
        d: dict[str, Any] = {"cost": self.cost, "alpha": self.alpha, "beta": self.beta, "method": self.method}
        if self.cost == CostKind.VLM:
            d.update(alpha_v=self.alpha_v, beta_v=self.beta_v)
        if self.pad_cost is not None:
            d["pad_cost"] = self.pad_cost
        return d

    def identity(self) -> dict[str, Any]:
        """The cost in a job's data identity: the constants that decide plans (not the method; pad_cost when it is
        not its default, so that the identities of jobs that do not set it stay as they were)."""
        d = {"cost": self.cost, "alpha": self.alpha, "beta": self.beta}
        if self.cost == CostKind.VLM:
            d.update(alpha_v=self.alpha_v, beta_v=self.beta_v)
        if self.pad_cost is not None and self.pad_cost != BalanceSpec(cost=self.cost, beta=self.beta).padding_cost:
            d["pad_cost"] = self.pad_cost
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BalanceSpec:
        """Strict inverse of `to_dict`."""
        return cls(**check_keys("[balance]", d, [f.name for f in fields(cls)]))


MAX_PREFETCH_STEPS = 4096  # planned steps are held in memory: no node allows more ([node] max_prefetch_steps)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """A validated, frozen job: what the ranks register and the planner runs."""

    name: str
    seed: int = 0
    seq_len: int = 8192
    micro_batches: int = 1
    rows: int = 1
    pad_id: int = PAD_FROM_TOKENIZER  # the tokenizer's pad token when it has one, else 257 (tokenizer.py)
    long_docs: str = "split"
    distribute: str = "dp"
    broadcast_at: tuple[str, ...] = ("tp",)
    prefetch_steps: int = 2
    pp_fields: Mapping[str, tuple[str, ...]] | None = None
    # the id of image placeholder tokens (a picture document's tokens: one per merge x merge patches, then its text)
    image_token_id: int = IMAGE_TOKEN_ID
    # the id of video placeholder tokens (one per merge x merge patches of one temporal patch of a clip)
    video_token_id: int = VIDEO_TOKEN_ID
    # hot standbys per source partition on other nodes (cluster layout only: never changes the data)
    shadow_loaders: int = 0
    # a resume over a source whose files changed: refuse ("error") or go on over the new files ("continue");
    # not part of the data identity (switching it must not itself break a resume)
    on_data_change: str = OnDataChange.ERROR.value
    # an object-store read failed for good: "fail" stops the job, "skip" counts the samples (storage_error)
    on_read_error: str = "fail"
    sources: tuple[SourceSpec, ...]
    mix: MixSpec
    balance: BalanceSpec = field(default_factory=BalanceSpec)
    mesh: ClientPlaceTree = field(default_factory=ClientPlaceTree)

    def __post_init__(self) -> None:
        check_name("job name", self.name)
        check_int("job seed", self.seed, low=0, fix="use a non-negative integer seed")
        check_int("job seq_len", self.seq_len, low=1, fix="set [job] seq_len to the tokens per packed row, e.g. 8192")
        check_int("job micro_batches", self.micro_batches, low=1, fix="set the micro-batches per DP rank per step")
        check_int("job rows", self.rows, low=1, fix="set the packed rows per micro-batch")
        if self.pad_id is PAD_FROM_TOKENIZER:
            object.__setattr__(self, "pad_id", default_pad(s.transform for s in self._source_list()))
        check_int("job pad_id", self.pad_id, low=0, fix="use a non-negative token id (257 by default)")
        fix = f"use a non-negative token id ({IMAGE_TOKEN_ID} by default) that is not pad_id={self.pad_id}"
        check_int("job image_token_id", self.image_token_id, low=0, fix=fix)
        if self.image_token_id == self.pad_id:
            raise ConfigError(f"job image_token_id={self.image_token_id} equals pad_id; {fix}")
        vfix = (
            f"use a non-negative token id ({VIDEO_TOKEN_ID} by default) that is neither pad_id={self.pad_id} nor "
            f"image_token_id={self.image_token_id}"
        )
        check_int("job video_token_id", self.video_token_id, low=0, fix=vfix)
        if self.video_token_id in (self.pad_id, self.image_token_id):
            raise ConfigError(f"job video_token_id={self.video_token_id} equals pad_id or image_token_id; {vfix}")
        LongDocs.parse(self.long_docs, "job long_docs")
        Distribute.parse(self.distribute, "job distribute")
        OnDataChange.parse(self.on_data_change, "job on_data_change")
        OnReadError.parse(self.on_read_error, "job on_read_error")
        check_int("job prefetch_steps", self.prefetch_steps, low=1, fix="plan at least 1 step ahead (2 by default)")
        if self.prefetch_steps > MAX_PREFETCH_STEPS:  # the step queues and rings it would pin grow without bound
            raise ConfigError(
                f"job prefetch_steps={self.prefetch_steps} is over {MAX_PREFETCH_STEPS}; plan 1..{MAX_PREFETCH_STEPS}"
                " steps ahead (2 by default; a node may allow fewer: [node] max_prefetch_steps)"
            )
        check_int(
            "job shadow_loaders", self.shadow_loaders, low=0, fix="use 0 (no standbys) or the standbys per partition"
        )
        self._check_broadcast()
        self._check_pp_fields()
        self._check_parts()

    def _check_broadcast(self) -> None:
        allowed = BroadcastAxis.values()
        axes = check_str_tuple("job broadcast_at", self.broadcast_at, fix=f"choose axes from {allowed}")
        for axis in axes:
            BroadcastAxis.parse(axis, "job broadcast_at axis")
        if len(set(axes)) != len(axes):
            raise ConfigError(f"job broadcast_at={list(axes)!r} names an axis twice; list each axis once")
        object.__setattr__(self, "broadcast_at", tuple(a for a in allowed if a in axes))

    def _check_pp_fields(self) -> None:
        if self.pp_fields is None:
            return
        check_keys("[job] pp_fields", self.pp_fields, PP_STAGES)
        out = {}
        for stage, names in self.pp_fields.items():
            names = check_str_tuple(f"job pp_fields.{stage}", names, fix="list batch keys such as 'tokens'")
            if len(set(names)) != len(names):
                raise ConfigError(f"job pp_fields.{stage}={list(names)!r} names a field twice; list each once")
            out[stage] = names
        object.__setattr__(self, "pp_fields", FrozenMap(out))

    def _source_list(self) -> list[SourceSpec]:
        """The sources, before _check_parts has vetted them (the pad_id default reads their tokenizers)."""
        sources = self.sources
        if isinstance(sources, SourceSpec) or not isinstance(sources, Sequence):
            return []
        return [s for s in sources if isinstance(s, SourceSpec)]

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

    def layout(self) -> dict[str, Any]:
        """The job's layout (ARCHITECTURE §4.2: the mesh, micro_batches and rows); states record it, and a state
        restored under another layout is a reshard."""
        return {"mesh": self.mesh.to_dict(), "micro_batches": self.micro_batches, "rows": self.rows}

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
        """Plain JSON-able dict in the shape of the job TOML (ARCHITECTURE §4.3)."""
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
        if self.image_token_id != IMAGE_TOKEN_ID:  # written only when set: text jobs' digests stay as they were
            job["image_token_id"] = self.image_token_id
        if self.video_token_id != VIDEO_TOKEN_ID:  # likewise: digests of jobs that keep the default stay
            job["video_token_id"] = self.video_token_id
        if self.shadow_loaders:  # written only when set: digests of jobs without standbys stay as they were
            job["shadow_loaders"] = self.shadow_loaders
        if self.on_data_change != OnDataChange.ERROR.value:  # written only when set: digests stay as they were
            job["on_data_change"] = self.on_data_change
        if self.on_read_error != OnReadError.FAIL.value:  # written only when set: digests stay as they were
            job["on_read_error"] = self.on_read_error
        return {
            "job": job,
            "mesh": self.mesh.to_dict(),
            "source": [s.to_dict() for s in self.sources],
            "mix": self.mix.to_dict(),
            "balance": self.balance.to_dict(),
        }

    def to_toml(self) -> str:
        """The job as TOML text that `DGraph.from_toml` reads back into an equal spec."""
        return _toml.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, base_dir: str | None = None) -> JobSpec:
        """Strict inverse of `to_dict`; relative source paths resolve against `base_dir` (default: cwd)."""
        check_keys("the job file (top level)", d, _TOP_KEYS)
        for key in ("job", "source", "mix"):
            if key not in d:
                example = {"job": "[job] name = ...", "source": "[[source]]", "mix": "[mix] weights = {...}"}[key]
                raise ConfigError(f"the job has no [{key}] table; add {example}")
        job = dict(check_keys("[job]", d["job"], _JOB_TABLE_KEYS))
        if "name" not in job:
            raise ConfigError('[job] has no name; add name = "..."')
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
            "cost": self.balance.identity(),
        }
        if self.image_token_id != IMAGE_TOKEN_ID:
            identity["image_token_id"] = self.image_token_id
        if self.video_token_id != VIDEO_TOKEN_ID:
            identity["video_token_id"] = self.video_token_id
        return _sha256(identity)


def _sha256(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
