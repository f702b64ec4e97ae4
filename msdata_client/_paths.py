"""Where a node server listens by default, shared by the server and its clients."""

from __future__ import annotations

import os
import tempfile

__all__ = ["ENDPOINT_ENV", "default_endpoint"]

ENDPOINT_ENV = "MSDATA_ENDPOINT"
_SOCK = "msdata.sock"


def default_endpoint() -> str:
    """/run/msdata when writable, else $XDG_RUNTIME_DIR, else a per-user folder in the temp dir."""
    run = "/run/msdata"
    if os.path.isdir(run) and os.access(run, os.W_OK):
        return os.path.join(run, _SOCK)
    if os.path.isdir("/run") and os.access("/run", os.W_OK) and not os.path.exists(run):
        return os.path.join(run, _SOCK)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return os.path.join(xdg, "msdata", _SOCK)
    return os.path.join(tempfile.gettempdir(), f"msdata-{os.getuid()}", _SOCK)
