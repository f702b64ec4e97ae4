"""The node configuration (node.toml): frozen, validated at the boundary with messages that say the fix."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

from msdata_client._paths import default_endpoint
from msdata_client.choices import is_import_path

from .errors import ConfigError

__all__ = [
    "AutoscaleConfig",
    "ClusterConfig",
    "NodeConfig",
    "ROLES",
    "ServerConfig",
    "StorageConfig",
    "load_config",
    "parse_config",
    "parse_host_port",
]

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)  # [node] log_format
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # [node] log_level
ROLES = ("leader", "follower", "single")  # what `status` reports as "role"; "single": no [cluster]


def _check_keys(table: dict, cls, where: str) -> None:
    allowed = sorted(f.name for f in fields(cls))
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{where}]; allowed keys: {allowed}")


def _int(where: str, key: str, v, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"[{where}] {key} = {v!r} must be an integer {rng}")
    return v


def parse_host_port(v: str, key: str = "listen") -> tuple[str, int]:
    """ "HOST:PORT" (IPv6 in brackets) -> (host, port); ``key`` names the [node] key in the error. The host must
    be an IP address or localhost (ARCHITECTURE §6: bind to loopback unless configured)."""
    host, sep, port = str(v).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(
            f'[node] {key} = {v!r} must be "HOST:PORT", e.g. "127.0.0.1:{_EXAMPLE_PORT[key]}" (port 0: any)'
        )
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ConfigError(f"[node] {key} host {host!r} must be an IP address or localhost") from None
    return host, int(port)


_EXAMPLE_PORT = {"listen": 7460, "metrics": 9460}
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """[node]: this server's identity, endpoints and resources."""

    id: str = field(default_factory=socket.gethostname)
    socket: str = field(default_factory=default_endpoint)
    listen: str = "127.0.0.1:0"
    shm_prefix: str = "msd"
    workers: int = 2
    state_dir: str = ""  # default: beside the socket
    ring_slots: int = 8  # slots per ring; 8-16 lets notices overlap with work (ARCHITECTURE §9)
    max_slot_mib: int = 1024  # a batch larger than this is refused with a clear error
    drain_timeout: float = 10.0  # graceful-shutdown budget before tasks are cancelled
    reconnect_grace: float = 60.0  # seconds a rank that lost its socket keeps its slots and place
    log_level: str = "INFO"
    log_format: str = "text"  # "text" or "json" (one object per line)
    metrics: str = ""  # "HOST:PORT" serves Prometheus text at /metrics; "" = off
    # module prefixes (or "module:function") whose functions a job may name as transform or cost, beyond
    # msdata_server's own; and path/URI prefixes jobs may read (empty: any). Checked as a job registers.
    allow_transforms: tuple[str, ...] = ()
    data_roots: tuple[str, ...] = ()
    # what one client or one sample may cost this server (README "Operations: limits")
    max_prefetch_steps: int = 64  # a job that plans further ahead (prefetch_steps) is refused as it registers
    max_client_frame_kib: int = 4096  # a longer frame from a local client is a protocol error (hello + state: KiBs)
    client_buffer_mib: int = 64  # partly received client frames held at once, all clients together
    frame_timeout: float = 30.0  # seconds a client may leave a frame half sent before it is dropped
    max_image_pixels: int = 50_000_000  # an image decoding to more pixels (after JPEG draft scaling) is a bad sample
    # what the node's sources hold, all together (loader/budget.py, sources/handles.py): read-ahead shared among
    # the loaders (each gets samples / loaders, at least 8; mib / loaders, at least 1 MiB), and open file handles
    readahead_samples: int = 4096
    readahead_mib: int = 1024
    open_files: int = 256

    def __post_init__(self):
        if not self.id or not all(c.isalnum() or c in "-_." for c in self.id):
            raise ConfigError(f"[node] id = {self.id!r} must be non-empty letters, digits, '-', '_' or '.'")
        if not self.socket:
            raise ConfigError("[node] socket must be a path")
        if len(self.socket.encode()) > 107:
            raise ConfigError(f"[node] socket = {self.socket!r} is longer than a Unix socket path may be (107 bytes)")
        parse_host_port(self.listen, "listen")
        if not isinstance(self.metrics, str):
            raise ConfigError(f'[node] metrics = {self.metrics!r} must be a string "HOST:PORT" ("" turns it off)')
        if self.metrics:
            parse_host_port(self.metrics, "metrics")
        prefix = self.shm_prefix
        if not prefix or not all(c.isalnum() or c in "_" for c in prefix) or len(prefix) > 16:
            raise ConfigError(f"[node] shm_prefix = {self.shm_prefix!r} must be 1-16 letters, digits or '_'")
        _int("node", "workers", self.workers, 0, 1024)
        _int("node", "ring_slots", self.ring_slots, 2, 1024)
        _int("node", "max_slot_mib", self.max_slot_mib, 1)
        if not isinstance(self.drain_timeout, (int, float)) or not 0 <= self.drain_timeout < float("inf"):
            raise ConfigError(f"[node] drain_timeout = {self.drain_timeout!r} must be a finite number >= 0 (seconds)")
        if not isinstance(self.reconnect_grace, (int, float)) or not 0 <= self.reconnect_grace < float("inf"):
            raise ConfigError(
                f"[node] reconnect_grace = {self.reconnect_grace!r} must be a finite number >= 0 (seconds)"
            )
        _int("node", "max_prefetch_steps", self.max_prefetch_steps, 1, 4096)
        _int("node", "max_client_frame_kib", self.max_client_frame_kib, 64, 16 * 1024)
        _int("node", "client_buffer_mib", self.client_buffer_mib, 1)
        _int("node", "max_image_pixels", self.max_image_pixels, 1 << 16)
        _int("node", "readahead_samples", self.readahead_samples, 0)
        _int("node", "readahead_mib", self.readahead_mib, 0)
        _int("node", "open_files", self.open_files, 1)
        if isinstance(self.frame_timeout, bool) or not isinstance(self.frame_timeout, (int, float)):
            raise ConfigError(f"[node] frame_timeout = {self.frame_timeout!r} must be a number of seconds > 0")
        if not 0 < self.frame_timeout < float("inf"):
            raise ConfigError(f"[node] frame_timeout = {self.frame_timeout!r} must be a finite number > 0 (seconds)")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"[node] log_level = {self.log_level!r} must be one of {', '.join(LOG_LEVELS)}")
        for a in self.allow_transforms:
            if not isinstance(a, str) or not (_MODULE_RE.fullmatch(a) or is_import_path(a)):
                raise ConfigError(
                    f'[node] allow_transforms entry {a!r} must be a module prefix like "mypkg.transforms" '
                    f'or one function "mypkg.transforms:tokenize"'
                )
        for r in self.data_roots:
            if not isinstance(r, str) or not (os.path.isabs(r) or "://" in r):
                raise ConfigError(
                    f"[node] data_roots entry {r!r} must be an absolute path (relative ones resolve against "
                    f'node.toml\'s directory) or a URI prefix like "s3://bucket/"'
                )
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(
                f"[node] log_format = {self.log_format!r} must be one of {', '.join(map(repr, LOG_FORMATS))}"
            )

    @property
    def listen_addr(self) -> tuple[str, int]:
        return parse_host_port(self.listen, "listen")

    @property
    def metrics_addr(self) -> tuple[str, int] | None:
        return parse_host_port(self.metrics, "metrics") if self.metrics else None

    @property
    def state_path(self) -> str:
        return self.state_dir or os.path.join(os.path.dirname(self.socket), "state")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """[cluster]: present only for multi-node operation (etcd membership and election)."""

    etcd: tuple[str, ...] = ()
    token_file: str = ""
    lease_ttl: float = 3.0
    prefix: str = "/msdata"
    # mutual TLS on peer links and https to etcd (cluster/net/tls.py): all three paths, or none (plain links)
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    def __post_init__(self):
        self._check_tls()
        if not self.etcd or not all(isinstance(e, str) and e.startswith(("http://", "https://")) for e in self.etcd):
            raise ConfigError(f'[cluster] etcd = {list(self.etcd)!r} must list endpoints like "http://127.0.0.1:2379"')
        if not self.token_file:
            raise ConfigError("[cluster] token_file is required: peers authenticate with the shared secret in it")
        if not isinstance(self.lease_ttl, (int, float)) or not 1 <= self.lease_ttl <= 60:
            raise ConfigError(f"[cluster] lease_ttl = {self.lease_ttl!r} must be seconds in [1, 60]")

    TLS_KEYS = ("tls_cert", "tls_key", "tls_ca")

    def _check_tls(self) -> None:
        """tls_cert, tls_key and tls_ca are set together or not at all (the files are checked as the node starts)."""
        paths = {k: getattr(self, k) for k in self.TLS_KEYS}
        for k, v in paths.items():
            if not isinstance(v, str):
                raise ConfigError(f"[cluster] {k} = {v!r} must be a path (a string)")
        missing = [k for k, v in paths.items() if not v]
        if 0 < len(missing) < len(paths):
            given = [k for k in paths if k not in missing]
            raise ConfigError(
                f"[cluster] {', '.join(given)} set without {', '.join(missing)}: mutual TLS needs tls_cert, tls_key "
                "and tls_ca together (or none of them for plain peer links)"
            )

    @property
    def tls(self) -> bool:
        """Mutual TLS on peer links (and https to etcd with our client certificate)."""
        return bool(self.tls_cert)


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoscaleConfig:
    """[autoscale]: size the transform workers, and each source's share of them, from measured cost and the
    mixture (msdata_server.autoscale). ``enabled = false``: ``[node] workers`` is a fixed pool shared FIFO."""

    enabled: bool = True
    min_workers: int = 1
    max_workers: int = 0  # 0: the number of CPUs
    interval: float = 2.0  # seconds between decisions (a mixture change decides at once)
    headroom: float = 0.25  # provision demand x (1 + headroom)
    cooldown: float = 0.0  # seconds a lower demand must last before workers are given back; 0: 3 x interval

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"[autoscale] enabled = {self.enabled!r} must be true or false")
        _int("autoscale", "min_workers", self.min_workers, 1, 1024)  # [node] workers = 0: transforms in the server
        _int("autoscale", "max_workers", self.max_workers, 0, 1024)
        if self.max_workers and self.max_workers < self.min_workers:
            raise ConfigError(
                f"[autoscale] max_workers = {self.max_workers} is below min_workers = {self.min_workers}; "
                "raise max_workers (0 means the number of CPUs) or lower min_workers"
            )
        for key, lo, hi in (("interval", 0.01, 3600.0), ("headroom", 0.0, 10.0), ("cooldown", 0.0, 86400.0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ConfigError(f"[autoscale] {key} = {v!r} must be a number in [{lo:g}, {hi:g}]")

    @property
    def max_size(self) -> int:
        """max_workers, or the number of CPUs this process may use when it is 0 (never below min_workers)."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(self.max_workers or cpus, self.min_workers)

    @property
    def cooldown_s(self) -> float:
        return self.cooldown or 3.0 * self.interval


_SECRET_KEY = re.compile(r"(secret|access_key|key_id|token|password|credential|session)", re.IGNORECASE)


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageConfig:
    """[storage]: how this node reads sources in object storage (msdata_server.storage). Credentials never go
    here: the store's standard environment variables and credential files (AWS_ACCESS_KEY_ID, ...)."""

    s3_endpoint: str = (
        ""  # "http://host:port" or "https://..." of an S3-compatible endpoint; "": AWS (or AWS_ENDPOINT_URL)
    )
    s3_region: str = ""
    max_inflight: int = 64  # concurrent object requests of this node
    retries: int = 100  # retries of one request (throttling, 5xx, timeouts, resets), within give_up_s
    give_up_s: float = 600.0
    cache_dir: str = ""  # an on-disk LRU cache of fetched ranges shared by the node's jobs; "": off
    cache_gib: float = 0.0

    def __post_init__(self):
        for key in ("s3_endpoint", "s3_region", "cache_dir"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"[storage] {key} = {getattr(self, key)!r} must be a string")
        if self.s3_endpoint:
            scheme, sep, rest = self.s3_endpoint.partition("://")
            if scheme not in ("http", "https") or not sep or not rest or "@" in rest:
                raise ConfigError(
                    f"[storage] s3_endpoint = {self.s3_endpoint!r} must be a URL with its scheme, e.g. "
                    f'"http://127.0.0.1:9000" or "https://s3.example.com" (no credentials in it)'
                )
        _int("storage", "max_inflight", self.max_inflight, 1, 4096)
        _int("storage", "retries", self.retries, 0, 100000)
        for key, lo, hi in (("give_up_s", 0.0, 86400.0), ("cache_gib", 0.0, 1 << 20)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ConfigError(f"[storage] {key} = {v!r} must be a number in [{lo:g}, {hi:g}]")
        if self.cache_gib and not self.cache_dir:
            raise ConfigError("[storage] cache_gib is set without cache_dir; set cache_dir to a local directory")


def _parse_storage(t: object, base_dir: str | None) -> StorageConfig:
    if not isinstance(t, dict):
        raise ConfigError("[storage] must be a table")
    secret = sorted(k for k in t if _SECRET_KEY.search(k))
    if secret:
        raise ConfigError(
            f"[storage] {', '.join(secret)}: credentials never go in node.toml; give them in the store's "
            "environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE) "
            "or its credential files (~/.aws/credentials)"
        )
    _check_keys(t, StorageConfig, "storage")
    t = dict(t)
    v = t.get("cache_dir")
    if isinstance(v, str) and v and base_dir and not os.path.isabs(v):
        t["cache_dir"] = os.path.join(base_dir, v)
    return StorageConfig(**t)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    node: NodeConfig
    cluster: ClusterConfig | None = None
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    @property
    def role(self) -> str:
        return "single" if self.cluster is None else "follower"


def parse_config(doc: dict, *, base_dir: str | None = None) -> ServerConfig:
    """Validate a parsed node.toml; relative paths resolve against base_dir."""
    _check_keys(doc, ServerConfig, "top level")
    node_t = doc.get("node", {})
    if not isinstance(node_t, dict):
        raise ConfigError("[node] must be a table")
    _check_keys(node_t, NodeConfig, "node")
    node_t = dict(node_t)
    for key in ("socket", "state_dir"):
        v = node_t.get(key)
        if isinstance(v, str) and v and base_dir and not os.path.isabs(v):
            node_t[key] = os.path.join(base_dir, v)
    for key in ("allow_transforms", "data_roots"):
        if key in node_t:
            v = node_t[key]
            if isinstance(v, str) or not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
                raise ConfigError(f"[node] {key} = {v!r} must be a list of non-empty strings")
            if key == "data_roots" and base_dir:
                v = [x if os.path.isabs(x) or "://" in x else os.path.join(base_dir, x) for x in v]
            node_t[key] = tuple(v)
    for key, typ in (
        ("id", str),
        ("socket", str),
        ("listen", str),
        ("shm_prefix", str),
        ("state_dir", str),
        ("log_level", str),
        ("log_format", str),
        ("metrics", str),
    ):
        if key in node_t and not isinstance(node_t[key], typ):
            raise ConfigError(f"[node] {key} = {node_t[key]!r} must be a string")
    node = NodeConfig(**node_t)
    cluster = None
    if "cluster" in doc:
        ct = doc["cluster"]
        if not isinstance(ct, dict):
            raise ConfigError("[cluster] must be a table")
        _check_keys(ct, ClusterConfig, "cluster")
        ct = dict(ct)
        if "etcd" in ct:
            e = ct["etcd"]
            ct["etcd"] = (e,) if isinstance(e, str) else tuple(e)
        for key in ("token_file", *ClusterConfig.TLS_KEYS):  # relative paths resolve against node.toml's directory
            v = ct.get(key)
            if isinstance(v, str) and v and base_dir and not os.path.isabs(v):
                ct[key] = os.path.join(base_dir, v)
        cluster = ClusterConfig(**ct)
    auto_t = doc.get("autoscale", {})
    if not isinstance(auto_t, dict):
        raise ConfigError("[autoscale] must be a table")
    _check_keys(auto_t, AutoscaleConfig, "autoscale")
    storage = _parse_storage(doc.get("storage", {}), base_dir)
    return ServerConfig(node=node, cluster=cluster, autoscale=AutoscaleConfig(**auto_t), storage=storage)


def load_config(path: str | None) -> ServerConfig:
    """Read node.toml (None: all defaults)."""
    if path is None:
        return ServerConfig(node=NodeConfig())
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"node config {path!r} does not exist; pass --config PATH to an existing node.toml") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"node config {path!r} is not valid TOML: {e}") from None
    return parse_config(doc, base_dir=os.path.dirname(os.path.abspath(path)))
