"""Whom a client's socket reached: the server's uid (SO_PEERCRED) must be the one expected of its socket, or
a process that replaced the socket (a directory others can write, another user's server) would feed batches
to the trainer (issue 25, item 2)."""

from __future__ import annotations

import os
import socket
import struct
import tempfile

from .errors import ConfigError

__all__ = ["SERVER_UID_ENV", "check_server_uid", "expected_server_uid", "peer_uid"]

SERVER_UID_ENV = "MSDATA_SERVER_UID"
_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def expected_server_uid(endpoint: str) -> tuple[int, str]:
    """(uid, why) the server at ``endpoint`` must run as: ``$MSDATA_SERVER_UID`` when set; this user for the
    per-user default directory (``<tmp>/msdata-<uid>/``, whose name says whose it is); else the owner of the
    socket's directory (who alone decides which server listens there)."""
    v = os.environ.get(SERVER_UID_ENV)
    if v is not None:
        try:
            return int(v), f"${SERVER_UID_ENV}"
        except ValueError:
            raise ConfigError(f"environment variable {SERVER_UID_ENV}={v!r} must be a numeric uid") from None
    d = os.path.dirname(os.path.abspath(endpoint)) or "."
    if d == os.path.join(tempfile.gettempdir(), f"msdata-{os.getuid()}"):
        return os.getuid(), f"this user's default socket directory {d!r}"
    try:
        return os.stat(d).st_uid, f"the owner of the socket directory {d!r}"
    except OSError as e:
        raise ConfigError(f"cannot stat the socket directory {d!r}: {e}") from None


def check_server_uid(sock: socket.socket, endpoint: str) -> None:
    """ConfigError (the socket closed) unless the server on ``sock`` runs as the expected uid."""
    try:
        uid = peer_uid(sock)
        want, why = expected_server_uid(endpoint)
    except (OSError, ConfigError):
        sock.close()
        raise
    if uid != want:
        sock.close()
        raise ConfigError(
            f"the server at {endpoint!r} runs as uid {uid}, but {why} says uid {want}: another user may have "
            f"replaced the socket; batches from it are not trusted. Put the socket in a directory only the "
            f"server's user can write, or set {SERVER_UID_ENV} to the uid the server runs as"
        )
