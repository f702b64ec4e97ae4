"""StepPlans over peer links: one payload frame per plan, a small JSON header plus the columnar arrays raw.

The header carries the job, digest, step and the leader's fencing token (receivers drop older tokens with a
``Fence``); the arrays travel as one contiguous buffer, never pickled, and are viewed (not copied) on arrival.

A node receives a *slice* of each step (``encode_slices``): the pieces it needs (those of the groups it builds
and those of the partitions it reads or stands by for; ``leader.slices``), in plan order, with the per-rank
costs of its own groups, the step's figures and the planner state (compact: its JSON, with the long integer
lists of its carry as raw arrays).
``bounds`` is not sent (the receiver derives it from the group and micro columns), and the pieces of groups
built elsewhere (sent only for their payload references) travel without their offset, length, micro and row
(zeros on arrival). A slice decodes to a StepPlan of the full plan's shape whose ``micro_batch`` answers for
the node's own groups: ``micro_cost`` rows of other groups are zero, ``cost`` keeps the step's maximum and
mean (what ``PlanStats`` reports), and every figure is the whole step's.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from ..errors import ProtocolError
from ..planner import StepPlan
from ..planner.planner import PlanStats

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["Cut", "decode_plan", "encode_plan", "encode_slices", "iter_slices", "plan_state"]


@dataclass(frozen=True, slots=True)
class Cut:
    """One node's slice of a step (``leader.slices``): the indices of its pieces (ascending), which of them it
    builds (the others it only counts references of), and the groups it builds."""

    idx: np.ndarray
    built: np.ndarray
    groups: list[int]


_ARRAYS = (
    ("source", "<i4"),
    ("ordinal", "<i8"),
    ("offset", "<i4"),
    ("length", "<i4"),
    ("group", "<i4"),
    ("micro", "<i4"),
    ("row", "<i4"),
    ("last", "|b1"),
    ("bounds", "<i8"),
    ("cost", "<f8"),
    ("micro_cost", "<f8"),
)
_SCALARS = ("imbalance", "lower_bound", "padding_fraction", "docs", "carried", "plan_ms", "ingest_ms")
# the two-stage cost's per-step figures (cost = "vlm"): in the header when the plan has them, else absent
_STAGES = ("backbone_imbalance", "encoder_imbalance")


def encode_plan(plan: StepPlan, *, job: str, digest: str, token: int) -> tuple[dict, bytes]:
    """(header, buffer) for PeerLink.send_payload."""
    st = plan.stats
    parts, arrays, off = [], [], 0
    for name, dt in _ARRAYS:
        a = getattr(st if name in ("cost", "micro_cost") else plan, name)
        b = np.ascontiguousarray(a, dtype=dt).tobytes()
        arrays.append([name, list(np.shape(a)), off, len(b)])
        parts.append(b)
        off += len(b)
    header = {
        "t": "plan",
        "job": job,
        "digest": digest,
        "step": int(plan.step),
        "token": int(token),
        "arrays": arrays,
        "tokens": {k: int(v) for k, v in st.tokens.items()},
        **{k: getattr(st, k) for k in _SCALARS},
        **{k: float(v) for k in _STAGES if (v := getattr(st, k)) is not None},
    }
    return header, b"".join(parts)


_DTYPES = tuple((name, np.dtype(dt)) for name, dt in _ARRAYS)
_PIECES = _ARRAYS[:8]  # the per-piece columns (a slice sends a subset of them)
_BUILT = ("offset", "length", "micro", "row")  # only for the pieces of the groups a slice's node builds


def _figures(plan: StepPlan) -> dict:
    st = plan.stats
    return {
        "tokens": {k: int(v) for k, v in st.tokens.items()},
        **{k: getattr(st, k) for k in _SCALARS},
        **{k: float(v) for k in _STAGES if (v := getattr(st, k)) is not None},
    }


def encode_slices(
    plan: StepPlan, cuts: Mapping[str, Cut], *, job: str, digest: str, token: int, state: dict | None = None
) -> dict[str, tuple[dict, memoryview]]:
    """Per node, (header, buffer) of its slice of ``plan``: ``iter_slices`` in one batch."""
    out: dict[str, tuple[dict, memoryview]] = {}
    for got in iter_slices(plan, cuts, job=job, digest=digest, token=token, state=state):
        out.update(got)
    return out


def iter_slices(
    plan: StepPlan,
    cuts: Mapping[str, Cut],
    *,
    job: str,
    digest: str,
    token: int,
    state: dict | None = None,
    batch: int = 0,
) -> Iterator[dict[str, tuple[dict, memoryview]]]:
    """Per node, (header, buffer) of its slice of ``plan`` (``cuts[node]``: its pieces, those it builds, its
    groups; ``leader.slices``), ``batch`` nodes at a time (0: all at once), each batch yielded as soon as it is
    encoded (so the first nodes' slices can leave while the rest are encoded). ``state``: the planner state at
    the step's start, sent compact (its JSON and its long integer lists as raw arrays, ``_state_blocks``, made
    once) at the payload's end; ``plan_state`` reads it back.

    One pass per batch (the leader's cost per step must not grow with the nodes): each column is gathered
    once, node after node; every node's sizes and offsets come from a few array operations; the payloads are
    consecutive read-only views of one buffer (every array in it 8-byte aligned), filled by one copy per
    array and node. Per node, only its header is built in Python."""
    st = plan.stats
    cost = np.asarray(st.cost, dtype="<f8")
    micro_cost = np.asarray(st.micro_cost, dtype="<f8")
    dp, mb = (int(micro_cost.shape[0]), int(micro_cost.shape[1])) if micro_cost.ndim == 2 else (0, 0)
    base = {
        "t": "plan",
        "job": job,
        "digest": digest,
        "step": int(plan.step),
        "token": int(token),
        **_figures(plan),
        "max_cost": float(cost.max()) if cost.size else 0.0,
        "mean_cost": float(cost.mean()) if cost.size else 0.0,
        "dp": dp,
        "micro_batches": mb,
    }
    items = list(cuts.items())
    blocks = _state_blocks(state) if state is not None else None
    size = batch or len(items) or 1
    for lo in range(0, len(items), size):
        yield _encode_batch(plan, items[lo : lo + size], base, cost, micro_cost, dp, blocks)


def _encode_batch(
    plan: StepPlan,
    cuts_: list[tuple[str, Cut]],
    base: dict,
    cost: np.ndarray,
    micro_cost: np.ndarray,
    dp: int,
    blocks: tuple[np.ndarray, int, list] | None,
) -> dict[str, tuple[dict, memoryview]]:
    """The slices of the nodes of ``cuts_`` (``iter_slices``)."""
    every = np.concatenate([c.idx for _, c in cuts_]).astype(np.int64, copy=False)
    built_mask = np.concatenate([c.built for _, c in cuts_]).astype(bool, copy=False)
    n = np.fromiter((len(c.idx) for _, c in cuts_), np.int64, len(cuts_))
    nb = np.diff(np.concatenate([[0], np.cumsum(built_mask, dtype=np.int64)])[np.concatenate([[0], np.cumsum(n)])])
    groups = [np.asarray(c.groups, dtype=np.int64) for _, c in cuts_]
    ng = np.fromiter((len(g) for g in groups), np.int64, len(groups))
    arrays = _slice_arrays(plan, every, every[built_mask], np.concatenate(groups), cost, micro_cost, dp)
    n_plan = len(arrays)
    block, rec, cols = blocks if blocks is not None else (None, 0, [])
    if block is not None:  # one block for every node: the state's JSON, then its columns (``_state_blocks``)
        arrays.append(("state", block, "one", len(block), None))
    counts = {"n": n, "nb": nb, "g": ng, "one": np.ones_like(n)}
    per = np.stack([counts[k] * unit for _, _, k, unit, _ in arrays], axis=1)  # [nodes, arrays] bytes
    size = (per + 7) & ~7
    off = np.zeros_like(size)
    np.cumsum(size[:, :-1], axis=1, out=off[:, 1:])  # each array's offset in its node's payload
    total = size.sum(axis=1)
    at = np.zeros(len(n) + 1, np.int64)
    np.cumsum(total, out=at[1:])  # each node's payload in the one buffer
    buf = np.zeros(int(at[-1]), np.uint8)
    dst = buf.data  # uint8: one byte per item
    src_at = [np.concatenate([[0], np.cumsum(counts[k] * unit)[:-1]]) if k != "one" else np.zeros_like(n)
              for _, _, k, unit, _ in arrays]  # fmt: skip
    srcs = [a.reshape(-1).view(np.uint8).data for _, a, _, _, _ in arrays]  # bytes (also when empty)
    for j in range(len(arrays)):  # one copy per array and node, into place
        mv, lo_, n_, to_ = srcs[j], src_at[j].tolist(), per[:, j].tolist(), (at[:-1] + off[:, j]).tolist()
        for lo, k, to in zip(lo_, n_, to_):
            dst[to : to + k] = mv[lo : lo + k]
    view = dst.toreadonly()
    out: dict[str, tuple[dict, memoryview]] = {}
    names = [name for name, _, _, _, _ in arrays[:n_plan]]
    lead = np.stack([counts[k] for _, _, k, _, _ in arrays[:n_plan]], axis=1).tolist()  # each array's first dimension
    tail = [shape for _, _, _, _, shape in arrays[:n_plan]]  # its other dimensions (all of them: the same for all)
    fixed = [k == "one" for _, _, k, _, _ in arrays[:n_plan]]
    rows = zip(cuts_, lead, off.tolist(), per.tolist(), groups, at[:-1].tolist(), at[1:].tolist())
    for (nid, _), ks, offs, nbs, g, lo, hi in rows:
        spec = [[name, t if f else [k, *t], o, b] for name, k, t, f, o, b in zip(names, ks, tail, fixed, offs, nbs)]
        head = {**base, "arrays": spec, "groups": g.tolist()}
        if block is not None:
            head["state_rec"] = [offs[n_plan], rec]
            if cols:
                head["state_cols"] = [[key, dt, offs[n_plan] + rel, size] for key, dt, rel, size in cols]
        out[nid] = (head, view[lo:hi])
    return out


def _slice_arrays(
    plan: StepPlan,
    every: np.ndarray,
    built: np.ndarray,
    groups: np.ndarray,
    cost: np.ndarray,
    micro_cost: np.ndarray,
    dp: int,
) -> list:
    """The arrays of the slices, each gathered once for every node (their entries node after node): (name,
    values, which count sizes it per node ("n" pieces, "nb" built pieces, "g" groups, "one": the same block
    for every node), bytes per counted entry, its shape in the header past the count (all of it for "one"))."""
    out: list = []
    for name, dt in _PIECES:
        sel, k = (built, "nb") if name in _BUILT else (every, "n")
        col = np.asarray(getattr(plan, name))
        vals = np.take(col if col.dtype == dt else col.astype(dt), sel)  # take: ~2x a fancy index's speed
        out.append((name, vals, k, vals.itemsize, []))
    if dp:
        mb = int(micro_cost.shape[1])
        out.append(("cost", np.ascontiguousarray(cost[groups]), "g", 8, []))
        out.append(("micro_cost", np.ascontiguousarray(micro_cost[groups]), "g", 8 * mb, [mb]))
    else:  # no groups: the (empty) cost arrays as they are, for every node
        out.append(("cost", np.ascontiguousarray(cost[:0]), "one", 0, [0]))
        mc = np.ascontiguousarray(micro_cost)
        out.append(("micro_cost", mc, "one", mc.nbytes, list(mc.shape)))
    return out


_COL_MIN = 16  # an integer list of a state's dict this long or longer travels as a raw array (``_state_blocks``)
_COL_TYPES = ("|i1", "<i2", "<i4", "<i8")


def _state_blocks(state: dict) -> tuple[np.ndarray, int, list[tuple[list[str], str, int, int]]]:
    """The planner state of a slice as one block: (the block: the state's JSON without the long integer lists
    of its dicts, zlib-compressed, then each of those lists in the narrowest little-endian integer type, each
    8-byte aligned; the compressed JSON's length; per list ([key, column], its type, its offset in the block,
    its bytes)). A node reads it with one small inflate and JSON parse and one ``frombuffer(...).tolist()`` per
    list (``plan_state``): the carry's columns (a thousand entries at dp 4,096) as JSON or a compressed record
    cost a node more to read than the rest of its slice; the rest (per-source lists, the mixture) compresses
    well and is large at many sources."""
    rest: dict = {}
    arrays: list[tuple[list[str], np.ndarray]] = []
    for key, value in state.items():
        if not isinstance(value, dict):
            rest[key] = value
            continue
        rest[key] = kept = {}
        for col, v in value.items():
            a = _int_column(v)
            kept[col] = v if a is None else None  # None: the list's place (the dict's order kept)
            if a is not None:
                arrays.append(([key, col], a))
    parts = [zlib.compress(orjson.dumps(rest), 6)]  # per-source lists and the mixture: large at many sources
    cols, at = [], len(parts[0])
    for name, a in arrays:
        parts.append(bytes(-at % 8))
        at += -at % 8
        cols.append((name, a.dtype.str, at, a.nbytes))
        parts.append(a.tobytes())
        at += a.nbytes
    return np.frombuffer(b"".join(parts), np.uint8), len(parts[0]), cols


def _int_column(v: object) -> np.ndarray | None:
    """``v`` as the narrowest integer array that holds it, if it is a list of ``_COL_MIN`` or more ints."""
    if not isinstance(v, list) or len(v) < _COL_MIN or not all(type(x) is int for x in v):
        return None
    try:
        a = np.asarray(v, dtype=np.int64)
    except OverflowError:
        return None
    lo, hi = int(a.min()), int(a.max())
    dt = next(t for t in _COL_TYPES if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max)
    return a.astype(dt)


def _from_slice(header: dict, got: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cost, micro_cost, bounds) of the whole step from a slice's own groups (see the module docstring)."""
    dp, mb = int(header["dp"]), int(header["micro_batches"])
    groups = np.asarray(header["groups"], dtype=np.int64)
    if (groups.size and (groups.min() < 0 or groups.max() >= dp)) or got["micro_cost"].shape != (groups.size, mb):
        raise ValueError(f"slice groups {groups.size} do not fit {dp} groups x {mb} micro-batches")
    micro_cost = np.zeros((dp, mb))
    micro_cost[groups] = got["micro_cost"]
    top, mean = float(header["max_cost"]), float(header["mean_cost"])
    own = np.zeros(dp, dtype=bool)
    own[groups] = True
    cost = np.zeros(dp)
    rest = dp - int(np.count_nonzero(own))
    if rest:  # groups built elsewhere: the step's maximum and mean kept (PlanStats reports those): the first
        left = mean * dp - float(got["cost"].sum())  # of them the maximum (unless one here has it), the others
        topped = top > float(got["cost"].max(initial=0.0))  # an equal share of the rest
        if topped:
            left, rest = left - top, rest - 1
        if rest:
            cost.fill(left / rest)
        if topped:
            cost[int(own.argmin())] = top
    cost[groups] = got["cost"]
    built = np.flatnonzero(own[got["group"]]) if dp else np.zeros(0, np.int64)
    for name in _BUILT:  # the pieces of groups built elsewhere (only counted there): zeros
        if got[name].shape != built.shape:
            raise ValueError(f"slice column {name} has {got[name].size} entries for {built.size} pieces built here")
        full = np.zeros(got["source"].shape, dtype=got[name].dtype)
        full[built] = got[name]
        got[name] = full
    key = got["group"].astype(np.int64) * mb + got["micro"]
    bounds = np.zeros(dp * mb + 1, dtype=np.int64)
    np.cumsum(np.bincount(key, minlength=dp * mb), out=bounds[1:])
    return cost, micro_cost, bounds


def plan_state(header: dict, payload: Buffer | None) -> dict | None:
    """The planner state a plan frame carries (at its step's start; None: none), from a slice's compact blocks
    (``_state_blocks``) or a whole plan's header. ProtocolError if they are malformed."""
    at = header.get("state_rec")
    if at is None:
        return header.get("state")
    buf = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
    try:
        state = orjson.loads(zlib.decompress(_block(buf, at[0], at[1], "state record")))
        if not isinstance(state, dict):
            raise TypeError("the state record is not an object")
        for (key, col), dt, off, n in header.get("state_cols", ()):
            if dt not in _COL_TYPES:
                raise ValueError(f"state column {key}.{col} has type {dt!r}")
            if not isinstance(state.get(key), dict) or col not in state[key]:
                raise ValueError(f"state column {key}.{col} has no place in the state record")
            state[key][col] = np.frombuffer(_block(buf, off, n, f"state column {key}.{col}"), dt).tolist()
        return state
    except (TypeError, ValueError, IndexError, zlib.error) as e:  # orjson's errors are ValueErrors
        raise ProtocolError(f"malformed plan frame for step {header.get('step')!r}: {e}") from None


def _block(buf: memoryview, off: Any, n: Any, what: str) -> memoryview:
    at, size = int(off), int(n)
    if at < 0 or size < 0 or at + size > len(buf):
        raise ValueError(f"{what} at {at}+{size} does not fit a {len(buf)}-byte payload")
    return buf[at : at + size]


def _stages(header: dict) -> dict[str, Any]:
    """The two-stage figures a plan header carries (none for a one-stage plan)."""
    return {k: float(header[k]) for k in _STAGES if header.get(k) is not None}


def decode_plan(header: dict, payload: Buffer | None) -> StepPlan:
    """The StepPlan of a plan frame (arrays are read-only views of the payload); ProtocolError if malformed."""
    buf = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
    try:
        specs = {name: (tuple(map(int, shape)), int(off), int(n)) for name, shape, off, n in header["arrays"]}
        got = {}
        sliced = "groups" in header
        size = len(buf)
        for name, dtype in _DTYPES:
            if sliced and name == "bounds":
                continue
            shape, off, n = specs[name]
            if off < 0 or n < 0 or off + n > size or n != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"array {name} {shape} at {off}+{n} does not fit a {len(buf)}-byte payload")
            got[name] = np.frombuffer(buf[off : off + n], dtype=dtype).reshape(shape)
        if sliced:
            got["cost"], got["micro_cost"], got["bounds"] = _from_slice(header, got)
        n = got["source"].shape[0]
        if any(got[k].shape != (n,) for k in ("ordinal", "offset", "length", "group", "micro", "row", "last")):
            raise ValueError("plan columns differ in length")
        stats = PlanStats(
            cost=got["cost"],
            micro_cost=got["micro_cost"],
            tokens={str(k): int(v) for k, v in header["tokens"].items()},
            **{k: type_(header[k]) for k, type_ in zip(_SCALARS, (float, float, float, int, int, float, float))},
            **_stages(header),
        )
        return StepPlan(
            step=int(header["step"]),
            source=got["source"],
            ordinal=got["ordinal"],
            offset=got["offset"],
            length=got["length"],
            group=got["group"],
            micro=got["micro"],
            row=got["row"],
            last=got["last"],
            stats=stats,
            bounds=got["bounds"],
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"malformed plan frame for step {header.get('step')!r}: {e}") from None
