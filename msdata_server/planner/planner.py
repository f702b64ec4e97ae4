"""The step planner: which pieces of which documents make step s, and on which DP rank, micro-batch and row.

Per step: the mixture says how many tokens each source owes (cumulative targets, so shares never
drift), each source gives its next documents in its own order until it has paid, long ones are split
(or truncated) at seq_len, and `balance.place` puts the pieces, with last step's carry-over first,
into the rows of the DP ranks; what does not fit is carried over to the next step.

A plan is a pure function of (planner state, config, document lengths): no clocks, no set or dict
order, only stable sorts, so an interrupted and restored run plans bit for bit what an
uninterrupted one does. The state is a position in each source's order plus the carried pieces
(at most about refine.CARRY_KEEP) and token counters: tens of kilobytes at most, whatever the data.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from msdata_client.choices import CostKind
from msdata_server.errors import ConfigError

from .balance import method_of, place
from .cost import check_cost_fn, make_cost, priced
from .deferred import Deferred, Insert
from .layout import Layout
from .lengths import LengthReader, MetadataView
from .listings import Listings
from .mixture import Mixture
from .pack import long_docs_mode, pieces
from .rows import order_by
from .state import CARRY_KEYS, VISION_KEYS, PendingSkip, Position
from .vlm_cost import VlmCost, load_imbalance

__all__ = ["MetadataView", "PlanStats", "Planner", "PlannerConfig", "StepPlan"]

log = logging.getLogger(__name__)


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
    # "attention" (alpha, beta or cost_fn), or "vlm": two stages balanced at once, the backbone's alpha and
    # beta per piece and the vision encoder's alpha_v * p**2 + beta_v * p per image of p patches (the
    # MetadataView's `vision`; a document's images go with its first piece)
    cost: str = CostKind.ATTENTION.value
    alpha_v: float = 1.0
    beta_v: float = 2048.0
    long_docs: str = "split"  # "split" | "truncate"
    # a rank stops taking documents once its cost would pass (1 + this) x the mean, leaving padding
    # where that shortens the step (a rank holding a full-row document); None: never pad on purpose
    balance_tolerance: float | None = 0.01
    # what a padded token costs a rank (cost.priced; a fixed-shape trainer pays the linear layers for it): the
    # job's [balance] pad_cost, beta by default there (planner/spec.py); 0 here: padding is free
    pad_cost: float = 0.0
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
        if CostKind.parse(self.cost, "cost", brief=True) is CostKind.VLM:
            VlmCost(alpha=self.alpha, beta=self.beta, alpha_v=self.alpha_v, beta_v=self.beta_v)  # validates them
            if self.cost_fn is not None:
                raise ConfigError(f"cost_fn={self.cost_fn!r} cannot be combined with cost='vlm'; drop one of them")
        tol = self.balance_tolerance
        if tol is not None and (
            isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0
        ):
            raise ConfigError(f"balance_tolerance={tol!r} must be None or a finite number >= 0")
        pad = self.pad_cost
        if isinstance(pad, bool) or not isinstance(pad, (int, float)) or not math.isfinite(pad) or pad < 0:
            raise ConfigError(f"pad_cost={pad!r} must be a finite number >= 0 (0: padding is free)")
        if self.cost_fn is None and pad > self.beta:
            raise ConfigError(f"pad_cost={pad!r} is more than beta={self.beta!r}, what a real token costs; use <= beta")
        if not isinstance(self.mixture, Mixture):
            raise ConfigError(f"mixture must be a Mixture (Mixture.constant or Mixture.schedule), got {self.mixture!r}")
        unknown = self.mixture.names().difference(self.sources)
        if unknown:
            raise ConfigError(f"mixture names unknown sources {sorted(unknown)}; the sources are {list(self.sources)}")

    @property
    def vlm_cost(self) -> VlmCost | None:
        """Both stages' constants with cost = "vlm"; None otherwise."""
        if self.cost != CostKind.VLM:
            return None
        return VlmCost(alpha=self.alpha, beta=self.beta, alpha_v=self.alpha_v, beta_v=self.beta_v)

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

    cost: np.ndarray  # float64 [dp]: cost of each DP rank (sum of its pieces' costs; "vlm": both stages')
    micro_cost: np.ndarray  # float64 [dp, micro_batches]
    imbalance: float  # max / mean of cost
    lower_bound: float  # max(total cost / dp, costliest piece): no plan of these pieces beats it
    padding_fraction: float  # share of the step's token capacity left as padding
    tokens: dict[str, int]  # tokens placed per source
    docs: int  # pieces placed
    carried: int  # pieces carried over to the next step
    plan_ms: float  # planner compute (excluding reading metadata)
    ingest_ms: float  # time spent in MetadataView.lengths
    # with cost = "vlm" (else None): float64 [2, dp] backbone (row 0) and encoder (row 1) cost per rank, and
    # each stage's max / mean over ranks (the stages synchronise separately: a step takes the sum of the maxima)
    stage_cost: np.ndarray | None = None
    backbone_imbalance: float | None = None
    encoder_imbalance: float | None = None

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
            "backbone_imbalance": self.backbone_imbalance,
            "encoder_imbalance": self.encoder_imbalance,
        }


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: an entry per document piece, sorted by (group, micro, row, position in row).

    ``group`` is the data group (the distinct data stream: a DP rank under ``distribute = "dp"``, a rank under
    ``"world"``) that receives the piece; the planner's ``dp`` is the number of data groups."""

    step: int
    source: np.ndarray  # int32 source index
    ordinal: np.ndarray  # int64 sample ordinal in its source
    offset: np.ndarray  # int32 first token of the piece within its document
    length: np.ndarray  # int32 tokens in the piece
    group: np.ndarray  # int32 data group
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

    def micro_batch(self, group: int, micro: int) -> StepPlan:
        """The pieces of one micro-batch, as a StepPlan of array views (no copy)."""
        n_micro = self.stats.micro_cost.shape[1]
        n_groups = self.stats.micro_cost.shape[0]
        if not (0 <= group < n_groups and 0 <= micro < n_micro):
            raise ConfigError(
                f"micro-batch ({group=}, {micro=}) is outside this plan's {n_groups} groups x {n_micro} micro-batches"
            )
        i = group * n_micro + micro
        sl = slice(int(self.bounds[i]), int(self.bounds[i + 1]))
        return StepPlan(
            step=self.step,
            source=self.source[sl],
            ordinal=self.ordinal[sl],
            offset=self.offset[sl],
            length=self.length[sl],
            group=self.group[sl],
            micro=self.micro[sl],
            row=self.row[sl],
            last=self.last[sl],
            stats=self.stats,
            bounds=np.array([0, sl.stop - sl.start], np.int64),
        )


class Planner:
    """Plans steps one after another from a deterministic position; see the module docstring."""

    def __init__(self, cfg: PlannerConfig, state: Mapping | None = None):
        if not isinstance(cfg, PlannerConfig):
            raise ConfigError(f"Planner needs a PlannerConfig, got {type(cfg).__name__}")
        self._cfg = cfg
        self._cost = make_cost(alpha=cfg.alpha, beta=cfg.beta, cost_fn=cfg.cost_fn)
        self._vlm = cfg.vlm_cost  # None: one cost
        vision = self._vlm is not None
        self._mode = long_docs_mode(cfg.long_docs)
        self._method = method_of(cfg.method)
        if state is None:
            self._pos = Position.start(len(cfg.sources), cfg.mixture, vision=vision)
        else:
            self._pos = Position.load(state, cfg.sources, cfg.seq_len, self._mode.value, vision=vision)
        # not state: a look-ahead of lengths already read and the chunk sizes (pure values, safe to drop)
        self._reader = LengthReader(cfg.sources, cfg.seq_len, self._mode, vision=vision)

    @classmethod
    def from_state(cls, cfg: PlannerConfig, state: Mapping) -> Planner:
        """A planner that continues from `state` (as returned by state_dict)."""
        return cls(cfg, state)

    @property
    def step(self) -> int:
        """The next step plan_step will plan."""
        return self._pos.step

    @property
    def config(self) -> PlannerConfig:
        return self._cfg

    @property
    def mixture(self) -> Mixture:
        """The mixture in force, run-time overrides included."""
        return self._pos.mixture

    def set_mixture(self, step: int, weights: Mapping[str, float]) -> None:
        """Use `weights` from `step` on. Steps already planned cannot change: restore their state first."""
        now = self._pos.step
        if isinstance(step, bool) or not isinstance(step, int) or step < now:
            raise ConfigError(
                f"set_mixture at step {step!r}: this planner has planned up to step {now - 1}; pick a step"
                f" >= {now}, or restore the planner state of step {step!r} first"
            )
        mixture = self._pos.mixture.with_override(step, weights)
        mixture.weights_at(step, self._cfg.sources)  # unknown names fail now, not at that step
        self._pos = replace(self._pos, mixture=mixture)

    def record_skip(self, before: Mapping) -> None:
        """Steps from the one of state ``before`` up to this planner's were planned and will never be delivered
        (``loader.skip``): the state says so from now on (lineage shows them as skipped; the documents started
        and tokens placed in them count as skipped). The plans of later steps do not change."""
        old = Position.load(
            before, self._cfg.sources, self._cfg.seq_len, self._mode.value, vision=self._vlm is not None
        )
        if not old.step < self._pos.step:
            raise ConfigError(
                f"record_skip: the state of step {old.step} is not before this planner's {self._pos.step}"
            )
        counts = {k: v.copy() for k, v in self._pos.count_arrays().items()}
        counts["skipped_docs"] += counts["started"] - old.count_arrays()["started"]
        counts["skipped_tokens"] += self._pos.placed - old.placed
        self._pos = replace(self._pos, skips=(*self._pos.skips, (old.step, self._pos.step)), counts=counts)

    @property
    def pending_skip(self) -> PendingSkip | None:
        """The skip still to come (``loader.skip(steps=(A, B))`` from a state saved before A), if any."""
        return self._pos.pending

    def take_pending_skip(self) -> PendingSkip | None:
        """The pending skip when this planner stands at its first step, now taken out of the state (the caller
        plans and skips its steps: ``lineage.skip.skip_pending``); None at any other step."""
        p = self._pos.pending
        if p is None or p.start != self._pos.step:
            return None
        self._pos = replace(self._pos, pending=None)
        return p

    def defer(self, inserts: Sequence[Insert]) -> None:
        """Read these deferred pieces at their virtual positions (``loader.skip(defer=True)``; deferred.py)."""
        if self._vlm is not None:
            raise ConfigError("skip(defer=True) is not supported with cost = 'vlm'; skip without defer")
        d = self._pos.deferred or Deferred()
        for ins in inserts:
            if ins.at < self._pos.cursor[ins.source]:
                raise ConfigError(f"a deferred insert at {ins.at} lies before source {ins.source}'s cursor")
            d = d.with_insert(ins)
        self._pos = replace(self._pos, deferred=d)

    def set_listing(self, listing: Listings) -> None:
        """The file listings the steps from here are planned over (the starters check them: datachange.py)."""
        if len(listing.digests) != len(self._cfg.sources):
            raise ConfigError(f"set_listing: {len(listing.digests)} listings for {len(self._cfg.sources)} sources")
        self._pos = replace(self._pos, listing=listing)

    def state_dict(self) -> dict:
        """Small JSON-able state at the current step boundary; Planner(cfg, state) continues from it."""
        return self._pos.state_dict(self._cfg.sources, self._cfg.seq_len, self._mode.value)

    # -- planning ---------------------------------------------------------------------------

    def _draw_parts(self, view: MetadataView, weights: np.ndarray, target: np.ndarray, taken: np.ndarray,
                    cursor: np.ndarray, ingest: list[float]) -> list[list[np.ndarray]]:  # fmt: skip
        """Each source's next documents until it has paid its target, as pieces with their arrival keys
        (``taken`` and ``cursor`` advance in place); with the vlm cost, each piece's image moments too."""
        cfg, vision = self._cfg, self._vlm is not None
        parts: list[list[np.ndarray]] = []
        for s in range(len(cfg.sources)):
            deficit = float(target[s]) - float(taken[s])
            if deficit <= 0:
                continue
            start = int(cursor[s])
            got = self._reader.draw(view, s, start, deficit, ingest)
            lens = got[0] if vision else got
            cursor[s] = start + lens.size
            doc, off, plen = pieces(lens, cfg.seq_len, self._mode)
            taken[s] += int(plen.sum())
            # arrival order interleaves the sources by tokens drawn per unit of weight (fair queueing)
            key = (np.cumsum(plen) - plen) / max(float(weights[s]), 1e-12)
            part: list[np.ndarray] = [np.full(doc.size, s, np.int32), start + doc, off, plen, key]
            if vision:  # a document's images (its placeholders lead it) go with its first piece
                part += [np.where(off == 0, m[doc], 0) for m in got[1:]]
            parts.append(part)
        return parts

    def plan_step(self, view: MetadataView) -> StepPlan:
        """Plan step `self.step` from the lengths in `view` and advance the state.

        All or nothing: if the view raises, the planner is left at the same step, unchanged. With the
        "vlm" cost, the view's `vision` (lengths.VisionView) gives the images; a view without it has none.
        """
        cfg, pos = self._cfg, self._pos
        vision = self._vlm is not None
        t0 = time.perf_counter()
        if pos.deferred:  # loader.skip(defer=True): read the virtual stream (deferred.py); plans in real ordinals
            view = pos.deferred.view(view)
        ingest = [0.0]
        weights = pos.mixture.weights_at(pos.step, cfg.sources)
        carry = pos.carry
        # tokens to draw: the step's capacity less the carry-over, plus what the streams gave beyond
        # their targets last time (each overshoots by less than one document), so that the pool
        # holds at least a step's capacity; the cumulative target is then placed + capacity
        surplus = float(pos.taken.sum()) - float(pos.target.sum())
        need = max(0.0, cfg.capacity - float(carry["length"].sum()) + surplus)
        target = pos.target + weights * need
        taken, cursor = pos.taken.copy(), pos.cursor.copy()

        parts = self._draw_parts(view, weights, target, taken, cursor, ingest)
        counts = {k: v.copy() for k, v in pos.count_arrays().items()}
        n_src = len(cfg.sources)
        # bad (empty) samples passed over: ordinals read less the documents drawn (one piece at offset 0 each)
        drawn = sum((np.bincount(p[0][p[2] == 0], minlength=n_src) for p in parts), np.zeros(n_src, np.int64))
        counts["bad"] += (cursor - pos.cursor) - drawn

        pool = _pool(carry, parts, vision)  # int64 [pieces, column]: gathered by rows below (one access per piece)
        lens = np.ascontiguousarray(pool[:, 3])
        mom = [np.ascontiguousarray(pool[:, j]) for j in range(4, pool.shape[1])]
        costs = self._cost(lens)
        enc = self._vlm.from_moments(*mom) if self._vlm is not None else None
        p = place(
            lens,
            costs,
            cfg.layout,
            method=self._method,
            priority=int(carry["length"].size),
            tolerance=cfg.balance_tolerance,
            vision=enc,
            pad_cost=cfg.pad_cost,
        )

        # the placed pieces by (rank, slot), then arrival; the left-over ones after them (a key past every row's)
        n_rows = cfg.dp * cfg.layout.slots
        left = p.rank < 0
        key = np.where(left, n_rows, p.rank * cfg.layout.slots + p.slot)
        order = order_by(key, n_rows + 1)
        n_left = int(np.count_nonzero(left))
        idx, gone = order[: order.size - n_left], order[order.size - n_left :]  # (gone: in arrival order)
        row_key = key[idx]  # rank * slots + slot = (rank * micro_batches + micro) * rows + row, ascending
        bounds = np.searchsorted(row_key, np.arange(cfg.dp * cfg.micro_batches + 1) * cfg.rows).astype(np.int64)
        rank, micro = _runs(bounds, cfg.dp, cfg.micro_batches)
        placed, kept = _take_rows(pool, idx), _take_rows(pool, gone)  # in plan order; left over
        src_i, ords_i, off_i, lens_i = (placed[:, j] for j in range(4))
        per_source, started = _placed_by_source(carry, kept, taken - pos.taken, drawn)
        counts["started"] += started
        rank_cost, micro_cost, stages = p.rank_cost, p.micro_cost, dict[str, Any]()
        # a placed piece's least rank cost (the lower bound's): its priced cost plus the rank's priced tokens
        costs = priced(costs, lens, cfg.pad_cost) + cfg.pad_cost * cfg.layout.slots * cfg.seq_len
        if enc is not None:
            rank_cost, micro_cost, stages = _two_stages(p.rank_cost, p.micro_cost, enc[idx], rank, micro)
            costs = costs + enc
        mean = float(rank_cost.sum()) / cfg.dp
        carry_src, carry_ords = kept[:, 0].astype(np.int32), np.ascontiguousarray(kept[:, 1])
        last = _last_pieces(src_i, ords_i, off_i, lens_i, carry_src, carry_ords, cfg.seq_len)
        lower = max(mean, float(costs.max(where=~left, initial=-np.inf)) if idx.size else 0.0)
        plan = StepPlan(
            step=pos.step,
            source=src_i.astype(np.int32, copy=False),
            ordinal=np.ascontiguousarray(ords_i),
            offset=off_i.astype(np.int32),
            length=lens_i.astype(np.int32),
            group=rank,
            micro=micro,
            row=(row_key % cfg.rows).astype(np.int32) if cfg.rows > 1 else np.zeros(idx.size, np.int32),
            last=last,
            stats=PlanStats(
                cost=rank_cost,
                micro_cost=micro_cost,
                imbalance=float(rank_cost.max()) / mean if mean > 0 else 1.0,
                lower_bound=lower,
                padding_fraction=1.0 - float(lens_i.sum()) / cfg.capacity,
                tokens={name: int(per_source[i]) for i, name in enumerate(cfg.sources)},
                docs=int(idx.size),
                carried=n_left,
                plan_ms=(time.perf_counter() - t0) * 1e3 - ingest[0],
                ingest_ms=ingest[0],
                **stages,
            ),
            bounds=bounds,
        )
        st = plan.stats
        log.debug("step %d: %d pieces, imbalance %.4f, padding %.4f, %d carried, %.1f ms (+%.1f ms metadata)",
                  pos.step, idx.size, st.imbalance, st.padding_fraction, st.carried, st.plan_ms, ingest[0])  # fmt: skip
        # commit
        self._pos = Position(
            step=pos.step + 1,
            cursor=cursor,
            taken=taken,
            target=target,
            placed=pos.placed + per_source,
            carry={
                "source": carry_src,
                "ordinal": carry_ords,
                "offset": np.ascontiguousarray(kept[:, 2]),
                "length": np.ascontiguousarray(kept[:, 3]),
                **{k: np.ascontiguousarray(kept[:, 4 + j]) for j, k in enumerate(VISION_KEYS[: len(mom)])},
            },
            mixture=self._pos.mixture,  # plan_step never changes the mixture
            skips=pos.skips,
            counts=counts,
            deferred=pos.deferred,
            listing=pos.listing,
            pending=pos.pending if pos.pending is not None and pos.pending.start > pos.step else None,  # a replay
        )
        return pos.deferred.translate(plan) if pos.deferred else plan


def _runs(bounds: np.ndarray, dp: int, micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
    """Each placed piece's rank and micro-batch (int32) from StepPlan.bounds, the runs of (rank, micro-batch) in
    plan order: no gathers of the pieces' placements."""
    rank = np.repeat(np.arange(dp, dtype=np.int32), np.diff(bounds[::micro_batches]))
    return rank, np.repeat(np.tile(np.arange(micro_batches, dtype=np.int32), dp), np.diff(bounds))


def _placed_by_source(
    carry: dict, kept: np.ndarray, drawn_tokens: np.ndarray, drawn_docs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens placed and documents started (pieces at offset 0 placed) per source: the pool's (the carry-over
    ``carry`` and what was drawn) less what is carried on (``kept``, pool rows): sums over the few carried pieces,
    not a pass over the placed ones."""
    n_src = drawn_tokens.size

    def per(src: np.ndarray, values: np.ndarray | None = None) -> np.ndarray:
        return np.bincount(src, weights=values, minlength=n_src).astype(np.int64)  # (exact: int sums below 2**53)

    old, new = carry["source"], kept[:, 0]
    tokens = per(old, carry["length"]) + drawn_tokens - per(new, kept[:, 3])
    started = per(old[carry["offset"] == 0]) + drawn_docs - per(new[kept[:, 2] == 0])
    return tokens, started


def _last_pieces(
    src: np.ndarray, ords: np.ndarray, off: np.ndarray, lens: np.ndarray, left_src: np.ndarray, left_ords: np.ndarray,
    seq_len: int,
) -> np.ndarray:  # fmt: skip
    """StepPlan.last of the placed pieces (src, ords, off, lens): no piece of the document is left over.

    A piece shares its document with another only when the document was split (all its pieces but the last fill
    a row; the last starts past 0): those few are looked up among the few left over, by binary search (np.isin
    of every piece sorted them all)."""
    last = np.ones(src.size, bool)
    split = np.flatnonzero((off > 0) | (lens == seq_len))
    if split.size and left_src.size:
        gone = np.sort(left_src.astype(np.int64) << 40 | left_ords.astype(np.int64))  # ordinals stay below 2**40
        key = src[split].astype(np.int64) << 40 | ords[split].astype(np.int64)
        last[split] = gone[np.minimum(np.searchsorted(gone, key), gone.size - 1)] != key
    return last


def _pool(carry: dict, parts: list, vision: bool) -> np.ndarray:
    """The pieces a step places: the carry-over first, then the drawn parts in arrival order (ties: by source,
    then position); int64 [pieces, 4 or 6]: source, ordinal, offset, length (, patches, patches squared with
    vision). By rows, so that a gather of pieces reads each piece once, not once per column (5-10x faster)."""
    keys = CARRY_KEYS + VISION_KEYS if vision else CARRY_KEYS
    cols = (0, 1, 2, 3, 5, 6)[: len(keys)]  # a part's columns (4: its arrival keys)
    n_carry = carry["length"].size
    n = n_carry + sum(p[3].size for p in parts)
    out = np.empty((n, len(keys)), np.int64)
    for j, k in enumerate(keys):
        out[:n_carry, j] = carry[k]
    if parts:
        drawn = np.empty((n - n_carry, len(keys)), np.int64)
        at = 0
        for p in parts:
            for j, c in enumerate(cols):
                drawn[at : at + p[3].size, j] = p[c]
            at += p[3].size
        order = np.argsort(np.concatenate([p[4] for p in parts]), kind="stable")
        np.take(_as_records(drawn), order, out=_as_records(out)[n_carry:], mode="clip")  # (with out, mode "raise"
        # buffers: 10x slower)
    return out


def _as_records(a: np.ndarray) -> np.ndarray:
    """A C-contiguous 2-d int64 array as a 1-d array of its rows (opaque records of a row's bytes; a view)."""
    return a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).reshape(a.shape[0])


def _take_rows(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """np.take(a, idx, axis=0) of a C-contiguous 2-d int64 array, as one gather of whole rows (3x faster: numpy
    copies the rows of a 2-d take one small copy at a time)."""
    return np.take(_as_records(a), idx).view(a.dtype).reshape(idx.size, a.shape[1])


def _two_stages(
    backbone: np.ndarray, micro_backbone: np.ndarray, enc: np.ndarray, rank: np.ndarray, micro: np.ndarray
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Rank and micro-batch costs of both stages together, and PlanStats' per-stage fields (the placed
    pieces' encoder costs `enc`, on `rank` and `micro`)."""
    dp, n_micro = micro_backbone.shape
    encoder = np.bincount(rank, weights=enc, minlength=dp).astype(np.float64)
    micro_enc = np.bincount(rank * n_micro + micro, weights=enc, minlength=dp * n_micro).reshape(dp, n_micro)
    stages = {
        "stage_cost": np.stack([backbone, encoder]),
        "backbone_imbalance": load_imbalance(backbone),
        "encoder_imbalance": load_imbalance(encoder),
    }
    return backbone + encoder, micro_backbone + micro_enc, stages
