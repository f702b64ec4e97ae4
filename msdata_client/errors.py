"""Exception types of msdata, named by who caused the failure.

The server package re-exports these, so a client and a server agree on names.
"""

__all__ = [
    "CheckpointError",
    "ClosedError",
    "ConfigError",
    "ConnectError",
    "MsdataError",
    "PeerLostError",
    "ProtocolError",
    "RemoteError",
]


class MsdataError(Exception):
    """Base class of every msdata error."""


class ConfigError(MsdataError, ValueError):
    """A job, mesh or node configuration is invalid; the message says what to change."""


class ProtocolError(MsdataError):
    """A frame on a socket was malformed or unexpected."""


class ClosedError(MsdataError):
    """We closed it: the object was used after close()."""


class PeerLostError(MsdataError, ConnectionError):
    """The other side went away (server stopped, client died, peer unreachable)."""


class ConnectError(PeerLostError):
    """No server answered at an endpoint within the connect timeout."""


class CheckpointError(MsdataError, ValueError):
    """A state dict does not fit this job (other data identity, version, or malformed)."""


class RemoteError(MsdataError):
    """The server refused a request; its message says why and how to fix it."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind
