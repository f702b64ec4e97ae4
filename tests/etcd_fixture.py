"""A real etcd for tests: loopback, OS-chosen free ports, a temp data dir, ready when it logs so.

Tuned for speed (50 ms heartbeat, 500 ms election timeout: leases of 1 s are allowed). Skips only when no etcd
binary exists (set $MSDATA_ETCD to use another). ``stop``/``start`` restart it on the same ports and data.
``tls=`` a certificate (tests/pki.py): https only, clients must present a certificate signed by the same CA.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .pki import Cert

ETCD = (
    os.environ.get("MSDATA_ETCD")
    or shutil.which("etcd")
    or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
)
_READY = b"ready to serve client requests"

__all__ = ["ETCD", "EtcdServer"]


def _reserve_port() -> int:
    """A free loopback port that stays free for a while: it is left in TIME_WAIT, so the kernel does not hand
    it to another bind(0), while etcd (SO_REUSEADDR) can still bind it."""
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the TIME_WAIT entry must allow reuse
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as cli:
            conn, _ = srv.accept()
            conn.close()
            cli.recv(1)
    return port


class EtcdServer:
    """One etcd member on loopback; its log goes to ``log_path``."""

    def __init__(self, data_dir: str | os.PathLike, *, tls: Cert | None = None):
        if ETCD is None:
            pytest.skip("no etcd binary (apt install etcd-server, or set $MSDATA_ETCD)")
        self.dir = Path(data_dir)
        self.log_path = self.dir / "etcd.log"
        self.client_port = _reserve_port()
        self.peer_port = _reserve_port()
        self.tls = tls
        self.proc: subprocess.Popen | None = None
        self._drain: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30.0) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            ETCD,
            "--name",
            "t",
            "--data-dir",
            str(self.dir / "data"),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"t={peer}",
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
        ]
        if self.tls is not None:  # client URLs only; the (single) member's peer URL stays plain
            cmd += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)]
            cmd += ["--client-cert-auth", "--trusted-ca-file", str(self.tls.ca)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        ready = threading.Event()
        proc = self.proc

        def drain() -> None:  # keeps the pipe empty and spots the readiness line
            with open(self.log_path, "ab") as log:
                for line in proc.stderr:
                    log.write(line)
                    if _READY in line:
                        ready.set()
            ready.set()  # EOF: it exited

        self._drain = threading.Thread(target=drain, daemon=True, name="etcd-log")
        self._drain.start()
        if not ready.wait(timeout) or proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"etcd did not become ready in {timeout}s; log:\n{self.log()[-3000:]}")
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it (SIGKILL: no chance to say goodbye to clients). The data dir stays for start()."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._drain is not None:
            self._drain.join(5)
        self.proc.stderr.close()
        self.proc = None

    def freeze(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung or partitioned member)."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
