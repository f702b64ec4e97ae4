"""The step planner: which pieces of which documents make step s, and on which DP rank, micro-batch and row.

Per step: the mixture says how many tokens each source owes (cumulative targets, so shares never
drift), each source gives its next documents in its own order until it has paid, long ones are split
(or truncated) at seq_len, and `balance.place` puts the pieces, with last step's carry-over first,
into the rows of the DP ranks; what does not fit is carried over to the next step.

A plan is a pure function of (planner state, config, document lengths): no clocks, no set or dict
order, only stable sorts, so an interrupted and restored run plans bit for bit what an
uninterrupted one does. The state is a position in each source's order plus the carried pieces
(at most about balance's CARRY_KEEP) and token counters: tens of kilobytes at most, whatever the data.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from msdata_server.errors import BadSampleError, CheckpointError, ConfigError, ProtocolError

from ._rows import order_by
from .balance import method_of, place
from .cost import check_cost_fn, make_cost
from .layout import Layout
from .mixture import Mixture
from .pack import LongDocs, long_docs_mode, pieces

__all__ = ["MetadataView", "PlanStats", "Planner", "PlannerConfig", "StepPlan"]

log = logging.getLogger(__name__)

STATE_VERSION = 1
# state_dict keys
K_VERSION, K_STEP, K_SOURCES, K_SEQ_LEN, K_LONG_DOCS = "version", "step", "sources", "seq_len", "long_docs"
K_CURSOR, K_TAKEN, K_TARGET, K_PLACED, K_CARRY, K_MIXTURE = "cursor", "taken", "target", "placed", "carry", "mixture"
_STATE_KEYS = frozenset(
    {K_VERSION, K_STEP, K_SOURCES, K_SEQ_LEN, K_LONG_DOCS, K_CURSOR, K_TAKEN, K_TARGET, K_PLACED, K_CARRY, K_MIXTURE}
)
_CARRY_KEYS = ("source", "ordinal", "offset", "length")

MIN_CHUNK, MAX_CHUNK = 64, 1 << 16  # ordinals per MetadataView.lengths call (the loaders hold what was asked)
MAX_SKIPPED = 1 << 20  # consecutive empty (bad) samples before a source is declared broken


class MetadataView(Protocol):
    """Lengths of samples by ordinal; what the planner reads (the node server implements it)."""

    def lengths(self, source: int, start: int, count: int) -> np.ndarray:
        """int64 token lengths of ordinals [start, start+count) of `source`; 0 = a skipped bad sample."""
        ...


def _pos_int(name: str, v: object, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{name}={v!r} must be an int >= {minimum}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """What the planner needs of a job: sources, shape of a step, balance method, cost, mixture."""

    sources: tuple[str, ...]
    seq_len: int
    dp: int  # number of distinct data groups (DP ranks)
    micro_batches: int = 1  # per DP rank per step
    rows: int = 1  # packed rows of seq_len per micro-batch
    method: str = "karmarkar_karp"  # "karmarkar_karp" | "greedy" | "none"
    alpha: float = 1.0
    beta: float = 4096.0
    cost_fn: str | None = None  # "module:function": fn(int64 lengths) -> float64 costs
    long_docs: str = "split"  # "split" | "truncate"
    # a rank stops taking documents once its cost would pass (1 + this) x the mean, leaving padding
    # where that shortens the step (a rank holding a full-row document); None: never pad on purpose
    balance_tolerance: float | None = 0.01
    mixture: Mixture

    def __post_init__(self) -> None:
        if isinstance(self.sources, (list, tuple)):
            object.__setattr__(self, "sources", tuple(self.sources))
        else:
            raise ConfigError(f"sources={self.sources!r} must be a tuple of source names")
        if not self.sources or not all(isinstance(s, str) and s for s in self.sources):
            raise ConfigError(f"sources={self.sources!r} must be a non-empty tuple of non-empty names")
        if len(set(self.sources)) != len(self.sources):
            raise ConfigError(f"sources={self.sources!r} has duplicates; name each source once")
        for name in ("seq_len", "dp", "micro_batches", "rows"):
            _pos_int(name, getattr(self, name))
        method_of(self.method)
        long_docs_mode(self.long_docs)
        make_cost(alpha=self.alpha, beta=self.beta)  # validates alpha and beta
        if self.cost_fn is not None:
            check_cost_fn(self.cost_fn)
        tol = self.balance_tolerance
        if tol is not None and (
            isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0
        ):
            raise ConfigError(f"balance_tolerance={tol!r} must be None or a finite number >= 0")
        if not isinstance(self.mixture, Mixture):
            raise ConfigError(f"mixture must be a Mixture (Mixture.constant or Mixture.schedule), got {self.mixture!r}")
        unknown = self.mixture.names().difference(self.sources)
        if unknown:
            raise ConfigError(f"mixture names unknown sources {sorted(unknown)}; the sources are {list(self.sources)}")

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, micro=self.micro_batches, rows=self.rows, seq_len=self.seq_len)

    @property
    def capacity(self) -> int:
        """Tokens per step: dp * micro_batches * rows * seq_len."""
        return self.dp * self.micro_batches * self.rows * self.seq_len


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanStats:
    """How good one step's plan is, and what it cost to make."""

    cost: np.ndarray  # float64 [dp]: cost of each DP rank (sum of its pieces' costs)
    micro_cost: np.ndarray  # float64 [dp, micro_batches]
    imbalance: float  # max / mean of cost
    lower_bound: float  # max(total cost / dp, costliest piece): no plan of these pieces beats it
    padding_fraction: float  # share of the step's token capacity left as padding
    tokens: dict[str, int]  # tokens placed per source
    docs: int  # pieces placed
    carried: int  # pieces carried over to the next step
    plan_ms: float  # planner compute (excluding reading metadata)
    ingest_ms: float  # time spent in MetadataView.lengths

    @property
    def gap(self) -> float:
        """Costliest rank over the lower bound (1.0 = provably optimal)."""
        top = float(self.cost.max()) if self.cost.size else 0.0
        return top / self.lower_bound if self.lower_bound > 0 else 1.0

    def to_dict(self) -> dict:
        """JSON-able summary (no per-rank arrays beyond max/mean)."""
        return {
            "imbalance": self.imbalance,
            "gap": self.gap,
            "lower_bound": self.lower_bound,
            "max_cost": float(self.cost.max()) if self.cost.size else 0.0,
            "mean_cost": float(self.cost.mean()) if self.cost.size else 0.0,
            "padding_fraction": self.padding_fraction,
            "tokens": dict(self.tokens),
            "docs": self.docs,
            "carried": self.carried,
            "plan_ms": self.plan_ms,
            "ingest_ms": self.ingest_ms,
        }


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: an entry per document piece, sorted by (dp, micro, row, position in row)."""

    step: int
    source: np.ndarray  # int32 source index
    ordinal: np.ndarray  # int64 sample ordinal in its source
    offset: np.ndarray  # int32 first token of the piece within its document
    length: np.ndarray  # int32 tokens in the piece
    dp: np.ndarray  # int32
    micro: np.ndarray  # int32
    row: np.ndarray  # int32
    # bool: no piece of this piece's document is left over (carried) after this step, so once the step's
    # pieces of it are built its payload is no longer needed (pieces of one document can span steps)
    last: np.ndarray
    stats: PlanStats
    # bounds[d * micro_batches + m] : bounds[... + 1] is micro-batch (d, m)'s slice of the arrays
    bounds: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))

    def __len__(self) -> int:
        return int(self.source.size)

    def micro_batch(self, dp: int, micro: int) -> StepPlan:
        """The pieces of one micro-batch, as a StepPlan of array views (no copy)."""
        n_micro = self.stats.micro_cost.shape[1]
        n_dp = self.stats.micro_cost.shape[0]
        if not (0 <= dp < n_dp and 0 <= micro < n_micro):
            raise ConfigError(
                f"micro-batch ({dp=}, {micro=}) is outside this plan's {n_dp} ranks x {n_micro} micro-batches"
            )
        i = dp * n_micro + micro
        sl = slice(int(self.bounds[i]), int(self.bounds[i + 1]))
        return StepPlan(
            step=self.step,
            source=self.source[sl],
            ordinal=self.ordinal[sl],
            offset=self.offset[sl],
            length=self.length[sl],
            dp=self.dp[sl],
            micro=self.micro[sl],
            row=self.row[sl],
            last=self.last[sl],
            stats=self.stats,
            bounds=np.array([0, sl.stop - sl.start], np.int64),
        )


def _empty_carry() -> dict[str, np.ndarray]:
    return {
        "source": np.zeros(0, np.int32),
        "ordinal": np.zeros(0, np.int64),
        "offset": np.zeros(0, np.int64),
        "length": np.zeros(0, np.int64),
    }


class Planner:
    """Plans steps one after another from a deterministic position; see the module docstring."""

    def __init__(self, cfg: PlannerConfig, state: Mapping | None = None):
        if not isinstance(cfg, PlannerConfig):
            raise ConfigError(f"Planner needs a PlannerConfig, got {type(cfg).__name__}")
        self._cfg = cfg
        self._cost = make_cost(alpha=cfg.alpha, beta=cfg.beta, cost_fn=cfg.cost_fn)
        self._mode = long_docs_mode(cfg.long_docs)
        self._method = method_of(cfg.method)
        n = len(cfg.sources)
        self._step = 0
        self._cursor = np.zeros(n, np.int64)  # next unread ordinal per source
        self._taken = np.zeros(n, np.int64)  # tokens taken from each stream (placed + carried)
        self._target = np.zeros(n, np.float64)  # tokens each stream should have given by now
        self._placed = np.zeros(n, np.int64)  # tokens placed in plans
        self._carry = _empty_carry()
        self._mixture = cfg.mixture
        # not state: a look-ahead of lengths already read (pure values, so safe to drop) and
        # a running mean length per source that only sizes the read chunks
        self._ahead: list[tuple[int, np.ndarray]] = [(0, np.zeros(0, np.int64)) for _ in range(n)]
        self._mean_len = np.full(n, max(1.0, cfg.seq_len / 8))
        if state is not None:
            self._load(state)

    @classmethod
    def from_state(cls, cfg: PlannerConfig, state: Mapping) -> Planner:
        """A planner that continues from `state` (as returned by state_dict)."""
        return cls(cfg, state)

    @property
    def step(self) -> int:
        """The next step plan_step will plan."""
        return self._step

    @property
    def config(self) -> PlannerConfig:
        return self._cfg

    @property
    def mixture(self) -> Mixture:
        """The mixture in force, run-time overrides included."""
        return self._mixture

    def set_mixture(self, step: int, weights: Mapping[str, float]) -> None:
        """Use `weights` from `step` on. Steps already planned cannot change: restore their state first."""
        if isinstance(step, bool) or not isinstance(step, int) or step < self._step:
            raise ConfigError(
                f"set_mixture at step {step!r}: this planner has planned up to step {self._step - 1}; pick a step"
                f" >= {self._step}, or restore the planner state of step {step!r} first"
            )
        mixture = self._mixture.with_override(step, weights)
        mixture.weights_at(step, self._cfg.sources)  # unknown names fail now, not at that step
        self._mixture = mixture

    # -- planning ---------------------------------------------------------------------------

    def plan_step(self, view: MetadataView) -> StepPlan:
        """Plan step `self.step` from the lengths in `view` and advance the state.

        All or nothing: if the view raises, the planner is left at the same step, unchanged.
        """
        cfg = self._cfg
        t0 = time.perf_counter()
        ingest = [0.0]
        weights = self._mixture.weights_at(self._step, cfg.sources)
        carry = self._carry
        # tokens to draw: the step's capacity less the carry-over, plus what the streams gave beyond
        # their targets last time (each overshoots by less than one document), so that the pool
        # holds at least a step's capacity; the cumulative target is then placed + capacity
        surplus = float(self._taken.sum()) - float(self._target.sum())
        need = max(0.0, cfg.capacity - float(carry["length"].sum()) + surplus)
        target = self._target + weights * need
        taken, cursor = self._taken.copy(), self._cursor.copy()

        parts: list[tuple[np.ndarray, ...]] = []
        for s in range(len(cfg.sources)):
            deficit = float(target[s]) - float(taken[s])
            if deficit <= 0:
                continue
            start = int(cursor[s])
            lens = self._draw(view, s, start, deficit, ingest)
            cursor[s] = start + lens.size
            doc, off, plen = pieces(lens, cfg.seq_len, self._mode)
            taken[s] += int(plen.sum())
            # arrival order interleaves the sources by tokens drawn per unit of weight (fair queueing)
            key = (np.cumsum(plen) - plen) / max(float(weights[s]), 1e-12)
            parts.append((np.full(doc.size, s, np.int32), start + doc, off, plen, key))

        src, ords, off, lens = (carry[k] for k in _CARRY_KEYS)
        if parts:
            cols = [np.concatenate(c) for c in zip(*parts)]
            order = np.argsort(cols[4], kind="stable")  # ties: by source, then position (concat order)
            src = np.concatenate([src, cols[0][order]])
            ords = np.concatenate([ords, cols[1][order]])
            off = np.concatenate([off, cols[2][order]])
            lens = np.concatenate([lens, cols[3][order]])
        costs = self._cost(lens)
        p = place(
            lens,
            costs,
            cfg.layout,
            method=self._method,
            priority=int(carry["length"].size),
            tolerance=cfg.balance_tolerance,
        )

        left = p.rank < 0
        idx = np.flatnonzero(~left)
        idx = idx[order_by(p.slot[idx], cfg.layout.slots)]  # by rank, then row, then arrival
        idx = idx[order_by(p.rank[idx], cfg.dp)]
        rank, slot = p.rank[idx], p.slot[idx]
        micro = slot // cfg.rows
        bounds = np.searchsorted(rank * cfg.micro_batches + micro, np.arange(cfg.dp * cfg.micro_batches + 1))
        per_source = np.bincount(src[idx], weights=lens[idx], minlength=len(cfg.sources)).astype(np.int64)
        mean = float(p.rank_cost.sum()) / cfg.dp
        doc_key = src.astype(np.int64) << 40 | ords.astype(np.int64)  # ordinals stay far below 2**40
        last = ~np.isin(doc_key[idx], doc_key[left])
        lower = max(mean, float(costs[idx].max()) if idx.size else 0.0)
        plan = StepPlan(
            step=self._step,
            source=src[idx].astype(np.int32),
            ordinal=ords[idx].astype(np.int64),
            offset=off[idx].astype(np.int32),
            length=lens[idx].astype(np.int32),
            dp=rank.astype(np.int32),
            micro=micro.astype(np.int32),
            row=(slot % cfg.rows).astype(np.int32),
            last=last,
            stats=PlanStats(
                cost=p.rank_cost,
                micro_cost=p.micro_cost,
                imbalance=float(p.rank_cost.max()) / mean if mean > 0 else 1.0,
                lower_bound=lower,
                padding_fraction=1.0 - float(lens[idx].sum()) / cfg.capacity,
                tokens={name: int(per_source[i]) for i, name in enumerate(cfg.sources)},
                docs=int(idx.size),
                carried=int(left.sum()),
                plan_ms=(time.perf_counter() - t0) * 1e3 - ingest[0],
                ingest_ms=ingest[0],
            ),
            bounds=bounds.astype(np.int64),
        )
        log.debug(
            "step %d: %d pieces, imbalance %.4f, padding %.4f, %d carried, %.1f ms (+%.1f ms metadata)",
            self._step, idx.size, plan.stats.imbalance, plan.stats.padding_fraction, plan.stats.carried,
            plan.stats.plan_ms, ingest[0],
        )
        # commit
        self._target, self._taken, self._cursor = target, taken, cursor
        self._placed = self._placed + per_source
        self._carry = {"source": src[left], "ordinal": ords[left], "offset": off[left], "length": lens[left]}
        self._step += 1
        return plan

    def _read(self, view: MetadataView, s: int, start: int, count: int, ingest: list[float]) -> np.ndarray:
        """Lengths of [start, start+count) of source s, from the look-ahead or the view."""
        a_start, ahead = self._ahead[s]
        if a_start == start and ahead.size:
            return ahead
        t = time.perf_counter()
        raw = view.lengths(s, start, count)
        ingest[0] += (time.perf_counter() - t) * 1e3
        arr = np.asarray(raw)
        if arr.shape != (count,) or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise ProtocolError(
                f"MetadataView.lengths({s}, {start}, {count}) returned {arr.dtype} shape {arr.shape};"
                f" it must return {count} integer lengths"
            )
        arr = arr.astype(np.int64, copy=False)
        if arr.size and int(arr.min()) < 0:
            raise ProtocolError(f"MetadataView.lengths({s}, {start}, {count}) returned a negative length")
        return arr

    def _draw(self, view: MetadataView, s: int, start: int, deficit: float, ingest: list[float]) -> np.ndarray:
        """Lengths of source s's next documents from `start`, in order, until `deficit` tokens are covered.

        The last one crosses the deficit (never short of it); empty (bad) samples are passed over.
        """
        cfg = self._cfg
        cur = start
        got: list[np.ndarray] = []
        have = 0
        empty_run = 0
        while True:
            count = int(min(MAX_CHUNK, max(MIN_CHUNK, 1.1 * (deficit - have) / self._mean_len[s] + 16)))
            arr = self._read(view, s, cur, count, ingest)
            used = np.minimum(arr, cfg.seq_len) if self._mode is LongDocs.TRUNCATE else arr
            ends = np.cumsum(used)
            j = int(np.searchsorted(ends, deficit - have, side="left"))
            nonzero = int(np.count_nonzero(arr))
            if nonzero:
                self._mean_len[s] = max(1.0, float(ends[-1]) / nonzero)
                empty_run = 0
            else:
                empty_run += arr.size
                if empty_run >= MAX_SKIPPED:
                    raise BadSampleError(
                        f"source {cfg.sources[s]!r} gave {empty_run} empty (bad) samples in a row up to ordinal"
                        f" {cur + arr.size - 1}; check its files and transform",
                        source=cfg.sources[s],
                    )
            if j < arr.size:
                got.append(arr[: j + 1])
                self._ahead[s] = (cur + j + 1, arr[j + 1 :])
                return np.concatenate(got) if len(got) > 1 else got[0]
            got.append(arr)
            have += int(ends[-1])
            cur += arr.size

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Small JSON-able state at the current step boundary; Planner(cfg, state) continues from it."""
        cfg = self._cfg
        return {
            K_VERSION: STATE_VERSION,
            K_STEP: self._step,
            K_SOURCES: list(cfg.sources),
            K_SEQ_LEN: cfg.seq_len,
            K_LONG_DOCS: self._mode.value,
            K_CURSOR: [int(x) for x in self._cursor],
            K_TAKEN: [int(x) for x in self._taken],
            K_TARGET: [float(x) for x in self._target],
            K_PLACED: [int(x) for x in self._placed],
            K_CARRY: {k: [int(x) for x in self._carry[k]] for k in _CARRY_KEYS},
            K_MIXTURE: self._mixture.to_dict(),
        }

    def _load(self, state: Mapping) -> None:
        """Strictly validate and adopt a state; CheckpointError says what does not fit and why."""
        cfg = self._cfg
        n = len(cfg.sources)
        if not isinstance(state, Mapping):
            raise CheckpointError(f"planner state must be a dict, got {type(state).__name__}")
        keys = set(state)
        if keys != _STATE_KEYS:
            raise CheckpointError(
                f"planner state keys differ: unknown {sorted(keys - _STATE_KEYS)}, missing {sorted(_STATE_KEYS - keys)}"
            )
        if state[K_VERSION] != STATE_VERSION:
            raise CheckpointError(
                f"planner state version {state[K_VERSION]!r} is not {STATE_VERSION}; it was saved by another msdata"
            )
        if list(state[K_SOURCES]) != list(cfg.sources):
            raise CheckpointError(
                f"planner state is for sources {state[K_SOURCES]!r}, this job has {list(cfg.sources)!r};"
                " restore into the job that saved it"
            )
        if state[K_SEQ_LEN] != cfg.seq_len:
            raise CheckpointError(
                f"planner state has seq_len={state[K_SEQ_LEN]!r}, this job {cfg.seq_len}; keep seq_len to restore"
            )
        if state[K_LONG_DOCS] != self._mode.value:
            raise CheckpointError(f"planner state has long_docs={state[K_LONG_DOCS]!r}, this job {self._mode.value!r}")
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
        if not isinstance(carry_raw, Mapping) or set(carry_raw) != set(_CARRY_KEYS):
            raise CheckpointError(f"planner state 'carry' must have keys {list(_CARRY_KEYS)}")
        cols = []
        for k in _CARRY_KEYS:
            v = carry_raw[k]
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise CheckpointError(f"planner state carry[{k!r}] must be a list of ints")
            cols.append(np.array(v, dtype=np.int64))
        c_src, c_ord, c_off, c_len = cols
        if len({c.size for c in cols}) != 1:
            raise CheckpointError("planner state carry columns have different lengths")
        if c_src.size and (
            c_src.min() < 0
            or c_src.max() >= n
            or c_ord.min() < 0
            or (c_ord >= cursor[c_src]).any()
            or c_off.min() < 0
            or c_len.min() < 1
            or c_len.max() > cfg.seq_len
        ):
            raise CheckpointError("planner state carry holds a piece outside its source, cursor or seq_len")
        try:
            mixture = Mixture.from_dict(state[K_MIXTURE])
            mixture.weights_at(step, cfg.sources)
        except ConfigError as exc:
            raise CheckpointError(f"planner state mixture does not fit this job: {exc}") from exc
        self._step = step
        self._cursor, self._taken, self._placed = cursor, taken, placed
        self._target = np.array(target, dtype=np.float64)
        self._carry = {"source": c_src.astype(np.int32), "ordinal": c_ord, "offset": c_off, "length": c_len}
        self._mixture = mixture
        self._ahead = [(0, np.zeros(0, np.int64)) for _ in range(n)]
