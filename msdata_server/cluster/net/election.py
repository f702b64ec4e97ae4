"""Membership (a lease kept alive, a registration bound to it) and one leader per cluster, through etcd.

The leader holds ``{prefix}/leader`` = node id, created in a txn only if absent and bound to its lease; its
fencing token is that key's create_revision, which grows with every new leader. A node believes it leads only
while its lease is surely alive in etcd: ``Membership.deadline`` is measured from when the last acknowledged
keepalive was *sent*, so it falls before etcd's own expiry, and leadership ends a margin before it. No other
node can create the key until etcd has expired or revoked the lease, so two nodes never lead at once, as long
as this process is not frozen between checking ``role`` and acting on it. Writes through ``put_fenced`` are
checked by etcd itself, so even a frozen old leader cannot land one; peers drop older tokens (``Fence``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing, suppress
from typing import TYPE_CHECKING, Literal

import orjson

from ...errors import ClosedError, ConfigError
from ...tasks import TaskSet
from .etcd import KV, Compare, Etcd, EtcdError, EtcdUnavailable, Op

if TYPE_CHECKING:
    from ...config import ServerConfig

__all__ = ["Fence", "LeaderElection", "Membership", "run_callbacks"]

log = logging.getLogger(__name__)

LeaseEvent = Literal["granted", "lost", "unreachable", "reachable"]
Role = Literal["leader", "follower"]


def run_callbacks(callbacks: list, args: tuple, on_fatal: Callable[[BaseException], None] | None, what: str) -> None:
    """Call every role or lease callback; one that fails must not leave the node half-way into a role, so the
    failure is fatal: ``on_fatal(exc)`` (the node server stops, and its supervisor restarts it clean), or, with
    no handler, the exception propagates to the caller."""
    failed: BaseException | None = None
    for cb in list(callbacks):
        try:
            cb(*args)
        except Exception as e:
            log.critical(
                "a callback failed on %s: %r; this node cannot continue in a consistent role", what, e, exc_info=e
            )
            failed = failed or e
    if failed is not None:
        if on_fatal is None:
            raise failed
        on_fatal(failed)


class Membership:
    """This node in the cluster: a lease of ``ttl`` seconds renewed every ttl/3 and ``{prefix}/nodes/{id}``.

    Lease events go to ``on_change`` callbacks, synchronously: "unreachable" (etcd refused a keepalive, or two
    in a row went unanswered), "reachable" (one succeeded again), "lost" (etcd says the lease is gone, or
    ``deadline`` nearly passed without a renewal: the lease is dropped for good, revoked once etcd answers, and
    a new one is granted and registered: "granted").
    """

    def __init__(
        self, etcd: Etcd, *, node_id: str, prefix: str = "/msdata", ttl: float = 3.0, info: Mapping | None = None
    ):
        if not node_id or "/" in node_id:
            raise ConfigError(f"node_id={node_id!r} must be a non-empty name without '/'")
        if not isinstance(ttl, (int, float)) or not 1 <= ttl <= 60:
            raise ConfigError(f"lease ttl={ttl!r} must be seconds in [1, 60] (etcd leases are whole seconds)")
        if not prefix.startswith("/") or prefix.endswith("/"):
            raise ConfigError(f'prefix={prefix!r} must start with "/" and not end with it, e.g. "/msdata"')
        self.etcd = etcd
        self.node_id = node_id
        self.prefix = prefix
        self.ttl = float(ttl)
        self.margin = 0.2 * self.ttl  # leadership ends this long before the lease could expire in etcd
        self.key = f"{prefix}/nodes/{node_id}"
        self.info = {"id": node_id, "pid": os.getpid(), "started": time.time(), **(info or {})}
        self.lease_id: int | None = None
        self.deadline = 0.0  # loop time before which lease_id is surely alive in etcd
        self.reachable = True
        self._stale: set[int] = set()  # leases we dropped but etcd may still hold: revoked when it answers
        self._callbacks: list[Callable[[LeaseEvent], None]] = []
        self._watchdog: asyncio.TimerHandle | None = None
        self._tasks = TaskSet("membership")
        self._closed = False
        self.on_fatal: Callable[[BaseException], None] | None = None  # a callback failed (see run_callbacks)

    @classmethod
    def from_config(cls, etcd: Etcd, config: ServerConfig, **info: object) -> Membership:
        """From a ServerConfig with a [cluster] table; the registration carries the peer listen address."""
        if config.cluster is None:
            raise ConfigError("Membership needs a [cluster] table in node.toml (single node: no etcd)")
        return cls(
            etcd,
            node_id=config.node.id,
            prefix=config.cluster.prefix,
            ttl=config.cluster.lease_ttl,
            info={"listen": config.node.listen, **info},
        )

    @property
    def alive(self) -> bool:
        """True while our lease is surely alive in etcd (with the margin)."""
        return self.lease_id is not None and asyncio.get_running_loop().time() < self.deadline - self.margin

    def on_change(self, callback: Callable[[LeaseEvent], None]) -> None:
        self._callbacks.append(callback)

    def _notify(self, event: LeaseEvent) -> None:
        run_callbacks(self._callbacks, (event,), self.on_fatal, f"the lease event {event!r}")

    async def start(self) -> None:
        """Grant the lease, register, start renewing. Raises EtcdUnavailable when etcd cannot be reached."""
        if self._closed or self.lease_id is not None:
            raise ClosedError(f"Membership of {self.node_id!r}: call start() once, before aclose()")
        await self._acquire()
        self._tasks.spawn(self._keepalive_loop(), name=f"lease-{self.node_id}")

    async def members(self) -> dict[str, dict]:
        """Every registered node: id -> its registration (id, listen, pid, started, ...)."""
        out = {}
        for kv in await self.etcd.get(f"{self.prefix}/nodes/", prefix=True):
            try:
                rec = orjson.loads(kv.value)
                out[str(rec["id"])] = rec
            except (orjson.JSONDecodeError, KeyError, TypeError):
                log.warning("ignoring malformed registration %r under %s/nodes/", kv.key, self.prefix)
        return out

    async def aclose(self) -> None:
        """Stop renewing and revoke the lease (our registration and any leader key go with it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._tasks.cancel_all("membership closing")
        lease = self.lease_id
        self._drop("closing")
        if lease is not None:
            with suppress(EtcdError, TimeoutError):
                await asyncio.wait_for(self.etcd.lease_revoke(lease), self.ttl)

    # ---- lease lifecycle ------------------------------------------------------------------------------
    async def _acquire(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        lease = await self.etcd.lease_grant(self.ttl)
        try:
            await self.etcd.put(self.key, orjson.dumps(self.info), lease=lease)
        except BaseException:
            with suppress(EtcdError):
                await self.etcd.lease_revoke(lease)
            raise
        self.lease_id = lease
        self._set_deadline(t0 + math.ceil(self.ttl))  # etcd counts from when it got the grant, after t0
        self.reachable = True
        log.info("node %s joined the cluster under %s (lease %x, ttl %gs)", self.node_id, self.key, lease, self.ttl)
        self._notify("granted")

    def _set_deadline(self, deadline: float) -> None:
        self.deadline = deadline
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = asyncio.get_running_loop().call_at(deadline - self.margin, self._expired)

    def _expired(self) -> None:
        self._watchdog = None
        self._drop(f"no keepalive succeeded for {self.ttl - self.margin:g}s")

    def _drop(self, why: str) -> None:
        """Forget the lease at once; revoke it in the background so that what it holds goes sooner."""
        lease = self.lease_id
        if lease is None:
            return
        self.lease_id = None
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if why != "closing":
            log.warning("node %s lost its lease %x: %s", self.node_id, lease, why)
            self._stale.add(lease)
        self._notify("lost")

    async def _revoke_stale(self) -> None:
        """Revoke dropped leases, so that the leader key a lost lease may still hold goes now, not at expiry."""
        for lease in list(self._stale):
            with suppress(EtcdError, TimeoutError):
                await asyncio.wait_for(self.etcd.lease_revoke(lease), self.ttl / 3)
                self._stale.discard(lease)

    def _set_reachable(self, ok: bool, err: object = None) -> None:
        if ok == self.reachable:
            return
        self.reachable = ok
        if ok:
            log.info("node %s reaches etcd again", self.node_id)
        else:
            log.warning("node %s cannot renew its lease: %s", self.node_id, err)
        self._notify("reachable" if ok else "unreachable")

    async def _keepalive_loop(self) -> None:
        """Renew every ttl/3; after a failure retry sooner. A refused connection (or etcd without a raft
        leader) is "unreachable" at once; a slow answer only after the second miss, and the watchdog ends the
        lease if no renewal lands in time."""
        loop = asyncio.get_running_loop()
        interval = self.ttl / 3
        retry = interval / 3
        misses = 0
        while True:
            if self._stale:
                await self._revoke_stale()
            if self.lease_id is None:
                try:
                    await asyncio.wait_for(self._acquire(), interval)
                except (EtcdError, TimeoutError) as e:
                    self._set_reachable(False, e if str(e) else "lease grant timed out")
                    await asyncio.sleep(retry)
                continue
            await asyncio.sleep(retry if misses else interval)
            lease = self.lease_id
            if lease is None:
                continue
            t0 = loop.time()
            try:
                ttl = await asyncio.wait_for(self.etcd.lease_keepalive_once(lease), interval)
            except (EtcdError, TimeoutError) as e:
                misses += 1
                if isinstance(e, EtcdUnavailable) or misses > 1:
                    self._set_reachable(False, e if str(e) else "keepalive timed out")
                continue
            misses = 0
            if lease != self.lease_id:
                continue  # dropped while we waited: never revive it
            self._set_reachable(True)
            if ttl <= 0:
                self._drop("etcd says it expired")
            else:
                self._set_deadline(t0 + ttl)


class LeaderElection:
    """Campaigns for ``{prefix}/leader`` with the membership's lease; followers watch it and campaign again
    when it goes. ``on_change(role, leader_id, token)`` runs synchronously whenever our role or the known
    leader changes; a leader steps down at once when its lease is lost or etcd is unreachable.
    """

    def __init__(self, etcd: Etcd, membership: Membership, *, recheck: float | None = None):
        self.etcd = etcd
        self.m = membership
        self.node_id = membership.node_id
        self.key = f"{membership.prefix}/leader"
        self.recheck = recheck or max(10.0, 5 * membership.ttl)  # re-read the key even if the watch is silent
        self.leader_id: str | None = None  # who leads, as far as we know (us included)
        self.leader_token: int | None = None
        self._leading = False
        self._token: int | None = None
        self._callbacks: list[Callable[[Role, str | None, int | None], None]] = []
        self._known = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks = TaskSet("election")
        self._closed = False
        self.on_fatal: Callable[[BaseException], None] | None = None  # a callback failed (see run_callbacks)
        membership.on_change(self._on_lease)

    # ---- public ---------------------------------------------------------------------------------------
    @property
    def role(self) -> Role:
        """ "leader" only while we hold the key under a lease that is surely alive (checked now, so a late
        watchdog timer never stretches leadership)."""
        return "leader" if self._leading and self.m.alive else "follower"

    @property
    def token(self) -> int | None:
        """Our fencing token while we lead, else None."""
        return self._token if self.role == "leader" else None

    def on_change(self, callback: Callable[[Role, str | None, int | None], None]) -> None:
        self._callbacks.append(callback)

    async def start(self) -> None:
        """Campaign in the background (waits for the membership's lease)."""
        if self._closed or len(self._tasks):
            raise ClosedError(f"LeaderElection of {self.node_id!r}: call start() once, before aclose()")
        self._tasks.spawn(self._run(), name=f"election-{self.node_id}")

    async def wait_leader(self) -> str:
        """The id of the current leader (maybe us), once one is known."""
        while True:
            await self._known.wait()
            if self.leader_id is not None:
                return self.leader_id

    async def put_fenced(self, key: str | bytes, value: str | bytes, *, lease: int | None = None) -> bool:
        """Write only while we lead: etcd checks that the leader key still has our create_revision."""
        return await self.txn_fenced([Op.put(key, value, lease=lease)])

    async def txn_fenced(self, ops: Sequence[Op]) -> bool:
        """Run ops atomically only while we lead; False (nothing written) otherwise. EtcdError when etcd
        cannot be reached: then whether it was written is unknown (read it back, or retry: it is fenced)."""
        token = self.token
        if token is None:
            return False
        res = await self.etcd.txn([Compare(self.key, "create", "==", token)], ops, [])
        if not res.succeeded and self._token == token:
            self._step_down("a fenced write found the leader key changed")
            self._wake.set()
        return res.succeeded

    async def aclose(self) -> None:
        """Stop campaigning; a leader deletes its key (guarded by its token) so that another wins at once."""
        if self._closed:
            return
        self._closed = True
        await self._tasks.cancel_all("election closing")
        token = self._token if self._leading else None
        self._step_down("closing")
        if token is not None:
            with suppress(EtcdError, TimeoutError):
                await asyncio.wait_for(
                    self.etcd.txn([Compare(self.key, "create", "==", token)], [Op.delete(self.key)], []), self.m.ttl
                )

    # ---- state changes --------------------------------------------------------------------------------
    def _fire(self) -> None:
        role: Role = "leader" if self._leading else "follower"
        run_callbacks(
            self._callbacks, (role, self.leader_id, self.leader_token), self.on_fatal, f"the change to role {role!r}"
        )

    def _on_lease(self, event: LeaseEvent) -> None:
        if event in ("lost", "unreachable"):
            self._step_down(f"lease {event}")
        self._wake.set()

    def _step_down(self, why: str) -> None:
        if not self._leading:
            return
        log.warning("node %s steps down as leader (token %s): %s", self.node_id, self._token, why)
        self._leading = False
        self._token = None
        self.leader_id = self.leader_token = None
        self._known.clear()
        self._fire()

    def _observe(self, kv: KV | None, lease: int) -> None:
        """Adopt what the leader key says (None: nobody leads)."""
        if kv is not None and kv.lease == lease and kv.value == self.node_id.encode():
            if not (self.m.lease_id == lease and self.m.alive):
                return  # our lease went while the txn flew: the key dies with it
            if self._leading and self._token == kv.create_revision:
                return
            self._leading, self._token = True, kv.create_revision
            self.leader_id, self.leader_token = self.node_id, kv.create_revision
            log.info("node %s is the leader (token %d)", self.node_id, kv.create_revision)
        else:
            if self._leading:
                self._step_down("the leader key is not ours any more")
            who = kv.value.decode(errors="replace") if kv is not None else None
            token = kv.create_revision if kv is not None else None
            if (who, token) == (self.leader_id, self.leader_token):
                return
            self.leader_id, self.leader_token = who, token
        if self.leader_id is not None:
            self._known.set()
        else:
            self._known.clear()
        self._fire()

    # ---- the campaign loop ----------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = self.m.ttl / 4
        while True:
            self._wake.clear()
            lease = self.m.lease_id
            if lease is None or not self.m.alive:
                await self._wake.wait()
                continue
            try:
                res = await self.etcd.txn(
                    [Compare(self.key, "create", "==", 0)],
                    [Op.put(self.key, self.node_id, lease=lease)],
                    [Op.get(self.key)],
                )
                kv: KV | None
                if res.succeeded:
                    kv = KV(
                        key=self.key.encode(),
                        value=self.node_id.encode(),
                        create_revision=res.revision,
                        mod_revision=res.revision,
                        version=1,
                        lease=lease,
                    )
                else:
                    kv = res.responses[0][0] if res.responses and res.responses[0] else None
                self._observe(kv, lease)
                if kv is not None:
                    await self._until_change(kv, res.revision)
            except EtcdError as e:
                self._step_down(f"etcd error: {e}")
                log.debug("election of %s: %s; retrying in %.2fs", self.node_id, e, backoff)
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), backoff)

    async def _until_change(self, kv: KV, revision: int) -> None:
        """Return when the leader key may have changed, our lease changed state, or recheck has passed."""
        wake = asyncio.ensure_future(self._wake.wait())
        watch = asyncio.ensure_future(self._watch_key(kv, revision))
        try:
            done, _ = await asyncio.wait({wake, watch}, timeout=self.recheck, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (wake, watch):
                t.cancel()
            await asyncio.gather(wake, watch, return_exceptions=True)
        if watch in done and not watch.cancelled() and (exc := watch.exception()) is not None:
            raise exc

    async def _watch_key(self, kv: KV, revision: int) -> None:
        async with aclosing(self.etcd.watch(self.key, start_revision=revision + 1)) as events:
            async for batch in events:
                for ev in batch:
                    if ev.type == "delete":
                        if self._leading:
                            self._step_down("the leader key was deleted (lease expired or revoked)")
                        self._observe(None, -1)
                        return
                    if ev.kv.create_revision != kv.create_revision or ev.kv.value != kv.value:
                        return  # re-read it with a campaign


class Fence:
    """Drops messages from an older leader: remembers the highest fencing token seen and refuses smaller."""

    __slots__ = ("token",)

    def __init__(self, token: int = 0):
        self.token = token

    def admit(self, token: int) -> bool:
        if token < self.token:
            return False
        self.token = token
        return True
