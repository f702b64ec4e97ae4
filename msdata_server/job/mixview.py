"""The mixture as a person reads it: per source, the target share of tokens now, the share actually delivered so
far, and how far the source is through its epochs (``status`` shows it).

A pure function of the newest planner state (its ``mixture``, ``step`` and ``cursor``) and the job's accounting;
no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import MsdataError
from ..planner.mixture import Mixture

__all__ = ["mixture_view"]


def mixture_view(
    state: Mapping[str, Any] | None,
    names: Sequence[str],
    sizes: Mapping[str, int],
    accounting: Mapping[str, Mapping[str, Any]],
) -> dict[str, dict[str, float | int | None]]:
    """Per source: ``target`` (share of tokens the mixture asks for at the newest step planned), ``delivered``
    (share of the tokens delivered so far), ``epochs_completed`` and ``epoch_progress`` (fraction of the current
    epoch read). None where nothing is planned yet or the size is unknown."""
    st = state or {}
    target: list[float] | None = None
    if st.get("mixture") is not None and isinstance(st.get("step"), int):
        try:
            target = [float(w) for w in Mixture.from_dict(st["mixture"]).weights_at(st["step"], tuple(names))]
        except (MsdataError, KeyError, TypeError, ValueError):
            target = None
    cursor = st.get("cursor") or [0] * len(names)
    tokens = [int(accounting.get(n, {}).get("tokens_delivered") or 0) for n in names]
    total = sum(tokens)
    out: dict[str, dict[str, float | int | None]] = {}
    for i, name in enumerate(names):
        size = sizes.get(name)
        c = int(cursor[i]) if i < len(cursor) else 0
        out[name] = {
            "target": round(target[i], 4) if target is not None else None,
            "delivered": round(tokens[i] / total, 4) if total else None,
            "epochs_completed": c // size if size else None,
            "epoch_progress": round((c % size) / size, 4) if size else None,
        }
    return out
