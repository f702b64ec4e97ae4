"""The WebDataset transform of bench/remote.py (``_remote_tf:wds_text``): a sample's ``txt`` part as byte tokens."""

from __future__ import annotations

from typing import Any

import numpy as np


def wds_text(record: Any, **_: Any) -> np.ndarray:
    data = bytes(record["txt"])
    out = np.empty(len(data) + 1, dtype=np.int32)
    out[:-1] = np.frombuffer(data, dtype=np.uint8)
    out[-1] = 256  # EOS, as msdata_server.transforms:byte_tokens
    return out
