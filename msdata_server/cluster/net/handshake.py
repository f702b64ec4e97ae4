"""The proof that both ends of a peer link hold the shared token, as a state machine without I/O.

Each side sends a random nonce and answers the other's with HMAC-SHA256(token, role, both nonces, both ids),
compared in constant time; the roles in the MAC stop a reflected answer. Client: ``hello`` -> server:
``challenge`` (its nonce and its proof) -> client: ``auth`` (its proof) -> server: ``welcome``. Kept apart from
PeerLink so that the link deals in bytes and tasks, and this in who may talk.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct

from ...errors import ProtocolError

__all__ = ["AuthError", "Handshake", "Refusal", "check_token", "check_token_mode", "load_token"]

_PROTO = 1
_LEN = struct.Struct(">I")


class AuthError(ProtocolError):
    """The other side does not hold our shared token (or does not speak the handshake)."""


class Refusal(AuthError):
    """An AuthError the other side is told about (``notice``) before the link closes: a wrong proof."""

    notice = {"t": "error", "message": "authentication failed"}


def load_token(path: str) -> bytes:
    """The shared secret from [cluster] token_file (surrounding whitespace ignored); refuses an empty one."""
    try:
        with open(path, "rb") as f:
            check_token_mode(path, os.fstat(f.fileno()).st_mode)
            token = f.read().strip()
    except OSError as e:
        raise AuthError(f"cannot read [cluster] token_file {path!r}: {e}; create it with a shared secret") from None
    if len(token) < 16:
        raise AuthError(
            f"[cluster] token_file {path!r} holds {len(token)} bytes; use a secret of at least 16 "
            "(e.g. `head -c 32 /dev/urandom | base64 > token`)"
        )
    return token


def check_token_mode(path: str, mode: int) -> None:
    """AuthError when the token file is open to group or others (as ssh refuses such a key): its secret is the
    only thing that makes a peer a member of the cluster."""
    if mode & 0o077:
        raise AuthError(
            f"[cluster] token_file {path!r} has mode {stat.S_IMODE(mode):04o}: group or others may read it; "
            f"run `chmod 600 {path}` (only the server's user may read the shared secret)"
        )


def check_token(token: bytes | str) -> bytes:
    """The token as bytes; AuthError if it is empty."""
    token = token.encode() if isinstance(token, str) else bytes(token)
    if not token:
        raise AuthError("the shared token is empty; set [cluster] token_file to a file with a secret")
    return token


def _mac(token: bytes, role: bytes, *parts: bytes) -> bytes:
    h = hmac.new(token, role, hashlib.sha256)
    for p in parts:  # length-prefixed: no two part lists hash alike
        h.update(_LEN.pack(len(p)) + p)
    return h.digest()


class Handshake:
    """One side's steps; ``advance`` takes each frame that arrives before authentication and returns the
    frames to send back, raising AuthError for anything out of order. ``done`` once both sides are proven."""

    def __init__(self, token: bytes, node_id: str, *, server: bool):
        self.token = token
        self.node_id = node_id
        self.server = server
        self.peer_id: str | None = None  # what the other side claims until ``done``
        self.done = False
        self._nonce = os.urandom(32)
        self._their_nonce = b""
        self._step = 0

    def hello(self) -> dict | None:
        """The client's first frame (a server waits for one)."""
        if self.server:
            return None
        return {"t": "hello", "v": _PROTO, "node": self.node_id, "nonce": self._nonce.hex()}

    def advance(self, frame: dict, peer: str) -> list[dict]:
        """Take one frame from ``peer`` (its address, for messages); the frames to answer with."""
        if "nbytes" in frame:
            raise AuthError(f"peer {peer} sent a payload before authenticating")
        t = frame["t"]
        if t == "error" and not self.server:
            raise AuthError(f"peer {peer} refused us: {frame.get('message')}")
        try:
            replies = self._answer(t, frame, peer)
        except (KeyError, ValueError, TypeError) as e:
            raise AuthError(f"peer {peer} sent a malformed handshake frame {t!r}: {e!r}") from None
        self._step += 1
        return replies

    def _answer(self, t: str, frame: dict, peer: str) -> list[dict]:
        if self.server and self._step == 0 and t == "hello":
            if frame.get("v") != _PROTO:
                raise AuthError(f"peer speaks protocol {frame.get('v')!r}, we speak {_PROTO}: upgrade both")
            self.peer_id = str(frame["node"])
            self._their_nonce = bytes.fromhex(frame["nonce"])
            mac = _mac(self.token, b"server", self._their_nonce, self._nonce, self._id_bytes())
            return [{"t": "challenge", "v": _PROTO, "node": self.node_id, "nonce": self._nonce.hex(), "mac": mac.hex()}]
        if not self.server and self._step == 0 and t == "challenge":
            self.peer_id = str(frame["node"])
            self._their_nonce = bytes.fromhex(frame["nonce"])
            want = _mac(self.token, b"server", self._nonce, self._their_nonce, self._id_bytes())
            if not hmac.compare_digest(want, bytes.fromhex(frame["mac"])):
                raise AuthError(
                    f"peer {peer} ({self.peer_id!r}) does not hold our token: check [cluster] token_file on both nodes"
                )
            mac = _mac(self.token, b"client", self._their_nonce, self._nonce, self._id_bytes())
            return [{"t": "auth", "mac": mac.hex()}]
        if self.server and self._step == 1 and t == "auth":
            want = _mac(self.token, b"client", self._nonce, self._their_nonce, self._id_bytes())
            if not hmac.compare_digest(want, bytes.fromhex(frame["mac"])):
                raise Refusal(
                    f"peer {peer} (claims {self.peer_id!r}) does not hold our token: "
                    "check [cluster] token_file on both nodes"
                )
            self.done = True
            return [{"t": "welcome"}]
        if not self.server and self._step == 1 and t == "welcome":
            self.done = True
            return []
        raise AuthError(f"peer {peer} sent {t!r} before authenticating (step {self._step})")

    def _id_bytes(self) -> bytes:
        server, client = (self.node_id, self.peer_id) if self.server else (self.peer_id, self.node_id)
        return f"{server}\0{client}".encode()
