"""A node server's place in a cluster: membership, leader election, the peer listener and links to peers.

Built only when node.toml has a [cluster] table. The peer listener binds first, so the membership record
carries the real port (``listen = "...:0"`` works); links to the other members follow the membership prefix
through an etcd watch. Frames from a leader carry its fencing token; ``fence`` drops older ones. With
``[cluster] tls_cert``/``tls_key``/``tls_ca`` every peer link is mutual TLS and https etcd endpoints get our
client certificate (``tls.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing, suppress
from typing import TYPE_CHECKING

import orjson

from ...errors import ConfigError, PeerLostError, ProtocolError
from ...ops.logs import Once
from ...tasks import TaskSet
from .election import Fence, LeaderElection, Membership
from .etcd import Etcd, EtcdError
from .peers import AuthError, PeerLink, PeerServer, Traffic, load_token
from .tls import PeerTls, etcd_context, peer_tls

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ...config import ServerConfig
    from .election import Role

__all__ = ["ClusterNode"]

log = logging.getLogger(__name__)

FrameHandler = Callable[[str, dict, memoryview | None], Awaitable[None] | None]


class ClusterNode:
    """Etcd + Membership + LeaderElection + PeerServer + outgoing PeerLinks of one node server.

    ``members`` mirrors ``{prefix}/nodes/`` (id -> record); ``links`` holds one authenticated outgoing link per
    live member (reconnected when a member re-registers). Frames that are not handled here go to ``handler``.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        handler: FrameHandler | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.config = config
        self.node_id = config.node.id
        if config.cluster is None:
            raise ConfigError("a cluster node needs a [cluster] table in node.toml (etcd, token_file, prefix)")
        self.cc = config.cluster
        self.handler = handler
        self._warned = Once()  # frames dropped for a stale token: named once per (peer, token)
        self.on_fatal = on_fatal  # a role or lease callback failed: the node server must stop
        self.token = load_token(self.cc.token_file)
        self.tls: PeerTls | None = None
        etcd_ssl = None
        if self.cc.tls:
            self.tls = peer_tls(self.cc.tls_cert, self.cc.tls_key, self.cc.tls_ca)
            etcd_ssl = etcd_context(self.cc.tls_cert, self.cc.tls_key, self.cc.tls_ca)
            if plain := [e for e in self.cc.etcd if e.startswith("http://")]:
                log.warning(
                    "node %s: [cluster] etcd endpoints %s are plain http although tls_* are set: membership and "
                    "planner states travel in the clear; use https:// endpoints (etcd --client-cert-auth)",
                    self.node_id,
                    ",".join(plain),
                )
        self.etcd = Etcd(list(self.cc.etcd), timeout=max(1.0, self.cc.lease_ttl), ssl=etcd_ssl)
        self.traffic = Traffic()  # bytes over every peer link of this node, both ways
        self.peers = PeerServer(
            token=self.token,
            node_id=self.node_id,
            handler=self._on_frame,
            traffic=self.traffic,
            tls=self.tls.server if self.tls is not None else None,
        )
        self.membership: Membership | None = None
        self.election: LeaderElection | None = None
        self.fence = Fence()
        self.members: dict[str, dict] = {}
        self.links: dict[str, PeerLink] = {}
        self.listen = config.node.listen
        self._tasks = TaskSet("cluster")
        self._dialing: dict[str, asyncio.Task] = {}
        self.members_changed = asyncio.Event()
        self.on_link: list[Callable[[str], None]] = []  # called with the peer's id whenever a link to it is up
        self.on_link_lost: list[Callable[[str], None]] = []  # ... and whenever our link to it breaks
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen for peers, join the cluster (lease + registration), campaign, follow the member list."""
        await self.etcd.wait_reachable()  # etcd down at start: a clear error, and we join once it answers
        host, port = self.config.node.listen_addr
        bound = await self.peers.start(host, port)
        self.listen = f"{host}:{bound}"
        self.membership = Membership(
            self.etcd, node_id=self.node_id, prefix=self.cc.prefix, ttl=self.cc.lease_ttl, info={"listen": self.listen}
        )
        self.election = LeaderElection(self.etcd, self.membership)
        self.membership.on_fatal = self.election.on_fatal = self.on_fatal
        self.election.on_change(self._on_role)
        await self.membership.start()
        await self.election.start()
        self._tasks.spawn(self._follow_members(), name="members")
        log.info(
            "node %s joined the cluster (etcd %s, prefix %s, peers on %s)",
            self.node_id,
            ",".join(self.cc.etcd),
            self.cc.prefix,
            self.listen,
        )

    async def aclose(self) -> None:
        """Leave: step down (the leader key goes at once), revoke the lease, close links and the listener."""
        if self._closed:
            return
        self._closed = True
        await self._tasks.cancel_all("cluster closing")
        for t in list(self._dialing.values()):
            t.cancel()
        await asyncio.gather(*self._dialing.values(), return_exceptions=True)
        if self.election is not None:
            await self.election.aclose()
        if self.membership is not None:
            await self.membership.aclose()
        await asyncio.gather(*(link.aclose() for link in self.links.values()), return_exceptions=True)
        self.links.clear()
        await self.peers.aclose()
        await self.etcd.aclose()

    # ---- role ----------------------------------------------------------------------------------------
    @property
    def role(self) -> str:
        return self.election.role if self.election is not None else "follower"

    @property
    def leader_id(self) -> str | None:
        return self.election.leader_id if self.election is not None else None

    def _on_role(self, role: Role, leader_id: str | None, token: int | None) -> None:
        log.info("node %s: role %s (leader %s, token %s)", self.node_id, role, leader_id, token)
        if token is not None:
            self.fence.admit(int(token))

    def status(self) -> dict:
        e = self.election
        return {
            "leader": e.leader_id if e is not None else None,
            "token": e.token if e is not None else None,
            "leader_token": e.leader_token if e is not None else None,
            "listen": self.listen,
            "members": sorted(self.members),
            "links": sorted(i for i, link in self.links.items() if not link.closed.done()),
            "incoming": sorted(self.peers.links),
            "lease_alive": bool(self.membership is not None and self.membership.alive),
            "traffic": self.traffic.to_dict(),
            "tls": self.tls is not None,  # mutual TLS on every peer link
        }

    # ---- members and links ---------------------------------------------------------------------------
    async def _follow_members(self) -> None:
        """Mirror {prefix}/nodes/ (read, then watch from the next revision); retry after etcd errors."""
        prefix = f"{self.cc.prefix}/nodes/"
        backoff = self.cc.lease_ttl / 4
        while True:
            try:
                kvs, rev = await self.etcd.get_with_revision(prefix, prefix=True)
                self._set_members({kv.key.decode()[len(prefix) :]: kv.value for kv in kvs})
                async with aclosing(self.etcd.watch(prefix, prefix=True, start_revision=rev + 1)) as events:
                    async for batch in events:
                        if not batch:
                            continue
                        cur = {i: orjson.dumps(r) for i, r in self.members.items()}
                        for ev in batch:
                            nid = ev.kv.key.decode()[len(prefix) :]
                            if ev.type == "delete":
                                cur.pop(nid, None)
                            else:
                                cur[nid] = ev.kv.value
                        self._set_members(cur)
            except EtcdError as e:
                log.debug("node %s: member watch: %s; retrying", self.node_id, e)
                await asyncio.sleep(backoff)  # back-off before retrying etcd, not synchronisation

    def _set_members(self, raw: dict[str, bytes]) -> None:
        members = {}
        for nid, value in raw.items():
            try:
                rec = orjson.loads(value)
                members[nid] = rec if isinstance(rec, dict) else {}
            except orjson.JSONDecodeError:
                log.warning("ignoring malformed registration of %r", nid)
        old = self.members
        self.members = members
        moved = any(old[i].get("listen") != members[i].get("listen") for i in old if i in members)
        if set(old) != set(members) or moved:
            log.info("node %s: members %s", self.node_id, sorted(members))
            self.members_changed.set()
        for nid in list(self.links):
            if nid not in members or members[nid].get("listen") != old.get(nid, {}).get("listen"):
                link = self.links.pop(nid)
                self._tasks.spawn(link.aclose(), name=f"unlink-{nid}")
        for nid, rec in members.items():
            if nid not in self.links and rec.get("listen"):
                self._redial(nid)

    def _redial(self, nid: str) -> None:
        if self._closed or nid in self._dialing or nid == self.node_id:
            return
        t = self._tasks.spawn(self._dial(nid), name=f"dial-{nid}")
        self._dialing[nid] = t
        t.add_done_callback(lambda _t: self._dialing.pop(nid, None))

    async def _dial(self, nid: str) -> None:
        """Connect to a member, at the address its current registration gives, until linked or it leaves."""
        delay = 0.05
        while nid in self.members and nid not in self.links:
            listen = str(self.members[nid].get("listen", ""))
            host, _, port = listen.rpartition(":")
            try:
                link = await PeerLink.connect(
                    host.strip("[]"),
                    int(port),
                    token=self.token,
                    node_id=self.node_id,
                    handler=self._on_frame,
                    traffic=self.traffic,
                    tls=self.tls.client if self.tls is not None else None,
                )
            except AuthError as e:  # its token, its CA or its TLS mode differs: no retry until it re-registers
                log.error("node %s: cannot link to peer %s at %s: %s", self.node_id, nid, listen, e)
                return
            except (PeerLostError, ProtocolError, ValueError) as e:
                log.debug("node %s: peer %s at %s: %s; retrying", self.node_id, nid, listen, e)
                await asyncio.sleep(delay)  # back-off between connection attempts
                delay = min(delay * 2, self.cc.lease_ttl / 2)
                continue
            if link.peer_id != nid or self.members.get(nid, {}).get("listen") != listen:
                log.warning(
                    "node %s: %s answered as %r for %r (or moved); dropping the link",
                    self.node_id,
                    listen,
                    link.peer_id,
                    nid,
                )
                await link.aclose()
                continue
            log.info("node %s: linked to peer %s at %s", self.node_id, nid, listen)
            self._linked(nid, link)
            return

    def _linked(self, nid: str, link: PeerLink) -> None:
        self.links[nid] = link
        link.closed.add_done_callback(lambda _f: self._link_gone(nid, link))
        for cb in list(self.on_link):  # frames sent while the link was down are lost: let the job layer resend
            cb(nid)

    def _link_gone(self, nid: str, link: PeerLink) -> None:
        if self.links.get(nid) is link:
            del self.links[nid]
            for cb in list(self.on_link_lost):
                cb(nid)
            if nid in self.members:
                self._redial(nid)

    async def send(self, nid: str, frame: dict, payload: Buffer | None = None) -> None:
        """Send a frame (and a payload buffer) to a peer over our outgoing link; PeerLostError if none. A reply
        (``rep``) goes back over the peer's link to us while ours is not up: its request came that way and the
        peer waits for it (our link to a peer that just restarted comes up only after its link to us)."""
        link = self.links.get(nid)
        if (link is None or link.closed.done()) and frame.get("t") == "rep":
            link = self.peers.links.get(nid)
        if link is None or link.closed.done():
            raise PeerLostError(f"no link to peer {nid!r} (members {sorted(self.members)})")
        if payload is None:
            await link.send(frame)
        else:
            await link.send_payload(frame, payload)

    # ---- incoming ------------------------------------------------------------------------------------
    async def _on_frame(self, peer_id: str, frame: dict, payload: memoryview | None) -> None:
        t = frame.get("t")
        if t == "ping":
            link = self.peers.links.get(peer_id)
            if link is not None:
                with suppress(PeerLostError, ConnectionError):
                    await link.send({"t": "pong", "id": frame.get("id"), "node": self.node_id, "role": self.role})
            return
        tok = frame.get("token")
        if tok is not None and not self.fence.admit(int(tok)):
            if self._warned("stale-token", peer_id, tok):  # a deposed leader sends many: name it once per token
                log.warning(
                    "node %s: dropped %r from %s: token %s is older than %s (further frames with it: not logged)",
                    self.node_id,
                    t,
                    peer_id,
                    tok,
                    self.fence.token,
                )
            return
        if self.handler is None:
            log.debug("node %s: no handler for frame %r from %s", self.node_id, t, peer_id)
            return
        r = self.handler(peer_id, frame, payload)
        if r is not None:
            await r
