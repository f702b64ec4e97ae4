"""A rank whose socket to its own node breaks while the job keeps running continues exactly.

The server keeps every batch notice it published to a rank until the rank releases that slot; a client whose
socket is shut down under it reconnects by itself, names the first micro-batch it did not receive and the slots
it still holds, and gets the rest again. A rank that never comes back is dropped after ``reconnect_grace``.
"""

from __future__ import annotations

import socket
import threading

import pytest

import msdata_client as msd
from msdata_client.wire import request

from .e2e_util import batch_record, run_ranks, small_job
from .polling import wait_for

N = 16  # micro-batches per rank
SLOTS = 4


def status(sock: str) -> dict:
    return request(sock, {"t": "status"})["status"]


def ring_full(sock: str, job: str, group: int) -> bool:
    for j in status(sock)["jobs"]:
        if j["name"] == job:
            return any(r["group"] == group and r["in_use"] == r["slots"] for r in j["rings"])
    return False


def away(sock: str, job: str) -> list[int]:
    return next((j["ranks_away"] for j in status(sock)["jobs"] if j["name"] == job), [])


@pytest.mark.parametrize("noticed", [True, False], ids=["server-noticed", "reconnect-first"])
def test_rank_socket_closed_mid_run_continues_exactly(server_factory, noticed):
    srv = server_factory(extra=f"ring_slots = {SLOTS}\n").start()
    spec = small_job(f"sock-{noticed}", dp=2, micro_batches=2)
    ref = run_ranks(spec, srv.socket, N)
    got: dict[int, list] = {}
    held_seen: list[dict] = []
    held_after: list[dict] = []
    errs: list[BaseException] = []

    def victim():
        try:
            with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=2, connect_timeout=30) as dc:
                recs, held = [], []
                for _ in range(5):
                    b = next(dc)
                    recs.append(batch_record(b))
                    held = ([*held, b])[-2:]  # the last two stay alive across the reconnect
                held_seen.extend(batch_record(b) for b in held)
                # the server has published every slot of the ring: batches wait, unread, on the old connection
                wait_for(lambda: ring_full(srv.socket, spec.name, spec.group_of(0)), 30, "a full ring")
                dc._conn.sock.shutdown(socket.SHUT_RDWR)  # the socket breaks under the client
                if noticed:
                    wait_for(
                        lambda: away(srv.socket, spec.name) == [0], 30, "the server to see rank 0 away", log=srv.log
                    )
                for _ in range(N - 5):
                    recs.append(batch_record(next(dc)))
                held_after.extend(batch_record(b) for b in held)  # their slots were never reused meanwhile
                del held, b
                got[0] = recs
        except BaseException as e:
            errs.append(e)

    def other():
        try:
            got.update(run_ranks(spec, srv.socket, N, ranks=[1]))
        except BaseException as e:
            errs.append(e)

    threads = [threading.Thread(target=victim), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errs:
        raise errs[0]
    assert got[0] == ref[0]  # the rank that lost its socket: the same sequence, nothing lost or repeated
    assert got[1] == ref[1]  # the other rank: unaffected
    assert held_after == held_seen
    log = srv.log()
    assert "rank 0 is back at step" in log
    assert "lost its connection" in log if noticed else True


def test_rank_that_never_comes_back_is_dropped_after_the_grace(server_factory):
    srv = server_factory(extra="ring_slots = 2\nreconnect_grace = 1.0\n").start()
    spec = small_job("gone", dp=1, tp=2, micro_batches=1)
    lost = msd.DataClient(spec, endpoint=srv.socket, rank=1, world_size=2, connect_timeout=30)
    got: list = []
    read, done = threading.Event(), threading.Event()

    def rank0():
        with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=2, connect_timeout=30) as dc:
            got.extend(batch_record(next(dc)) for _ in range(10))
            read.set()
            done.wait(60)  # still connected while rank 1 tries to come back

    t = threading.Thread(target=rank0)
    t.start()
    try:
        next(lost)
        lost._conn.sock.shutdown(socket.SHUT_RDWR)  # its process lives on, but it does not read again for a while
        assert read.wait(60)
        assert len(got) == 10  # the TP peer waited at most the grace, then got the slots back
        assert "rank 1 did not come back" in srv.log()
        with pytest.raises(msd.CheckpointError, match="away longer than reconnect_grace"):
            next(lost)  # it comes back too late: refused clearly, never a silent gap in its data
    finally:
        done.set()
        lost.close()
        t.join(30)
