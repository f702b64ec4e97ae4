"""The image transform of bench/autoscale.py, imported by the node server's workers (``_autoscale_tf:image_tokens``).

It runs the real ``msdata_server.transforms:vlm`` transform (Pillow JPEG decode, smart resize, patchify) and
keeps the document's tokens only: the benchmark measures how many workers the decoding needs, and dropping
the pixels keeps the server's copying of them (the same in every arm) from drowning the workers on 2 cores.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_VLM: Any = None


def image_tokens(record: Any, *, rng: Any = None, **_: Any) -> np.ndarray:
    global _VLM
    if _VLM is None:
        from msdata_server.transforms import vlm

        _VLM = vlm()
    return np.asarray(_VLM(record, rng=rng).tokens)


image_tokens.needs_rng = False  # type: ignore[attr-defined]
