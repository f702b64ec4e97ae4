"""Prometheus text at ``/metrics`` (ARCHITECTURE §4.6: names prefixed ``msdata_``, job series labelled ``job``).

Every scrape renders the node's status dict (what ``msdata-server status --json`` prints) through a custom
collector: the status stays the one source of truth, nothing is counted twice or kept in sync by hand.
Counters end in ``_total``, units are seconds, bytes or ratios, and labels come from bounded sets (jobs,
sources, ranks, ring groups, bad-sample kinds, the three roles). A figure's name is its status name: ``msdata_``,
its scope (``job``: the job's planner, for the whole job; ``source``: this node's loaders; ``rank``), the status
key with a unit word (bytes, seconds; ``_s`` is seconds, a fraction a ratio) moved to the end, ``_total`` on
counters (README, Operations, has the table; tests/test_names.py holds it to the code).

Status keys read (absent keys are skipped): ``node``, ``role``, ``uptime_s``, ``workers``, ``memory``;
``jobs[]``: ``name``, ``digest``, ``state``, ``world_size``, ``ranks``, ``steps_planned``,
``micro_batches_published``, ``imbalance``, ``padding_fraction``, ``plan_ms`` (mean per step),
``last_step.imbalance``, ``tokens_planned``, ``accounting{}``, ``mixture{}``, ``rings[]`` (``group``, ``slots``,
``in_use``, ``slot_size``), ``sources{}`` (``samples_done``, ``bytes_read``, ``tokens_read``,
``bad_samples{kind: n}``, ``errors``, ``held`` or ``ready``, ``held_bound``, ``held_pinned``, ``memory_bytes``,
``buffer_fill``, ``readahead``, ``inflight``, ``workers``),
``ranks_detail`` (the shape of ``msdata_server.ops.waits``); ``autoscale`` (ARCHITECTURE §4.6); ``cluster``
(``leader``, ``leader_token``, ``members``, ``links``, ``incoming``, ``lease_alive``, ``traffic``, ``runs``);
``storage`` (``requests``, ``bytes``, ``retries``, ``throttled``, ``errors``, ``latency_ms_p50``, ``latency_ms_p99``,
``cache_hits``, ``cache_misses``).

The server is a few lines on ``asyncio.start_server`` (no thread): a scrape calls ``status()`` on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from ..config import ROLES, parse_host_port
from ..errors import ConfigError

__all__ = ["METRICS", "StatusCollector", "families", "start_metrics_server"]

log = logging.getLogger(__name__)

_J, _S, _R = ("job",), ("job", "source"), ("job", "rank")

# name: (type, help, label names). The one table of what is exported.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "msdata_node_info": ("gauge", "This node server (always 1)", ("node", "role")),
    "msdata_role": ("gauge", "1 for this node's current role, 0 for the others", ("role",)),
    "msdata_uptime_seconds": ("gauge", "Seconds since the server started", ()),
    "msdata_workers": ("gauge", "Transform worker processes in the pool", ()),
    "msdata_jobs": ("gauge", "Jobs this server hosts", ()),
    "msdata_job_info": ("gauge", "A job hosted here (always 1)", ("job", "digest", "state")),
    "msdata_job_world_size": ("gauge", "Ranks of the job", _J),
    "msdata_job_ranks_connected": ("gauge", "Ranks of the job connected to this server", _J),
    "msdata_job_steps_planned_total": ("counter", "Training steps planned", _J),
    "msdata_job_micro_batches_published_total": ("counter", "Micro-batches published into rings", _J),
    "msdata_job_imbalance": ("gauge", "Mean over planned steps of max/mean DP rank cost (1 = balanced)", _J),
    "msdata_job_last_step_imbalance": ("gauge", "max/mean DP rank cost of the newest planned step", _J),
    "msdata_job_padding_ratio": ("gauge", "Mean share of each step's token capacity left as padding", _J),
    "msdata_job_plan_seconds_total": ("counter", "Planner compute time over all planned steps", _J),
    "msdata_job_tokens_planned_total": ("counter", "Tokens planned, per source", _S),
    "msdata_job_tokens_delivered_total": ("counter", "Tokens delivered (planned less skipped steps), per source", _S),
    "msdata_job_docs_delivered_total": ("counter", "Documents whose every piece was delivered, per source", _S),
    "msdata_job_tokens_skipped_total": ("counter", "Tokens of steps loader.skip dropped, per source", _S),
    "msdata_job_docs_skipped_total": ("counter", "Documents whose first piece was in a skipped step", _S),
    "msdata_job_bad_samples_total": ("counter", "Bad samples the planner passed over, per source", _S),
    "msdata_job_epochs_completed": ("gauge", "Whole passes over the source", _S),
    "msdata_job_epoch_progress_ratio": ("gauge", "Share of the source's current epoch read", _S),
    "msdata_job_mixture_target_ratio": ("gauge", "Share of tokens the mixture asks for at the newest step", _S),
    "msdata_job_mixture_delivered_ratio": ("gauge", "Share of the tokens delivered so far", _S),
    "msdata_source_samples_done_total": ("counter", "Samples read", _S),
    "msdata_source_read_bytes_total": ("counter", "Bytes read from storage", _S),
    "msdata_source_tokens_read_total": ("counter", "Tokens of the samples read", _S),
    "msdata_source_bad_samples_total": ("counter", "Samples skipped as bad, by kind", ("job", "source", "kind")),
    "msdata_source_errors_total": ("counter", "Read errors", _S),
    "msdata_source_held_payloads": ("gauge", "Sample payloads held in memory (read, not yet released)", _S),
    "msdata_source_held_payloads_bound": ("gauge", "The bound held payloads must stay within", _S),
    "msdata_source_pinned_payloads": ("gauge", "Held payloads pinned by planned, carried or looked-ahead pieces", _S),
    "msdata_source_held_bytes": ("gauge", "Bytes of the held payloads", _S),
    "msdata_source_readahead_fill_ratio": ("gauge", "Read-ahead buffer fill (ready / readahead)", _S),
    "msdata_source_readahead_samples": ("gauge", "The read-ahead bound in samples", _S),
    "msdata_source_inflight_reads": ("gauge", "Reads in flight", _S),
    "msdata_source_workers": ("gauge", "Workers assigned to the source", _S),
    "msdata_rank_micro_batches_delivered_total": ("counter", "Micro-batches delivered to the rank", _R),
    "msdata_rank_wait_seconds_total": ("counter", "Seconds the rank waited for data", _R),
    "msdata_rank_wait_p50_seconds": ("gauge", "Median data wait over the rank's recent batches", _R),
    "msdata_rank_wait_p99_seconds": ("gauge", "99th percentile data wait over recent batches", _R),
    "msdata_rank_wait_ratio": ("gauge", "Share of wall time the rank spent waiting for data", _R),
    "msdata_rank_step": ("gauge", "The rank's step at its newest report", _R),
    "msdata_ring_slots": ("gauge", "Ring slots of the group", ("job", "group")),
    "msdata_ring_slots_in_use": ("gauge", "Ring slots holding a batch not yet released", ("job", "group")),
    "msdata_ring_slot_bytes": ("gauge", "Size of one ring slot", ("job", "group")),
    "msdata_autoscale_enabled": ("gauge", "1 when the worker autoscaler runs", ()),
    "msdata_autoscale_workers": ("gauge", "Workers the autoscaler gives the source", ("source",)),
    "msdata_autoscale_partitions": ("gauge", "Partitions of the source", ("source",)),
    "msdata_autoscale_demand_samples_per_second": ("gauge", "Samples/s the trainers consume", ("source",)),
    "msdata_autoscale_supply_samples_per_second": ("gauge", "Samples/s the workers can produce", ("source",)),
    "msdata_autoscale_cpu_seconds_per_sample": ("gauge", "CPU seconds per sample", ("source",)),
    "msdata_cluster_leader_info": ("gauge", "The leader this node knows (always 1)", ("leader",)),
    "msdata_cluster_leader_token": ("gauge", "Fencing token of the current leader", ()),
    "msdata_cluster_members": ("gauge", "Nodes registered in the cluster", ()),
    "msdata_cluster_links": ("gauge", "Outgoing peer links up", ()),
    "msdata_cluster_incoming_links": ("gauge", "Incoming peer links", ()),
    "msdata_cluster_lease_alive": ("gauge", "1 while this node's etcd lease is alive", ()),
    "msdata_cluster_runs": ("gauge", "Cluster job runs this node takes part in", ()),
    "msdata_cluster_peer_received_bytes_total": ("counter", "Bytes received over peer links", ()),
    "msdata_cluster_peer_sent_bytes_total": ("counter", "Bytes sent over peer links", ()),
    "msdata_memory_server_pss_bytes": ("gauge", "PSS of the server process", ()),
    "msdata_memory_total_pss_bytes": ("gauge", "PSS of the server, its workers and helpers", ()),
    "msdata_memory_total_uss_bytes": ("gauge", "USS of the server, its workers and helpers", ()),
    "msdata_storage_requests_total": ("counter", "Object-store requests (every attempt, retries included)", ()),
    "msdata_storage_bytes_total": ("counter", "Bytes fetched from object storage", ()),
    "msdata_storage_retries_total": ("counter", "Object-store requests retried", ()),
    "msdata_storage_throttled_total": ("counter", "Object-store requests throttled (503 SlowDown, 429)", ()),
    "msdata_storage_errors_total": ("counter", "Object-store requests that failed for good", ()),
    "msdata_storage_latency_p50_seconds": ("gauge", "Median latency of recent object-store requests", ()),
    "msdata_storage_latency_p99_seconds": ("gauge", "99th percentile latency of recent object-store requests", ()),
    "msdata_storage_cache_hits_total": ("counter", "Reads served by the node's on-disk object cache", ()),
    "msdata_storage_cache_misses_total": ("counter", "Reads the on-disk object cache did not hold", ()),
}

# per-source status key -> metric
_SOURCE_KEYS = {
    "samples_done": "msdata_source_samples_done_total",
    "bytes_read": "msdata_source_read_bytes_total",
    "tokens_read": "msdata_source_tokens_read_total",
    "errors": "msdata_source_errors_total",
    "held_bound": "msdata_source_held_payloads_bound",
    "held_pinned": "msdata_source_pinned_payloads",
    "memory_bytes": "msdata_source_held_bytes",
    "buffer_fill": "msdata_source_readahead_fill_ratio",
    "readahead": "msdata_source_readahead_samples",
    "inflight": "msdata_source_inflight_reads",
    "workers": "msdata_source_workers",
}
_RANK_KEYS = {
    "micro_batches_delivered": "msdata_rank_micro_batches_delivered_total",
    "wait_s": "msdata_rank_wait_seconds_total",
    "wait_p50_s": "msdata_rank_wait_p50_seconds",
    "wait_p99_s": "msdata_rank_wait_p99_seconds",
    "wait_frac": "msdata_rank_wait_ratio",
    "step": "msdata_rank_step",
}
# per-source accounting and mixture keys (the job's planner) -> metric
_ACCOUNTING_KEYS = {
    "tokens_delivered": "msdata_job_tokens_delivered_total",
    "docs_delivered": "msdata_job_docs_delivered_total",
    "tokens_skipped": "msdata_job_tokens_skipped_total",
    "docs_skipped": "msdata_job_docs_skipped_total",
    "bad_samples": "msdata_job_bad_samples_total",
}
_MIXTURE_KEYS = {
    "target": "msdata_job_mixture_target_ratio",
    "delivered": "msdata_job_mixture_delivered_ratio",
    "epochs_completed": "msdata_job_epochs_completed",
    "epoch_progress": "msdata_job_epoch_progress_ratio",
}
_AUTOSCALE_KEYS = {
    "workers": "msdata_autoscale_workers",
    "partitions": "msdata_autoscale_partitions",
    "demand_samples_s": "msdata_autoscale_demand_samples_per_second",
    "supply_samples_s": "msdata_autoscale_supply_samples_per_second",
    "cpu_s_per_sample": "msdata_autoscale_cpu_seconds_per_sample",
}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    return float(v) if isinstance(v, (int, float)) else None


class _Samples:
    """Values per metric and label tuple; a repeated label tuple overwrites (a family never repeats a series)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in METRICS}

    def add(self, name: str, labels: tuple[Any, ...], value: Any) -> None:
        v = _num(value)
        if v is not None:
            self.values[name][tuple(str(x) for x in labels)] = v

    def families(self) -> Iterator[Metric]:
        for name, (kind, doc, labels) in METRICS.items():
            fam: Metric
            if kind == "counter":
                fam = CounterMetricFamily(name, doc, labels=labels)
            else:
                fam = GaugeMetricFamily(name, doc, labels=labels)
            for lv, v in self.values[name].items():
                fam.add_metric(list(lv), v)
            yield fam


def families(st: Mapping[str, Any]) -> list[Metric]:
    """The metric families of one status dict (pure)."""
    out = _Samples()
    role = st.get("role")
    out.add("msdata_node_info", (st.get("node", ""), role or "unknown"), 1)
    for r in ROLES:
        out.add("msdata_role", (r,), int(r == role))
    out.add("msdata_uptime_seconds", (), st.get("uptime_s"))
    out.add("msdata_workers", (), st.get("workers"))
    jobs = st.get("jobs") or []
    out.add("msdata_jobs", (), len(jobs))
    for k, v in (st.get("memory") or {}).items():
        name = f"msdata_memory_{k}_bytes"
        if _NAME.match(str(k)) and name in METRICS:
            out.add(name, (), v)
    for j in jobs:
        _job(out, j)
    _autoscale(out, st.get("autoscale"))
    _cluster(out, st.get("cluster"))
    _storage(out, st.get("storage"))
    return list(out.families())


def _storage(out: _Samples, s: Any) -> None:
    """The node-wide ``storage`` object: counters, and latencies in seconds."""
    if not isinstance(s, Mapping):
        return
    for key in ("requests", "bytes", "retries", "throttled", "errors", "cache_hits", "cache_misses"):
        out.add(f"msdata_storage_{key}_total", (), s.get(key))
    for q in ("p50", "p99"):
        ms = _num(s.get(f"latency_ms_{q}"))
        out.add(f"msdata_storage_latency_{q}_seconds", (), None if ms is None else ms / 1000.0)


def _job(out: _Samples, j: Mapping[str, Any]) -> None:
    job = str(j.get("name", ""))
    out.add("msdata_job_info", (job, j.get("digest", ""), j.get("state", "")), 1)
    out.add("msdata_job_world_size", (job,), j.get("world_size"))
    ranks = j.get("ranks")
    if isinstance(ranks, list):
        out.add("msdata_job_ranks_connected", (job,), len(ranks))
    steps = j.get("steps_planned")
    out.add("msdata_job_steps_planned_total", (job,), steps)
    out.add("msdata_job_micro_batches_published_total", (job,), j.get("micro_batches_published"))
    out.add("msdata_job_imbalance", (job,), j.get("imbalance"))
    out.add("msdata_job_last_step_imbalance", (job,), (j.get("last_step") or {}).get("imbalance"))
    out.add("msdata_job_padding_ratio", (job,), j.get("padding_fraction"))
    plan_ms = _num(j.get("plan_ms"))
    if plan_ms is not None and isinstance(steps, int):
        out.add("msdata_job_plan_seconds_total", (job,), plan_ms * steps / 1000.0)  # status has the mean
    for src, n in (j.get("tokens_planned") or {}).items():
        out.add("msdata_job_tokens_planned_total", (job, src), n)
    for table, keys in (("accounting", _ACCOUNTING_KEYS), ("mixture", _MIXTURE_KEYS)):
        for src, figs in (j.get(table) or {}).items():
            for key, name in keys.items():
                out.add(name, (job, src), figs.get(key))
    for src, s in (j.get("sources") or {}).items():
        for key, name in _SOURCE_KEYS.items():
            out.add(name, (job, src), s.get(key))
        out.add("msdata_source_held_payloads", (job, src), s.get("held", s.get("ready")))
        for kind, n in (s.get("bad_samples") or {}).items():
            out.add("msdata_source_bad_samples_total", (job, src, kind), n)
    for rank, d in (j.get("ranks_detail") or {}).items():
        for key, name in _RANK_KEYS.items():
            out.add(name, (job, rank), d.get(key))
    groups: dict[str, list[float]] = {}  # a group may have several rings: one series per (job, group)
    for r in j.get("rings") or []:
        g = groups.setdefault(str(r.get("group")), [0, 0, 0])
        g[0] += _num(r.get("slots")) or 0
        g[1] += _num(r.get("in_use")) or 0
        g[2] = max(g[2], _num(r.get("slot_size")) or 0)
    for group, (slots, in_use, size) in groups.items():
        out.add("msdata_ring_slots", (job, group), slots)
        out.add("msdata_ring_slots_in_use", (job, group), in_use)
        out.add("msdata_ring_slot_bytes", (job, group), size)


def _autoscale(out: _Samples, a: Any) -> None:
    if not isinstance(a, Mapping):
        return
    out.add("msdata_autoscale_enabled", (), a.get("enabled"))
    for src, s in (a.get("sources") or {}).items():
        for key, name in _AUTOSCALE_KEYS.items():
            out.add(name, (src,), s.get(key))


def _cluster(out: _Samples, c: Any) -> None:
    if not isinstance(c, Mapping):
        return
    if c.get("leader") is not None:
        out.add("msdata_cluster_leader_info", (c["leader"],), 1)
    out.add("msdata_cluster_leader_token", (), c.get("leader_token"))
    for key, name in (
        ("members", "msdata_cluster_members"),
        ("links", "msdata_cluster_links"),
        ("incoming", "msdata_cluster_incoming_links"),
        ("runs", "msdata_cluster_runs"),
    ):
        if isinstance(c.get(key), list):
            out.add(name, (), len(c[key]))
    out.add("msdata_cluster_lease_alive", (), c.get("lease_alive"))
    traffic = c.get("traffic") or {}
    out.add("msdata_cluster_peer_received_bytes_total", (), traffic.get("bytes_in"))
    out.add("msdata_cluster_peer_sent_bytes_total", (), traffic.get("bytes_out"))


class StatusCollector(Collector):
    """Calls ``status()`` once per scrape and yields its metric families."""

    def __init__(self, status: Callable[[], Mapping[str, Any]]):
        self._status = status

    def describe(self) -> list[Metric]:
        return []  # registering must not call status()

    def collect(self) -> Iterator[Metric]:
        yield from families(self._status())


_MAX_REQUEST = 8192
_READ_TIMEOUT = 5.0


async def start_metrics_server(addr: str, status: Callable[[], Mapping[str, Any]]) -> tuple[asyncio.Server, int]:
    """Serve GET /metrics on ``addr`` ("HOST:PORT", port 0: any); returns the server and its bound port.

    A malformed address or one that cannot be bound (in use, not local) raises ConfigError.
    Close it with ``server.close(); await server.wait_closed()``. One request per connection; a request
    that is not complete within 5 s or exceeds 8 KiB is dropped.
    """
    host, port = parse_host_port(addr, "metrics")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
            method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if path != "/metrics":
                code, ctype, body = "404 Not Found", "text/plain; charset=utf-8", b"not found; try /metrics\n"
            elif method not in ("GET", "HEAD"):
                code, ctype, body = "405 Method Not Allowed", "text/plain; charset=utf-8", b"use GET\n"
            else:
                try:
                    code, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest(registry)
                except Exception:  # a bug in status() must cost one scrape, not the server
                    log.exception("rendering /metrics failed")
                    code, ctype, body = "500 Internal Server Error", "text/plain; charset=utf-8", b"error\n"
            writer.write(
                f"HTTP/1.1 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode("latin-1")
            )
            if method != "HEAD":
                writer.write(body)
            await asyncio.wait_for(writer.drain(), _READ_TIMEOUT)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # the scraper went away or sent garbage: nothing to answer
        finally:
            writer.close()

    try:
        server = await asyncio.start_server(handle, host, port, limit=_MAX_REQUEST)
    except OSError as e:
        raise ConfigError(
            f'[node] metrics = {addr!r} cannot be served: {e}; choose a free port, or "" to turn the exporter off'
        ) from None
    bound = server.sockets[0].getsockname()[1]
    log.info("Prometheus metrics at http://%s:%d/metrics", host, bound)
    return server, bound
