"""What a rank says while it waits: for a server to answer at its socket, or for the other ranks of its job to
register (the start barrier). Library code: it logs through this package's loggers and never configures logging.

The server's side of the story (which ranks it has registered) is read from its status in one place,
``server_view``: on one node the job's registered ranks are all of them; a cluster node knows only its own, so
there the line says what the rank itself knows (job, rank, world size, socket, time waited).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import MsdataError
from .wire import request

__all__ = ["LOG_EVERY", "PeerWait", "log_every", "server_view"]

LOG_EVERY = 5.0  # seconds between two lines of one wait (shorter when the timeout is short)


def log_every(timeout: float) -> float:
    """How often a wait bounded by ``timeout`` logs: every ``LOG_EVERY`` seconds, at least 4 times in all."""
    return min(LOG_EVERY, max(0.05, timeout / 4))


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerWait:
    """A rank waiting for its job to start: who it is, and the ranks the server has registered (None: unknown)."""

    job: str
    rank: int
    world_size: int
    registered: tuple[int, ...] | None = None

    @property
    def missing(self) -> tuple[int, ...] | None:
        """The ranks the job still waits for; None when the server does not say."""
        if self.registered is None:
            return None
        return tuple(r for r in range(self.world_size) if r not in self.registered)

    def detail(self) -> str:
        """'2 of 4 ranks of job 'x' registered; missing ranks 1, 3', or what the rank knows without the server."""
        missing = self.missing
        if missing is None:
            return (
                f"the server does not say which of the {self.world_size} ranks of job {self.job!r} registered; "
                "start every rank of the mesh"
            )
        if not missing:
            return f"all {self.world_size} ranks of job {self.job!r} registered; the server is starting it"
        return (
            f"{len(self.registered or ())} of {self.world_size} ranks of job {self.job!r} registered; "
            f"missing ranks {', '.join(map(str, missing))}"
        )


def server_view(endpoint: str, job: str, digest: str, rank: int, world_size: int) -> PeerWait:
    """The server's detail of a waiting job, read from its status (a second, short connection).

    The one place that asks the server which ranks it has registered: a single node knows every rank of its jobs;
    a node of a cluster (its status has ``cluster``) knows only the ranks attached to it, so there the answer is
    "unknown" until the server reports the job's registration across the cluster.
    """
    unknown = PeerWait(job=job, rank=rank, world_size=world_size)
    try:
        reply = request(endpoint, {"t": "status"}, timeout=2.0)
    except (OSError, MsdataError):
        return unknown
    st = reply.get("status")
    if not isinstance(st, dict) or "cluster" in st:
        return unknown
    for j in st.get("jobs") or ():
        if not isinstance(j, dict) or j.get("name") != job or not digest.startswith(str(j.get("digest"))):
            continue
        if j.get("state") != "waiting":
            continue
        try:
            ranks = tuple(sorted({int(r) for r in j.get("ranks") or ()}))
        except (TypeError, ValueError):
            return unknown
        return PeerWait(job=job, rank=rank, world_size=world_size, registered=ranks)
    return unknown
