"""Throwaway certificate authorities and node certificates for the TLS tests, made with the ``openssl`` CLI.

EC P-256 keys (fast to make), written mode 0600 as a node requires; every leaf certificate is good for both
TLS roles (a node accepts and dials links) and names 127.0.0.1 and localhost, so etcd's can be checked by IP.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"

__all__ = ["CA", "Cert", "need_openssl"]


def need_openssl() -> None:
    if not Path(OPENSSL).exists():
        pytest.skip("no openssl CLI (apt install openssl)")


def _run(*args: str) -> None:
    subprocess.run([OPENSSL, *args], check=True, capture_output=True, timeout=60)


def _key(path: Path) -> Path:
    _run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
    path.chmod(0o600)
    return path


@dataclass(frozen=True)
class Cert:
    """A certificate, its key and the CA that signed it: the three [cluster] tls_* paths."""

    cert: Path
    key: Path
    ca: Path

    def toml(self) -> str:
        return f'tls_cert = "{self.cert}"\ntls_key = "{self.key}"\ntls_ca = "{self.ca}"\n'


class CA:
    """A self-signed CA in ``directory``; ``issue(name)`` signs a leaf certificate for it."""

    def __init__(self, directory: Path, name: str = "msdata-test-ca"):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = _key(self.dir / "ca.key")
        self.cert = self.dir / "ca.pem"
        _run(
            "req", "-x509", "-new", "-key", str(self.key), "-out", str(self.cert), "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip

    def issue(self, name: str) -> Cert:
        key = _key(self.dir / f"{name}.key")
        csr, cert, ext = (self.dir / f"{name}.{s}" for s in ("csr", "pem", "ext"))
        _run("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        ext.write_text(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
        )
        _run(
            "x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(ext),
        )  # fmt: skip
        return Cert(cert=cert, key=key, ca=self.cert)
