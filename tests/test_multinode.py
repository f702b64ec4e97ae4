"""Several node servers on loopback with a real etcd: election, roles, peer links, failover of the leader,
restarts, wrong tokens, malformed peer frames, etcd going away; and the pure placement function."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msdata_server.cluster.net.peers import AuthError, PeerLink
from msdata_server.cluster.placement import place, place_sources
from msdata_server.errors import ConfigError

from .cluster_util import TTL, node_status
from .polling import wait_for
from .server_util import ServerProc


def cli_status(sock: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "msdata_server", "status", "--endpoint", sock, "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


# ---- election, roles, failover, restart ----------------------------------------------------------------
def test_three_nodes_one_leader_failover_and_rejoin(etcd_server, cluster_factory):
    c = cluster_factory(etcd_server.url).start()
    alive = set(c.nodes)
    leader, token = wait_for(lambda: c.settled(alive), 30, "one leader that every node agrees on")
    roles = {nid: cli_status(srv.socket)["role"] for nid, srv in c.nodes.items()}
    assert sorted(roles.values()) == ["follower", "follower", "leader"]
    assert roles[leader] == "leader"
    assert token is not None
    assert token > 0

    # SIGKILL the leader: no goodbye, its lease must expire; another node leads with a larger token
    t0 = time.monotonic()
    c.nodes[leader].kill()
    alive.discard(leader)
    leader2, token2 = wait_for(lambda: c.settled(alive), 6 * TTL, "a new leader after the old one was killed")
    took = time.monotonic() - t0
    assert leader2 != leader
    assert token2 > token
    assert took < 4 * TTL, f"failover took {took:.1f}s with a {TTL}s lease"

    # the killed node restarts and rejoins as a follower; the leader stays
    c.nodes[leader].start()
    alive.add(leader)
    leader3, token3 = wait_for(lambda: c.settled(alive), 30, "the restarted node to rejoin")
    assert (leader3, token3) == (leader2, token2)
    assert c.statuses()[leader]["role"] == "follower"

    # a graceful stop of the leader hands over at once (the key is deleted, not left to expire)
    t0 = time.monotonic()
    assert c.nodes[leader2].stop() == 0
    alive.discard(leader2)
    leader4, token4 = wait_for(lambda: c.settled(alive), 6 * TTL, "a new leader after a graceful stop")
    assert leader4 != leader2
    assert token4 > token2
    assert time.monotonic() - t0 < 2 * TTL + 3  # no lease expiry to wait for (plus process shutdown)


def test_single_node_without_cluster_is_its_own_leader(server_factory):
    srv = server_factory().start()
    st = cli_status(srv.socket)
    assert st["role"] == "single"
    assert "cluster" not in st
    assert srv.ready["listen"] is None


# ---- peers: wrong token, malformed frames ----------------------------------------------------------------
def _peer_addr(srv: ServerProc) -> tuple[str, int]:
    host, _, port = srv.ready["listen"].rpartition(":")
    return host, int(port)


def test_peer_with_wrong_token_is_rejected(etcd_server, cluster_factory):
    c = cluster_factory(etcd_server.url, n=1).start()
    wait_for(lambda: c.settled({"node-0"}), 30, "the only node to lead")  # else it may answer as a follower
    srv = c.nodes["node-0"]
    host, port = _peer_addr(srv)
    good = c.token_file.read_text().strip()

    async def main():
        with pytest.raises(AuthError):
            await PeerLink.connect(host, port, token="x" * 32, node_id="intruder")
        got = asyncio.get_running_loop().create_future()

        def on(peer, frame, payload):
            if not got.done():
                got.set_result(frame)

        link = await PeerLink.connect(host, port, token=good, node_id="friend", handler=on)
        await link.send({"t": "ping", "id": 7})
        frame = await asyncio.wait_for(got, 10)
        await link.aclose()
        return frame

    frame = asyncio.run(main())
    assert frame == {"t": "pong", "id": 7, "node": "node-0", "role": "leader"}
    assert "intruder" not in node_status(srv.socket)["cluster"]["incoming"]
    assert "token" in srv.log() or "auth" in srv.log().lower()


@pytest.mark.parametrize(
    "bad",
    [
        b"\xff\xff\xff\xff" + b"x" * 64,  # absurd length
        b"\x00\x00\x00\x05{{{{{",  # not JSON
        b"\x00\x00\x00\x0b" + b'{"t":"ping"}'[:11],  # a frame before the handshake
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # someone else's protocol
    ],
)
def test_malformed_peer_frames_close_only_that_connection(etcd_server, cluster_factory, bad):
    c = cluster_factory(etcd_server.url, n=2).start()
    alive = set(c.nodes)
    leader, token = wait_for(lambda: c.settled(alive), 30, "two linked nodes")
    for srv in c.nodes.values():
        with socket.create_connection(_peer_addr(srv), timeout=10) as s:
            s.sendall(bad)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(10)
            while True:  # the server closes the connection (we read until EOF; whatever it sent is dropped)
                try:
                    if not s.recv(4096):
                        break
                except ConnectionResetError:
                    break
    # both servers are alive, the election and the real links are untouched
    assert c.settled(alive) == (leader, token)
    assert all(srv.proc.poll() is None for srv in c.nodes.values())


# ---- etcd unreachable ------------------------------------------------------------------------------------
def test_etcd_restart_never_two_leaders_and_recovers(fresh_etcd, cluster_factory):
    c = cluster_factory(fresh_etcd.url).start()
    alive = set(c.nodes)
    leader, token = wait_for(lambda: c.settled(alive), 30, "a leader")
    fresh_etcd.stop(signal.SIGKILL)

    def nobody_leads():
        sts = c.statuses()
        lead = [nid for nid, st in sts.items() if st["role"] == "leader"]
        assert len(lead) <= 1, f"two leaders at once: {lead}"
        return not lead

    wait_for(nobody_leads, 3 * TTL, "the leader to step down while etcd is away")
    for _ in range(10):  # etcd is still down: nobody may lead
        assert nobody_leads()
    fresh_etcd.start()
    seen = []

    def recovered():
        sts = c.statuses()
        lead = [(nid, st["cluster"]["token"]) for nid, st in sts.items() if st["role"] == "leader"]
        seen.append(lead)
        assert len(lead) <= 1, f"two leaders at once: {lead}"
        return c.settled(alive)

    leader2, token2 = wait_for(recovered, 10 * TTL, "a leader after etcd came back")
    # the same leader may resume under its old key (its lease outlived etcd's pause); anyone else needs a new key
    assert token2 > token or (leader2, token2) == (leader, token)
    assert all(len(x) <= 1 for x in seen)


# ---- placement (pure) ----------------------------------------------------------------------------------
def test_place_round_robin_over_sorted_ids():
    assert place(5, ["c", "a", "b"]) == ["a", "b", "c", "a", "b"]
    assert place(0, ["a"]) == []
    with pytest.raises(ConfigError, match="at least one live node"):
        place(3, [])
    with pytest.raises(ConfigError, match="n_partitions=-1"):
        place(-1, ["a"])


@settings(max_examples=60, deadline=None)
@given(
    parts=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    nodes=st.sets(st.sampled_from([f"n{i}" for i in range(8)]), min_size=1, max_size=8),
    costs=st.none() | st.lists(st.floats(0, 100), min_size=5, max_size=5),
)
def test_place_sources_is_fair_and_a_function_of_the_member_set(parts, nodes, costs):
    cost = None if costs is None else costs[: len(parts)]
    out = place_sources(parts, list(nodes), cost)
    assert out == place_sources(parts, sorted(nodes, reverse=True), cost)  # order of the member list is irrelevant
    assert [len(x) for x in out] == parts
    assert {n for x in out for n in x} <= nodes
    load = {n: 0.0 for n in nodes}
    for s, x in enumerate(out):
        for n in x:
            load[n] += 1.0 if cost is None else cost[s]
    biggest = 1.0 if cost is None else max(cost, default=0.0)
    assert max(load.values()) - min(load.values()) <= biggest + 1e-9


def test_place_sources_reassigns_when_a_node_leaves():
    before = place_sources([3, 2], ["a", "b", "c"])
    after = place_sources([3, 2], ["a", "c"])
    assert before == [["a", "b", "c"], ["a", "b"]]
    assert after == [["a", "c", "a"], ["c", "a"]]
    assert "b" not in {n for x in after for n in x}


def test_mixture_weighted_placement_spreads_the_reading_work_when_a_node_leaves():
    """Four sources with shares .5/.3/.15/.05, three partitions each (placed when three nodes ran the job), two
    nodes left: dealt by count, one node reads 55% of the tokens; weighted by the mixture, within 2% of half."""
    from msdata_client.graph import MixSpec
    from msdata_server.cluster.placement import partition_costs

    names = ["a", "b", "c", "d"]
    mix = MixSpec(weights={"a": 5, "b": 3, "c": 1.5, "d": 0.5})  # shares are normalised
    cost = partition_costs(mix, names, 3)
    assert cost == pytest.approx([0.5 / 3, 0.3 / 3, 0.15 / 3, 0.05 / 3])

    def worst(out):
        load: dict[str, float] = {}
        for s, row in enumerate(out):
            for n in row:
                load[n] = load.get(n, 0.0) + cost[s]
        return max(load.values()) / (sum(load.values()) / len(load))

    assert worst(place_sources([3] * 4, ["n0", "n1", "n2"], cost)) == pytest.approx(1.0)
    by_count = worst(place_sources([3] * 4, ["n0", "n2"]))
    by_cost = worst(place_sources([3] * 4, ["n0", "n2"], cost))
    assert by_count == pytest.approx(1.1)
    assert by_cost <= 1.04
    assert by_cost < by_count
    # a schedule averages its points; a source off at first still gets a (small) cost, so it spreads out
    sched = MixSpec(schedule=((0, {"a": 1.0, "b": 0.0}), (100, {"a": 0.5, "b": 0.5})))
    ca, cb = partition_costs(sched, ["a", "b"], 2)
    assert ca == pytest.approx(0.75 / 2)
    assert cb == pytest.approx(0.25 / 2)
    off = partition_costs(MixSpec(weights={"a": 1.0, "b": 0.0}), ["a", "b"], 1)
    assert off[1] > 0
    spread = place_sources(
        [1, 4], ["n0", "n1", "n2", "n3"], partition_costs(MixSpec(weights={"a": 1.0, "b": 0.0}), ["a", "b"], 4)
    )
    assert len(set(spread[1])) >= 3


# ---- plans over the wire ------------------------------------------------------------------------------
def _a_plan(dp=4, steps=2):
    from msdata_server.planner import Mixture, Planner, PlannerConfig

    class View:
        def lengths(self, source, start, count):
            import numpy as np

            rng = np.random.default_rng(source * 1000003 + start)
            return rng.integers(4, 600, count).astype(np.int64)

    p = Planner(
        PlannerConfig(
            sources=("a", "b"), seq_len=512, dp=dp, micro_batches=2, mixture=Mixture.constant({"a": 0.5, "b": 0.5})
        )
    )
    return [p.plan_step(View()) for _ in range(steps)][-1]


def test_plan_frame_round_trip_is_exact():
    import numpy as np

    from msdata_server.cluster.planwire import decode_plan, encode_plan

    plan = _a_plan()
    header, buf = encode_plan(plan, job="j", digest="d" * 64, token=17)
    assert header["token"] == 17
    assert header["step"] == plan.step == 1
    got = decode_plan(orjson_round(header), memoryview(buf))
    for f in ("source", "ordinal", "offset", "length", "group", "micro", "row", "bounds"):
        a, b = getattr(plan, f), getattr(got, f)
        assert a.dtype == b.dtype, f
        assert np.array_equal(a, b), f
    assert np.array_equal(got.stats.micro_cost, plan.stats.micro_cost)
    assert got.stats.tokens == plan.stats.tokens
    assert got.stats.imbalance == plan.stats.imbalance
    assert np.array_equal(got.micro_batch(1, 1).ordinal, plan.micro_batch(1, 1).ordinal)


def orjson_round(header):
    import orjson

    return orjson.loads(orjson.dumps(header))


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda h, b: (h, b[:-8]), "does not fit"),
        (lambda h, b: ({**h, "arrays": h["arrays"][1:]}, b), "source"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "tokens"}, b), "tokens"),
    ],
)
def test_malformed_plan_frames_are_protocol_errors(mutate, why):
    from msdata_server.cluster.planwire import decode_plan, encode_plan
    from msdata_server.errors import ProtocolError

    h, b = mutate(*encode_plan(_a_plan(), job="j", digest="d" * 64, token=1))
    with pytest.raises(ProtocolError, match=f"malformed plan frame.*{why}"):
        decode_plan(h, b)


# ---- planner states in etcd, fenced ----------------------------------------------------------------------
def test_state_store_keeps_a_window_and_only_the_leader_writes(etcd_server):
    from msdata_server.cluster import Etcd, LeaderElection, Membership
    from msdata_server.cluster.leader.statestore import EtcdStateStore

    prefix = "/t" + secrets.token_hex(4)

    async def main():
        async with Etcd([etcd_server.url]) as etcd:
            ms = [Membership(etcd, node_id=f"n{i}", prefix=prefix, ttl=TTL) for i in range(2)]
            es = [LeaderElection(etcd, m) for m in ms]
            for m, e in zip(ms, es):
                await m.start()
                await e.start()
            await es[0].wait_leader()
            await es[1].wait_leader()
            lead = next(e for e in es if e.role == "leader")
            other = next(e for e in es if e is not lead)
            stores = {e: EtcdStateStore(etcd, e, prefix=prefix, job="j", digest="ab" * 32, keep=3, every=1) for e in es}
            for s in range(6):
                assert await stores[lead].save(s, {"step": s})
            assert not await stores[other].save(6, {"step": 6})  # a follower's write is refused by etcd
            steps = await stores[lead].steps()
            newest = await stores[other].load_at_or_before(None)
            at4 = await stores[other].load_at_or_before(4)
            gone = await stores[other].load_at_or_before(2)
            # the leader goes: the new one continues from the newest state, the old one can write no more
            became = asyncio.Event()
            other.on_change(lambda role, _leader, _token: role == "leader" and became.set())
            await lead.aclose()
            await lead.m.aclose()
            if other.role != "leader":
                await asyncio.wait_for(became.wait(), 10 * TTL)
            late = await stores[lead].save(6, {"step": 6})
            took_over = await stores[other].save(6, {"step": 6})
            await other.aclose()
            await other.m.aclose()
            return steps, newest, at4, gone, late, took_over

    steps, newest, at4, gone, late, took_over = asyncio.run(main())
    assert steps == [3, 4, 5]
    assert newest == (5, {"step": 5})
    assert at4 == (4, {"step": 4})
    assert gone is None
    assert late is False
    assert took_over is True


@pytest.mark.parametrize(
    "name",
    [
        "msdata_server.cluster.placement",
        "msdata_server.cluster.planwire",
        "msdata_server.cluster.net.runtime",
        "msdata_server.cluster.leader.statestore",
    ],
)
def test_new_cluster_modules_all_sorted_and_torch_free(name):
    code = (
        f"import sys, {name} as m; names = list(m.__all__); assert names == sorted(names), names; "
        "assert all(hasattr(m, n) for n in names); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).resolve().parents[1]))
