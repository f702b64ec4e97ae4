"""The cluster layer: etcd access, membership and one leader per cluster, authenticated peer links.

Used only with a [cluster] table in node.toml; a single node is its own leader and never imports etcd code.
"""

from .net.election import Fence, LeaderElection, Membership
from .net.etcd import KV, Compare, Etcd, EtcdError, EtcdUnavailable, Event, Op, TxnResult
from .net.peers import AuthError, PeerLink, PeerServer, load_token

__all__ = [
    "AuthError",
    "Compare",
    "Etcd",
    "EtcdError",
    "EtcdUnavailable",
    "Event",
    "Fence",
    "KV",
    "LeaderElection",
    "Membership",
    "Op",
    "PeerLink",
    "PeerServer",
    "TxnResult",
    "load_token",
]
