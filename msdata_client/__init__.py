"""msdata's trainer-side package: the job graph, the mesh, and DataClient (the only part that imports torch).

``import msdata_client`` stays light: DataClient (and torch) load on first use, so the node server can
share the graph, mesh, wire and ring modules without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import (
    CheckpointError,
    ClosedError,
    ConfigError,
    ConnectError,
    MsdataError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)
from .graph import DGraph, JobSpec, SourceSpec
from .mesh import ClientPlaceTree

__version__ = "0.1.0"  # the package's version (pyproject.toml's; a test keeps them equal)

if TYPE_CHECKING:
    from .calibration import Calibration, calibrate
    from .client import DataClient

__all__ = [
    "Calibration",
    "CheckpointError",
    "ClientPlaceTree",
    "ClosedError",
    "ConfigError",
    "ConnectError",
    "DGraph",
    "DataClient",
    "JobSpec",
    "MsdataError",
    "PeerLostError",
    "ProtocolError",
    "RemoteError",
    "SourceSpec",
    "calibrate",
]


def __getattr__(name: str):
    if name == "DataClient":
        from .client import DataClient

        return DataClient
    if name in ("Calibration", "calibrate"):  # times the user's model (torch), so loaded on first use too
        from . import calibration

        return getattr(calibration, name)
    raise AttributeError(f"module 'msdata_client' has no attribute {name!r}")
