"""Processes killed under a running job, through a real server: a transform worker SIGKILLed mid-run is
replaced and the batches stay exactly those of an uninterrupted run. (A SIGKILLed rank restarted from its
checkpoint: tests/test_resume.py; a rank that loses its socket: tests/test_reconnect.py; the pool's own
replacement of a worker mid-task: tests/test_pool.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import orjson

import msdata_client as msd

from .e2e_util import batch_record, run_ranks
from .polling import wait_for


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_bytes()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2 :].split()[1]) == pid:
                out.append(int(d))
    return out


def workers(server_pid: int) -> list[int]:
    """The transform workers: children of the pool's forkserver, itself a child of the server."""
    return sorted(w for c in children(server_pid) for w in children(c))


def test_killed_transform_worker_is_replaced_and_batches_are_unchanged(server_factory, tmp_path):
    rng = np.random.default_rng(1)
    d = tmp_path / "docs"
    d.mkdir()
    alphabet = list("abcdefghij klmnop")
    rows = [{"text": "".join(rng.choice(alphabet, size=int(rng.integers(20, 300))).tolist())} for _ in range(3000)]
    (d / "part-0.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    g = msd.DGraph("worker-kill", seed=2)
    g.source("docs", "jsonl", [str(d)], column="text", transform="msdata_server.transforms:byte_tokens")
    spec = g.mix({"docs": 1.0}).pack(512, micro_batches=2).mesh(dp=1).plan()
    srv = server_factory(workers=2, extra="[autoscale]\nenabled = false\n").start()  # a fixed pool of two
    ref = run_ranks(spec, srv.socket, 40)[0]
    with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=30) as dc:
        got = [batch_record(next(dc)) for _ in range(10)]
        before = workers(srv.proc.pid)
        assert len(before) == 2, before
        os.kill(before[0], signal.SIGKILL)
        got += [batch_record(next(dc)) for _ in range(30)]
    assert got == ref
    now = wait_for(  # replaced: two workers, a new one among them
        lambda: (w := workers(srv.proc.pid)) != before and len(w) == 2 and w, 30, "the killed worker's replacement"
    )
    assert before[0] not in now
    assert srv.proc.poll() is None
