"""A plan as lineage columns (``msdata_client.lineage.COLUMNS``): one row per document piece, in batch order.

The plan's pieces are sorted by (group, micro, row, position in row) and each row holds its pieces back to back
(``batch.py``), so a piece's offset in its row is the sum of the lengths before it there. Files and rows come
from the source's deterministic order (``Locate``); the sample id is ``file << 32 | row`` as
``Source.sample_ids`` gives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..planner import StepPlan

__all__ = ["Locate", "empty_columns", "join_columns", "plan_columns"]


class Locate(Protocol):
    """Where ordinals of a source live: what lineage rows name."""

    def locate(self, source: int, ordinals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, file index, row in file) int64 arrays of ordinals of ``source``."""
        ...

    def files(self, source: int) -> list[str]:
        """The files of ``source`` by index (one name for a source without files)."""
        ...


def _row_offsets(plan: StepPlan, micro_batches: int, rows: int) -> np.ndarray:
    """Each piece's first token within its packed row."""
    n = plan.length.size
    if n == 0:
        return np.zeros(0, np.int32)
    key = (plan.group.astype(np.int64) * micro_batches + plan.micro) * rows + plan.row
    ends = np.cumsum(plan.length, dtype=np.int64)
    first = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    before = np.repeat(ends[first] - plan.length[first], np.diff(np.append(first, n)))
    return (ends - plan.length - before).astype(np.int32)


def plan_columns(
    plan: StepPlan,
    locate: Locate,
    *,
    seq_len: int,
    micro_batches: int,
    rows: int,
    skipped: bool = False,
    group: int | None = None,
) -> dict[str, np.ndarray]:
    """The lineage columns of one plan (only data group ``group``'s pieces when given); strings by index
    (``source_id``, ``file_index``)."""
    offset = _row_offsets(plan, micro_batches, rows)
    sel = slice(None) if group is None else plan.group == group
    src, ords = plan.source[sel], plan.ordinal[sel]
    n = src.size
    epoch, fidx, frow = (np.zeros(n, np.int64) for _ in range(3))
    for s in np.unique(src).tolist():
        m = src == s
        epoch[m], fidx[m], frow[m] = locate.locate(s, ords[m])
    doc_offset = plan.offset[sel].astype(np.int32)
    return {
        "step": np.full(n, plan.step, np.int64),
        "micro": plan.micro[sel].astype(np.int32),
        "dp_rank": plan.group[sel].astype(np.int32),
        "row": plan.row[sel].astype(np.int32),
        "offset": offset[sel],
        "length": plan.length[sel].astype(np.int32),
        "file_row": frow,
        "sample_id": (fidx << 32) | frow,
        "piece": (doc_offset // seq_len).astype(np.int32),
        "skipped": np.full(n, skipped, bool),
        "source_id": src.astype(np.int32),
        "file_index": fidx.astype(np.int32),
        "epoch": epoch,
        "ordinal": ords.astype(np.int64),
        "doc_offset": doc_offset,
    }


def empty_columns() -> dict[str, np.ndarray]:
    """No rows."""
    from msdata_client.lineage import COLUMNS

    return {k: np.zeros(0, t) for k, t in COLUMNS.items() if t != "str"}


def join_columns(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The rows of several plans, one after another."""
    if not parts:
        return empty_columns()
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
