"""The proof that both ends of a peer link hold the shared token, as a state machine without I/O.

Each side sends a random nonce and answers the other's with HMAC-SHA256(token, role, both nonces, both ids),
compared in constant time; the roles in the MAC stop a reflected answer. Client: ``hello`` -> server:
``challenge`` (its nonce and its proof) -> client: ``auth`` (its proof) -> server: ``welcome``. Kept apart from
PeerLink so that the link deals in bytes and tasks, and this in who may talk.

With mutual TLS (``tls=True``) the client first sends ``starttls`` and the server answers ``starttls``; both then
run the TLS handshake (``upgrade`` turns true; PeerLink does it and calls ``upgraded``), and the token handshake
above follows inside TLS. A side with TLS refuses a side without it (and the other way round) with an ``error``
frame that says so, before any secret-dependent byte is sent; stripping ``starttls`` cannot downgrade a link,
since a TLS side never speaks the token handshake in the clear.
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
    """An AuthError the other side is told about (``notice``) before the link closes: a wrong proof, or no TLS
    where we need it (or TLS where we have none)."""

    notice = {"t": "error", "message": "authentication failed"}  # noqa: RUF012  (replaced per instance, never mutated)

    def __init__(self, message: str, notice: str | None = None):
        super().__init__(message)
        if notice is not None:
            self.notice = {"t": "error", "message": notice}


_TLS_KEYS = "[cluster] tls_cert, tls_key and tls_ca"


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

    def __init__(self, token: bytes, node_id: str, *, server: bool, tls: bool = False):
        self.token = token
        self.node_id = node_id
        self.server = server
        self.tls = tls  # this side requires TLS: ``starttls`` comes before anything else
        self.upgrade = False  # both sides agreed on TLS: the link runs the TLS handshake now
        self.peer_id: str | None = None  # what the other side claims until ``done``
        self.done = False
        self._nonce = os.urandom(32)
        self._their_nonce = b""
        self._step = 0
        self._secured = not tls  # TLS is up (or not wanted): the token handshake may run

    def hello(self) -> dict | None:
        """The client's first frame (a server waits for one): ``starttls`` with TLS, else the token handshake's."""
        if self.server:
            return None
        if not self._secured:
            return {"t": "starttls", "v": _PROTO}
        return {"t": "hello", "v": _PROTO, "node": self.node_id, "nonce": self._nonce.hex()}

    @property
    def tls_up(self) -> bool:
        """TLS was agreed and is up."""
        return self.tls and self._secured

    def upgraded(self) -> dict | None:
        """TLS is up: the client's ``hello`` (a server waits for one)."""
        self.upgrade = False
        self._secured = True
        return self.hello()

    def advance(self, frame: dict, peer: str) -> list[dict]:
        """Take one frame from ``peer`` (its address, for messages); the frames to answer with."""
        if "nbytes" in frame:
            raise AuthError(f"peer {peer} sent a payload before authenticating")
        t = frame["t"]
        if t == "error" and not self.server:
            raise AuthError(f"peer {peer} refused us: {frame.get('message')}")
        if self.upgrade:
            raise AuthError(f"peer {peer} sent {t!r} where the TLS handshake belongs")
        if not self._secured or (t == "starttls" and not self.tls):
            return self._starttls(t, frame, peer)
        try:
            replies = self._answer(t, frame, peer)
        except (KeyError, ValueError, TypeError) as e:
            raise AuthError(f"peer {peer} sent a malformed handshake frame {t!r}: {e!r}") from None
        self._step += 1
        return replies

    def _starttls(self, t: str, frame: dict, peer: str) -> list[dict]:
        """Before the token handshake: agree on TLS, or refuse a side that does not match ours."""
        if t != "starttls":  # we require TLS; the peer opened (or answered) in the clear
            who = f"{peer} (node {str(frame['node'])!r})" if "node" in frame else peer
            raise Refusal(
                f"peer {who} speaks without TLS ({t!r}), but this node requires TLS on peer links: "
                f"set {_TLS_KEYS} on every node, or on none",
                notice=f"this node requires TLS on peer links: set {_TLS_KEYS} on every node, or on none",
            )
        if not self.tls:
            raise Refusal(
                f"peer {peer} asks for TLS, but this node has no {_TLS_KEYS}: set them on every node, or on none",
                notice=f"this node has no TLS on peer links ({_TLS_KEYS} unset): set them on every node, or on none",
            )
        self.upgrade = True
        return [{"t": "starttls", "v": _PROTO}] if self.server else []

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
