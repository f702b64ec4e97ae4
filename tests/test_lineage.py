"""Lineage by replay on one node: the rows of each step are the pieces the ranks actually received (decoded back
to their files and rows), from the server, from the offline CLI (from the beginning and from a trainer's saved
state), as Parquet with the documented schema."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import msdata_client as msd
from msdata_client.lineage import COLUMNS, FIXED_COLUMNS, from_wire, to_pylist
from msdata_client.wire import request
from msdata_server.lineage.command import offline
from msdata_server.lineage.query import Query
from msdata_server.planner.accounting import accounting

from .lineage_util import SAVE_AT, run_job
from .server_util import ServerProc

EOS = 256
SEQ_LEN = 256
STEPS = 6


@pytest.fixture(scope="module")
def srv():
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="msd-")
    s = ServerProc(d).start()
    yield s
    s.stop()
    s.proc.stdout.close()
    shutil.rmtree(d, ignore_errors=True)


def write_sources(root: Path) -> tuple[dict[str, str], dict[tuple[str, int], str]]:
    """A JSON Lines source (some documents longer than SEQ_LEN) and a Parquet one; (dirs, {(path, row): text})."""
    rng = np.random.default_rng(11)
    texts: dict[tuple[str, int], str] = {}
    dirs = {}
    for name, fmt, files in (("code", "jsonl", [40, 35]), ("web", "parquet", [50])):
        d = root / name
        d.mkdir()
        dirs[name] = str(d)
        for f, n in enumerate(files):
            docs = []
            for i in range(n):
                k = int(rng.integers(5, 200)) if i % 9 else int(rng.integers(300, 700))
                docs.append(f"<{name}{f}:{i}>" + "".join(rng.choice(list("abcdefgh ,.\n"), size=k).tolist()))
            path = d / f"part-{f}.{fmt}"
            if fmt == "jsonl":
                path.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in docs))
            else:
                pq.write_table(pa.table({"text": docs}), path, row_group_size=8)
            texts.update({(str(path), r): t for r, t in enumerate(docs)})
    return dirs, texts


def job_spec(name: str, dirs: dict[str, str], *, dp: int = 2):
    g = msd.DGraph(name, seed=5)
    g.source("code", "jsonl", [dirs["code"]], column="text", transform="msdata_server.transforms:byte_tokens")
    g.source("web", "parquet", [dirs["web"]], column="text", transform="msdata_server.transforms:byte_tokens")
    g.mix({"code": 0.5, "web": 0.5}).pack(SEQ_LEN, micro_batches=2, rows=2).mesh(dp=dp).prefetch(2)
    return g.plan()


def check_rows_match_batch(rows: list[dict], batch, texts: dict[tuple[str, int], str]) -> None:
    """The rows of one micro-batch name exactly its pieces: ids in order, and the tokens at (row, offset) are the
    bytes of file_row of file from doc_offset on."""
    assert [(r["source_id"], r["sample_id"]) for r in rows] == list(
        zip(batch["source_ids"].tolist(), batch["sample_ids"].tolist())
    )
    tokens = batch["tokens"].numpy()
    for r in rows:
        text = texts[(r["file"], r["file_row"])]
        doc = np.append(np.frombuffer(text.encode(), np.uint8).astype(np.int64), EOS)
        want = doc[r["doc_offset"] : r["doc_offset"] + r["length"]]
        got = tokens[r["row"], r["offset"] : r["offset"] + r["length"]]
        assert np.array_equal(got, want), r
        assert r["piece"] == r["doc_offset"] // SEQ_LEN
        assert not r["skipped"]
        assert r["sample_id"] == (r["file_index"] << 32) | r["file_row"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "msdata_server", "lineage", *args], capture_output=True, text=True, timeout=90
    )


@pytest.fixture(scope="module")
def first_run(srv, tmp_path_factory):
    """One uninterrupted run of STEPS steps on dp 2, with every step's lineage asked while it ran."""
    tmp_path = tmp_path_factory.mktemp("lineage")
    dirs, texts = write_sources(tmp_path)
    spec = job_spec("lin", dirs)
    toml = tmp_path / "job.toml"
    toml.write_text(spec.to_toml())
    got, lin, saved = run_job(spec, srv.socket, STEPS)
    return tmp_path, texts, spec, toml, got, lin, saved


def test_lineage_is_what_ranks_received_server_and_offline(first_run):
    tmp_path, texts, spec, toml, got, lin, saved = first_run

    # the server's rows (loader.lineage) are this rank's pieces, decoded back to their files
    long_pieces = 0
    for r, batches in got.items():
        for step, micro, b in batches:
            rows = [x for x in lin[r][step] if x["micro"] == micro]
            assert {x["dp_rank"] for x in rows} == {spec.group_of(r)}
            check_rows_match_batch(rows, b, texts)
            long_pieces += sum(x["piece"] > 0 for x in rows)
    assert long_pieces > 0  # documents longer than seq_len came in pieces, and lineage says which

    # offline from the job TOML, from the beginning: Parquet with the documented schema, the same rows
    out = tmp_path / "all.parquet"
    res = cli("--job", str(toml), "--steps", f"0:{STEPS}", "--out", str(out))
    assert res.returncode == 0, res.stderr
    table = pq.read_table(out)
    assert table.column_names == list(COLUMNS)
    assert table.column_names[:12] == list(FIXED_COLUMNS)
    assert str(table.schema.field("source").type) == "string"
    assert str(table.schema.field("step").type) == "int64"
    assert str(table.schema.field("skipped").type) == "bool"
    offline = table.to_pylist()
    server_rows = sorted(
        (x for r in (0, 1) for s in range(STEPS) for x in lin[r][s]),
        key=lambda x: (x["step"], x["dp_rank"], x["micro"], x["row"], x["offset"]),
    )
    assert offline == server_rows

    # offline from a trainer's saved state (after SAVE_AT steps): the same rows of the later steps
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(saved[0]))
    out2 = tmp_path / "later.parquet"
    res = cli("--job", str(toml), "--state", str(state_file), "--steps", f"{SAVE_AT}:{STEPS}", "--out", str(out2))
    assert res.returncode == 0, res.stderr
    assert pq.read_table(out2).to_pylist() == [x for x in offline if x["step"] >= SAVE_AT]

    # the saved state carries the accounting of the steps before it: tokens and whole documents per source
    acc = accounting(saved[0]["planner"], ["code", "web"], {"code": 75, "web": 50})
    before = [x for x in offline if x["step"] < SAVE_AT]
    later = {(x["source"], x["ordinal"]) for x in offline if x["step"] >= SAVE_AT}
    for name in ("code", "web"):
        assert acc[name]["tokens_delivered"] == sum(x["length"] for x in before if x["source"] == name) > 0
        done = {x["ordinal"] for x in before if x["source"] == name and (name, x["ordinal"]) not in later}
        assert acc[name]["docs_delivered"] == len(done)
        assert acc[name]["docs_skipped"] == acc[name]["bad_samples"] == 0
        assert acc[name]["epochs_completed"] == 0

    # a state past the first step asked for is refused with the fix
    res = cli("--job", str(toml), "--state", str(state_file), "--steps", "0:2")
    assert res.returncode == 2
    assert "at or before" in res.stderr

    # --sample: where one document went (its rows only); --rank: one rank's group; a printed table
    sid = offline[5]["sample_id"]
    res = cli("--job", str(toml), "--steps", f"0:{STEPS}", "--sample", str(sid), "--rank", "1")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    want = [x for x in offline if x["sample_id"] == sid and x["dp_rank"] == 1]
    assert lines[0].split() == list(FIXED_COLUMNS)
    assert len(lines) == 1 + len(want)

    # sample ids repeat across sources: --source names the one meant (and a wrong name lists the sources)
    shared = sorted(
        {x["sample_id"] for x in offline if x["source"] == "web"}
        & {x["sample_id"] for x in offline if x["source"] == "code"}
    )
    assert shared, "both sources number their samples from file 0, row 0"
    out3 = tmp_path / "one.parquet"
    res = cli(
        "--job", str(toml), "--steps", f"0:{STEPS}", "--sample", str(shared[0]), "--source", "web", "--out", str(out3)
    )
    assert res.returncode == 0, res.stderr
    got = pq.read_table(out3).to_pylist()
    assert got == [x for x in offline if x["sample_id"] == shared[0] and x["source"] == "web"]
    assert got
    res = cli("--job", str(toml), "--steps", "0:1", "--source", "nope")
    assert res.returncode == 2
    assert "'nope' is not a source" in res.stderr
    assert "web" in res.stderr


def test_lineage_cli_bad_input(tmp_path):
    res = cli("--job", "nojob", "--steps", "3", "--endpoint", str(tmp_path / "none.sock"))
    assert res.returncode == 2
    assert "A:B" in res.stderr
    res = cli("--job", "nojob", "--steps", "4:2", "--endpoint", str(tmp_path / "none.sock"))
    assert res.returncode == 2
    assert "0 <= A < B" in res.stderr
    res = cli("--job", "nojob", "--steps", "0:2", "--endpoint", str(tmp_path / "none.sock"))
    assert res.returncode == 2
    assert "no server" in res.stderr


def pieces(batches) -> list[tuple[int, int, bytes]]:
    """(step, sample id, tokens) of every piece a rank received, in order."""
    out = []
    for step, _, b in batches:
        flat = b["tokens"].numpy().reshape(-1)
        cu = b["cu_seqlens"].numpy().tolist()
        segs = [flat[x:y] for x, y in itertools.pairwise(cu)]
        for sid, seg in zip(b["sample_ids"].tolist(), segs):
            out.append((step, sid, seg.tobytes()))
    return out


def test_skip_resumes_exactly_and_lineage_marks_the_skipped_steps(srv, first_run):
    _tmp_path, _texts, spec, _toml, got, _lin, saved = first_run
    k = 2
    state = saved[0]
    after, _lin_b, _ = run_job(spec, srv.socket, STEPS - SAVE_AT - k, state=state, skip={"steps": k}, lineage=False)
    for r in after:
        # delivered = the uninterrupted run's pieces minus exactly those of the skipped steps SAVE_AT..SAVE_AT+k-1
        want = [p for p in pieces(got[r]) if p[0] >= SAVE_AT + k]
        assert pieces(after[r]) == want
        skipped = [p for p in pieces(got[r]) if SAVE_AT <= p[0] < SAVE_AT + k]
        assert skipped
        assert not set(skipped) & set(pieces(after[r]))
        # and the later batches are bit for bit the uninterrupted ones
        for (s1, m1, b1), (s2, m2, b2) in zip(after[r], [x for x in got[r] if x[0] >= SAVE_AT + k]):
            assert (s1, m1) == (s2, m2)
            assert all(np.array_equal(b1[key], b2[key]) for key in b1)


def test_skip_lineage_from_the_server_shows_skipped_rows(srv, first_run):
    _tmp_path, _texts, spec, _toml, _got, lin, saved = first_run
    k = 2
    gate, done = threading.Event(), threading.Event()
    result: dict = {}

    def ask():  # while the resumed job runs: its server replays the skipped steps from the states it stored
        gate.wait(60)
        try:
            result["rows"] = msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=2).lineage(SAVE_AT)
            result["status"] = request(srv.socket, {"t": "status"})["status"]
        except BaseException as e:  # reported below
            result["error"] = e
        done.set()

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    world = spec.mesh.world_size

    def body(r):
        with msd.DataClient(spec, endpoint=srv.socket, rank=r, world_size=world, connect_timeout=30) as dc:
            dc.load_state_dict(saved[0])
            dc.skip(steps=k)
            b = next(dc)
            assert int(b["step"]) == SAVE_AT + k
            gate.set()
            done.wait(60)

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for x in ts:
        x.start()
    for x in [*ts, t]:
        x.join(90)
    assert "error" not in result, result.get("error")
    # status --json: per source, the tokens and documents the skip dropped
    (job,) = [j for j in result["status"]["jobs"] if j["name"] == spec.name]
    skipped = [x for r in (0, 1) for s in range(SAVE_AT, SAVE_AT + k) for x in lin[r][s]]
    for name in ("code", "web"):
        acc = job["accounting"][name]
        assert acc["tokens_skipped"] == sum(x["length"] for x in skipped if x["source"] == name) > 0
        assert acc["docs_skipped"] == len({x["ordinal"] for x in skipped if x["source"] == name and x["piece"] == 0})
    rows = result["rows"].to_pylist()
    assert rows
    assert all(x["skipped"] for x in rows)
    assert [dict(x, skipped=False) for x in rows] == lin[0][SAVE_AT]


def test_ranks_that_disagree_on_the_skip_are_refused(srv, first_run):
    _tmp_path, _texts, spec, _toml, _got, _lin, saved = first_run
    world = spec.mesh.world_size
    errs: dict = {}

    def body(r):
        try:
            with msd.DataClient(spec, endpoint=srv.socket, rank=r, world_size=world, connect_timeout=30) as dc:
                dc.load_state_dict(saved[0])
                dc.skip(steps=1 + r)
                next(dc)
        except msd.errors.CheckpointError as e:
            errs[r] = str(e)

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for x in ts:
        x.start()
    for x in ts:
        x.join(60)
    assert set(errs) == {0, 1}
    assert all("disagree on the skip" in e for e in errs.values())


def test_skip_misuse_is_refused_in_the_client(first_run):
    spec = first_run[2]
    dc = msd.DataClient(spec, endpoint="/nonexistent.sock", rank=0, world_size=2)
    with pytest.raises(msd.errors.CheckpointError, match="load_state_dict"):
        dc.skip(steps=2)
    dc.load_state_dict(first_run[6][0])
    with pytest.raises(msd.errors.ConfigError, match="steps must be an int >= 1"):
        dc.skip(steps=0)
    dc.skip(steps=2)
    with pytest.raises(msd.errors.CheckpointError, match="already called"):
        dc.skip(steps=1)
    assert dc.state_dict()["skip"] == {"steps": 2, "defer": False}
    dc.close()


def test_replay_window_equals_the_original_batches_while_the_job_runs(srv, first_run):
    _tmp_path, _texts, spec, _toml, got, _lin, _saved = first_run
    world, pause_at = spec.mesh.world_size, 2 * spec.micro_batches
    paused, go = threading.Barrier(world + 1), threading.Event()
    again: dict = {r: [] for r in range(world)}
    errs: dict = {}

    def body(r):  # a new run of the same job from its beginning: the same batches as the first run
        try:
            with msd.DataClient(spec, endpoint=srv.socket, rank=r, world_size=world, connect_timeout=30) as dc:
                for i in range(STEPS * spec.micro_batches):
                    if i == pause_at:
                        paused.wait(60)
                        go.wait(60)
                    b = next(dc)
                    again[r].append((int(b["step"]), int(b["micro"]), {k: v.clone() for k, v in b.items()}))
                    dc.release(b)
        except BaseException as e:  # reported to the test
            errs[r] = e

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in ts:
        t.start()
    paused.wait(60)  # every rank is mid-run: the job is registered and planning ahead
    try:
        window = list(msd.DataClient(spec, endpoint=srv.socket, rank=1, world_size=world, replay=(1, 4)))
    finally:
        go.set()
    for t in ts:
        t.join(90)
    assert not errs, errs
    want = [b for s, _, b in got[1] if 1 <= s < 4]
    assert len(window) == len(want) == 3 * spec.micro_batches
    for w, b in zip(window, want):
        assert sorted(w) == sorted(b)
        for key in b:
            assert w[key].dtype == b[key].dtype, key
            assert torch.equal(w[key], b[key]), key
    # the running job was not disturbed: its ranks got exactly the first run's batches
    for r in range(world):
        assert [(s, m) for s, m, _ in again[r]] == [(s, m) for s, m, _ in got[r]]
        assert all(all(torch.equal(a[k], b[k]) for k in b) for (_, _, a), (_, _, b) in zip(again[r], got[r]))


def test_replay_client_is_read_only(first_run):
    spec = first_run[2]
    dc = msd.DataClient(spec, endpoint="/nonexistent.sock", rank=0, world_size=2, replay=(2, 4))
    with pytest.raises(msd.errors.ConfigError, match="read-only"):
        dc.load_state_dict(first_run[6][0])
    with pytest.raises(msd.errors.ConfigError, match="read-only"):
        dc.set_mixture({"code": 1.0})
    with pytest.raises(msd.errors.ConfigError, match=r"replay=\(4, 2\)"):
        msd.DataClient(spec, endpoint="/nonexistent.sock", rank=0, world_size=2, replay=(4, 2))
    dc.close()


def test_skip_defer_delivers_the_skipped_pieces_after_the_rest_of_their_epoch(srv, first_run):
    _tmp_path, texts, spec, _toml, _got, _lin, saved = first_run
    k, last = 2, 17
    ref = to_pylist(from_wire(asyncio.run(offline(spec, Query(start=0, stop=last), None))))  # uninterrupted
    after, lin_b, _ = run_job(spec, srv.socket, last - SAVE_AT - k, state=saved[0], skip={"steps": k, "defer": True})
    for r, batches in after.items():  # the resumed server's rows are what its ranks received (decoded)
        for step, micro, b in batches:
            check_rows_match_batch([x for x in lin_b[r][step] if x["micro"] == micro], b, texts)
    mine = sorted(
        [x for x in ref if x["step"] < SAVE_AT] + [x for r in lin_b for s in lin_b[r] for x in lin_b[r][s]],
        key=lambda x: (x["step"], x["dp_rank"], x["micro"], x["row"], x["offset"]),
    )
    deferred = [x for x in ref if SAVE_AT <= x["step"] < SAVE_AT + k]
    key = ("source", "epoch", "ordinal", "doc_offset", "length")

    def piece(x):
        return tuple(x[c] for c in key)

    deferred_keys = {piece(x) for x in deferred}
    assert deferred_keys
    assert len(deferred_keys) == len(deferred)
    first_deferred = min(x["step"] for x in mine if piece(x) in deferred_keys)
    # until the deferred pieces come, the resumed run is the uninterrupted one without the skipped steps
    assert [piece(x) for x in mine if SAVE_AT + k <= x["step"] < first_deferred] == [
        piece(x) for x in ref if SAVE_AT + k <= x["step"] < first_deferred
    ]
    for name in ("code", "web"):
        # every piece of the source's first epoch exactly once: none lost, none repeated
        e0 = sorted(piece(x) for x in mine if x["source"] == name and x["epoch"] == 0)
        assert e0 == sorted(piece(x) for x in ref if x["source"] == name and x["epoch"] == 0)
        # ... and the deferred ones drawn after every other piece of that epoch, before the next epoch's (a piece
        # drawn earlier may be placed a step later: the planner carries what does not fit to the next step)
        steps = [x["step"] for x in mine if x["source"] == name and x["epoch"] == 0 and piece(x) not in deferred_keys]
        late = [x["step"] for x in mine if x["source"] == name and piece(x) in deferred_keys]
        nxt = [x["step"] for x in mine if x["source"] == name and x["epoch"] == 1]
        assert late, (steps, late, nxt)
        assert min(late) >= max(steps) - 1, (steps, late, nxt)
        assert nxt, (steps, late, nxt)
        assert max(late) <= min(nxt) + 1, (steps, late, nxt)
