"""ClientPlaceTree: the training mesh, and which data stream and batch fields each rank receives.

Ranks are laid out in mixed radix over the axes in `order` (outermost first, the last axis varies
fastest), so the usual Megatron layout ``order=("pp", "dp", "cp", "tp")`` puts TP peers on adjacent ranks.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from msdata_client.errors import ConfigError

__all__ = ["AXES", "ClientPlaceTree", "Coord", "DISTRIBUTE", "PP_STAGES", "default_stage_fields"]

logger = logging.getLogger(__name__)

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
DISTRIBUTE: tuple[str, ...] = ("dp", "cp", "world")
PP_STAGES: tuple[str, ...] = ("first", "middle", "last")

# Default per-stage fields (ARCHITECTURE §4.4). Fields not named in LABEL_FIELDS or ATTENTION_FIELDS are inputs
# (tokens and other modalities' keys) and go to the first stage only.
LABEL_FIELDS: frozenset[str] = frozenset({"labels", "loss_mask"})
# doc_counts goes with cu_seqlens: it says which of its segments are documents and which are padding
ATTENTION_FIELDS: frozenset[str] = frozenset({"cu_seqlens", "doc_counts", "position_ids", "step", "micro"})
_LAST_EXTRA: frozenset[str] = frozenset({"sample_ids", "source_ids"})


def default_stage_fields(stage: str, all_fields: Sequence[str]) -> tuple[str, ...]:
    """Fields a pipeline stage receives by default, in the order of `all_fields`."""
    if stage == "first":
        keep = [f for f in all_fields if f not in LABEL_FIELDS]
    elif stage == "last":
        wanted = LABEL_FIELDS | ATTENTION_FIELDS | _LAST_EXTRA
        keep = [f for f in all_fields if f in wanted]
    elif stage == "middle":
        keep = [f for f in all_fields if f in ATTENTION_FIELDS]
    else:
        raise ConfigError(f"pipeline stage {stage!r} is not one of {PP_STAGES}; use one of {', '.join(PP_STAGES)}")
    return tuple(keep)


def _check_size(axis: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"mesh {axis}={value!r} must be an integer >= 1; set [mesh] {axis} to the {axis} group size")


@dataclass(frozen=True, slots=True, kw_only=True)
class Coord:
    """A rank's position on each mesh axis."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientPlaceTree:
    """The mesh of a job: axis sizes and their nesting; maps ranks to coordinates, data streams and fields."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    order: tuple[str, ...] = AXES

    def __post_init__(self) -> None:
        for axis in AXES:
            _check_size(axis, getattr(self, axis))
        order = self.order
        if isinstance(order, str) or not isinstance(order, Sequence):
            raise ConfigError(f"mesh order={order!r} must be a list of axis names; use a permutation of {list(AXES)}")
        order = tuple(order)
        if not all(isinstance(a, str) for a in order) or sorted(order) != sorted(AXES):
            raise ConfigError(
                f"mesh order={list(order)!r} must name each of {list(AXES)} exactly once, outermost first; "
                f"for example {list(AXES)}"
            )
        object.__setattr__(self, "order", order)

    # -- layout -------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks in the mesh."""
        return self.dp * self.pp * self.cp * self.tp

    def _strides(self) -> dict[str, int]:
        strides: dict[str, int] = {}
        step = 1
        for axis in reversed(self.order):
            strides[axis] = step
            step *= getattr(self, axis)
        return strides

    def _check_rank(self, rank: Any) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigError(
                f"rank={rank!r} is outside the mesh of world_size={self.world_size} "
                f"(dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp}); use a rank in 0..{self.world_size - 1} "
                f"or change [mesh] to match the launcher's WORLD_SIZE"
            )

    def coord(self, rank: int) -> Coord:
        """Coordinates of `rank`; the last axis of `order` varies fastest."""
        self._check_rank(rank)
        strides = self._strides()
        return Coord(**{axis: (rank // strides[axis]) % getattr(self, axis) for axis in AXES})

    def rank(self, coord: Coord) -> int:
        """The rank at `coord` (inverse of `coord`)."""
        if not isinstance(coord, Coord):
            raise ConfigError(f"coord={coord!r} must be a Coord; build one with Coord(pp=.., dp=.., cp=.., tp=..)")
        strides = self._strides()
        total = 0
        for axis in AXES:
            value = getattr(coord, axis)
            size = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ConfigError(f"coord {axis}={value!r} is outside the mesh ({axis}={size}); use 0..{size - 1}")
            total += value * strides[axis]
        return total

    # -- data streams -------------------------------------------------------------------------------

    def _check_distribute(self, distribute: str) -> None:
        if distribute not in DISTRIBUTE:
            raise ConfigError(
                f"distribute={distribute!r} is not one of {DISTRIBUTE}; use one of {', '.join(DISTRIBUTE)}"
            )

    def data_groups(self, distribute: str = "dp") -> int:
        """Number of distinct data streams: dp for "dp" and "cp" (CP ranks slice one build), world_size for "world"."""
        self._check_distribute(distribute)
        return self.world_size if distribute == "world" else self.dp

    def group_of(self, rank: int, distribute: str = "dp") -> int:
        """The data stream (0..data_groups-1) that `rank` reads."""
        self._check_distribute(distribute)
        if distribute == "world":
            self._check_rank(rank)
            return rank
        return self.coord(rank).dp

    def group(self, rank: int) -> int:
        """The receiving group of `rank` under the default distribution ("dp"): its DP coordinate."""
        return self.group_of(rank, "dp")

    def readers(self, group: int, distribute: str = "dp") -> tuple[int, ...]:
        """All ranks that read data stream `group`, sorted."""
        n = self.data_groups(distribute)
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < n:
            raise ConfigError(f"group={group!r} is outside 0..{n - 1} (data_groups for distribute={distribute!r})")
        if distribute == "world":
            return (group,)
        strides = self._strides()
        others = [a for a in AXES if a != "dp"]
        base = group * strides["dp"]
        ranks = [
            base + sum(v * strides[a] for a, v in zip(others, values, strict=True))
            for values in itertools.product(*(range(getattr(self, a)) for a in others))
        ]
        return tuple(sorted(ranks))

    # -- pipeline fields ----------------------------------------------------------------------------

    def stage(self, rank: int) -> str:
        """Pipeline stage of `rank`: "first", "middle" or "last" ("first" when pp == 1)."""
        pp = self.coord(rank).pp
        if pp == 0:
            return "first"
        return "last" if pp == self.pp - 1 else "middle"

    def fields(
        self, rank: int, all_fields: Sequence[str], pp_fields: Mapping[str, Sequence[str]] | None = None
    ) -> tuple[str, ...]:
        """Batch fields `rank` receives (ARCHITECTURE §4.4), in the order of `all_fields`.

        pp == 1: every field. Otherwise by stage; `pp_fields` ({"first"|"middle"|"last": [...]}, as in the
        job's `pp_fields`) replaces the default list of the stages it names.
        """
        if isinstance(all_fields, str):
            raise ConfigError(f"all_fields={all_fields!r} must be a sequence of field names, not one string")
        self._check_rank(rank)
        if self.pp == 1:
            return tuple(all_fields)
        stage = self.stage(rank)
        if pp_fields is not None and stage in pp_fields:
            chosen = set(pp_fields[stage])
            return tuple(f for f in all_fields if f in chosen)
        return default_stage_fields(stage, all_fields)

    # -- serialisation ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the shape of the TOML `[mesh]` table."""
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp, "order": list(self.order)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClientPlaceTree:
        """Strict inverse of `to_dict`: unknown keys raise ConfigError."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"[mesh] must be a table, got {type(d).__name__}: {d!r}")
        allowed = (*AXES, "order")
        for key in d:
            if key not in allowed:
                raise ConfigError(f"unknown key {key!r} in table [mesh]; allowed keys: {', '.join(allowed)}")
        kwargs = dict(d)
        if "order" in kwargs and isinstance(kwargs["order"], list):
            kwargs["order"] = tuple(kwargs["order"])
        return cls(**kwargs)
