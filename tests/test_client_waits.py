"""A waiting rank says what it waits for (issue 26, item 7): a socket nobody answers at, or the other ranks of its
job; and connect_timeout bounds the wait for missing ranks too (a rank whose peer never starts no longer waits
forever)."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

import msdata_client as msd
from msdata_client.waiting import PeerWait, log_every

from .e2e_util import small_job

LOGGER = "msdata_client.connection"


def test_a_client_without_a_server_says_where_it_waits(sockdir, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    ep = os.path.join(sockdir, "nobody.sock")
    dc = msd.DataClient(small_job(dp=1), endpoint=ep, rank=0, world_size=1, connect_timeout=1.0)
    with pytest.raises(msd.ConnectError, match=r"nobody.sock"):
        next(dc)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    waiting = [m for m in lines if "waiting for the msdata server at" in m]
    assert len(waiting) >= 2, lines  # every log_every(1.0) = 0.25 s, not only at the end
    assert ep in waiting[0]
    assert "MSDATA_ENDPOINT" in waiting[0]


def test_a_rank_whose_peers_never_start_names_them_and_gives_up(server_factory, caplog):
    """Ranks 0 and 2 of a 4-rank job start, 1 and 3 never do: both log which ranks are missing and, past their
    connect_timeout, raise a ConnectError naming them (the server forgets their registration)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    srv = server_factory().start()
    spec = small_job("lonely", dp=4)
    errs: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        try:
            limit = 3.0 if r == 0 else 8.0  # rank 0 gives up first, while rank 2 is registered
            with msd.DataClient(spec, endpoint=srv.socket, rank=r, world_size=4, connect_timeout=limit) as dc:
                next(dc)
        except BaseException as e:
            errs[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank waited past its connect_timeout"
    assert time.monotonic() - t0 < 30
    assert set(errs) == {0, 2}, errs
    for r, missing in ((0, "missing ranks 1, 3;"), (2, "missing ranks 0, 1, 3;")):  # rank 0 left before rank 2 gave up
        e = errs[r]
        assert isinstance(e, msd.ConnectError)
        assert missing in str(e)
        assert "connect_timeout" in str(e)
        assert srv.socket in str(e)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any("2 of 4 ranks of job 'lonely' registered; missing ranks 1, 3" in m for m in lines), lines
    assert any(m.startswith("rank 0 of 4 waits at " + srv.socket) for m in lines), lines


def test_a_rank_waiting_for_a_slow_peer_starts_when_it_comes(server_factory, caplog):
    """The bound applies to missing ranks only: a peer that comes within the timeout starts the job."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    srv = server_factory().start()
    spec = small_job("late", dp=2)
    got: dict[int, int] = {}
    errs: dict[int, BaseException] = {}
    logged = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "missing ranks 1" in record.getMessage():
                logged.set()

    seen = Seen()
    logging.getLogger(LOGGER).addHandler(seen)

    def rank(r: int) -> None:
        try:
            with msd.DataClient(spec, endpoint=srv.socket, rank=r, world_size=2, connect_timeout=30.0) as dc:
                got[r] = int(next(dc)["step"])
        except BaseException as e:
            errs[r] = e

    try:
        first = threading.Thread(target=rank, args=(0,), daemon=True)
        first.start()
        assert logged.wait(60), "rank 0 never said it waits for rank 1"
        second = threading.Thread(target=rank, args=(1,), daemon=True)
        second.start()
        for t in (first, second):
            t.join(60)
            assert not t.is_alive()
    finally:
        logging.getLogger(LOGGER).removeHandler(seen)
    assert not errs, errs
    assert got == {0: 0, 1: 0}


def test_the_wait_detail_reads_the_way_the_issue_asks():
    assert PeerWait(job="x", rank=0, world_size=4, registered=(0, 2)).detail() == (
        "2 of 4 ranks of job 'x' registered; missing ranks 1, 3"
    )
    assert PeerWait(job="x", rank=0, world_size=2, registered=(0, 1)).missing == ()
    assert PeerWait(job="x", rank=0, world_size=2).missing is None
    assert log_every(60.0) == 5.0
    assert log_every(1.0) == 0.25
