"""A real S3 API on loopback for storage tests: moto's server (ThreadedMotoServer) and a fault proxy in front of
it that adds latency, answers 503 SlowDown to a share of GETs (and to every GET during a burst), resets
connections, refuses wrong credentials (403) and counts requests. The proxy hands requests to moto's S3
application in its own process (FaultProxy(MotoS3)): about a third of the CPU per request of a second HTTP hop."""

from __future__ import annotations

import http.client
import io
import json
import logging
import os
import random
import re
import socket
import sys
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

ACCESS_KEY = "msdtestkey"
SECRET_KEY = "msdtestsecret-do-not-log"
REGION = "us-east-1"
_CREDENTIAL = re.compile(r"Credential=([^/]+)/")
SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request '
    b"rate.</Message><RequestId>msd</RequestId></Error>"
)


def s3_env(monkeypatch, endpoint: str | None = None) -> None:
    """Test credentials in the environment (never in a TOML), for this process and the servers it starts."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    if endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)


def _cache_moto_modules() -> None:
    """moto's server lists its own package directory (os.listdir and ~180 stats) twice per request to route it,
    about 1 ms of its ~2.7 ms CPU per request: list it once. The answers are the same (the directory does not
    change while it runs); on a 2-core machine the S3 server's CPU competes with the node server's."""
    from moto import backends

    if getattr(backends.list_of_moto_modules, "cached", False):
        return
    modules = tuple(backends.list_of_moto_modules())

    def listed() -> tuple[str, ...]:
        return modules

    listed.cached = True  # type: ignore[attr-defined]
    backends.list_of_moto_modules = listed  # type: ignore[assignment]


class MotoS3:
    """moto's S3 server on 127.0.0.1 (an OS-chosen port)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        _cache_moto_modules()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.addr = (host, int(port))
        self.endpoint = f"http://{host}:{port}"
        # moto's application, for a FaultProxy in this process to hand requests to directly (the server's
        # objects are module state of moto, shared by every application instance of the process)
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

        self.app = DomainDispatcherApplication(create_backend_app)

    def fs(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(
            endpoint_override=f"{self.addr[0]}:{self.addr[1]}",
            scheme="http",
            region=REGION,
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            allow_bucket_creation=True,
        )

    def upload(self, local: Path, bucket: str, prefix: str = "") -> None:
        """Every file under ``local`` to ``bucket/prefix/<relative path>`` (the bucket is created)."""
        fs = self.fs()
        fs.create_dir(bucket)
        for root, _, files in os.walk(local):
            for name in files:
                p = Path(root, name)
                key = "/".join(x for x in (bucket, prefix, p.relative_to(local).as_posix()) if x)
                with fs.open_output_stream(key) as out:
                    out.write(p.read_bytes())

    def put(self, key: str, data: bytes) -> None:
        with self.fs().open_output_stream(key) as out:
            out.write(data)

    def stop(self) -> None:
        self.server.stop()


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint. Knobs (change them any time): ``latency_s`` per
    request, ``slowdown_share`` of GETs answered 503 SlowDown, ``reset_share`` of GETs whose connection is
    reset, ``burst(seconds)``: every GET answered 503 SlowDown for that long, ``deny``: 403 to all.
    ``counts``: requests seen by method (GET, HEAD, LIST: a GET of a bucket listing); ``served``: those passed
    on to the store (not faulted), with their paths and ranges.

    ``upstream``: a MotoS3 of this process, whose S3 application the proxy calls directly (what a client sees
    is the same HTTP exchange; moto's own HTTP server closes every connection, and a connect, an accept, a
    thread and a parse per request there cost more CPU than moto's S3 work: ~1.2 of ~2 ms on this machine), or
    the (host, port) of any S3 endpoint, one upstream connection per request."""

    def __init__(self, upstream: MotoS3 | tuple[str, int], *, seed: int = 0):
        self.upstream = upstream.addr if isinstance(upstream, MotoS3) else upstream
        self.app = upstream.app if isinstance(upstream, MotoS3) else None
        self.latency_s = 0.0
        self.slowdown_share = 0.0
        self.reset_share = 0.0
        self.deny = False
        self._burst_until = 0.0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.served: list[tuple[str, str, str]] = []  # (kind as in counts, path, Range header) sent upstream
        self.faults: dict[str, int] = {"slowdown": 0, "reset": 0, "denied": 0}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

            def log_message(self, *a) -> None:  # quiet
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def burst(self, seconds: float) -> None:
        with self._lock:
            self._burst_until = time.monotonic() + seconds

    def reset_counts(self) -> None:
        with self._lock:
            self.counts = {}
            self.served = []

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def _kind(self, h: BaseHTTPRequestHandler) -> str:
        path = h.path.split("?", 1)
        if h.command == "GET" and len(path) > 1 and ("list-type" in path[1] or path[0].count("/") <= 1):
            return "LIST"
        return h.command

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        kind = self._kind(h)
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            burst = time.monotonic() < self._burst_until
            roll_slow, roll_reset = self._rng.random(), self._rng.random()
        n = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(n) if n else None
        if self.latency_s:
            time.sleep(self.latency_s)  # the added latency of a remote store
        m = _CREDENTIAL.search(h.headers.get("Authorization", ""))
        if self.deny or (m is not None and m.group(1) != ACCESS_KEY):
            self.faults["denied"] += 1
            return self._error(h, 403, b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>")
        if h.command == "GET":
            if burst or roll_slow < self.slowdown_share:
                self.faults["slowdown"] += 1
                return self._error(h, 503, SLOWDOWN_BODY)
            if roll_reset < self.reset_share:
                self.faults["reset"] += 1
                h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                h.close_connection = True
                h.connection.close()
                return
        with self._lock:
            self.served.append((kind, h.path.split("?", 1)[0], h.headers.get("Range", "")))
        status, headers, data = self._forward(h, body) if self.app is None else self._call_app(h, body)
        h.send_response(status)
        length = None
        for k, v in headers:
            if k.lower() == "content-length":
                length = v
            elif k.lower() not in ("connection", "transfer-encoding", "server", "date"):
                h.send_header(k, v)
        # a HEAD tells the object's size; a body, its own length
        h.send_header("Content-Length", length if h.command == "HEAD" and length else str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _forward(self, h: BaseHTTPRequestHandler, body: bytes | None) -> tuple[int, list[tuple[str, str]], bytes]:
        """The request sent on to the upstream endpoint over a connection of its own: (status, headers, body)."""
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() != "connection"}
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _call_app(self, h: BaseHTTPRequestHandler, body: bytes | None) -> tuple[int, list[tuple[str, str]], bytes]:
        """The request handed to moto's application in this process, with the WSGI environment its own server
        (werkzeug's) would make of it: (status, headers, body)."""
        url = urlsplit(h.path)
        environ: dict[str, object] = {
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(body or b""),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
            "REQUEST_METHOD": h.command,
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote(url.path).encode().decode("latin-1"),
            "QUERY_STRING": url.query.encode().decode("latin-1"),
            "REQUEST_URI": h.path.encode().decode("latin-1"),
            "RAW_URI": h.path.encode().decode("latin-1"),
            "REMOTE_ADDR": h.client_address[0],
            "REMOTE_PORT": h.client_address[1],
            "SERVER_NAME": self.upstream[0],
            "SERVER_PORT": str(self.upstream[1]),
            "SERVER_PROTOCOL": h.request_version,
        }
        for k, v in h.headers.items():
            if "_" in k:  # as werkzeug: X_Foo must not pass for X-Foo
                continue
            key = k.upper().replace("-", "_")
            key = key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"
            environ[key] = f"{environ[key]},{v}" if key in environ else v
        started: list = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: object = None) -> None:
            started[:] = [int(status.split(" ", 1)[0]), headers]

        out = self.app(environ, start_response)  # type: ignore[misc]
        try:
            data = b"".join(out)
        finally:
            if hasattr(out, "close"):
                out.close()
        return started[0], started[1], data

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        h.send_response(status)
        h.send_header("Content-Type", "application/xml")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def write_formats(root: Path, *, files: int = 3) -> dict[str, Path]:
    """Small datasets of every file format under ``root``: {format: directory}. Documents are text."""
    dirs = {f: root / f for f in ("parquet", "jsonl", "arrow", "webdataset")}
    for d in dirs.values():
        (d / "sub").mkdir(parents=True, exist_ok=True)
    for i in range(files):
        sub = "sub/" if i == files - 1 else ""  # one file a level down: directories are listed recursively
        pq.write_table(
            pa.table({"text": [f"parquet doc {i}-{j} " + "w" * (j % 37) for j in range(300)]}),
            dirs["parquet"] / f"{sub}part-{i}.parquet",
            row_group_size=40,
        )
        with open(dirs["jsonl"] / f"{sub}part-{i}.jsonl", "w") as f:
            for j in range(200):
                f.write(json.dumps({"text": f"jsonl doc {i}-{j} " + "x" * (j % 23)}) + "\n")
        with pa.ipc.new_file(dirs["arrow"] / f"{sub}part-{i}.arrow", pa.schema([("text", pa.string())])) as w:
            for b in range(5):
                w.write_batch(pa.record_batch({"text": [f"arrow doc {i}-{b}-{j}" for j in range(40)]}))
        with tarfile.open(dirs["webdataset"] / f"{sub}shard-{i}.tar", "w") as tf:
            for j in range(60):
                for ext, data in (("txt", f"wds doc {i}-{j}".encode()), ("bin", bytes([j % 251]) * (50 + j))):
                    ti = tarfile.TarInfo(f"s{j:04d}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
    (dirs["parquet"] / "_SUCCESS").write_bytes(b"")  # a marker a listing skips like a local walk does
    return dirs


def _control(proxy: FaultProxy, query: dict[str, str]) -> dict:
    """The proxy's knobs set from a control request's query, and its counters."""
    for k in ("latency_s", "slowdown_share", "reset_share"):
        if k in query:
            setattr(proxy, k, float(query[k]))
    if "deny" in query:
        proxy.deny = query["deny"] == "1"
    if "burst" in query:
        proxy.burst(float(query["burst"]))
    if query.get("reset") == "1":
        proxy.reset_counts()
    return {"counts": dict(proxy.counts), "faults": dict(proxy.faults)}


def main() -> None:
    """``python -m tests.s3_util``: moto and the fault proxy in their own process (a benchmark's S3 server must
    not share the trainer's interpreter); prints {"s3": ..., "proxy": ...} and serves until stdin closes. The
    proxy answers ``GET /__msd_control?latency_s=..&slowdown_share=..&burst=..&reset=1`` itself, with its counts."""
    import sys
    from urllib.parse import parse_qsl, urlsplit

    server = MotoS3()
    proxy = FaultProxy(server)
    handle = proxy._handle

    def controlled(h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        if parts.path != "/__msd_control":
            return handle(h)
        body = json.dumps(_control(proxy, dict(parse_qsl(parts.query)))).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    proxy._handle = controlled  # type: ignore[method-assign]
    print(json.dumps({"s3": server.endpoint, "proxy": proxy.endpoint}), flush=True)
    sys.stdin.read()
    proxy.stop()
    server.stop()


if __name__ == "__main__":
    main()
