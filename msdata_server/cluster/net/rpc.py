"""Requests and replies over the peer links: one outstanding future per request id, failed at once when the
link to that peer breaks (rather than at the timeout). Frames to this node itself go straight to ``local``.

``send`` is the one path every job-layer frame leaves by; ``msdata_server.faults`` wraps it in tests.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import TYPE_CHECKING

from ... import errors
from ...errors import MsdataError, PeerLostError, RemoteError

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .runtime import ClusterNode

__all__ = ["PeerRpc", "error_reply"]

log = logging.getLogger(__name__)

# a refusal travels with the name of its type, and is raised again as that type when it is one of ours
_KINDS: dict[str, type[MsdataError]] = {
    name: cls
    for name in errors.__all__
    if isinstance(cls := getattr(errors, name), type) and issubclass(cls, MsdataError)
}


def error_reply(e: BaseException) -> dict:
    """The reply head of a request this node could not serve (see ``PeerRpc.request``)."""
    return {"error": f"{type(e).__name__}: {e}", "kind": type(e).__name__}


Local = Callable[[str, dict, memoryview | None], Awaitable[None]]


class PeerRpc:
    """Send, request/reply and fire-and-forget frames to peers by node id."""

    def __init__(self, cluster: ClusterNode, node_id: str, local: Local, *, timeout: float) -> None:
        self.cluster = cluster
        self.node_id = node_id
        self._local = local
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[str, asyncio.Future]] = {}  # request id -> (peer, its reply)

    async def send(self, nid: str, frame: dict, payload: Buffer | None = None) -> None:
        if nid == self.node_id:
            await self._local(nid, frame, None if payload is None else memoryview(payload))
        else:
            await self.cluster.send(nid, frame, payload)

    async def quiet_send(self, nid: str, frame: dict, payload: Buffer | None = None) -> None:
        """Send, and let a lost peer go (its catch-up comes with the link's return)."""
        with suppress(PeerLostError):
            await self.send(nid, frame, payload)

    async def request(self, nid: str, frame: dict, payload: Buffer | None = None) -> tuple[dict, bytes | None]:
        """Send a request and await its reply. PeerLostError if the peer goes or stays silent; if it answers
        that it cannot serve the request, the error it names (one of ours), else RemoteError: the peer failed."""
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (nid, fut)
        try:
            await self.send(nid, {**frame, "id": rid, "from": self.node_id}, payload)
            head, body = await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            raise PeerLostError(f"peer {nid} did not answer {frame.get('t')!r} within {self.timeout:.0f}s") from None
        finally:
            self._waiting.pop(rid, None)
        if head.get("error"):
            msg = f"peer {nid} could not answer {frame.get('t')!r}: {head['error']}"
            kind = _KINDS.get(str(head.get("kind")))
            raise kind(msg) if kind is not None and kind is not RemoteError else RemoteError(msg, str(head.get("kind")))
        return head, body

    async def reply(self, frame: dict, head: dict, payload: Buffer | None = None) -> None:
        if "from" not in frame or "id" not in frame:  # a malformed request: nobody to answer
            log.warning("node %s: a %r request without 'from' or 'id' cannot be answered", self.node_id, frame.get("t"))
            return
        await self.quiet_send(str(frame["from"]), {**head, "t": "rep", "id": frame["id"]}, payload)

    def answered(self, frame: dict, payload: memoryview | None) -> None:
        """A ``rep`` frame arrived: complete its request."""
        waiting = self._waiting.get(frame.get("id", -1))
        fut = waiting[1] if waiting is not None else None
        if fut is not None and not fut.done():
            fut.set_result((frame, None if payload is None else bytes(payload)))

    def link_lost(self, nid: str) -> None:
        """Requests to a peer whose link broke get no answer: fail them now rather than at the timeout."""
        for peer, fut in list(self._waiting.values()):
            if peer == nid and not fut.done():
                fut.set_exception(PeerLostError(f"the link to peer {nid} broke before it answered"))
