"""Mutual TLS for peer links and for the etcd client, from node.toml ``[cluster] tls_cert``, ``tls_key``, ``tls_ca``.

Peer links: TLS 1.3, both sides present a certificate and require the other's to be signed by ``tls_ca``. The
hostname is not checked (peers dial the address a member advertises in etcd, which may be any of its
addresses): ``tls_ca`` must be a CA that signs only this cluster's nodes, and membership is still decided by the
token handshake that runs inside TLS. etcd: https with our certificate as the client certificate, the server's
certificate checked against ``tls_ca`` *and* its hostname (etcd endpoints are fixed URLs).
Files are checked before OpenSSL reads them, so a missing or open key is a ConfigError that names the fix.
"""

from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass

from ...errors import ConfigError

__all__ = ["PeerTls", "check_key_mode", "etcd_context", "peer_tls"]

_KEYS = ("tls_cert", "tls_key", "tls_ca")


@dataclass(frozen=True, slots=True)
class PeerTls:
    """The two contexts of a node's peer links: ``server`` for links it accepts, ``client`` for links it dials."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def check_key_mode(path: str, mode: int) -> None:
    """ConfigError when the private key is open to group or others (as the token file: see ``load_token``)."""
    if mode & 0o077:
        raise ConfigError(
            f"[cluster] tls_key {path!r} has mode {stat.S_IMODE(mode):04o}: group or others may read it; "
            f"run `chmod 600 {path}` (only the server's user may read the private key)"
        )


def _check_files(cert: str, key: str, ca: str) -> None:
    for name, path in zip(_KEYS, (cert, key, ca), strict=True):
        if not path:
            raise ConfigError(f"[cluster] {name} is not set: mutual TLS needs tls_cert, tls_key and tls_ca together")
        try:
            with open(path, "rb") as f:
                if name == "tls_key":
                    check_key_mode(path, os.fstat(f.fileno()).st_mode)
                f.read(1)
        except OSError as e:
            raise ConfigError(
                f"cannot read [cluster] {name} {path!r}: {e.strerror or e}; give a readable PEM file"
            ) from None


def _load(ctx: ssl.SSLContext, cert: str, key: str, ca: str) -> ssl.SSLContext:
    """Our certificate chain and the CA we verify the other side against; ConfigError for files OpenSSL refuses."""
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ConfigError(
            f"[cluster] tls_cert {cert!r} and tls_key {key!r} do not load: {e}: they must be a PEM certificate "
            "(chain) and its unencrypted private key"
        ) from None
    try:
        ctx.load_verify_locations(cafile=ca)
    except ssl.SSLError as e:
        raise ConfigError(f"[cluster] tls_ca {ca!r} does not load: {e}: it must hold PEM CA certificates") from None
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_tls(cert: str, key: str, ca: str) -> PeerTls:
    """The contexts of mutual TLS on peer links (both sides verified against ``ca``; no hostname check)."""
    _check_files(cert, key, ca)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False  # see the module docstring: any certificate of the cluster's CA, then the token
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # both ends are msdata nodes
        _load(ctx, cert, key, ca)
    return PeerTls(server=server, client=client)


def etcd_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The client context for https etcd endpoints: our certificate for etcd's ``--client-cert-auth``, etcd's
    certificate verified against ``ca`` with its hostname (or IP) checked."""
    _check_files(cert, key, ca)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname on, TLS 1.2 at least
    return _load(ctx, cert, key, ca)
