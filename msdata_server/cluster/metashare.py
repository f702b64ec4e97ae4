"""Remote sources' listing and metadata read once per cluster (issue 27, item 4): the leader lists a source and
reads its footers (or finds them in its state_dir), every other node asks it for that kept file over the
authenticated peer links and keeps the copy in its own state_dir; nobody else lists or reads a footer.

Wire: ``smeta`` (node -> leader) ``{"spec": <[[source]] dict>}``; the reply ``{"found": bool}`` with the
metadata file as payload (the bytes the leader keeps: a JSON head and raw arrays, loaded with
``allow_pickle=False``), or ``{"busy": true}`` while the leader is still listing (asked again shortly). Only
sources whose every path is in object storage are served: a peer never learns about the leader's local files.
The leader lists one source at a time per identity (a lock per key); its own partitions' opens wait on the same
lock. Whatever fails (no leader yet, the leader lost, an error there) leaves the node to list by itself."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from msdata_client.source import SourceSpec

from ..errors import MsdataError
from ..sources import open_source
from ..sources.base import meta_identity
from ..storage import MetaCache, Store, is_uri, local_path
from ..tasks import TaskSet
from .net.rpc import PeerRpc, error_reply
from .net.runtime import ClusterNode

__all__ = ["MetaShare"]

log = logging.getLogger(__name__)
_BUSY_WAIT_S = 0.2  # between asks while the leader is still listing
_GIVE_UP_S = 3600.0  # a listing that takes longer: this node lists by itself


class MetaShare:
    """This node's side (``fetch``, called by ``MetaCache.load`` in a source-opening thread) and the leader's
    (``on_request``)."""

    def __init__(self, cluster: ClusterNode, node_id: str, rpc: PeerRpc, tasks: TaskSet) -> None:
        self.cluster, self.node_id, self.rpc, self.tasks = cluster, node_id, rpc, tasks
        self._loop: asyncio.AbstractEventLoop | None = None
        self._store: Store | None = None
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._mine = threading.local()  # the key this thread lists for (the nested open lists, never asks)
        self._busy: dict[str, asyncio.Task] = {}  # the leader's listings in progress, by key

    def install(self, store: Store) -> None:
        """Share ``store``'s kept metadata (nothing to share without a state_dir); called on the event loop."""
        self._loop = asyncio.get_running_loop()
        if store.meta is not None:
            self._store = store
            store.meta.share = self

    def uninstall(self) -> None:
        if self._store is not None and self._store.meta is not None and self._store.meta.share is self:
            self._store.meta.share = None
        self._store = None

    # ---- any node: a source opened here lacks its metadata ----------------------------------------------------
    def fetch(self, identity: dict[str, Any], spec: Any) -> bytes | None:
        leader, loop = self.cluster.leader_id, self._loop
        if leader is None or loop is None or not _remote(spec) or identity != meta_identity(spec):
            return None
        try:
            asyncio.get_running_loop()
            return None  # an open on the event loop itself must not wait for it: list here
        except RuntimeError:
            pass
        try:
            if leader == self.node_id:
                return self.produce(spec)
            return asyncio.run_coroutine_threadsafe(self._ask(leader, spec), loop).result(_GIVE_UP_S + 60)
        except Exception as e:
            log.info(
                "node %s: source %s: no listing from leader %s (%s); listing here", self.node_id, spec.name, leader, e
            )
            return None

    async def _ask(self, leader: str, spec: Any) -> bytes | None:
        deadline = time.monotonic() + _GIVE_UP_S
        while time.monotonic() < deadline and self.cluster.leader_id == leader:
            head, body = await self.rpc.request(leader, {"t": "smeta", "spec": spec.to_dict()})
            if not head.get("busy"):
                return body if head.get("found") and body else None
            await asyncio.sleep(_BUSY_WAIT_S)  # the leader is still listing: ask again
        return None

    # ---- the leader ---------------------------------------------------------------------------------------------
    async def on_request(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        self.tasks.spawn(self._serve(frame), name="smeta")

    async def _serve(self, frame: dict) -> None:
        try:
            if self.cluster.leader_id != self.node_id:
                raise MsdataError(f"node {self.node_id} is not the leader")
            spec = SourceSpec.from_dict(frame["spec"])
            if not _remote(spec):
                raise MsdataError(f"source {spec.name!r}: only sources in object storage are listed for peers")
            key = MetaCache.key(meta_identity(spec))
            task = self._busy.get(key)
            if task is None:
                task = self._busy[key] = asyncio.create_task(asyncio.to_thread(self.produce, spec))
                task.add_done_callback(lambda _: self._busy.pop(key, None))
            done, _ = await asyncio.wait({task}, timeout=self.rpc.timeout / 3)
            if not done:
                await self.rpc.reply(frame, {"busy": True})
                return
            blob = task.result()
        except Exception as e:
            await self.rpc.reply(frame, error_reply(e))
            return
        await self.rpc.reply(frame, {"found": blob is not None}, blob)

    def produce(self, spec: Any) -> bytes | None:
        """The kept metadata file of a source, listing it and reading its metadata first when this node has none
        (one listing at a time per source identity)."""
        store = self._store
        if store is None or store.meta is None:
            return None
        identity = meta_identity(spec)
        key = MetaCache.key(identity)
        if getattr(self._mine, "key", None) == key:
            return None  # the open below asks: it lists
        with self._locks_guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            blob = store.meta.read_bytes(identity)
            if blob is None:
                self._mine.key = key
                try:
                    open_source(spec, seed=0).close()  # lists, reads the metadata and keeps it in state_dir
                finally:
                    self._mine.key = None
                blob = store.meta.read_bytes(identity)
        return blob


def _remote(spec: Any) -> bool:
    paths = [str(p) for p in getattr(spec, "paths", ())]
    return bool(paths) and all(is_uri(p) and local_path(p) is None for p in paths)
