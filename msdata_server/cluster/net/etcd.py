"""A small asyncio etcd v3 client over etcd's JSON gateway (HTTP/1.1 POSTs to ``/v3/...``, base64 keys).

Why the gateway and not gRPC (aetcd, etcd3): etcd 3.4+ serves it on the client port, it needs no grpcio or
protobuf (large wheels with their own threads, outside the event loop), and it runs on asyncio streams under
uvloop. The cluster layer needs only kv, txn, leases and watch. Keep-alive connections are pooled; a connection
error moves to the next endpoint. A request whose connection breaks after etcd received it may be applied
twice: callers that need exactly-once guard the write with a txn compare (the election does).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import ssl as _ssl
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import orjson

from ...errors import ClosedError, ConfigError, MsdataError

__all__ = ["Compare", "Etcd", "EtcdError", "EtcdUnavailable", "Event", "KV", "Op", "TxnResult", "prefix_end"]

log = logging.getLogger(__name__)

Key = bytes | str
_GRPC_UNAVAILABLE = 14  # "no leader", "request timed out", member stopping: worth another try later
_MAX_BODY = 256 << 20
_MAX_IDLE = 4


class EtcdError(MsdataError):
    """etcd refused a request (bad lease, compacted revision, ...); ``code`` is the gRPC status code."""

    def __init__(self, message: str, *, code: int | None = None):
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError, ConnectionError):
    """No etcd endpoint answered in time (down, partitioned, or without a raft leader)."""


def _b(key: Key) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def prefix_end(prefix: Key) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix`` (etcd's convention)."""
    p = bytearray(_b(prefix))
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"  # an empty (or all-0xff) prefix: every key


def _range(key: Key, prefix: bool) -> dict:
    k = _b(key)
    if prefix and not k:
        k = b"\0"  # etcd's spelling of "every key": [\0, \0)
        return {"key": _b64(k), "range_end": _b64(k)}
    req = {"key": _b64(k)}
    if prefix:
        req["range_end"] = _b64(prefix_end(k))
    return req


@dataclass(frozen=True, slots=True, kw_only=True)
class KV:
    """One key-value pair as etcd stores it; ``lease`` is 0 when unbound."""

    key: bytes
    value: bytes = b""
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    lease: int = 0

    @classmethod
    def from_json(cls, d: dict) -> KV:
        return cls(
            key=_unb64(d.get("key")),
            value=_unb64(d.get("value")),
            create_revision=int(d.get("create_revision", 0)),
            mod_revision=int(d.get("mod_revision", 0)),
            version=int(d.get("version", 0)),
            lease=int(d.get("lease", 0)),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """A watch event; a delete's ``kv`` carries only the key and the deleting revision."""

    type: Literal["put", "delete"]
    kv: KV
    prev_kv: KV | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TxnResult:
    """Which branch ran, the revision after the txn, and one response per op: list[KV] (get), int (put: the
    revision; delete: how many were deleted)."""

    succeeded: bool
    revision: int
    responses: list


_TARGETS = {
    "create": ("CREATE", "create_revision"),
    "mod": ("MOD", "mod_revision"),
    "version": ("VERSION", "version"),
    "value": ("VALUE", "value"),
    "lease": ("LEASE", "lease"),
}
_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


@dataclass(frozen=True, slots=True)
class Compare:
    """A txn guard, e.g. ``Compare(k, "create", "==", 0)`` (k absent) or ``Compare(k, "mod", "==", rev)``."""

    key: Key
    target: Literal["create", "mod", "version", "value", "lease"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes | str

    def __post_init__(self) -> None:
        if self.target not in _TARGETS:
            raise ValueError(f"Compare target {self.target!r} must be one of {sorted(_TARGETS)}")
        if self.op not in _RESULTS:
            raise ValueError(f"Compare op {self.op!r} must be one of {sorted(_RESULTS)}")

    def to_json(self) -> dict:
        target, field = _TARGETS[self.target]
        v = self.value
        if self.target != "value":
            value = str(int(v))
        elif isinstance(v, int):
            raise ValueError(f"Compare on a key's value takes bytes or str, got {v!r}")
        else:
            value = _b64(_b(v))
        return {"key": _b64(_b(self.key)), "target": target, "result": _RESULTS[self.op], field: value}


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One operation inside a txn; build with ``Op.get``, ``Op.put`` or ``Op.delete``."""

    kind: Literal["get", "put", "delete"]
    key: Key
    value: bytes | str = b""
    lease: int | None = None
    prefix: bool = False

    @staticmethod
    def get(key: Key, *, prefix: bool = False) -> Op:
        return Op(kind="get", key=key, prefix=prefix)

    @staticmethod
    def put(key: Key, value: bytes | str, *, lease: int | None = None) -> Op:
        return Op(kind="put", key=key, value=value, lease=lease)

    @staticmethod
    def delete(key: Key, *, prefix: bool = False) -> Op:
        return Op(kind="delete", key=key, prefix=prefix)

    def to_json(self) -> dict:
        if self.kind == "put":
            return {"request_put": _put(self.key, self.value, self.lease)}
        if self.kind == "get":
            return {"request_range": _range(self.key, self.prefix)}
        return {"request_delete_range": _range(self.key, self.prefix)}


def _put(key: Key, value: bytes | str, lease: int | None) -> dict:
    req = {"key": _b64(_b(key)), "value": _b64(_b(value))}
    if lease:
        req["lease"] = str(int(lease))
    return req


class _Conn:
    """One HTTP/1.1 keep-alive connection to one endpoint."""

    __slots__ = ("answered", "index", "reader", "used", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int):
        self.reader = reader
        self.writer = writer
        self.index = index
        self.used = False  # has completed a request before (so it may be stale)
        self.answered = False  # the server started answering the current request

    async def send(self, host: str, path: str, body: bytes, extra: str = "") -> None:
        self.answered = False
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        )
        self.writer.write(head.encode("latin-1") + body)
        await self.writer.drain()

    async def read_head(self) -> tuple[int, dict[str, str]]:
        line = await self.reader.readuntil(b"\r\n")
        self.answered = True
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise EtcdError(f"etcd answered with a malformed status line {line[:80]!r}: is this an etcd client URL?")
        headers: dict[str, str] = {}
        while (h := await self.reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = h.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers

    async def read_chunk(self) -> bytes | None:
        """The next chunk of a chunked body; None after the last one (trailers consumed)."""
        size_line = await self.reader.readuntil(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise EtcdError(f"malformed chunk size {size_line[:40]!r} from etcd") from None
        if size == 0:
            while await self.reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                pass
            return None
        if size > _MAX_BODY:
            raise EtcdError(f"etcd sent a chunk of {size} bytes, over {_MAX_BODY}")
        data = await self.reader.readexactly(size)
        await self.reader.readexactly(2)
        return data

    async def read_body(self, headers: dict[str, str]) -> bytes:
        """The whole body: chunked, Content-Length, or (neither) until EOF."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while (c := await self.read_chunk()) is not None:
                parts.append(c)
            return b"".join(parts)
        if "content-length" in headers:
            n = int(headers["content-length"])
            if n > _MAX_BODY:
                raise EtcdError(f"etcd response of {n} bytes exceeds {_MAX_BODY}; narrow the range")
            return await self.reader.readexactly(n)
        return await self.reader.read(-1)  # delimited by EOF; reusable() keeps it out of the pool

    @staticmethod
    def reusable(headers: dict[str, str]) -> bool:
        delimited = "content-length" in headers or headers.get("transfer-encoding", "").lower() == "chunked"
        return delimited and headers.get("connection", "").lower() != "close"

    def close(self) -> None:
        self.writer.close()


def _decode(path: str, status: int, body: bytes) -> dict:
    try:
        obj = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError:
        raise EtcdError(f"etcd {path} answered HTTP {status} with a body that is not JSON: {body[:200]!r}") from None
    if status != 200 or (isinstance(obj, dict) and isinstance(obj.get("error"), (str, dict)) and "result" not in obj):
        raise _error(path, obj if isinstance(obj, dict) else {}, status)
    if not isinstance(obj, dict):
        raise EtcdError(f"etcd {path} answered {obj!r}, not a JSON object")
    return obj


def _error(path: str, obj: dict, status: int | None = None) -> EtcdError:
    err = obj.get("error")
    if isinstance(err, dict):  # streaming errors nest the status
        obj = err
    msg = obj.get("message") or obj.get("error") or f"HTTP {status}"
    code = obj.get("code")
    cls = EtcdUnavailable if code == _GRPC_UNAVAILABLE or status == 503 else EtcdError
    return cls(f"etcd {path} failed: {msg} (code {code})", code=code)


class Etcd:
    """An etcd v3 client for one event loop: pooled keep-alive connections, failover across endpoints."""

    def __init__(self, endpoints: Sequence[str] | str, *, timeout: float = 5.0, ssl: _ssl.SSLContext | None = None):
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if not endpoints:
            raise ConfigError("Etcd needs at least one endpoint, e.g. ['http://127.0.0.1:2379']")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"Etcd timeout={timeout!r} must be seconds > 0")
        self.timeout = float(timeout)
        self.urls = list(endpoints)
        self._eps: list[tuple[str, int, _ssl.SSLContext | None, str]] = []
        for url in self.urls:
            u = urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ConfigError(f'etcd endpoint {url!r} must look like "http://127.0.0.1:2379"')
            ctx = (ssl or _ssl.create_default_context()) if u.scheme == "https" else None
            port = u.port or (443 if ctx else 2379)
            self._eps.append((u.hostname, port, ctx, u.netloc))
        self._current = 0
        self._idle: list[_Conn] = []
        self._streams: set[_Conn] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"<Etcd {self.urls[self._current]}>"

    async def __aenter__(self) -> Etcd:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every connection, watches included (idempotent)."""
        self._closed = True
        conns = self._idle + list(self._streams)
        self._idle.clear()
        self._streams.clear()
        for c in conns:
            c.close()
        for c in conns:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await c.writer.wait_closed()

    # ---- plumbing -------------------------------------------------------------------------------------
    async def _open(self) -> _Conn:
        if self._closed:
            raise ClosedError("this Etcd client is closed; create a new one")
        errors = []
        n = len(self._eps)
        for i in range(n):
            idx = (self._current + i) % n
            host, port, ctx, _ = self._eps[idx]
            try:
                reader, writer = await asyncio.open_connection(host, port, ssl=ctx, limit=1 << 20)
            except OSError as e:
                errors.append(f"{self.urls[idx]}: {e}")
                continue
            if idx != self._current:
                log.warning("etcd endpoint %s is unreachable; using %s", self.urls[self._current], self.urls[idx])
                self._current = idx
            return _Conn(reader, writer, idx)
        raise EtcdUnavailable(
            f"no etcd endpoint answered ({'; '.join(errors)}); "
            "check that etcd runs and that [cluster] etcd lists its client URLs"
        )

    def _next_endpoint(self, conn: _Conn) -> None:
        self._current = (conn.index + 1) % len(self._eps)

    async def _raw(self, path: str, payload: dict) -> tuple[int, bytes]:
        """POST one JSON body; returns (status, body). Retries a stale pooled connection and fails over."""
        if self._closed:
            raise ClosedError("this Etcd client is closed; create a new one")
        body = orjson.dumps(payload)
        try:
            async with asyncio.timeout(self.timeout):
                return await self._raw_once(path, body)
        except TimeoutError:
            url = self.urls[self._current]
            self._current = (self._current + 1) % len(self._eps)
            raise EtcdUnavailable(f"etcd at {url} did not answer {path} within {self.timeout:g}s") from None

    async def _raw_once(self, path: str, body: bytes) -> tuple[int, bytes]:
        failures: list[str] = []
        while True:
            conn = self._idle.pop() if self._idle else await self._open()
            try:
                await conn.send(self._eps[conn.index][3], path, body)
                status, headers = await conn.read_head()
                data = await conn.read_body(headers)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
                conn.close()
                if conn.used and not conn.answered:
                    continue  # a pooled connection the server had closed: try a fresh one
                failures.append(f"{self.urls[conn.index]}: {e!r}")
                self._next_endpoint(conn)
                if len(failures) >= len(self._eps):
                    raise EtcdUnavailable(f"etcd connection lost during {path} ({'; '.join(failures)})") from None
                continue
            except BaseException:
                conn.close()  # cancelled or a malformed answer mid-request: the stream is out of sync
                raise
            if conn.reusable(headers) and not conn.reader.at_eof() and len(self._idle) < _MAX_IDLE and not self._closed:
                conn.used = True
                self._idle.append(conn)
            else:
                conn.close()
            return status, data

    async def _call(self, path: str, payload: dict) -> dict:
        status, data = await self._raw(path, payload)
        return _decode(path, status, data)

    # ---- kv -------------------------------------------------------------------------------------------
    async def wait_reachable(self, *, max_delay: float = 5.0, note_every: float = 30.0) -> float:
        """Return once an endpoint answers (the seconds it took). Meanwhile log a clear error naming the endpoints
        and the fix (at once, then every ``note_every`` seconds) and try again with a growing pause."""
        t0 = time.monotonic()
        delay, noted = 0.1, -note_every
        while True:
            try:
                await self.get(b"\0msdata-probe")
            except EtcdUnavailable as e:
                now = time.monotonic()
                if now - noted >= note_every:
                    noted = now
                    log.error(
                        "etcd is unreachable after %.0f s: %s. Start etcd (or correct [cluster] etcd in node.toml); "
                        "this server joins the cluster as soon as one endpoint answers",
                        now - t0,
                        e,
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_delay)
                continue
            waited = time.monotonic() - t0
            if noted >= 0:
                log.info("etcd answered after %.1f s; joining the cluster", waited)
            return waited

    async def get(self, key: Key, *, prefix: bool = False) -> list[KV]:
        """The key (or every key under a prefix), sorted by key."""
        return (await self.get_with_revision(key, prefix=prefix))[0]

    async def get_with_revision(self, key: Key, *, prefix: bool = False) -> tuple[list[KV], int]:
        """As get, plus the store revision it was read at (watch from revision + 1 to miss nothing)."""
        obj = await self._call("/v3/kv/range", _range(key, prefix))
        return [KV.from_json(d) for d in obj.get("kvs", ())], int(obj["header"]["revision"])

    async def put(self, key: Key, value: bytes | str, *, lease: int | None = None) -> int:
        """Store value (bound to lease when given); returns the new revision."""
        obj = await self._call("/v3/kv/put", _put(key, value, lease))
        return int(obj["header"]["revision"])

    async def delete(self, key: Key, *, prefix: bool = False) -> int:
        """Delete the key (or a prefix); returns how many keys went."""
        obj = await self._call("/v3/kv/deleterange", _range(key, prefix))
        return int(obj.get("deleted", 0))

    async def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """Atomically: if every compare holds run success, else failure."""
        obj = await self._call(
            "/v3/kv/txn",
            {
                "compare": [c.to_json() for c in compare],
                "success": [o.to_json() for o in success],
                "failure": [o.to_json() for o in failure],
            },
        )
        responses: list = []
        for r in obj.get("responses", ()):
            if "response_range" in r:
                responses.append([KV.from_json(d) for d in r["response_range"].get("kvs", ())])
            elif "response_put" in r:
                responses.append(int(r["response_put"].get("header", {}).get("revision", obj["header"]["revision"])))
            elif "response_delete_range" in r:
                responses.append(int(r["response_delete_range"].get("deleted", 0)))
            else:
                responses.append(r)
        return TxnResult(
            succeeded=bool(obj.get("succeeded", False)), revision=int(obj["header"]["revision"]), responses=responses
        )

    # ---- leases ---------------------------------------------------------------------------------------
    async def lease_grant(self, ttl: float) -> int:
        """A new lease of ceil(ttl) seconds (etcd may raise it to its minimum); returns its id."""
        if not isinstance(ttl, (int, float)) or ttl <= 0:
            raise ConfigError(f"lease ttl={ttl!r} must be seconds > 0")
        obj = await self._call("/v3/lease/grant", {"TTL": str(math.ceil(ttl))})
        return int(obj["ID"])

    async def lease_revoke(self, lease_id: int) -> bool:
        """Revoke a lease (its keys are deleted); False when it did not exist (any more)."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(int(lease_id))})
        except EtcdError as e:
            if e.code == 5:  # NotFound
                return False
            raise
        return True

    async def lease_keepalive_once(self, lease_id: int) -> float:
        """Renew the lease once; returns its TTL from now in seconds (<= 0: the lease is gone)."""
        status, data = await self._raw("/v3/lease/keepalive", {"ID": str(int(lease_id))})
        obj = _decode("/v3/lease/keepalive", status, data.split(b"\n", 1)[0])
        if "error" in obj:
            raise _error("/v3/lease/keepalive", obj)
        if not isinstance(obj.get("result"), dict):  # never read "no answer" as "lease gone"
            raise EtcdError(f"etcd answered a lease keepalive without a result: {data[:200]!r}")
        return float(obj["result"].get("TTL", 0))

    # ---- watch ----------------------------------------------------------------------------------------
    async def watch(
        self, key: Key, *, prefix: bool = False, start_revision: int | None = None, prev_kv: bool = False
    ) -> AsyncGenerator[list[Event], None]:
        """Yield ``[]`` once etcd has created the watch (a readiness signal), then each batch of events.

        Runs on its own connection until the caller closes the iterator (``contextlib.aclosing``); raises
        EtcdUnavailable when the stream breaks and EtcdError when etcd cancels it (e.g. revision compacted).
        """
        req = _range(key, prefix)
        if start_revision is not None:
            req["start_revision"] = str(int(start_revision))
        if prev_kv:
            req["prev_kv"] = True
        body = orjson.dumps({"create_request": req})
        path = "/v3/watch"
        conn: _Conn | None = None
        try:
            try:
                async with asyncio.timeout(self.timeout):
                    conn = await self._open()
                    self._streams.add(conn)
                    # hasleader: etcd cancels the watch when its member loses the raft leader (no silent hang)
                    await conn.send(self._eps[conn.index][3], path, body, "Grpc-Metadata-hasleader: true\r\n")
                    status, headers = await conn.read_head()
            except TimeoutError:
                if conn is not None:
                    self._next_endpoint(conn)
                raise EtcdUnavailable(
                    f"etcd at {self.urls[self._current]} did not start a watch within {self.timeout:g}s"
                ) from None
            if status != 200 or headers.get("transfer-encoding", "").lower() != "chunked":
                raise _decode_stream_error(path, status, await conn.read_body(headers))
            buf = b""
            while (chunk := await conn.read_chunk()) is not None:
                buf += chunk
                while (nl := buf.find(b"\n")) >= 0:
                    line, buf = buf[:nl], buf[nl + 1 :]
                    if line.strip():
                        yield _watch_message(key, line)
            raise EtcdUnavailable(f"etcd at {self.urls[conn.index]} ended the watch on {_b(key)!r}")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            if conn is not None:
                self._next_endpoint(conn)
            raise EtcdUnavailable(f"etcd watch on {_b(key)!r} lost its connection: {e!r}") from None
        finally:
            if conn is not None:
                self._streams.discard(conn)
                conn.close()


def _decode_stream_error(path: str, status: int, data: bytes) -> EtcdError:
    try:
        _decode(path, status, data)
    except EtcdError as e:
        return e
    return EtcdError(f"etcd {path} answered HTTP {status}")


def _watch_message(key: Key, line: bytes) -> list[Event]:
    try:
        msg = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise EtcdError(f"etcd sent a watch message that is not JSON: {line[:200]!r}") from None
    if "error" in msg:
        raise _error("/v3/watch", msg)
    res = msg.get("result", {})
    if res.get("canceled"):
        why = res.get("cancel_reason") or ""
        if "compact_revision" in res:
            why = f"revision compacted up to {res['compact_revision']}; read the key again and watch from there"
        raise EtcdError(f"etcd canceled the watch on {_b(key)!r}: {why or 'no reason given'}")
    return [
        Event(
            type="delete" if e.get("type") == "DELETE" else "put",
            kv=KV.from_json(e.get("kv", {})),
            prev_kv=KV.from_json(e["prev_kv"]) if e.get("prev_kv") else None,
        )
        for e in res.get("events", ())
    ]
