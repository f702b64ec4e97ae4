"""The etcd client, membership and leader election, against a real etcd on loopback (tests/etcd_fixture.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets

import pytest

from msdata_server.cluster import Compare, Etcd, EtcdError, EtcdUnavailable, Fence, LeaderElection, Membership, Op
from msdata_server.config import ClusterConfig, NodeConfig, ServerConfig
from msdata_server.errors import ClosedError, ConfigError

from .aio import LOOPS, run
from .etcd_fixture import _reserve_port

TTL = 1.0


def prefix() -> str:
    return "/t" + secrets.token_hex(4)


# ---- the client ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loop", LOOPS)
def test_put_get_delete_with_prefixes(etcd_server, loop):
    p = prefix()

    async def main():
        async with Etcd([etcd_server.url]) as etcd:
            r1 = await etcd.put(f"{p}/b", "2")
            r2 = await etcd.put(f"{p}/a", b"\x00\xff")
            await etcd.put(f"{p}x", "outside")  # shares the string prefix but not the "dir/"
            assert r2 == r1 + 1
            kvs = await etcd.get(f"{p}/", prefix=True)
            assert [(kv.key, kv.value) for kv in kvs] == [(f"{p}/a".encode(), b"\x00\xff"), (f"{p}/b".encode(), b"2")]
            assert kvs[0].create_revision == kvs[0].mod_revision == r2
            assert kvs[0].version == 1
            assert kvs[0].lease == 0
            _, rev = await etcd.get_with_revision(f"{p}/a")
            assert rev >= r2 + 1
            assert await etcd.get(f"{p}/none") == []
            assert await etcd.delete(f"{p}/", prefix=True) == 2
            assert await etcd.get(f"{p}/", prefix=True) == []
            assert [kv.value for kv in await etcd.get(p, prefix=True)] == [b"outside"]
            assert await etcd.delete(f"{p}x") == 1

    run(main(), loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_txn_create_if_absent_and_put_if_mod_revision(etcd_server, loop):
    p = prefix()

    async def main():
        async with Etcd(etcd_server.url) as etcd:
            k = f"{p}/k"
            first = await etcd.txn([Compare(k, "create", "==", 0)], [Op.put(k, "one")], [Op.get(k)])
            assert first.succeeded
            assert first.responses == [first.revision]
            second = await etcd.txn([Compare(k, "create", "==", 0)], [Op.put(k, "two")], [Op.get(k)])
            assert not second.succeeded
            (kv,) = second.responses[0]
            assert kv.value == b"one"
            assert kv.create_revision == first.revision
            # "put if key k still has mod_revision R": succeeds once, then R is stale
            ok = await etcd.txn([Compare(k, "mod", "==", kv.mod_revision)], [Op.put(k, "three")])
            stale = await etcd.txn([Compare(k, "mod", "==", kv.mod_revision)], [Op.put(k, "four")])
            assert ok.succeeded
            assert not stale.succeeded
            assert (await etcd.get(k))[0].value == b"three"
            by_value = await etcd.txn([Compare(k, "value", "==", "three")], [Op.delete(k)])
            assert by_value.succeeded
            assert by_value.responses == [1]
            with pytest.raises(ValueError, match="target 'nope'"):
                Compare(k, "nope", "==", 0)

    run(main(), loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_lease_binds_keys_keepalive_and_revoke(etcd_server, loop):
    p = prefix()

    async def main():
        async with Etcd(etcd_server.url) as etcd:
            lease = await etcd.lease_grant(TTL)
            await etcd.put(f"{p}/node", "x", lease=lease)
            assert (await etcd.get(f"{p}/node"))[0].lease == lease
            assert await etcd.lease_keepalive_once(lease) >= TTL
            assert await etcd.lease_revoke(lease) is True
            assert await etcd.get(f"{p}/node") == []  # the key went with the lease
            assert await etcd.lease_keepalive_once(lease) <= 0
            assert await etcd.lease_revoke(lease) is False
            with pytest.raises(EtcdError, match="lease not found") as ei:
                await etcd.put(f"{p}/node", "x", lease=lease)
            assert ei.value.code == 5
            assert not isinstance(ei.value, EtcdUnavailable)

    run(main(), loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_watch_from_revision_and_compaction(etcd_server, loop):
    p = prefix()

    async def main():
        async with Etcd(etcd_server.url) as etcd:
            _, rev = await etcd.get_with_revision(p)
            async with contextlib.aclosing(etcd.watch(f"{p}/", prefix=True, start_revision=rev + 1)) as w:
                assert await anext(w) == []  # created: a readiness signal
                await etcd.put(f"{p}/a", "1")
                await etcd.put(f"{p}/b", "2")
                await etcd.delete(f"{p}/a")
                seen = []
                while len(seen) < 3:
                    seen += await anext(w)
            assert [(e.type, e.kv.key, e.kv.value) for e in seen] == [
                ("put", f"{p}/a".encode(), b"1"),
                ("put", f"{p}/b".encode(), b"2"),
                ("delete", f"{p}/a".encode(), b""),
            ]
            # a watch from the past replays history; once compacted it is refused with the fix in the message
            async with contextlib.aclosing(etcd.watch(f"{p}/a", start_revision=rev + 1)) as w:
                assert await anext(w) == []
                assert [e.type for e in await anext(w)] == ["put", "delete"]
            await etcd._call("/v3/kv/compaction", {"revision": str(seen[-1].kv.mod_revision)})
            with pytest.raises(EtcdError, match="compacted"):  # noqa: PT012  (raised while the watch iterates)
                async with contextlib.aclosing(etcd.watch(f"{p}/a", start_revision=rev + 1)) as w:
                    async for _ in w:
                        pass

    run(main(), loop)


def test_failover_unavailable_timeout_and_closed(etcd_server):
    dead = f"http://127.0.0.1:{_reserve_port()}"

    async def silent(reader, writer):  # accepts, never answers: a hung member
        await reader.read()
        writer.close()

    async def garbage(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await reader.read()
        writer.close()

    async def main():
        async with Etcd([dead, etcd_server.url]) as etcd:  # the first endpoint refuses: the next one serves
            assert await etcd.put(prefix(), "v") > 0
            assert etcd.urls[etcd._current] == etcd_server.url
        async with Etcd([dead, f"http://127.0.0.1:{_reserve_port()}"]) as etcd:
            with pytest.raises(EtcdUnavailable, match="no etcd endpoint answered"):
                await etcd.get("k")
        hung = await asyncio.start_server(silent, "127.0.0.1", 0)
        bad = await asyncio.start_server(garbage, "127.0.0.1", 0)
        async with hung, bad:
            async with Etcd(f"http://127.0.0.1:{hung.sockets[0].getsockname()[1]}", timeout=0.2) as etcd:
                with pytest.raises(EtcdUnavailable, match=r"did not answer /v3/kv/range within 0.2s"):
                    await etcd.get("k")
            async with Etcd(f"http://127.0.0.1:{bad.sockets[0].getsockname()[1]}") as etcd:
                with pytest.raises(EtcdError, match="malformed status line"):
                    await etcd.get("k")
        etcd = Etcd(etcd_server.url)
        await etcd.aclose()
        with pytest.raises(ClosedError):
            await etcd.get("k")
        with pytest.raises(ConfigError, match="must look like"):
            Etcd("127.0.0.1:2379")

    run(main(), "uvloop")


def test_pooled_connection_survives_an_etcd_restart(fresh_etcd):
    async def main():
        async with Etcd(fresh_etcd.url) as etcd:
            await etcd.put("/k", "1")
            assert len(etcd._idle) == 1  # kept alive
            fresh_etcd.stop()
            fresh_etcd.start()
            await etcd.put("/k", "2")  # the stale pooled connection is dropped and a fresh one used
            assert (await etcd.get("/k"))[0].value == b"2"

    run(main(), "uvloop")


# ---- membership and election ----------------------------------------------------------------------------------
class Node:
    def __init__(self, url: str, p: str, i: int, ttl: float = TTL):
        self.id = f"n{i}"
        self.etcd = Etcd(url, timeout=1.0)
        self.m = Membership(self.etcd, node_id=self.id, prefix=p, ttl=ttl, info={"listen": f"127.0.0.1:{7000 + i}"})
        self.e = LeaderElection(self.etcd, self.m)

    async def start(self) -> Node:
        await self.m.start()
        await self.e.start()
        return self

    async def aclose(self) -> None:
        await self.e.aclose()
        await self.m.aclose()
        await self.etcd.aclose()


class Log:
    """Every role change of every node, with the loop time; checks at each one that at most one node leads."""

    def __init__(self, nodes: list[Node]):
        self.nodes = nodes
        self.loop = asyncio.get_running_loop()
        self.records: list[tuple[float, str, str, int | None]] = []
        self.max_leaders = 0
        self.changed = asyncio.Event()
        for n in nodes:
            n.e.on_change(lambda role, _who, token, n=n: self._record(n, role, token))
            n.m.on_change(lambda _event: self.changed.set())

    def _record(self, n: Node, role: str, token: int | None) -> None:
        self.records.append((self.loop.time(), n.id, role, token if role == "leader" else None))
        self.max_leaders = max(self.max_leaders, len(self.leaders()))
        self.changed.set()

    def leaders(self) -> list[Node]:
        return [n for n in self.nodes if n.e.role == "leader"]

    async def until(self, pred, timeout: float = 10 * TTL):  # noqa: ASYNC109  (event-based, its own deadline)
        async with asyncio.timeout(timeout):
            while not (v := pred()):
                self.changed.clear()
                await self.changed.wait()
        return v

    def stable_leader(self, among: list[Node] | None = None) -> Node | None:
        """The one leader when every node (of ``among``) agrees on it."""
        ls = self.leaders()
        if len(ls) == 1 and all(
            n.e.leader_id == ls[0].id and n.e.leader_token == ls[0].e.token for n in among or self.nodes
        ):
            return ls[0]
        return None

    def intervals(self, end: float) -> list[tuple[float, float, str, int]]:
        out, open_ = [], {}
        for t, who, role, token in self.records:
            if role == "leader" and who not in open_:
                open_[who] = (t, token)
            elif role != "leader" and who in open_:
                t0, tok = open_.pop(who)
                out.append((t0, t, who, tok))
        out += [(t0, end, who, tok) for who, (t0, tok) in open_.items()]
        return sorted(out)

    def assert_never_two_leaders(self) -> None:
        assert self.max_leaders <= 1
        iv = self.intervals(self.loop.time())
        for (_s0, e0, w0, t0), (s1, _e1, w1, t1) in itertools.pairwise(iv):
            assert e0 <= s1, f"{w0} led until {e0:.3f} but {w1} from {s1:.3f}: {iv}"
            assert t1 >= t0, f"token went back from {t0} to {t1}: {iv}"


async def cluster(url: str, n: int = 3) -> tuple[list[Node], Log, str]:
    p = prefix()
    nodes = [Node(url, p, i) for i in range(n)]
    log = Log(nodes)
    for node in nodes:
        await node.start()
    return nodes, log, p


async def close_all(nodes: list[Node]) -> None:
    for n in sorted(nodes, key=lambda n: n.e.role == "leader"):  # the leader last: no hand-over churn
        await n.aclose()


@pytest.mark.parametrize("loop", LOOPS)
def test_membership_registers_and_leaves(etcd_server, loop):
    async def main():
        p = prefix()
        a, b = Node(etcd_server.url, p, 0), Node(etcd_server.url, p, 1)
        await a.m.start()
        await b.m.start()
        members = await a.m.members()
        assert sorted(members) == ["n0", "n1"]
        assert members["n1"]["listen"] == "127.0.0.1:7001"
        assert members["n0"]["pid"] > 0
        assert a.m.alive
        assert a.m.lease_id != b.m.lease_id
        await b.aclose()  # revokes its lease: the registration goes at once, not after the TTL
        assert sorted(await a.m.members()) == ["n0"]
        await a.aclose()
        await a.aclose()  # idempotent
        async with Etcd(etcd_server.url) as etcd:
            assert await etcd.get(f"{p}/", prefix=True) == []

    run(main(), loop)


def test_membership_from_config_and_validation(etcd_server):
    async def main():
        async with Etcd(etcd_server.url) as etcd:
            cfg = ServerConfig(
                node=NodeConfig(id="node-7", listen="127.0.0.1:7460"),
                cluster=ClusterConfig(etcd=(etcd_server.url,), token_file="/x", lease_ttl=2.5, prefix=prefix()),
            )
            m = Membership.from_config(etcd, cfg, jobs=0)
            assert (m.node_id, m.ttl, m.info["listen"], m.info["jobs"]) == ("node-7", 2.5, "127.0.0.1:7460", 0)
            with pytest.raises(ConfigError, match=r"lease ttl=0.5"):
                Membership(etcd, node_id="a", ttl=0.5)
            with pytest.raises(ConfigError, match="without '/'"):
                Membership(etcd, node_id="a/b")
            with pytest.raises(ConfigError, match=r"\[cluster\] table"):
                Membership.from_config(etcd, ServerConfig(node=NodeConfig(id="x")))

    run(main(), "uvloop")


def test_one_leader_then_failover_when_its_lease_dies(etcd_server):
    async def main():
        nodes, log, p = await cluster(etcd_server.url)
        try:
            leader = await log.until(log.stable_leader)
            token = leader.e.token
            assert isinstance(token, int)
            assert token > 0
            assert [n.e.role for n in nodes].count("leader") == 1
            assert await nodes[0].e.wait_leader() == leader.id
            assert await leader.e.put_fenced(f"{p}/plan", "from-first")
            follower = next(n for n in nodes if n is not leader)
            assert not await follower.e.put_fenced(f"{p}/plan", "from-follower")

            # kill the leader's lease behind its back (as an expiry would)
            async with Etcd(etcd_server.url) as admin:
                old_lease = leader.m.lease_id
                await admin.lease_revoke(old_lease)
                # whatever the old leader believes right now, its fenced write cannot land
                assert not await leader.e.put_fenced(f"{p}/plan", "stale")
                new = await log.until(lambda: (x := log.stable_leader()) and x.e.token != token and x)
                assert new.e.token > token
                assert leader.e.role == "follower" or leader is new
                stale = await admin.txn([Compare(f"{p}/leader", "create", "==", token)], [Op.put(f"{p}/plan", "x")])
                assert not stale.succeeded
                assert await new.e.put_fenced(f"{p}/plan", "from-second")
                assert (await admin.get(f"{p}/plan"))[0].value == b"from-second"
                # the node that lost its lease rejoins under a new one
                await log.until(lambda: leader.m.lease_id not in (None, old_lease))
                assert sorted(await new.m.members()) == ["n0", "n1", "n2"]
            fence = Fence()
            assert fence.admit(token)
            assert fence.admit(new.e.token)
            assert not fence.admit(token)
        finally:
            await close_all(nodes)

    run(main(), "uvloop")


def test_partitioned_leader_steps_down_before_another_wins(etcd_server):
    """The leader stops reaching etcd (its requests hang) while the others still do."""

    async def main():
        nodes, log, p = await cluster(etcd_server.url)
        healed = asyncio.Event()
        try:
            leader = await log.until(log.stable_leader)
            token = leader.e.token
            raw = leader.etcd._raw

            async def partitioned(path, payload):
                await healed.wait()
                return await raw(path, payload)

            leader.etcd._raw = partitioned
            others = [n for n in nodes if n is not leader]
            new = await log.until(lambda: (x := log.stable_leader(others)) not in (None, leader) and x)
            assert new.e.token > token
            down = [t for t, who, role, _ in log.records if who == leader.id and role == "follower"]
            up = [t for t, who, role, _ in log.records if who == new.id and role == "leader"]
            assert down
            assert up
            assert down[-1] < up[-1]
            log.assert_never_two_leaders()
            assert not await leader.e.put_fenced(f"{p}/plan", "stale")
            healed.set()
            leader.etcd._raw = raw
            await log.until(lambda: leader.e.leader_id == new.id and leader.m.alive)
            assert leader.e.role == "follower"
            assert new.e.role == "leader"
            log.assert_never_two_leaders()
        finally:
            healed.set()
            await close_all(nodes)

    run(main(), "uvloop")


@pytest.mark.parametrize("how", ["restart", "freeze", "restart-past-ttl", "freeze-past-ttl"])
def test_etcd_outage_never_two_leaders_and_recovers(fresh_etcd, how):
    async def main():
        nodes, log, p = await cluster(fresh_etcd.url)
        try:
            leader = await log.until(log.stable_leader)
            token = leader.e.token
            if how.startswith("restart"):
                fresh_etcd.stop(9)  # SIGKILL: connections refused at once
            else:
                fresh_etcd.freeze()  # requests hang until they time out
            # the leader steps down at once (unreachable) or at the latest before its lease could expire
            await log.until(lambda: not log.leaders())
            assert leader.e.token is None
            if how.endswith("past-ttl"):  # stay down until every node has given its lease up
                await log.until(lambda: all(n.m.lease_id is None for n in nodes))
                assert not log.leaders()
            if how.startswith("restart"):
                fresh_etcd.start()
            else:
                fresh_etcd.thaw()
            again = await log.until(log.stable_leader, timeout=15 * TTL)
            # a short outage may leave the same term in place; a long one always ends it
            assert again.e.token > token if how.endswith("past-ttl") else again.e.token >= token
            log.assert_never_two_leaders()
            assert await again.e.put_fenced(f"{p}/plan", "after")
        finally:
            await close_all(nodes)

    run(main(), "uvloop")


def test_closing_leader_hands_over_at_once(etcd_server):
    async def main():
        nodes, log, _p = await cluster(etcd_server.url, n=2)
        try:
            leader = await log.until(log.stable_leader)
            other = next(n for n in nodes if n is not leader)
            await leader.aclose()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await log.until(lambda: other.e.role == "leader")
            assert loop.time() - t0 < TTL  # the key was deleted, not left to expire
            assert sorted(await other.m.members()) == [other.id]
            log.assert_never_two_leaders()
        finally:
            await close_all(nodes)

    run(main(), "uvloop")


def test_a_failing_role_callback_is_fatal_not_ignored(etcd_server):
    """A role callback that raises must not leave the node half-way into a role: the failure goes to the
    node's fatal hook (the server stops and its supervisor restarts it clean), never only to a log line."""
    from msdata_server.cluster.net.election import run_callbacks

    async def main():
        p = prefix()
        node = Node(etcd_server.url, p, 0)
        fatal: list[BaseException] = []
        seen: list[str] = []
        failed = asyncio.Event()

        def on_fatal(exc: BaseException) -> None:
            fatal.append(exc)
            failed.set()

        node.e.on_fatal = on_fatal
        node.e.on_change(lambda role, _who, _token: (_ for _ in ()).throw(RuntimeError(f"broken on {role}")))
        node.e.on_change(lambda role, _who, _token: seen.append(role))  # later callbacks still run
        await node.start()
        try:
            await node.e.wait_leader()
            async with asyncio.timeout(10 * TTL):
                await failed.wait()  # the election task runs the callbacks
            assert isinstance(fatal[0], RuntimeError)
            assert "broken on leader" in str(fatal[0])
            assert seen
            assert seen[0] == "leader"
        finally:
            await node.aclose()
        # with no handler the exception propagates to whoever fired the change
        with pytest.raises(ValueError, match="bad"):
            run_callbacks([lambda: (_ for _ in ()).throw(ValueError("bad"))], (), None, "a test")

    run(main(), "uvloop")
