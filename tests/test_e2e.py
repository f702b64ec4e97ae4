"""End to end: a real `msdata-server serve` process, real clients, real shared memory."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch

import msdata_client as msd
from msdata_client.wire import FrameReader, encode, recv_into_reader
from msdata_server.shm import list_segments

from .e2e_util import batch_record, finish, run_ranks, small_job, start_rank_process, status_json

status = status_json  # the one status helper (e2e_util)


def test_dp_ranks_get_disjoint_packed_batches(server_factory):
    srv = server_factory().start()
    spec = small_job(dp=2, micro_batches=2, seq_len=512)
    got = run_ranks(spec, srv.socket, 8)
    ids = {r: {tuple(x) for rec in recs for x in rec["ids"]} for r, recs in got.items()}
    assert ids[0]
    assert ids[1]
    assert not ids[0] & ids[1]
    assert [(r["step"], r["micro"]) for r in got[0]] == [(s, m) for s in range(4) for m in range(2)]


def test_batch_contract(server_factory):
    srv = server_factory().start()
    spec = small_job(dp=1, micro_batches=1, seq_len=256, rows=2)
    with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1) as dc:
        b = next(dc)
        assert set(b) >= {
            "tokens",
            "labels",
            "loss_mask",
            "position_ids",
            "cu_seqlens",
            "sample_ids",
            "source_ids",
            "step",
            "micro",
        }
        assert b["tokens"].shape == (2, 256)
        assert b["tokens"].dtype == torch.int64
        assert b["cu_seqlens"].dtype == torch.int32
        assert int(b["cu_seqlens"][0]) == 0
        assert int(b["cu_seqlens"][-1]) == 512
        t = b["tokens"].flatten()
        cu = b["cu_seqlens"].tolist()
        # every document segment ends in EOS (256) or is a padding tail / a split piece
        assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
        assert b["step"].dim() == 0
        assert int(b["step"]) == 0
        b["tokens"][0, 0] = -5  # writable, copy-on-write: no warning, nobody else sees it
        assert int(b["tokens"][0, 0]) == -5
        assert len(cu) >= 2
        assert t.numel() == 512
        # doc_counts: each row's document pieces; cu_seqlens lists them, then the row's padding tail if any
        counts, seq = b["doc_counts"].tolist(), 256
        assert b["doc_counts"].dtype == torch.int64
        assert len(counts) == 2
        assert sum(counts) == len(b["sample_ids"])
        pad_rows = 0
        for r in range(2):
            inside = [c - r * seq for c in cu[1:] if r * seq < c <= (r + 1) * seq]
            used = inside[counts[r] - 1] if counts[r] else 0
            assert len(inside) == counts[r] + (used < seq)  # the pieces, then one padding segment
            assert bool((b["tokens"][r, used:] == spec.pad_id).all())
            pad_rows += used < seq
        assert len(cu) - 1 == len(b["sample_ids"]) + pad_rows


def test_tp_readers_share_one_slot_with_identical_bytes(server_factory):
    srv = server_factory().start()
    spec = small_job(dp=2, tp=2, micro_batches=2)
    got = run_ranks(spec, srv.socket, 6)
    mesh = spec.mesh
    for r in range(4):
        peer = mesh.readers(mesh.group_of(r))
        for q in peer:
            assert got[q] == got[r]  # same bytes, field by field
    assert got[mesh.readers(0)[0]] != got[mesh.readers(1)[0]]


def test_cp_slices_reassemble(server_factory):
    srv = server_factory().start()
    spec = small_job(dp=1, cp=2, micro_batches=1, seq_len=256)
    full_spec = small_job(dp=1, cp=1, micro_batches=1, seq_len=256)
    _, kept = run_ranks(spec, srv.socket, 3, keep=True)
    _, kept_full = run_ranks(full_spec, srv.socket, 3, keep=True)
    from msdata_server.batch import zigzag_index

    idx = zigzag_index(256, 2)
    for i in range(3):
        full = kept_full[0][i]["tokens"]
        re = torch.empty_like(full)
        for c in range(2):
            rank = spec.mesh.rank(spec.mesh.coord(0).__class__(pp=0, dp=0, cp=c, tp=0))
            re[:, torch.from_numpy(idx[c])] = kept[rank][i]["tokens"]
        assert torch.equal(re, full)
        assert torch.equal(kept[0][i]["cu_seqlens"], kept_full[0][i]["cu_seqlens"])


def test_slot_is_held_until_the_batch_is_collected(server_factory):
    srv = server_factory(extra="ring_slots = 3\n").start()
    spec = small_job(dp=1, micro_batches=1)
    dc = msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1)
    try:
        held = [next(dc) for _ in range(3)]  # the ring is full: nothing was released by asking for more

        def in_use():
            return status(srv.socket)["jobs"][0]["rings"][0]["in_use"]

        assert in_use() == 3
        toks = held[0]["tokens"]  # a tensor outlives its dict: the slot stays taken
        del held[0]
        gc.collect()
        assert in_use() == 3
        del toks
        gc.collect()
        b = next(dc)  # the finalizer released slot 0, so a new batch could be built
        assert int(b["step"]) == 3
        dc.release(held[0])
        dc.release(held[0])  # idempotent
        del b, held
        gc.collect()
        next(dc)
    finally:
        dc.close()


def test_killed_reader_does_not_stall_the_others(server_factory, tmp_path):
    srv = server_factory(extra="ring_slots = 4\n").start()
    spec = small_job(dp=1, tp=2, micro_batches=1)
    victim, _ = start_rank_process(spec, srv.socket, 1, 1000, tmp_path, "--hold", 4)
    got = {}

    def rank0():
        got[0] = run_ranks(spec, srv.socket, 30, ranks=[0])[0]

    t = threading.Thread(target=rank0)
    t.start()
    victim.stdout.readline()  # it has a batch: the job runs
    finish(victim)  # SIGKILL while holding 4 slots: the others must get them back
    t.join(60)
    assert not t.is_alive()
    assert len(got[0]) == 30


def test_sigterm_leaves_shm_clean(server_factory):
    srv = server_factory().start()
    spec = small_job(dp=1)
    dc = msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=5)
    next(dc)
    pid = srv.proc.pid
    assert srv.stop(signal.SIGTERM) == 0
    assert not [n for n, i in list_segments() if i.get("pid") == pid]
    assert not os.path.exists(srv.socket)
    dc.close()


def _raw(endpoint, frames: list[bytes]) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(endpoint)
    with s:
        for f in frames:
            s.sendall(f)
        r = FrameReader()
        while (f := r.next_frame()) is None:
            recv_into_reader(s, r)
        return f


def test_bad_clients_get_clear_errors_and_the_server_keeps_serving(server_factory):
    srv = server_factory().start()
    spec = small_job(dp=1)
    good = msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1)
    next(good)
    err = _raw(srv.socket, [b"\x00\x00\x00\x05hello"])
    assert err["t"] == "error"
    assert "not valid JSON" in err["message"]
    err = _raw(srv.socket, [b"\xff\xff\xff\xff"])
    assert "exceeds MAX_FRAME" in err["message"]
    hello = {"t": "hello", "v": 1, "job": spec.to_dict(), "digest": "0" * 64, "rank": 0, "world_size": 1}
    err = _raw(srv.socket, [encode(hello)])
    assert "digest mismatch" in err["message"]
    spec2 = small_job("t2", dp=2)
    with pytest.raises(msd.ConfigError, match="rank 5 is outside"):  # noqa: PT012  (refused at the first next)
        d = msd.DataClient(spec2, endpoint=srv.socket, rank=0, world_size=2)
        d.rank = 5  # bypass the client-side check: the server must refuse too
        next(d)
    other = small_job(dp=1, seed=99)  # same name, other definition, while rank 0 is connected
    with pytest.raises(msd.ConfigError, match="another definition"):
        next(msd.DataClient(other, endpoint=srv.socket, rank=0, world_size=1))
    with pytest.raises(msd.ConfigError, match="already connected"):
        next(msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1))
    for _ in range(5):
        next(good)  # still served
    good.close()


def test_oversize_batch_is_refused_clearly(server_factory):
    srv = server_factory(extra="max_slot_mib = 1\n").start()
    spec = small_job("huge", dp=1, seq_len=65536, rows=4)
    with pytest.raises(msd.RemoteError, match="max_slot_mib"):
        next(msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1))
    ok = small_job(dp=1)
    assert len(run_ranks(ok, srv.socket, 2)[0]) == 2


def test_several_jobs_and_a_dead_job_does_not_hold_back_the_others(server_factory, tmp_path):
    srv = server_factory().start()
    a, b = small_job("job-a", dp=1), small_job("job-b", dp=1, seed=7)
    pa, _ = start_rank_process(a, srv.socket, 0, 1000, tmp_path, "--hold", 8)
    pa.stdout.readline()
    got = run_ranks(b, srv.socket, 12)
    assert len(got[0]) == 12
    st = status(srv.socket)
    assert {j["name"] for j in st["jobs"]} == {"job-a", "job-b"} or {j["name"] for j in st["jobs"]} == {"job-a"}
    finish(pa)
    assert len(run_ranks(b, srv.socket, 4)[0]) == 4


def test_status_json(server_factory):
    srv = server_factory().start()
    spec = small_job(dp=1)
    with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1) as dc:
        next(dc)
        st = status(srv.socket)
    assert st["node"] == "test-node"
    assert st["role"] == "single"
    (job,) = st["jobs"]
    assert job["name"] == "t"
    assert job["ranks"] == [0]
    assert job["steps_planned"] >= 1
    out = subprocess.run(
        [sys.executable, "-m", "msdata_server", "status", "--endpoint", srv.socket],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "role single" in out


def test_client_reconnects_after_server_restart(server_factory):
    srv = server_factory()
    srv.start()
    spec = small_job(dp=1, micro_batches=2)
    ref = run_ranks(spec, srv.socket, 10)[0]
    dc = msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=60)
    first = [batch_record(next(dc)) for _ in range(4)]
    srv.kill()  # SIGKILL: nothing to clean up, the rings were unlinked at creation
    srv.start()
    rest = [batch_record(next(dc)) for _ in range(6)]
    dc.close()
    assert first + rest == ref  # a pause, not a change of data


def test_connect_timeout_names_the_endpoint(sockdir):
    spec = small_job(dp=1)
    ep = os.path.join(sockdir, "nobody.sock")
    with pytest.raises(msd.ConnectError, match=r"nobody.sock"):
        next(msd.DataClient(spec, endpoint=ep, rank=0, world_size=1, connect_timeout=0.3))


def test_pp_stages_get_their_fields(server_factory):
    srv = server_factory().start()
    spec = small_job("pp", dp=1, pp=3, micro_batches=1)
    _, kept = run_ranks(spec, srv.socket, 2, keep=True)
    stage = {spec.mesh.stage(r): kept[r][0] for r in range(3)}
    assert {"tokens", "position_ids", "cu_seqlens"} <= set(stage["first"])
    assert "labels" not in stage["first"]
    assert {"labels", "loss_mask", "cu_seqlens"} <= set(stage["last"])
    assert "tokens" not in stage["last"]
    assert set(stage["middle"]) == {"cu_seqlens", "doc_counts", "position_ids", "step", "micro"}
    # one build: the stages' common fields are the same bytes
    assert torch.equal(stage["first"]["cu_seqlens"], stage["last"]["cu_seqlens"])


def test_distribute_world_gives_every_rank_its_own_data(server_factory):
    srv = server_factory().start()
    g = msd.DGraph("world", seed=0).source("a", "synthetic", samples=200, median=50.0, max_len=256)
    spec = g.mix({"a": 1.0}).pack(256).mesh(dp=1, tp=2).distribute("world").plan()
    got = run_ranks(spec, srv.socket, 3)
    ids = [{tuple(x) for rec in got[r] for x in rec["ids"]} for r in (0, 1)]
    assert ids[0]
    assert ids[1]
    assert not ids[0] & ids[1]


def test_small_dev_shm_gives_a_clear_error_and_the_server_keeps_serving(server_factory):
    from .server_util import can_unshare

    if not can_unshare():
        pytest.skip("needs `unshare -m` (root) to mount a small /dev/shm")
    srv = server_factory(shm_mib=4).start()
    big = small_job("big", dp=1, seq_len=65536, rows=2)  # 8 slots of a few MiB each: does not fit 4 MiB
    with pytest.raises(msd.RemoteError, match="shm-size"):
        next(msd.DataClient(big, endpoint=srv.socket, rank=0, world_size=1))
    assert len(run_ranks(small_job("small", dp=1, seq_len=256), srv.socket, 3)[0]) == 3
