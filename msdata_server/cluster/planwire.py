"""StepPlans over peer links: one payload frame per plan, a small JSON header plus the columnar arrays raw.

The header carries the job, digest, step and the leader's fencing token (receivers drop older tokens with a
``Fence``); the arrays travel as one contiguous buffer, never pickled, and are viewed (not copied) on arrival.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ProtocolError
from ..planner import StepPlan
from ..planner.planner import PlanStats

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["decode_plan", "encode_plan"]

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


def _stages(header: dict) -> dict[str, Any]:
    """The two-stage figures a plan header carries (none for a one-stage plan)."""
    return {k: float(header[k]) for k in _STAGES if header.get(k) is not None}


def decode_plan(header: dict, payload: Buffer | None) -> StepPlan:
    """The StepPlan of a plan frame (arrays are read-only views of the payload); ProtocolError if malformed."""
    buf = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
    try:
        specs = {name: (tuple(int(x) for x in shape), int(off), int(n)) for name, shape, off, n in header["arrays"]}
        got = {}
        for name, dt in _ARRAYS:
            shape, off, n = specs[name]
            dtype = np.dtype(dt)
            if off < 0 or n < 0 or off + n > len(buf) or n != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise ValueError(f"array {name} {shape} at {off}+{n} does not fit a {len(buf)}-byte payload")
            got[name] = np.frombuffer(buf[off : off + n], dtype=dtype).reshape(shape)
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
