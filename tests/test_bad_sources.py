"""A source whose every sample is bad stops its job quickly with an error naming the source and the reason
(the window rule of planner.lengths), while the server goes on serving other jobs; `validate --job` pushes a
few records of each source through its transform."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import msdata_client as msd

SEQ_LEN = 256
TRANSFORM = "msdata_server.transforms:byte_tokens"


def _good_jsonl(d: Path, n: int = 50) -> str:
    d.mkdir()
    (d / "part-0.jsonl").write_bytes(b"".join(orjson.dumps({"text": f"doc {i} " * 5}) + b"\n" for i in range(n)))
    return str(d)


def _int_parquet(d: Path, n: int = 20) -> str:
    d.mkdir()
    pq.write_table(pa.table({"text": pa.array(range(n), pa.int64())}), d / "part-0.parquet")
    return str(d)


def _job(name: str, sources: list[tuple[str, str, str]]):
    g = msd.DGraph(name, seed=3)
    for src, fmt, d in sources:
        g.source(src, fmt, [d], column="text", transform=TRANSFORM)
    g.mix({s: 1.0 / len(sources) for s, _, _ in sources}).pack(SEQ_LEN, micro_batches=1, rows=1).mesh(dp=1)
    return g.plan()


def test_all_bad_source_fails_the_job_fast_and_the_server_serves_on(server_factory, tmp_path):
    good = _good_jsonl(tmp_path / "good")
    bad = _int_parquet(tmp_path / "ints")
    srv = server_factory(workers=1).start()
    spec = _job("badjob", [("good", "jsonl", good), ("ints", "parquet", bad)])
    t0 = time.monotonic()
    with (
        pytest.raises(msd.MsdataError) as ei,
        msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=30) as dc,
    ):
        for _ in dc:
            pass
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert "source 'ints' has no good sample among its last" in msg, msg
    assert "mostly transform_error" in msg, msg
    assert ei.value.kind == "BadSourceError"
    assert took < 30, f"the job took {took:.0f} s to fail"
    # the server serves on: a job of the good source alone runs
    spec2 = _job("goodjob", [("good", "jsonl", good)])
    with msd.DataClient(spec2, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=30) as dc:
        for i, _ in enumerate(dc):
            if i == 2:
                break


def test_validate_job_pushes_records_through_the_transform(tmp_path):
    good = _good_jsonl(tmp_path / "good")
    bad = _int_parquet(tmp_path / "ints")
    node = tmp_path / "node.toml"
    node.write_text(f'[node]\nid = "n1"\nsocket = "{tmp_path}/s.sock"\n')
    job = tmp_path / "job.toml"

    def validate(sources):
        job.write_text(_job("v", sources).to_toml())
        return subprocess.run(
            [sys.executable, "-m", "msdata_server", "validate", "--config", str(node), "--job", str(job)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = validate([("good", "jsonl", good)])
    assert out.returncode == 0, out.stderr
    assert "first 8 records through transform" in out.stdout
    assert ": 8 good" in out.stdout
    out = validate([("good", "jsonl", good), ("ints", "parquet", bad)])
    assert out.returncode == 2, out.stdout
    assert "source 'ints': none of its first 8 records is good (transform_error" in out.stderr
    assert "part-0.parquet" in out.stderr or "ints row" in out.stderr


class _View:
    """Lengths of source 0 from a function of the ordinal (a MetadataView over made-up data)."""

    def __init__(self, length):
        self.length = length
        self.read = 0

    def lengths(self, source, start, count):
        self.read += count
        return np.array([self.length(o) for o in range(start, start + count)], np.int64)


def test_window_rule_fails_an_all_bad_source_and_skips_a_shorter_bad_run():
    from msdata_server.errors import BadSourceError
    from msdata_server.planner.lengths import BAD_WINDOW, LengthReader
    from msdata_server.planner.pack import LongDocs

    def reader():
        return LengthReader(("s",), 256, LongDocs.SPLIT)

    # all bad, a small source (20 samples an epoch): fails after BAD_WINDOW reads, not a million
    view = _View(lambda o: 0)
    with pytest.raises(BadSourceError, match=r"source 's' has no good sample among its last \d+ reads") as ei:
        reader().draw(view, 0, 0, 1000.0, [0.0])
    assert ei.value.source == "s"
    assert view.read < 2 * BAD_WINDOW
    # a run of bad samples just short of the window (a corrupt row group) is passed over
    run = BAD_WINDOW - 1
    got = reader().draw(_View(lambda o: 0 if 10 <= o < 10 + run else 50), 0, 0, 2000.0, [0.0])
    assert (got == 0).sum() == run
    # one good sample in every window keeps a source going, epoch after epoch
    r, view = reader(), _View(lambda o: 50 if o % (BAD_WINDOW - 1) == 0 else 0)
    start = 0
    for _ in range(4):
        start += r.draw(view, 0, start, 40.0, [0.0]).size
    assert start > 3 * (BAD_WINDOW - 1)
