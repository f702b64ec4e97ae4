"""The planner's checkpoint: a position in each source's order, the carried pieces and token counters.

`Position` is where a planner stands between steps. `state_dict` composes it from named keys with
a version; `Position.load` takes one back strictly: CheckpointError says what does not fit and why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from msdata_server.errors import CheckpointError, ConfigError

from .deferred import Deferred
from .listings import Listings
from .mixture import Mixture

__all__ = [
    "CARRY_KEYS",
    "COUNT_KEYS",
    "K_COUNTS",
    "K_DEFERRED",
    "K_LISTING",
    "K_PENDING",
    "K_SKIPS",
    "STATE_VERSION",
    "VISION_KEYS",
    "PendingSkip",
    "Position",
]

STATE_VERSION = 1
# state_dict keys
K_VERSION, K_STEP, K_SOURCES, K_SEQ_LEN, K_LONG_DOCS = "version", "step", "sources", "seq_len", "long_docs"
K_CURSOR, K_TAKEN, K_TARGET, K_PLACED, K_CARRY, K_MIXTURE = "cursor", "taken", "target", "placed", "carry", "mixture"
_STATE_KEYS = frozenset(
    {K_VERSION, K_STEP, K_SOURCES, K_SEQ_LEN, K_LONG_DOCS, K_CURSOR, K_TAKEN, K_TARGET, K_PLACED, K_CARRY, K_MIXTURE}
)
# optional: the step ranges [start, stop) that loader.skip() planned and never delivered (lineage shows them as
# skipped); absent while there are none, so the states of a job that never skipped are unchanged
K_SKIPS = "skips"
# optional on load (zeros), always saved: running counts per source for token accounting (lineage/accounting.py):
# documents whose first piece was placed, bad (empty) samples passed over, and what loader.skip dropped
K_COUNTS = "counts"
# optional: pieces loader.skip(defer=True) put after the rest of their source's epoch (deferred.Deferred)
K_DEFERRED = "deferred"
# optional: the file listings the state was planned over and the changes a resume went on across
# (listings.Listings); absent in states saved before they were kept (the file list is unknown then)
K_LISTING = "listing"
# optional: a skip of steps [start, stop) still to come (loader.skip(steps=(A, B)) from a state saved before A);
# the planning home skips them when it reaches start. Absent while there is none.
K_PENDING = "pending_skip"
COUNT_KEYS = ("started", "bad", "skipped_docs", "skipped_tokens")
CARRY_KEYS = ("source", "ordinal", "offset", "length")  # a column per carried piece
# with the "vlm" cost, two more: the piece's image patches and patches squared (a document's first piece
# holds its images), so a restored planner prices its carry-over without reading old ordinals again
VISION_KEYS = ("patches", "patches_sq")


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingSkip:
    """Steps [start, stop) to plan and never deliver once the planner reaches ``start`` (``defer``: their pieces
    after the rest of their source's epoch), as ``loader.skip(steps=(start, stop), defer=...)`` asks."""

    start: int
    stop: int
    defer: bool = False

    def to_dict(self) -> dict:
        return {"start": self.start, "stop": self.stop, "defer": self.defer}


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Position:
    """Where a planner stands between steps: a pure value, replaced whole when a step is planned."""

    step: int  # the next step to plan
    cursor: np.ndarray  # int64 per source: next unread ordinal
    taken: np.ndarray  # int64 per source: tokens taken from each stream (placed + carried)
    target: np.ndarray  # float64 per source: tokens each stream should have given by now
    placed: np.ndarray  # int64 per source: tokens placed in plans
    carry: dict[str, np.ndarray]  # CARRY_KEYS: the pieces carried over to the next step
    mixture: Mixture  # run-time overrides included
    skips: tuple[tuple[int, int], ...] = ()  # K_SKIPS: skipped step ranges [start, stop), oldest first
    counts: dict[str, np.ndarray] | None = None  # K_COUNTS: int64 per source each (None: all zero)
    deferred: Deferred | None = None  # K_DEFERRED: virtual ordinals that map to deferred pieces
    listing: Listings | None = None  # K_LISTING: the files planned over (None: unknown)
    pending: PendingSkip | None = None  # K_PENDING: a skip still to come

    @classmethod
    def start(cls, n: int, mixture: Mixture, *, vision: bool = False) -> Position:
        """Step 0 of n sources: nothing read, taken or carried (`vision`: carry VISION_KEYS too)."""
        carry: dict[str, np.ndarray] = {
            "source": np.zeros(0, np.int32),
            "ordinal": np.zeros(0, np.int64),
            "offset": np.zeros(0, np.int64),
            "length": np.zeros(0, np.int64),
        }
        if vision:
            carry.update({k: np.zeros(0, np.int64) for k in VISION_KEYS})
        return cls(
            step=0,
            cursor=np.zeros(n, np.int64),
            taken=np.zeros(n, np.int64),
            target=np.zeros(n, np.float64),
            placed=np.zeros(n, np.int64),
            carry=carry,
            mixture=mixture,
        )

    def state_dict(self, sources: tuple[str, ...], seq_len: int, long_docs: str) -> dict:
        """Small JSON-able state, with the job's sources, seq_len and long_docs that it only fits."""
        return {
            K_VERSION: STATE_VERSION,
            K_STEP: self.step,
            K_SOURCES: list(sources),
            K_SEQ_LEN: seq_len,
            K_LONG_DOCS: long_docs,
            K_CURSOR: [int(x) for x in self.cursor],
            K_TAKEN: [int(x) for x in self.taken],
            K_TARGET: [float(x) for x in self.target],
            K_PLACED: [int(x) for x in self.placed],
            K_CARRY: {k: [int(x) for x in self.carry[k]] for k in CARRY_KEYS + VISION_KEYS if k in self.carry},
            K_MIXTURE: self.mixture.since(self.step).to_dict(),  # only what steps from here on use
            **({K_SKIPS: [list(r) for r in self.skips]} if self.skips else {}),
            K_COUNTS: {k: [int(x) for x in v] for k, v in self.count_arrays().items()},
            **({K_DEFERRED: self.deferred.to_list()} if self.deferred else {}),
            **({K_LISTING: self.listing.to_dict()} if self.listing is not None else {}),
            **({K_PENDING: self.pending.to_dict()} if self.pending is not None else {}),
        }

    def count_arrays(self) -> dict[str, np.ndarray]:
        """The K_COUNTS columns (zeros where none were kept)."""
        if self.counts is not None:
            return self.counts
        return {k: np.zeros(self.cursor.size, np.int64) for k in COUNT_KEYS}

    @classmethod
    def load(
        cls, state: Mapping, sources: tuple[str, ...], seq_len: int, long_docs: str, *, vision: bool = False
    ) -> Position:
        """Strictly validate a state_dict of the job with these sources, seq_len and long_docs (and, with
        `vision`, the "vlm" cost's carry columns)."""
        n = len(sources)
        if not isinstance(state, Mapping):
            raise CheckpointError(f"planner state must be a dict, got {type(state).__name__}")
        keys = set(state) - {K_SKIPS, K_COUNTS, K_DEFERRED, K_LISTING, K_PENDING}
        if keys != _STATE_KEYS:
            raise CheckpointError(
                f"planner state keys differ: unknown {sorted(keys - _STATE_KEYS)}, missing {sorted(_STATE_KEYS - keys)}"
            )
        if state[K_VERSION] != STATE_VERSION:
            raise CheckpointError(
                f"planner state version {state[K_VERSION]!r} is not {STATE_VERSION}; it was saved by another msdata"
            )
        if list(state[K_SOURCES]) != list(sources):
            raise CheckpointError(
                f"planner state is for sources {state[K_SOURCES]!r}, this job has {list(sources)!r};"
                " restore into the job that saved it"
            )
        if state[K_SEQ_LEN] != seq_len:
            raise CheckpointError(
                f"planner state has seq_len={state[K_SEQ_LEN]!r}, this job {seq_len}; keep seq_len to restore"
            )
        if state[K_LONG_DOCS] != long_docs:
            raise CheckpointError(f"planner state has long_docs={state[K_LONG_DOCS]!r}, this job {long_docs!r}")
        step = state[K_STEP]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"planner state step={step!r} must be an int >= 0")

        def ints(key: str, minimum: int = 0) -> np.ndarray:
            v = state[key]
            if (
                not isinstance(v, list)
                or len(v) != n
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= minimum for x in v)
            ):
                raise CheckpointError(f"planner state {key!r} must be {n} ints >= {minimum}, got {v!r}")
            return np.array(v, dtype=np.int64)

        cursor, taken, placed = ints(K_CURSOR), ints(K_TAKEN), ints(K_PLACED)
        target = state[K_TARGET]
        if (
            not isinstance(target, list)
            or len(target) != n
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in target)
        ):
            raise CheckpointError(f"planner state 'target' must be {n} finite numbers, got {target!r}")
        carry_raw = state[K_CARRY]
        columns = CARRY_KEYS + VISION_KEYS if vision else CARRY_KEYS
        if not isinstance(carry_raw, Mapping) or set(carry_raw) != set(columns):
            raise CheckpointError(
                f"planner state 'carry' must have keys {list(columns)}"
                + (" (the vlm cost's state; was it saved by a job with another cost?)" if vision else "")
            )
        cols = []
        for k in columns:
            v = carry_raw[k]
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise CheckpointError(f"planner state carry[{k!r}] must be a list of ints")
            cols.append(np.array(v, dtype=np.int64))
        c_src, c_ord, c_off, c_len = cols[:4]
        extra = dict(zip(VISION_KEYS, cols[4:]))
        if any(c.size and c.min() < 0 for c in extra.values()):
            raise CheckpointError(f"planner state carry {list(VISION_KEYS)} must be ints >= 0")
        if len({c.size for c in cols}) != 1:
            raise CheckpointError("planner state carry columns have different lengths")
        if c_src.size and (
            c_src.min() < 0
            or c_src.max() >= n
            or c_ord.min() < 0
            or (c_ord >= cursor[c_src]).any()
            or c_off.min() < 0
            or c_len.min() < 1
            or c_len.max() > seq_len
        ):
            raise CheckpointError("planner state carry holds a piece outside its source, cursor or seq_len")
        try:
            mixture = Mixture.from_dict(state[K_MIXTURE])
            mixture.weights_at(step, sources)
        except ConfigError as exc:
            raise CheckpointError(f"planner state mixture does not fit this job: {exc}") from exc
        return cls(
            step=step,
            skips=_skips(state.get(K_SKIPS, []), step),
            counts=_counts(state.get(K_COUNTS), n),
            deferred=Deferred.from_list(state[K_DEFERRED], n) if K_DEFERRED in state else None,
            listing=Listings.from_dict(state[K_LISTING], n) if K_LISTING in state else None,
            pending=_pending(state[K_PENDING], step) if K_PENDING in state else None,
            cursor=cursor,
            taken=taken,
            target=np.array(target, dtype=np.float64),
            placed=placed,
            carry={"source": c_src.astype(np.int32), "ordinal": c_ord, "offset": c_off, "length": c_len, **extra},
            mixture=mixture,
        )


def _skips(raw: object, step: int) -> tuple[tuple[int, int], ...]:
    """The K_SKIPS ranges of a state at ``step``: [start, stop) pairs, increasing, none past ``step``."""
    out: list[tuple[int, int]] = []
    if not isinstance(raw, list):
        raise CheckpointError(f"planner state {K_SKIPS!r} must be a list of [start, stop] step ranges, got {raw!r}")
    for r in raw:
        ok = isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        if not ok or not (0 <= r[0] < r[1] <= step) or (out and r[0] < out[-1][1]):
            raise CheckpointError(
                f"planner state {K_SKIPS!r} holds {r!r}: each must be [start, stop] with start < stop <= step"
                f" {step}, after the range before it"
            )
        out.append((r[0], r[1]))
    return tuple(out)


def _pending(raw: object, step: int) -> PendingSkip:
    """The K_PENDING skip of a state at ``step``: {start, stop, defer} with step <= start < stop."""
    ok = isinstance(raw, Mapping) and set(raw) == {"start", "stop", "defer"}
    if ok:
        a, b, d = raw["start"], raw["stop"], raw["defer"]  # type: ignore[index]
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b))
        ok = ints and isinstance(d, bool) and step <= a < b
    if not ok:
        raise CheckpointError(
            f"planner state {K_PENDING!r} holds {raw!r}: it must be {{'start': A, 'stop': B, 'defer': bool}} with"
            f" step {step} <= A < B"
        )
    return PendingSkip(start=a, stop=b, defer=d)


def _counts(raw: object, n: int) -> dict[str, np.ndarray] | None:
    """The K_COUNTS of a state (None when it has none: a state saved before they were kept)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or set(raw) != set(COUNT_KEYS):
        raise CheckpointError(f"planner state {K_COUNTS!r} must have keys {list(COUNT_KEYS)}, got {raw!r}")
    out = {}
    for k in COUNT_KEYS:
        v = raw[k]
        if not isinstance(v, list) or len(v) != n or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise CheckpointError(f"planner state {K_COUNTS}[{k!r}] must be {n} ints, got {v!r}")
        out[k] = np.array(v, dtype=np.int64)
    return out
