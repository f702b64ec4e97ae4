"""Shadow loaders after the takeover (`[job] shadow_loaders`), on real etcd and three server processes, the ranks
on two nodes and the third only owning data: (a) the owner comes back (its supervisor restarts it) while its
standbys serve its partitions; (b) a rank node's peer link to the owner breaks while the owner lives. Either way
the ranks get exactly the batches of an uninterrupted run on one node, and the layout returns: the owner reads
its partitions again and the standbys stand by again."""

from __future__ import annotations

import re
import threading

import msdata_client as msd

from .cluster_util import node_status, send_peer_frame
from .e2e_util import batch_record, run_ranks, small_job
from .polling import wait_for


def _runs(srv, job: str) -> list[dict]:
    """The node's runs of ``job`` (cluster status), [] while it is down or has none."""
    st = node_status(srv.socket) or {}
    return [r for r in st.get("cluster", {}).get("runs", []) if r["job"] == job]


def _here(srv, job: str, key: str) -> int:
    """``partitions_here``, ``shadows_here`` or ``takeovers`` of the node's runs of ``job``, summed."""
    return sum(r[key] for r in _runs(srv, job))


class _Ranks:
    """Two rank threads (one per rank node) reading ``n`` micro-batches each; each waits at every gate (a count
    of micro-batches) until the test opens it."""

    def __init__(self, spec, sockets: list[str], n: int, gates: list[int]):
        self.got: dict[int, list] = {0: [], 1: []}
        self.errs: list[BaseException] = []
        self.gates = {g: threading.Event() for g in gates}
        self._threads = [
            threading.Thread(target=self._body, args=(spec, sockets[r], r, n), daemon=True) for r in range(2)
        ]
        for t in self._threads:
            t.start()

    def _body(self, spec, sock: str, r: int, n: int) -> None:
        try:
            with msd.DataClient(spec, endpoint=sock, rank=r, world_size=2) as dc:
                for i in range(n):
                    if i in self.gates:
                        self.gates[i].wait(90)
                    self.got[r].append(batch_record(next(dc)))
        except BaseException as e:  # reported to the test
            self.errs.append(e)

    def at(self, gate: int, what: str, also=lambda: True) -> None:
        """Wait until both ranks wait at ``gate`` (and ``also()`` holds)."""
        wait_for(lambda: (all(len(x) == gate for x in self.got.values()) and also()) or self.errs, 90, what)
        assert not self.errs, self.errs

    def open(self, gate: int) -> None:
        self.gates[gate].set()

    def join(self) -> None:
        for g in self.gates.values():
            g.set()
        for t in self._threads:
            t.join(120)
            assert not t.is_alive(), "a rank hung"
        assert not self.errs, self.errs


def _setup(etcd_server, cluster_factory, server_factory, name: str, seed: int, n: int):
    spec = msd.DGraph.from_spec(small_job(name, dp=2, samples=400, seed=seed, prefetch=1)).shadow_loaders(1).plan()
    want = run_ranks(spec, server_factory().start().socket, n)
    c = cluster_factory(etcd_server.url).start()
    leader, _ = wait_for(lambda: c.settled(set(c.nodes)), 30, "one leader that every node agrees on")
    owner = next(nid for nid in sorted(c.nodes) if nid != leader)
    rank_nodes = [nid for nid in sorted(c.nodes) if nid != owner]
    return spec, want, c, owner, rank_nodes


def test_owner_back_while_its_standbys_serve_reads_its_partitions_again_exact(
    etcd_server, cluster_factory, server_factory
):
    """The owner is SIGKILLed, its standbys serve; then it is started again (as systemd would) while they do:
    it joins, the partitions are dealt afresh (the owner reads its own again, the former standbys close theirs
    and stand by again), and the ranks' batches are exactly an uninterrupted run's."""
    mb = 2
    before, mid, late, n = 3 * mb, 6 * mb, 10 * mb, 14 * mb
    spec, want, c, owner, rank_nodes = _setup(etcd_server, cluster_factory, server_factory, "shback", 31, n)
    assert spec.micro_batches == mb
    rk = _Ranks(spec, [c.nodes[nid].socket for nid in rank_nodes], n, [before, mid, late])

    def standing() -> bool:
        return sum(_here(c.nodes[nid], "shback", "shadows_here") for nid in rank_nodes) > 0

    rk.at(before, "ranks at the first pause, standbys built", standing)
    c.nodes[owner].kill()
    rk.open(before)
    rk.at(mid, "ranks fed by the standbys")
    took = sum(_here(c.nodes[nid], "shback", "takeovers") for nid in rank_nodes)
    assert took > 0, "no standby took a partition over"

    c.nodes[owner].start()  # its supervisor restarts it while the standbys serve its partitions
    wait_for(lambda: c.settled(set(c.nodes)), 60, "the owner back in the cluster, linked to every node")
    rk.open(mid)
    rk.at(late, "the owner reading its partitions again", lambda: _here(c.nodes[owner], "shback", "partitions_here"))
    assert standing(), "the former standbys do not stand by again after the owner came back"
    rk.join()
    for r in range(2):
        assert rk.got[r] == want[r], f"rank {r} saw other batches than an uninterrupted run"
    logs = "".join(c.nodes[nid].log() for nid in rank_nodes)
    assert re.search(rf"{owner} gone; \d+ partition\(s\) taken over by their standbys", logs)


def test_peer_link_broken_while_the_owner_lives_standbys_serve_then_hand_back_exact(
    etcd_server, cluster_factory, server_factory, monkeypatch
):
    """Both rank nodes' links to the owner are closed (an injected fault) while the owner runs on: each counts
    the owner as gone at once (its lease says nothing), and the owner's partitions go to their standbys (each
    has one on a rank node). The links are dialled again at once, and with them the owner counts as back: the
    layout is dealt afresh, the owner reads its partitions (it never stopped) and the standbys stand by again.
    The ranks' batches are exactly an uninterrupted run's (a payload is the same whoever reads it)."""
    monkeypatch.setenv("MSDATA_TEST_FAULTS", "1")
    mb = 2
    before, late, n = 3 * mb, 8 * mb, 12 * mb
    spec, want, c, owner, rank_nodes = _setup(etcd_server, cluster_factory, server_factory, "shlink", 37, n)
    rk = _Ranks(spec, [c.nodes[nid].socket for nid in rank_nodes], n, [before, late])

    def standing() -> bool:
        return all(_here(c.nodes[nid], "shlink", "shadows_here") for nid in rank_nodes)

    rk.at(before, "ranks at the pause, standbys built", standing)
    token = c.token_file.read_text().strip()
    gone = re.compile(rf"{owner} gone; \d+ partition\(s\) taken over")
    for nid in rank_nodes:
        srv = c.nodes[nid]
        links = srv.log().count(f"linked to peer {owner} at")
        send_peer_frame(srv, token, {"t": "fault", "node": owner, "close": True})
        wait_for(lambda srv=srv: gone.search(srv.log()), 30, "the takeover")
        wait_for(lambda srv=srv, n=links: srv.log().count(f"linked to peer {owner} at") > n, 30, "the link again")
    assert sum(_here(c.nodes[nid], "shlink", "takeovers") for nid in rank_nodes) > 0, "no standby took over"
    rk.open(before)
    rk.at(late, "ranks past the link breaks", lambda: _here(c.nodes[owner], "shlink", "partitions_here"))
    assert standing(), "the standbys do not stand by again after the links came back"
    assert c.nodes[owner].proc is not None, "the owner was to live on"
    assert c.nodes[owner].proc.poll() is None, "the owner was to live on"
    rk.join()
    for r in range(2):
        assert rk.got[r] == want[r], f"rank {r} saw other batches than an uninterrupted run"
