"""Server-side errors: the shared names from msdata_client.errors plus server-only ones."""

from msdata_client.errors import (
    CheckpointError,
    ClosedError,
    ConfigError,
    MsdataError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)

__all__ = [
    "BadSampleError",
    "BadSourceError",
    "CheckpointError",
    "ClosedError",
    "ConfigError",
    "MsdataError",
    "PeerLostError",
    "ProtocolError",
    "RemoteError",
    "ShmError",
    "SlotSizeError",
    "StorageError",
]


class ShmError(MsdataError, OSError):
    """Shared memory could not be created or sized (often: /dev/shm too small)."""


class SlotSizeError(ConfigError):
    """A micro-batch of the job needs a ring slot larger than [node] max_slot_mib allows: a configuration
    (rows x seq_len, or the node's limit) to change. Ranks see it as a RemoteError of this kind."""


class BadSampleError(MsdataError):
    """A sample could not be read or transformed deterministically; it is skipped and counted."""

    def __init__(self, message: str, *, source: str = "", location: str = ""):
        super().__init__(message)
        self.source = source
        self.location = location


class BadSourceError(MsdataError):
    """Every recent sample of a source is bad (planner.lengths.BAD_WINDOW): its job stops with this error, naming
    the source; the job adds the reason most of its bad samples had. Other jobs are unaffected."""

    def __init__(self, message: str, *, source: str):
        super().__init__(message)
        self.source = source


class StorageError(MsdataError):
    """An object-store request failed for good (after the retries, or at once for 403/404): names the object,
    the last status code and the cause; never a credential."""

    def __init__(self, message: str, *, status: int = 0):
        super().__init__(message)
        self.status = status
