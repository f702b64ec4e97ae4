"""StepPlans over peer links: one payload frame per plan, a small JSON header plus the columnar arrays raw.

The header carries the job, digest, step and the leader's fencing token (receivers drop older tokens with a
``Fence``); the arrays travel as one contiguous buffer, never pickled, and are viewed (not copied) on arrival.

A node receives a *slice* of each step (``encode_slices``): the pieces it needs (those of the groups it builds
and those of the partitions it reads or stands by for; ``leader.slices``), in plan order, with the per-rank
costs of its own groups and the step's figures; ``bounds`` is not sent (the receiver derives it from the
group and micro columns). A slice decodes to a StepPlan of the full plan's shape: ``micro_cost`` rows of
groups built elsewhere are zero, ``cost`` keeps the step's maximum and mean (what ``PlanStats`` reports), and
every figure is the whole step's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ProtocolError
from ..planner import StepPlan
from ..planner.planner import PlanStats

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["decode_plan", "encode_plan", "encode_slices"]

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


_PIECES = _ARRAYS[:8]  # the per-piece columns (a slice sends a subset of them)


def _figures(plan: StepPlan) -> dict:
    st = plan.stats
    return {
        "tokens": {k: int(v) for k, v in st.tokens.items()},
        **{k: getattr(st, k) for k in _SCALARS},
        **{k: float(v) for k in _STAGES if (v := getattr(st, k)) is not None},
    }


def encode_slices(
    plan: StepPlan, cuts: dict[str, tuple[np.ndarray, list[int]]], *, job: str, digest: str, token: int
) -> dict[str, tuple[dict, bytes]]:
    """Per node, (header, buffer) of its slice of ``plan``. ``cuts[node]`` = (the indices of its pieces,
    ascending; the groups it builds). The columns are gathered once for all nodes (``leader.slices`` hands
    the indices node after node), then cut per node."""
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
    order = [idx for idx, _ in cuts.values()]
    every = np.concatenate(order) if order else np.zeros(0, np.int64)
    cols = {name: np.ascontiguousarray(np.asarray(getattr(plan, name))[every], dtype=dt) for name, dt in _PIECES}
    out: dict[str, tuple[dict, bytes]] = {}
    at = 0
    for nid, (idx, groups) in cuts.items():
        n = len(idx)
        g = np.asarray(groups, dtype=np.int64)
        parts: list[Buffer] = []
        arrays: list[list] = []
        off = 0
        for name, _dt in _PIECES:
            b = cols[name][at : at + n].data
            arrays.append([name, [n], off, b.nbytes])
            parts.append(b)
            off += b.nbytes
        for name, a in (("cost", cost[g] if dp else cost[:0]), ("micro_cost", micro_cost[g] if dp else micro_cost)):
            c = np.ascontiguousarray(a, dtype="<f8").tobytes()
            arrays.append([name, list(a.shape), off, len(c)])
            parts.append(c)
            off += len(c)
        at += n
        out[nid] = ({**base, "arrays": arrays, "groups": g.tolist()}, b"".join(parts))
    return out


def _from_slice(header: dict, got: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cost, micro_cost, bounds) of the whole step from a slice's own groups (see the module docstring)."""
    dp, mb = int(header["dp"]), int(header["micro_batches"])
    groups = np.asarray(header["groups"], dtype=np.int64)
    if groups.size and (groups.min() < 0 or groups.max() >= dp) or got["micro_cost"].shape != (groups.size, mb):
        raise ValueError(f"slice groups {groups.size} do not fit {dp} groups x {mb} micro-batches")
    micro_cost = np.zeros((dp, mb))
    micro_cost[groups] = got["micro_cost"]
    cost = np.zeros(dp)
    cost[groups] = got["cost"]
    top, mean = float(header["max_cost"]), float(header["mean_cost"])
    rest = np.setdiff1d(np.arange(dp), groups)
    if rest.size:  # groups built elsewhere: the step's maximum and mean kept (PlanStats reports those)
        left = mean * dp - float(got["cost"].sum())
        if top > float(got["cost"].max(initial=0.0)):
            cost[rest[0]], left, rest = top, left - top, rest[1:]
        if rest.size:
            cost[rest] = left / rest.size
    key = got["group"].astype(np.int64) * mb + got["micro"]
    bounds = np.searchsorted(key, np.arange(dp * mb + 1, dtype=np.int64)).astype(np.int64)
    return cost, micro_cost, bounds


def _stages(header: dict) -> dict[str, Any]:
    """The two-stage figures a plan header carries (none for a one-stage plan)."""
    return {k: float(header[k]) for k in _STAGES if header.get(k) is not None}


def decode_plan(header: dict, payload: Buffer | None) -> StepPlan:
    """The StepPlan of a plan frame (arrays are read-only views of the payload); ProtocolError if malformed."""
    buf = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
    try:
        specs = {name: (tuple(int(x) for x in shape), int(off), int(n)) for name, shape, off, n in header["arrays"]}
        got = {}
        sliced = "groups" in header
        for name, dt in _ARRAYS:
            if sliced and name == "bounds":
                continue
            shape, off, n = specs[name]
            dtype = np.dtype(dt)
            if off < 0 or n < 0 or off + n > len(buf) or n != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise ValueError(f"array {name} {shape} at {off}+{n} does not fit a {len(buf)}-byte payload")
            got[name] = np.frombuffer(buf[off : off + n], dtype=dtype).reshape(shape)
        n = got["source"].shape[0]
        if any(got[k].shape != (n,) for k in ("ordinal", "offset", "length", "group", "micro", "row", "last")):
            raise ValueError("plan columns differ in length")
        if sliced:
            got["cost"], got["micro_cost"], got["bounds"] = _from_slice(header, got)
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
