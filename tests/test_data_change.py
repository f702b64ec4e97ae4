"""A resume notices changed source files (issue 26): real JSON Lines files in tmp_path, a real server.

By default a resume over a changed file list is refused, naming what changed; ``[job] on_data_change =
"continue"`` goes on from the saved cursor located in the new file order and records the change in the state.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import orjson
import pytest

import msdata_client as msd
from msdata_server.datachange import check_listings, listings_now
from msdata_server.errors import CheckpointError
from msdata_server.planner.listings import Listings
from msdata_server.sources import open_source

from .e2e_util import run_ranks

FILES, ROWS = 4, 40


def _file(d: Path, f: int) -> None:
    rng = np.random.default_rng(f)
    docs = [f"<{f}:{i}>" + "x" * int(rng.integers(20, 120)) for i in range(ROWS)]
    (d / f"part-{f}.jsonl").write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in docs))


def _job(tmp_path: Path, name: str, on_data_change: str = "error") -> msd.JobSpec:
    d = tmp_path / "web"
    if not d.exists():
        d.mkdir()
        for f in range(FILES):
            _file(d, f)
    g = msd.DGraph(name, seed=3)
    g.source("web", "jsonl", [str(d)], column="text", transform="msdata_server.transforms:byte_tokens")
    g.mix({"web": 1.0}).pack(256, rows=2, micro_batches=2).mesh(dp=1)
    return dataclasses.replace(g.plan(), on_data_change=on_data_change)


@pytest.fixture
def server(server_factory):
    return server_factory().start()


def test_unchanged_files_resume_bit_identically(server, tmp_path):
    spec = _job(tmp_path, "same")
    whole = run_ranks(spec, server.socket, 6)[0]
    saved: dict = {}
    run_ranks(spec, server.socket, 3, saved=saved)
    listing = saved[0]["planner"]["listing"]
    assert listing["files"] == [FILES]
    assert len(listing["digest"][0]) == 32
    assert "changes" not in listing
    rest = run_ranks(spec, server.socket, 3, states={0: saved[0]})[0]
    assert rest == whole[3:]


def test_added_file_is_refused_then_continue_goes_on_at_the_cursor(server, tmp_path):
    spec = _job(tmp_path, "added")
    saved: dict = {}
    run_ranks(spec, server.socket, 4, saved=saved)
    state = saved[0]
    _file(tmp_path / "web", FILES)  # one file more
    with pytest.raises(msd.CheckpointError, match=r"source 'web': 1 file\(s\) added \(part-4\.jsonl\), 0 removed"):
        run_ranks(spec, server.socket, 1, states={0: state})
    with pytest.raises(msd.CheckpointError, match='on_data_change = "continue"'):
        run_ranks(spec, server.socket, 1, states={0: state})
    # the same data identity: switching on_data_change does not itself break the resume
    cont = _job(tmp_path, "added", "continue")
    assert cont.data_digest() == spec.data_digest()
    assert cont.digest() != spec.digest()
    after: dict = {}
    recs = run_ranks(cont, server.socket, 2, states={0: state}, saved=after)[0]
    step = state["planner"]["step"]
    assert recs[0]["step"] == step
    listing = after[0]["planner"]["listing"]
    assert listing["files"] == [FILES + 1]
    assert listing["changes"] == [
        {"step": step, "source": "web", "was": state["planner"]["listing"]["digest"][0], "now": listing["digest"][0]}
    ]
    # the position: the saved cursor (epoch * num_samples + pos) is located in the new file order; what the step
    # delivers is read from there on, or carried over from before (a piece of a document begun earlier)
    src = open_source(cont.sources[0], seed=cont.seed)
    try:
        cursor = state["planner"]["cursor"][0]
        ahead = set(src.sample_ids(np.arange(cursor, cursor + 4 * ROWS)).tolist())
        carried = set(src.sample_ids(np.array(state["planner"]["carry"]["ordinal"], np.int64)).tolist())
        got = {i for rec in recs for _, i in rec["ids"]}
        assert got
        assert got <= ahead | carried
        assert src.num_samples == (FILES + 1) * ROWS
    finally:
        src.close()


def test_changed_mtime_or_size_is_named(server, tmp_path):
    spec = _job(tmp_path, "touched")
    saved: dict = {}
    run_ranks(spec, server.socket, 2, saved=saved)
    p = tmp_path / "web" / "part-2.jsonl"
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(msd.CheckpointError, match=r"0 removed, 1 changed \(size or mtime\) \(part-2\.jsonl\)"):
        run_ranks(spec, server.socket, 1, states={0: saved[0]})
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # restored: the resume goes on
    with p.open("ab") as f:
        f.write(orjson.dumps({"text": "one more"}) + b"\n")
    with pytest.raises(msd.CheckpointError, match=r"1 changed \(size or mtime\) \(part-2\.jsonl\)"):
        run_ranks(spec, server.socket, 1, states={0: saved[0]})


def test_state_without_listing_still_loads(server, tmp_path):
    spec = _job(tmp_path, "old")
    whole = run_ranks(spec, server.socket, 4)[0]
    saved: dict = {}
    run_ranks(spec, server.socket, 2, saved=saved)
    old = dict(saved[0], planner={k: v for k, v in saved[0]["planner"].items() if k != "listing"})
    after: dict = {}
    assert run_ranks(spec, server.socket, 2, states={0: old}, saved=after)[0] == whole[2:]
    assert after[0]["planner"]["listing"]["files"] == [FILES]  # recorded from now on


def test_without_the_old_manifest_the_error_names_counts_and_digests(tmp_path):
    spec = _job(tmp_path, "nomanifest")
    new, now = listings_now(spec)
    saved = Listings(digests=("0" * 32,), files=(3,))
    state = {"step": 5, "listing": saved.to_dict()}
    with pytest.raises(CheckpointError, match=r"saved: 3 files, digest 000000000000; now: 4 files, digest "):
        check_listings(spec, state, now, new, lambda d: None)
    cont = dataclasses.replace(spec, on_data_change="continue")
    got = check_listings(cont, state, now, new, lambda d: None)
    assert got.digests == now.digests
    assert [c.step for c in got.changes] == [5]
    # a later check over the same files keeps the change history
    again = check_listings(cont, {"step": 9, "listing": got.to_dict()}, now, new, lambda d: None)
    assert again == got


def test_listing_names_are_relative_so_moving_the_data_keeps_the_digest(tmp_path):
    spec = _job(tmp_path, "moved")
    _, before = listings_now(spec)
    os.rename(tmp_path / "web", tmp_path / "elsewhere")
    moved = dataclasses.replace(
        spec, sources=(dataclasses.replace(spec.sources[0], paths=(str(tmp_path / "elsewhere"),)),)
    )
    _, after = listings_now(moved)
    assert after.digests == before.digests


def test_on_data_change_is_validated():
    with pytest.raises(msd.ConfigError, match="on_data_change='maybe' is not one of"):
        msd.JobSpec.from_dict(
            {
                "job": {"name": "x", "on_data_change": "maybe"},
                "source": [{"name": "a", "format": "synthetic"}],
                "mix": {"weights": {"a": 1.0}},
            }
        )


def test_lineage_refuses_steps_read_from_the_old_file_list(tmp_path):
    from msdata_server.lineage.query import Query, check_files

    spec = _job(tmp_path, "lin")
    new, now = listings_now(spec)
    old = {"step": 4, "listing": Listings(digests=("1" * 32,), files=(3,)).to_dict()}
    went = check_listings(dataclasses.replace(spec, on_data_change="continue"), old, now, new, lambda d: None)
    later = {"step": 6, "listing": went.to_dict()}
    with pytest.raises(msd.ConfigError, match=r"steps before 4 .* another file list of source 'web'"):
        check_files(spec, Query(start=2, stop=5), [old, later])
    check_files(spec, Query(start=4, stop=6), [later])  # steps from the change on replay over today's files
