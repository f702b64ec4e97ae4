"""`msdata-server demo --video`: captions, pages, short and long clips in one job end to end, as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("PIL")
pytest.importorskip("av")


@pytest.mark.slow
def test_demo_video_runs_end_to_end():
    out = subprocess.run(
        [sys.executable, "-m", "msdata_server", "demo", "--video", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert "never retrieved" not in out.stderr
    figures = dict(re.findall(r"^(\S.*?\S)\s{2,}(\S+)$", out.stdout, re.M))
    assert int(figures["clips delivered (all ranks)"]) > 0  # the ranks checked placeholders against the keys
    assert int(figures["frames delivered"]) > 0
    assert int(figures["images delivered"]) > 0
    assert 1.0 <= float(figures["encoder imbalance (max/mean, mean over steps)"]) < 2.0
    assert 1.0 <= float(figures["backbone imbalance (max/mean, mean over steps)"]) < 2.0
    assert figures["bad samples"] == "none"
