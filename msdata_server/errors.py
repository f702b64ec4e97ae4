"""Server-side errors: the shared names from msdata_client.errors plus server-only ones."""

from msdata_client.errors import (
    CheckpointError,
    ClosedError,
    ConfigError,
    MsdataError,
    PeerLostError,
    ProtocolError,
)

__all__ = [
    "BadSampleError",
    "CheckpointError",
    "ClosedError",
    "ConfigError",
    "MsdataError",
    "PeerLostError",
    "ProtocolError",
    "RingFullError",
    "ShmError",
]


class ShmError(MsdataError, OSError):
    """Shared memory could not be created or sized (often: /dev/shm too small)."""


class RingFullError(MsdataError):
    """A batch does not fit a ring slot."""


class BadSampleError(MsdataError):
    """A sample could not be read or transformed deterministically; it is skipped and counted."""

    def __init__(self, message: str, *, source: str = "", location: str = ""):
        super().__init__(message)
        self.source = source
        self.location = location
