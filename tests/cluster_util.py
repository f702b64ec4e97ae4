"""A cluster of real node servers on loopback sharing an etcd, and what the cluster tests do with one: read a
node's status, run ranks spread over the nodes, pause them, send a node a frame as an outside peer."""

from __future__ import annotations

import asyncio
import secrets
import threading
from pathlib import Path

import msdata_client as msd
from msdata_client.wire import request
from msdata_server.cluster.net.peers import PeerLink

from .e2e_util import batch_record, run_ranks
from .polling import wait_for
from .server_util import ServerProc

TTL = 2.0  # the lease of each node's membership in etcd
NODES = 3  # nodes in the clusters of the job tests


def node_status(sock: str) -> dict | None:
    """The server's status over its Unix socket (None while it is down)."""
    try:
        return request(sock, {"t": "status"}, timeout=5)["status"]
    except OSError:
        return None


class Cluster:
    """N `msdata-server serve` processes sharing an etcd, a token file and a key prefix."""

    def __init__(self, base: Path, etcd_url: str, n: int, *, token: str | None = None):
        self.base = base
        self.prefix = "/t" + secrets.token_hex(4)
        self.token_file = base / "token"
        self.token_file.write_text(token or secrets.token_hex(24))
        self.token_file.chmod(0o600)  # a token open to others is refused
        self.nodes: dict[str, ServerProc] = {}
        for i in range(n):
            nid = f"node-{i}"
            d = base / nid
            d.mkdir()
            srv = ServerProc(
                str(d),
                extra=f"""
[cluster]
etcd = ["{etcd_url}"]
token_file = "{self.token_file}"
lease_ttl = {TTL}
prefix = "{self.prefix}"
""",
            )
            cfg = Path(srv.config)
            cfg.write_text(cfg.read_text().replace('id = "test-node"', f'id = "{nid}"\nlisten = "127.0.0.1:0"'))
            self.nodes[nid] = srv

    def start(self) -> Cluster:
        for srv in self.nodes.values():
            srv.start()
        return self

    def statuses(self) -> dict[str, dict]:
        out = {}
        for nid, srv in self.nodes.items():
            if srv.proc is not None and srv.proc.poll() is None:
                st = node_status(srv.socket)
                if st is not None:
                    out[nid] = st
        return out

    def settled(self, alive: set[str]):
        """The common leader once every live node agrees on it, sees every live member and links to each."""
        sts = self.statuses()
        if set(sts) != alive:
            return None
        leaders = {st["cluster"]["leader"] for st in sts.values()}
        roles = [nid for nid, st in sts.items() if st["role"] == "leader"]
        if len(leaders) != 1 or len(roles) != 1 or roles[0] not in leaders:
            return None
        for nid, status in sts.items():
            c = status["cluster"]
            if set(c["members"]) != alive or set(c["links"]) != alive - {nid}:
                return None
        return roles[0], sts[roles[0]]["cluster"]["token"]

    def stop(self) -> None:
        for srv in self.nodes.values():
            try:
                srv.stop()
            except Exception:
                srv.kill()
            if srv.proc is not None and srv.proc.stdout:
                srv.proc.stdout.close()


def spread(world: int) -> dict[int, list[int]]:
    """Rank r on node r % 3: TP pairs span nodes, so a group gets a ring on each of its nodes."""
    return {i: [r for r in range(world) if r % NODES == i] for i in range(NODES)}


def run_spread(c, spec, n: int, placement: dict[int, list[int]], **kw) -> dict[int, list]:
    """Ranks as threads, each connected to its own node's socket, all at once."""
    out, errs = {}, []

    def body(i, ranks):
        try:
            out.update(run_ranks(spec, c.nodes[f"node-{i}"].socket, n, ranks=ranks, timeout=90, **kw))
        except BaseException as e:  # reported to the test
            errs.append(e)

    threads = [threading.Thread(target=body, args=(i, rs), daemon=True) for i, rs in placement.items() if rs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a node's ranks hung"
    if errs:
        raise errs[0]
    return out


def node_ranks(
    c,
    spec,
    n: int,
    pause_at: int,
    *,
    node_of: dict[int, int] | None = None,
    rank0=None,
    connect_timeout: dict[int, float] | None = None,
    gone: int | None = None,
    together: bool = False,
    held: int | None = None,
):
    """One rank per node (rank r on node-{node_of[r]}, by default node-r), each in a thread reading n batches
    and pausing after ``pause_at`` of them until ``go`` is set. ``rank0(dc, i)`` runs before rank 0 reads
    batch i; rank ``gone`` stops at the pause (its node is about to die); ``together``: no rank leaves before
    every rank read its n batches (a training run's ranks end at one collective); ``held``: only that rank
    pauses (the others read on). Returns (got, errs, go, threads)."""
    node_of = node_of or {r: r for r in range(NODES)}
    got: dict[int, list] = {r: [] for r in range(NODES)}
    errs: dict[int, BaseException] = {}
    go = threading.Event()
    end = threading.Barrier(NODES) if together else None

    def body(r):
        try:
            dc = msd.DataClient(
                spec,
                endpoint=c.nodes[f"node-{node_of[r]}"].socket,
                rank=r,
                world_size=NODES,
                connect_timeout=(connect_timeout or {}).get(r, 60),
            )
            for i in range(n):
                if rank0 is not None and r == 0:
                    rank0(dc, i)
                if i == pause_at and held in (None, r):
                    go.wait(120)
                    if r == gone:
                        return
                b = next(dc)
                got[r].append(batch_record(b))
                del b
            if end is not None:
                end.wait(120)
            dc.close()
        except BaseException as e:  # reported to the test
            errs[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(NODES)]
    for t in threads:
        t.start()
    return got, errs, go, threads


def at_pause(got, errs, pause_at: int) -> None:
    wait_for(lambda: all(len(got[r]) == pause_at for r in range(NODES)) or errs, 90, "every rank at the pause")
    assert not errs, errs


def send_peer_frame(srv, token: str, frame: dict) -> None:
    """Connect to a node's peer port as an outside peer holding the token, send one frame, leave."""
    host, _, port = srv.ready["listen"].rpartition(":")

    async def main():
        link = await PeerLink.connect(host, int(port), token=token, node_id="tester")
        await link.send(frame)
        await link.aclose()

    asyncio.run(main())
