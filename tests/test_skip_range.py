"""``loader.skip(steps=(A, B))`` on one node: from a state saved at S < A the run delivers S..A-1 as the plain run
does, never A..B-1, and from B on exactly what ``skip(steps=B-A)`` from the state at A delivers (``defer`` too);
a checkpoint taken between S and A carries the skip; the bounds are checked in the client and at the start."""

from __future__ import annotations

import numpy as np
import pytest

import msdata_client as msd
from msdata_server.checkpoint import start_skip
from msdata_server.errors import CheckpointError
from msdata_server.lineage.replay import replay
from msdata_server.lineage.skip import skip_pending
from msdata_server.planner import Planner

from .e2e_util import small_job
from .lineage_util import run_job
from .planner_util import MEDIANS, View, config
from .server_util import ServerProc

S, A, B, N = 1, 3, 5, 8  # state saved at S, skip A..B-1, read up to step N


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProc(str(tmp_path_factory.mktemp("srv"))).start()
    yield s
    s.stop()
    s.proc.stdout.close()


@pytest.fixture(scope="module")
def base(srv):
    """The job, its plain run of N steps, and the ranks' states saved at S and at A."""
    spec = small_job("skr", dp=2, samples=300, seed=3)
    plain, _, at_s = run_job(spec, srv.socket, N, save_at=S, lineage=False)
    _, _, at_a = run_job(spec, srv.socket, A, save_at=A, lineage=False)
    return spec, plain, at_s[0], at_a[0]


def same(got: list, want: list) -> None:
    """The same micro-batches, bit for bit (every key: tokens, sample ids, ...)."""
    assert [(s, m) for s, m, _ in got] == [(s, m) for s, m, _ in want]
    for (s, m, b1), (_, _, b2) in zip(got, want):
        assert set(b1) == set(b2)
        for k in b1:
            assert np.array_equal(b1[k].numpy(), b2[k].numpy()), (s, m, k)


@pytest.mark.parametrize("defer", [False, True])
def test_range_skips_only_a_to_b(srv, base, defer):
    spec, plain, at_s, at_a = base
    ref, _, ref_state = run_job(
        spec, srv.socket, N - B, state=at_a, skip={"steps": B - A, "defer": defer}, save_at=1, lineage=False
    )
    got, lin, got_state = run_job(
        spec,
        srv.socket,
        (A - S) + (N - B),
        state=at_s,
        skip={"steps": (A, B), "defer": defer},
        save_at=A - S + 1,
        ask=range(A, B),
    )
    for r in got:
        assert sorted({s for s, _, _ in got[r]}) == [*range(S, A), *range(B, N)]
        same([x for x in got[r] if x[0] < A], [x for x in plain[r] if S <= x[0] < A])
        same([x for x in got[r] if x[0] >= B], ref[r])
        for step in range(A, B):  # lineage of the skipped steps: replayed by the server, flagged skipped
            assert lin[r][step]
            assert all(x["skipped"] for x in lin[r][step])
        assert not any(x["skipped"] for s in range(S, A) for x in lin[r][s])
    # the state after B is the one skip(steps=B-A) from A reaches (skips recorded, deferred pieces, counts)
    assert got_state[0]["planner"] == ref_state[0]["planner"]
    assert got_state[0]["planner"]["skips"] == [[A, B]]
    assert "pending_skip" not in got_state[0]["planner"]


def test_a_checkpoint_before_a_carries_the_skip(srv, base):
    spec, _plain, at_s, _at_a = base
    whole, _, mid = run_job(spec, srv.socket, (A - S) + (N - B), state=at_s, skip={"steps": (A, B)}, save_at=1)
    assert mid[0]["planner"]["pending_skip"] == {"start": A, "stop": B, "defer": False}
    assert "skip" not in mid[0]  # the planner state carries it: a plain load resumes with the skip
    rest, _, _ = run_job(spec, srv.socket, (A - S - 1) + (N - B), state=mid[0], lineage=False)
    for r in rest:
        assert sorted({s for s, _, _ in rest[r]}) == [*range(S + 1, A), *range(B, N)]
        same(rest[r], [x for x in whole[r] if x[0] >= S + 1])


def test_a_state_saved_at_a_is_skip_of_b_minus_a(srv, base):
    spec, _plain, _at_s, at_a = base
    ref, _, _ = run_job(spec, srv.socket, N - B, state=at_a, skip={"steps": B - A}, lineage=False)
    got, _, _ = run_job(spec, srv.socket, N - B, state=at_a, skip={"steps": (A, B)}, lineage=False)
    for r in got:
        same(got[r], ref[r])


def test_range_misuse_is_refused(base):
    spec, _plain, _at_s, at_a = base
    with msd.DataClient(spec, endpoint="/nonexistent.sock", rank=0, world_size=2) as dc:
        dc.load_state_dict(at_a)
        with pytest.raises(msd.errors.CheckpointError, match=rf"state is at step {A}, past step {S}"):
            dc.skip(steps=(S, B))
        with pytest.raises(msd.errors.ConfigError, match="A must be below B"):
            dc.skip(steps=(B, A))
        with pytest.raises(msd.errors.ConfigError, match="A must be below B"):
            dc.skip(steps=(A, A))
        with pytest.raises(msd.errors.ConfigError, match=r"two ints >= 0"):
            dc.skip(steps=(A, B, 9))
        dc.skip(steps=(A, B), defer=True)
        assert dc.state_dict()["skip"] == {"start": A, "stop": B, "defer": True}


def test_the_start_rule_places_the_range():
    planner = {"step": S, "cursor": [0]}
    assert start_skip({"planner": planner, "skip": {"start": S, "stop": B, "defer": True}}) == (planner, B - S, True)
    got = start_skip({"planner": planner, "skip": {"start": A, "stop": B, "defer": False}})
    assert got == ({**planner, "pending_skip": {"start": A, "stop": B, "defer": False}}, 0, False)
    with pytest.raises(CheckpointError, match=f"already past step {S - 1}"):  # an edited state the client never made
        start_skip({"planner": {"step": S}, "skip": {"start": S - 1, "stop": B, "defer": False}})
    with pytest.raises(CheckpointError, match="A must be below B"):
        start_skip({"planner": planner, "skip": {"start": B, "stop": A, "defer": False}})


@pytest.mark.parametrize("defer", [False, True])
def test_every_state_kept_for_a_skipped_step_plans_the_skip_again(defer):
    """A new leader re-plans from the newest state at or before the first step a node lacks, a rejoining node's
    catch-up and lineage likewise: from the state kept for any step of A..B-1 the plans from B on are the job's,
    and A..B-1 come back skipped (a state taken inside the range would deliver them and forget the skip)."""
    cfg, view, sizes = config(), View(MEDIANS), [5000, 3000, 2000, 800]
    planner = Planner(cfg)
    for _ in range(A):
        planner.plan_step(view)
    planner = Planner(cfg, state={**planner.state_dict(), "pending_skip": {"start": A, "stop": B, "defer": defer}})
    skipped, states, _ = skip_pending(planner, view, sizes)
    assert [p.step for p in skipped] == sorted(states) == list(range(A, B))
    after = [planner.plan_step(view) for _ in range(3)]
    for k, state in states.items():
        again = Planner(cfg, state=state)
        redo, _, _ = skip_pending(again, view, sizes)
        assert [p.step for p in redo] == list(range(A, B)), f"the state kept for step {k} forgot the skip"
        for want, got in zip(after, replay(cfg, state, view, B, B + 3, sizes=sizes), strict=True):
            assert got.step == want.step
            for key in ("source", "ordinal", "offset", "length", "group", "micro", "row"):
                assert np.array_equal(getattr(got, key), getattr(want, key)), (k, want.step, key)
