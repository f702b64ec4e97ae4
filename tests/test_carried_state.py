"""A server restarted without its stored states (no persistent ``state_dir``: a container restarted from its
image) continues its ranks from the newest state they carry, mixture changes included, not from the beginning
on the original mixture."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import msdata_client as msd

from .e2e_util import batch_record, small_job


def test_restart_without_state_dir_keeps_the_mixture_change(server_factory):
    srv = server_factory(extra="ring_slots = 2\n").start()
    spec = small_job("carried", dp=2, micro_batches=2)
    n = 20
    got: dict[int, list] = {0: [], 1: []}
    cut: list[int] = []
    reached = threading.Barrier(3)
    go = threading.Event()
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with msd.DataClient(spec, endpoint=srv.socket, rank=r, world_size=2, connect_timeout=60) as dc:
                for i in range(n):
                    got[r].append(batch_record(next(dc)))
                    if r == 0 and i == 1:
                        cut.append(dc.set_mixture({"a": 1.0, "b": 0.0}))
                    if i == 4:
                        reached.wait(30)
                        go.wait(30)
        except BaseException as e:
            errors.append(e)
            reached.abort()

    ts = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    reached.wait(30)
    srv.kill()
    shutil.rmtree(Path(srv.dir, "state"))  # the container layer is gone: nothing stored survives
    srv.start()
    go.set()
    for t in ts:
        t.join(90)
    assert not errors, errors
    assert all(len(v) == n for v in got.values())
    (at,) = cut
    late = at + 2  # pieces of documents begun before the change may still come in its first steps (carry-over)
    by_step: dict[int, set] = {}
    for rec in (rec for v in got.values() for rec in v):
        by_step.setdefault(rec["step"], set()).update(s for s, _ in rec["ids"])
    assert max(by_step) > late, f"no batch well after the mixture change at step {at}"
    wrong = {step: src for step, src in by_step.items() if step > late and src != {0}}
    assert not wrong, f"steps after the mixture change at step {at} read {wrong}: the change was dropped"
    log = srv.log()
    assert "continuing from the state the ranks carry" in log
    assert "replaying from the beginning" not in log
