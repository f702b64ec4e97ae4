"""Token accounting from a planner state: per source, what the steps before the state's step delivered, so a
trainer can log the true mixture it saw. A pure function of the state (its counters, cursor and carry) and,
for epochs, each source's samples per epoch.

- ``tokens_delivered``: tokens placed in plans, less those of skipped steps (``loader.skip``);
- ``docs_delivered``: documents whose every piece was placed (first pieces placed, less documents still open
  in the carry-over, less those whose first piece was in a skipped step);
- ``docs_skipped``: documents whose first piece was in a skipped step; ``tokens_skipped`` likewise;
- ``bad_samples``: samples passed over because they could not be read or transformed (length 0);
- ``epochs_completed``: whole passes over the source (its cursor over its samples per epoch), None when the
  size is not known here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from msdata_client.spec import JobSpec

__all__ = ["accounting"]


def accounting(
    state: Mapping | None, names: Sequence[str] | JobSpec, sizes: Mapping[str, int] | None = None
) -> dict[str, dict[str, int | None]]:
    """Per source name (``names``, or a job's sources), the figures above as of ``state`` (None: nothing
    planned yet; a status shows them as of the newest step planned)."""
    names = names.source_names() if isinstance(names, JobSpec) else names
    n, sizes = len(names), sizes or {}
    zero = [0] * n
    st = state or {}
    counts = st.get("counts") or {}
    started, bad = np.array(counts.get("started", zero)), np.array(counts.get("bad", zero))
    skipped_docs, skipped_tokens = (
        np.array(counts.get("skipped_docs", zero)),
        np.array(counts.get("skipped_tokens", zero)),
    )
    placed, cursor = np.array(st.get("placed", zero)), np.array(st.get("cursor", zero))
    carry = st.get("carry") or {"source": [], "ordinal": [], "offset": []}
    src, ords, off = (np.asarray(carry[k], np.int64) for k in ("source", "ordinal", "offset"))
    # documents started but not finished: carried documents none of whose carried pieces is their first
    docs = np.unique(src << 40 | ords) >> 40 if src.size else np.zeros(0, np.int64)
    open_docs = np.bincount(docs, minlength=n)[:n] - np.bincount(src[off == 0], minlength=n)[:n]
    out: dict[str, dict[str, int | None]] = {}
    for i, name in enumerate(names):
        size = sizes.get(name)
        out[name] = {
            "tokens_delivered": int(placed[i] - skipped_tokens[i]),
            "docs_delivered": int(started[i] - open_docs[i] - skipped_docs[i]),
            "docs_skipped": int(skipped_docs[i]),
            "tokens_skipped": int(skipped_tokens[i]),
            "bad_samples": int(bad[i]),
            "epochs_completed": int(cursor[i]) // size if size else None,
        }
    return out
