"""Differential planner checkpoints: bases + deltas compose to exactly the states saved, in state_dir and etcd;
version-1 states (whole JSON) still load; a delta never composes with a base it was not written against."""

from __future__ import annotations

import asyncio
import os
import secrets

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msdata_server.planner import Planner
from msdata_server.planner.delta import DeltaWriter, compose, decode, encode_base, encode_delta
from msdata_server.statedir import StateStore

ints = st.integers(-(2**40), 2**40)


@st.composite
def carries(draw, n_sources: int):
    k = draw(st.integers(0, 12))
    src = draw(st.lists(st.integers(0, n_sources - 1), min_size=k, max_size=k))
    ords = draw(st.lists(st.integers(0, 10**7), min_size=k, max_size=k))
    carry = {
        "source": src,
        "ordinal": ords,
        "offset": draw(st.lists(st.integers(0, 9000), min_size=k, max_size=k)),
        "length": draw(st.lists(st.integers(1, 9000), min_size=k, max_size=k)),
    }
    if draw(st.booleans()):
        carry["patches"] = draw(st.lists(st.integers(0, 99), min_size=k, max_size=k))
    return carry


@st.composite
def state_sequences(draw):
    """Planner-shaped states, each step changing some keys (the carry, counters, now and then the mixture),
    and now and then a state of another shape (a key gone or added, a carry that is not columns)."""
    n = draw(st.integers(1, 4))
    length = draw(st.integers(1, 30))
    state = {
        "version": 1,
        "step": 0,
        "sources": [f"s{i}" for i in range(n)],
        "seq_len": 8192,
        "cursor": [0] * n,
        "target": [0.0] * n,
        "carry": draw(carries(n)),
        "mixture": {"weights": [1.0 / n] * n},
    }
    out = []
    for step in range(length):
        state = dict(state, step=step)
        for key in draw(st.sets(st.sampled_from(["cursor", "target", "carry", "mixture", "odd", "gone"]))):
            if key == "cursor":
                state["cursor"] = draw(st.lists(ints, min_size=n, max_size=n))
            elif key == "target":
                state["target"] = draw(
                    st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=n, max_size=n)
                )
            elif key == "carry":
                state["carry"] = draw(st.one_of(carries(n), st.just({"ordinal": [1, 2]}), st.just([3, 4])))
            elif key == "mixture":
                state["mixture"] = {"weights": draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))}
            elif key == "odd":
                state["extra"] = draw(st.one_of(ints, st.text(max_size=5), st.none()))
            else:
                state.pop("extra", None)
        out.append(state)
    return out


def same(a, b) -> bool:
    return orjson.dumps(a) == orjson.dumps(b)  # exact: key order, int vs float, every value


@settings(max_examples=60, deadline=None)
@given(states=state_sequences(), every=st.integers(1, 6))
def test_bases_and_deltas_compose_to_the_states_exactly(states, every):
    w = DeltaWriter(every)
    bases: dict[int, bytes] = {}
    for state in states:
        data, is_base = w.encode(state["step"], state)
        rec = decode(data, "test")
        assert rec.step == state["step"]
        assert rec.is_delta != is_base
        if is_base:
            bases[rec.step] = data
            assert same(rec.state, state)
        else:
            assert rec.base is not None
            assert state["step"] - rec.base < every
            assert same(compose(rec, decode(bases[rec.base], "b"), bases[rec.base], "test"), state)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(states=state_sequences(), every=st.integers(1, 5), keep=st.integers(1, 6))
def test_state_dir_loads_every_step_of_its_window(tmp_path_factory, states, every, keep):
    d = tmp_path_factory.mktemp("sd")
    store = StateStore(str(d), "job", "f" * 64, keep=keep, every=every)
    for state in states:
        s = state["step"]
        store.save(s, state)
        for back in range(max(0, s - keep + 1), s + 1):  # every step of the window loads exactly
            got = StateStore(str(d), "job", "f" * 64).load_at_or_before(back)  # a fresh store: from disk only
            assert got is not None
            assert got[0] == back
            assert same(got[1], states[back])
        assert len(os.listdir(store.dir)) <= keep + every - 1  # bounded: the window and its bases


def _planner_states(n: int) -> list[dict]:
    from .planner_util import MEDIANS, View, config

    planner, view, out = Planner(config(dp=64)), View(MEDIANS, seed=1), []
    for _ in range(n):
        out.append(planner.state_dict())
        planner.plan_step(view)
    return out


def test_real_planner_states_round_trip_and_restore_a_planner(tmp_path):
    states = _planner_states(20)
    store = StateStore(str(tmp_path), "job", "e" * 64, every=8)
    for s in states:
        store.save(s["step"], s)
    got = store.load_at_or_before(13)
    assert got is not None
    assert got[0] == 13
    assert same(got[1], states[13])
    from .planner_util import config

    assert Planner(config(dp=64), state=got[1]).state_dict() == states[13]  # a planner restores from it
    kinds = sorted(n.rsplit(".", 1)[1] for n in os.listdir(store.dir))
    assert kinds == ["msds"] * 20
    full = sum(len(orjson.dumps(s)) for s in states)
    assert store.bytes_written < full / 2  # the carry's columns code small


def test_version_1_files_still_load_and_are_replaced_by_records(tmp_path):
    states = _planner_states(4)
    store = StateStore(str(tmp_path), "job", "d" * 64)
    os.makedirs(store.dir)
    for s in states[:3]:  # what an older msdata wrote: the whole state as JSON
        with open(os.path.join(store.dir, f"step-{s['step']:012d}.json"), "wb") as f:
            f.write(orjson.dumps(s))
    fresh = StateStore(str(tmp_path), "job", "d" * 64)
    assert same(fresh.load_at_or_before(99), (2, states[2]))
    fresh.save(2, states[2])  # the same step again: the record replaces the JSON file
    fresh.save(3, states[3])
    names = sorted(os.listdir(store.dir))
    assert names == [
        "step-000000000000.json",
        "step-000000000001.json",
        "step-000000000002.msds",
        "step-000000000003.msds",
    ]
    again = StateStore(str(tmp_path), "job", "d" * 64)
    for s in states:
        assert same(again.load_at_or_before(s["step"]), (s["step"], s))


def test_a_delta_never_composes_with_a_rewritten_or_corrupt_base(tmp_path, caplog):
    states = _planner_states(6)
    store = StateStore(str(tmp_path), "job", "c" * 64, every=4)
    for s in states:
        store.save(s["step"], s)  # bases at 0 and 4, deltas 1-3 and 5
    # another run rewrites the base of step 4 with another state: step 5's delta no longer belongs to it
    other = dict(states[4], cursor=[x + 1 for x in states[4]["cursor"]])
    with open(os.path.join(store.dir, "step-000000000004.msds"), "wb") as f:
        f.write(encode_base(4, other))
    fresh = StateStore(str(tmp_path), "job", "c" * 64)
    assert same(fresh.load_at_or_before(5), (4, other))
    assert "base (step 4) is missing or was rewritten" in caplog.text
    with open(os.path.join(store.dir, "step-000000000004.msds"), "wb") as f:
        f.write(b"MSDS\x02torn")
    assert same(StateStore(str(tmp_path), "job", "c" * 64).load_at_or_before(5), (3, states[3]))
    assert "corrupt planner state record" in caplog.text
    with open(os.path.join(store.dir, "step-000000000003.msds"), "wb") as f:
        f.write(b"MSDS\x09" + b"x")
    with pytest.raises(Exception, match="version 9 is newer than this msdata"):
        decode(b"MSDS\x09x", "here")
    assert same(StateStore(str(tmp_path), "job", "c" * 64).load_at_or_before(5), (2, states[2]))


def test_a_delta_names_its_base_and_its_base_crc():
    a, b = {"step": 0, "x": [1, 2]}, {"step": 1, "x": [1, 2], "y": 3}
    base = encode_base(0, a)
    rec = decode(encode_delta(1, b, 0, a, base), "t")
    assert rec.base == 0
    assert rec.changed == {"step": 1, "y": 3}
    assert rec.removed == ()
    assert same(compose(rec, decode(base, "t"), base, "t"), b)


def test_etcd_store_composes_deltas_and_reads_version_1_values(etcd_server):
    from msdata_server.cluster import Etcd, LeaderElection, Membership
    from msdata_server.cluster.leader.statestore import EtcdStateStore

    prefix = "/t" + secrets.token_hex(4)
    states = _planner_states(12)

    async def main():
        async with Etcd([etcd_server.url]) as etcd:
            m = Membership(etcd, node_id="n0", prefix=prefix, ttl=1.0)
            e = LeaderElection(etcd, m)
            await m.start()
            await e.start()
            await e.wait_leader()
            store = EtcdStateStore(etcd, e, prefix=prefix, job="j", digest="ab" * 32, keep=4, every=4)
            for s in states:
                assert await store.save(s["step"], s)
            steps = await store.steps()
            loaded = {s: await store.load_at_or_before(s) for s in range(5, 12)}
            # a value that an older msdata wrote (the whole state as JSON) loads as it is
            await etcd.put(store.base + f"{12:012d}", orjson.dumps(dict(states[11], step=12)))
            legacy = await store.load_at_or_before(None)
            written = store.bytes_written
            await e.aclose()
            await m.aclose()
            return steps, loaded, legacy, written

    steps, loaded, legacy, written = asyncio.run(main())
    assert steps == list(range(5, 12))  # keep + every - 1 steps: the newest 4 and their base (8) among them
    for s in range(8, 12):
        assert same(loaded[s], (s, states[s]))
    assert same(legacy, (12, dict(states[11], step=12)))
    assert written < sum(len(orjson.dumps(s)) for s in states) / 2
