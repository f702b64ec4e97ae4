"""Scale benchmark (issue 29): the real leader against N simulated nodes, and many sources on one node.

    python bench/scale.py [--quick | --smoke]

Leader part: one process runs the real leader code (``ClusterNode``: etcd membership, election and peer links;
``Coordinator``/``JobCoordinator``: start barrier, planner in a thread, fenced etcd state writes, per-node plan
slices over the links). Child processes (one per 128 nodes, at most 4; ``--case N,S,STEPS,PROCS`` sets it) run
N simulated nodes: each a real ``PeerServer`` (the peer protocol and its token handshake) registered in the
same etcd, owning 8 ranks (8 data groups: tp = 1) and its share of the partitions; it decodes each slice with
the real decoder (``planwire.decode_plan``, ``plan_state``) and acknowledges as a node does (the last step
fed, when ``context.ack_due`` says: it feeds at once), building no batch. What the nodes measure stays in their
process until the leader's harness asks for it after the timed steps (stdin/stdout), so measuring adds no
frames to the leader's links. The planner reads synthetic text4 lengths (``workloads.SyntheticLengths``)
through the leader's own run; nothing is read from disk. Cases: N = 8, 64, 512 (dp 64, 512, 4,096), 16k
context, 4 micro-batches, text4's 4 sources; and S = 64 and 1,024 sources at N = 64.

Measured per case, over the steps after the first two: leader bytes sent per step (its peer links' counter)
and the ratio to one full plan's frame; the largest node's bytes per step; plan ready -> the last node has
decoded its slice (p50/p99 ms; every process reads the one system-wide monotonic clock), over steps paced
so that each is planned once the one before is everywhere (the nodes feed ``prefetch_steps`` behind their
newest plan: here the planner thread would otherwise take the cores the nodes decode on; the free-running
figure is ``plan_to_all_pipelined_ms_p99``); beside it the model
of the same on machines of their own (``plan_to_all_model_ms_p99``: the CPU the leader's event loop spends
from the plan ready to its last slice handed to the kernel, plus one node's decode CPU, p99), since here the
leader, 512 nodes and etcd share two cores; leader CPU s per step (the process) beside the planner's own (its
thread's CPU) and the CPU making up the synthetic lengths it reads (through the event loop; a cluster's
partition owners read them), the leader's overhead being the rest (``leader_overhead_with_lengths_ms``: with
them); etcd request bytes and writes per step (the leader's client); steps/s the leader sustains (nodes feed at
once: planning and distribution are the limit). The plan-ready instant, the last slice's send and the
planner's CPU are read by wrapping ``JobCoordinator.frame_batches``, ``JobCoordinator._plan_one`` and
``Planner.plan_step`` in this process (measurement only).

The last line is one JSON object (keys of DESIGN 4.7). Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import itertools
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from workloads import COST, TEXT4, LengthDist, SyntheticLengths, Workload  # noqa: E402

SEQ = 16384
MICRO = 4
RANKS_PER_NODE = 8
PACED = 8  # steps timed for plan -> all (paced: ``_latency``); --quick: 6


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _raise_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def workload(n_sources: int) -> Workload:
    """text4 itself (4 sources), or ``n_sources`` sources cycling through its four length distributions."""
    if n_sources == len(TEXT4.sources):
        return TEXT4
    dists = list(TEXT4.sources.values())
    names = [f"s{i:04d}" for i in range(n_sources)]
    srcs: dict[str, LengthDist] = {n: dists[i % len(dists)] for i, n in enumerate(names)}
    return Workload(
        name=f"text4x{n_sources}", description="", seq_lens=(SEQ,), weights=dict.fromkeys(names, 1.0), sources=srcs
    )


def job_dict(wl: Workload, dp: int, data: Path) -> dict:
    data.mkdir(parents=True, exist_ok=True)
    f = data / "one.jsonl"
    f.write_text('{"text": "x"}\n')
    return {
        "job": {"name": "scale", "seed": 7, "seq_len": SEQ, "micro_batches": MICRO, "rows": 1},
        "mesh": {"dp": dp, "pp": 1, "cp": 1, "tp": 1},
        "source": [
            {
                "name": n,
                "format": "jsonl",
                "paths": [str(f)],
                "column": "text",
                "transform": "msdata_server.transforms:byte_tokens",
            }
            for n in wl.sources
        ],
        "mix": {"weights": dict(wl.weights)},
        "balance": {"cost": "attention", **COST},
    }


# ---- the simulated nodes (child processes) ----------------------------------------------------------------
async def sim_nodes(n: int, first: int, etcd_url: str, prefix: str, token_file: str, ttl: float) -> None:
    """Simulated nodes ``first`` .. ``first + n - 1``: PeerServers registered under one lease; each decodes its
    slices (the real decoder) and acknowledges them as a node does (``ClusterContext.ack``'s frame, at its
    pace: ``ack_due``), or, once paced (stdin ``ack STEP``: every node acknowledges STEP now, then only when
    told), when the harness says. What each node measured stays here until the leader asks (stdin ``wait
    STEP``: once every node here decoded STEP, one JSON line: step -> [[received at, decode ms, bytes, pieces],
    ...] of the steps not reported yet), so the measurement adds no frames to the leader's receive path; stdin's
    end stops the nodes. One command at a time: each is answered before the next is sent."""
    from msdata_client.spec import JobSpec
    from msdata_server.cluster import Etcd
    from msdata_server.cluster.context import ack_due
    from msdata_server.cluster.net.peers import PeerServer
    from msdata_server.cluster.planwire import decode_plan, plan_state
    from msdata_server.errors import PeerLostError, ProtocolError

    token = Path(token_file).read_text().strip()  # noqa: ASYNC240  (once, before the loop serves anything)
    servers: list[PeerServer] = []
    records: dict[int, list[tuple]] = {}  # step -> what each node here measured of it (until reported)
    acked: dict[str, int] = {}  # node -> the last step it acknowledged
    newest: dict[int, tuple[int, str, str, str]] = {}  # node -> its newest plan's step, digest, run and peer
    changed = asyncio.Event()
    run = {"window": 1, "paced": 0, "reported": -1}  # window: how far the leader plans past the lowest
    # acknowledged step (from the run's start); paced: 1 once the harness says when to acknowledge

    def handler_of(i: int):
        nid = f"sim{i:04d}"

        async def handle(peer: str, frame: dict, payload: memoryview | None) -> None:
            if frame.get("t") == "jstart":  # as a node's Run reads it: the job's prefetch_steps + 1
                run["window"] = JobSpec.from_dict(frame["spec"]).prefetch_steps + 1
            if frame.get("t") != "plan":
                return
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                plan = decode_plan(frame, payload)
                plan_state(frame, payload)
            except ProtocolError:
                return
            got = time.monotonic()
            decode_ms, decode_cpu_ms = (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3
            size = len(orjson.dumps(frame)) + (0 if payload is None else len(payload))
            records.setdefault(plan.step, []).append((got, decode_ms, size, len(plan), decode_cpu_ms))
            changed.set()
            newest[i] = (plan.step, frame["digest"], frame["run"], peer)
            if not run["paced"] and ack_due(plan.step, acked.get(nid), plan.step, run["window"]):
                await acknowledge(i, plan.step)  # fed at once: the newest plan held is the one fed

        return handle

    async def acknowledge(i: int, fed: int) -> None:
        """Node ``i`` tells the leader it fed up to step ``fed`` (unless it told it that or more already)."""
        nid = f"sim{i:04d}"
        if i not in newest or fed <= acked.get(nid, -1):
            return
        _, digest, run_id, peer = newest[i]
        link = servers[i - first].links.get(peer)
        if link is None:
            return
        acked[nid] = fed
        with contextlib.suppress(PeerLostError, ConnectionError):
            await link.send({"t": "ack", "digest": digest, "run": run_id, "node": nid, "step": fed})

    async def report(step: int) -> None:
        while len(records.get(step, ())) < n:
            changed.clear()
            await changed.wait()
        print(json.dumps({s: records.pop(s) for s in sorted(records) if run["reported"] < s <= step}), flush=True)
        run["reported"] = max(run["reported"], step)

    async def ack_all(step: int) -> None:
        run["paced"] = 1
        await asyncio.gather(*(acknowledge(i, step) for i in range(first, first + n)))
        print("acked", flush=True)

    async with Etcd([etcd_url]) as etcd:
        lease = await etcd.lease_grant(ttl)
        stop = asyncio.Event()

        async def keep_alive() -> None:  # from the grant on: 512 registrations may outlast one TTL under load
            while not stop.is_set():
                await etcd.lease_keepalive_once(lease)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), ttl / 4)

        keeper = asyncio.ensure_future(keep_alive())
        for i in range(first, first + n):
            srv = PeerServer(token=token, node_id=f"sim{i:04d}", handler=handler_of(i))
            port = await srv.start("127.0.0.1", 0)
            servers.append(srv)
            rec = {"id": f"sim{i:04d}", "listen": f"127.0.0.1:{port}", "pid": os.getpid()}
            await etcd.put(f"{prefix}/nodes/sim{i:04d}", orjson.dumps(rec), lease=lease)
        # what is here now lives as long as the nodes: out of the cyclic collector's way, whose passes over it
        # (the 128 nodes' links and servers) would otherwise land on the decodes the benchmark times
        gc.collect()
        gc.freeze()
        print("ready", flush=True)
        asks: set[asyncio.Task] = set()

        def command() -> None:
            line = sys.stdin.buffer.readline()
            if not line:
                stop.set()
            elif line.startswith((b"wait ", b"ack ")):
                word, step = line.split()
                t = asyncio.ensure_future((report if word == b"wait" else ack_all)(int(step)))
                asks.add(t)
                t.add_done_callback(asks.discard)

        asyncio.get_running_loop().add_reader(sys.stdin.fileno(), command)
        await stop.wait()
        for t in list(asks):
            t.cancel()
        await keeper
        await etcd.lease_revoke(lease)
        for srv in servers:
            await srv.aclose()


class Sims:
    """The simulated nodes' processes: N nodes in ``procs`` processes (one process decoding every slice in
    turn would put its own queue into plan -> all; real nodes decode in parallel). Every process reads the one
    system-wide monotonic clock, as the leader does."""

    def __init__(self, n: int, procs: int, etcd_url: str, prefix: str, token_file: Path) -> None:
        cuts = [n * k // procs for k in range(procs + 1)]
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--sim",
                    str(b - a),
                    "--sim-first",
                    str(a),
                    "--etcd",
                    etcd_url,
                    "--prefix",
                    prefix,
                    "--token-file",
                    str(token_file),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            for a, b in itertools.pairwise(cuts)
            if b > a
        ]

    def cpu(self) -> float:
        """The CPU seconds the simulated nodes' processes used so far (Linux: /proc)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for p in self.procs:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    async def _line(self, p: subprocess.Popen) -> bytes:
        assert p.stdout is not None
        return await asyncio.to_thread(p.stdout.readline)

    async def ready(self) -> None:
        for line in await asyncio.gather(*(self._line(p) for p in self.procs)):
            if line.strip() != b"ready":
                raise RuntimeError(f"the simulated nodes did not start: {line!r}")

    async def ack(self, step: int) -> None:
        """Every node acknowledges ``step`` now (once they have: the leader may plan up to step + window), and
        from now on only when told."""
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"ack {step}\n".encode())
            p.stdin.flush()
        for line in await asyncio.gather(*(self._line(p) for p in self.procs)):
            if line.strip() != b"acked":
                raise RuntimeError(f"the simulated nodes did not acknowledge: {line!r}")

    async def wait(self, step: int, timeout: float) -> dict[int, list[list[float]]]:  # noqa: ASYNC109
        """Once every node decoded ``step``: what they measured of the steps up to it not returned before."""
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"wait {step}\n".encode())
            p.stdin.flush()
        lines = await asyncio.wait_for(asyncio.gather(*(self._line(p) for p in self.procs)), timeout)
        out: dict[int, list[list[float]]] = {}
        for line in lines:
            if not line:
                raise RuntimeError("a simulated nodes' process ended")
            for s, recs in json.loads(line).items():
                out.setdefault(int(s), []).extend(recs)
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---- the leader (this process) -----------------------------------------------------------------------------
class BenchRun:
    """The leader node's own run (``HeldRun``): the partition layout over the live members, synthetic lengths."""

    def __init__(self, layout, lengths: SyntheticLengths) -> None:
        self.id = ""
        self._layout = layout
        self._lengths = lengths
        self.cpu = 0.0  # seconds making up lengths (in a cluster the partitions' owners read them)

    @property
    def layout(self):
        return self._layout

    async def lengths(self, s: int, start: int, count: int) -> np.ndarray:
        t = time.thread_time()
        out = self._lengths.lengths(s, start, count)
        self.cpu += time.thread_time() - t
        return out

    async def vision(self, s: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError("text only")


class BenchRuns:
    def __init__(self) -> None:
        self.run: BenchRun | None = None
        self.digest = ""

    def held(self, digest: str, run_id: str) -> BenchRun | None:
        run = self.run
        return run if run is not None and digest == self.digest and run.id == run_id else None


class Probe:
    """Measurement wrappers: when each step's plan was ready, the planner thread's CPU, etcd requests."""

    def __init__(self) -> None:
        self.ready: dict[int, float] = {}
        self.sent: dict[int, tuple[float, float]] = {}  # step -> when the leader handed its last slice to the
        # kernel, and the CPU its event loop's thread had used by then
        self.ready_cpu: dict[int, float] = {}  # step -> that thread's CPU when the plan was ready
        self.snap: dict[int, tuple[float, float, int, int, int, float, float]] = {}  # step -> counters when ready
        self.plan_cpu = 0.0  # the planner thread's CPU seconds so far
        self.run: BenchRun | None = None  # its synthetic lengths' CPU
        self.traffic = None
        self.last_plan = None
        self.etcd_bytes = 0
        self.etcd_writes = 0
        self._undo: list = []

    def install(self) -> None:
        from msdata_server.cluster.leader import coordinator
        from msdata_server.cluster.net.etcd import Etcd
        from msdata_server.planner import Planner

        probe = self
        jc = coordinator.JobCoordinator
        frames0, one0, plan0, raw0 = jc.frame_batches, jc._plan_one, Planner.plan_step, Etcd._raw

        def frames(self, plan, extra, table, nodes, only=None):
            if only is None and plan.step not in probe.ready:
                now = probe.ready[plan.step] = time.monotonic()
                probe.ready_cpu[plan.step] = time.thread_time()
                out = probe.traffic.bytes_out if probe.traffic is not None else 0
                probe.snap[plan.step] = (
                    now,
                    time.process_time(),
                    out,
                    probe.etcd_bytes,
                    probe.etcd_writes,
                    probe.plan_cpu,
                    probe.run.cpu if probe.run is not None else 0.0,
                )
                probe.last_plan = plan
            return frames0(self, plan, extra, table, nodes, only)

        async def plan_one(self, view):  # plan, store, and hand every node its slice (the sends awaited)
            went = await one0(self, view)
            probe.sent[self.planned - 1] = (time.monotonic(), time.thread_time())
            return went

        def plan_step(self, view):
            t = time.thread_time()
            plan = plan0(self, view)
            probe.plan_cpu += time.thread_time() - t
            return plan

        async def raw(self, path, payload):
            status, body = await raw0(self, path, payload)
            probe.etcd_bytes += len(orjson.dumps(payload)) + len(body)
            if path.endswith(("/kv/put", "/kv/txn")):
                probe.etcd_writes += 1
            return status, body

        jc.frame_batches, jc._plan_one = frames, plan_one
        Planner.plan_step = plan_step
        Etcd._raw = raw
        self._undo = [
            (jc, "frame_batches", frames0),
            (jc, "_plan_one", one0),
            (Planner, "plan_step", plan0),
            (Etcd, "_raw", raw0),
        ]

    def remove(self) -> None:
        for cls, name, fn in self._undo:
            setattr(cls, name, fn)


async def leader_case(
    n: int, n_sources: int, steps: int, base: Path, etcd_url: str, procs: int = 0, paced: int = PACED
) -> dict:
    """One case: the real leader here, ``n`` simulated nodes in ``procs`` processes (0: one per 128 nodes, at
    most 4); the figures of ``steps`` steps after the first two (nodes feeding at once), then plan -> all over
    ``paced`` steps with the nodes feeding ``window - 1`` steps behind their newest plan, so that the leader
    plans a step only once the last one is everywhere (``_latency``)."""
    from msdata_client.spec import JobSpec
    from msdata_server.cluster.context import ClusterContext
    from msdata_server.cluster.leader.coordinator import Coordinator
    from msdata_server.cluster.net.rpc import PeerRpc
    from msdata_server.cluster.net.runtime import ClusterNode
    from msdata_server.cluster.placement import PartitionLayout, partition_costs
    from msdata_server.cluster.planwire import encode_plan
    from msdata_server.config import AutoscaleConfig, parse_config
    from msdata_server.tasks import TaskSet

    prefix = "/scale" + secrets.token_hex(4)
    token_file = base / "token"
    if not token_file.exists():
        token_file.write_text(secrets.token_hex(16))
        token_file.chmod(0o600)
    ttl = 30.0  # the leader's own lease: a loaded machine must not cost it the lead mid-run
    cfg = parse_config(
        {
            "node": {"id": "leader", "listen": "127.0.0.1:0", "socket": str(base / "l.sock")},
            "cluster": {"etcd": [etcd_url], "token_file": str(token_file), "prefix": prefix, "lease_ttl": ttl},
        }
    )
    wl = workload(n_sources)
    dp = n * RANKS_PER_NODE
    spec = JobSpec.from_dict(job_dict(wl, dp, base / "data"))
    procs = procs or max(1, min(4, n // 128))
    sims = Sims(n, procs, etcd_url, prefix, token_file)
    probe = Probe()
    runs = BenchRuns()
    coord: Coordinator | None = None
    node: ClusterNode | None = None
    try:
        await sims.ready()

        async def on_frame(peer: str, frame: dict, payload: memoryview | None) -> None:
            if coord is not None and frame.get("t") in ("ack", "need", "jobs"):
                coord.on_frame(frame)

        async def local(nid: str, frame: dict, payload: memoryview | None) -> None:
            if frame.get("t") == "jstart" and runs.run is not None:
                runs.run.id = str(frame["run"])

        say(f"  N={n}: {n} simulated nodes registered ({len(sims.procs)} processes); the leader joins")
        node = ClusterNode(cfg, handler=on_frame)
        tasks = TaskSet("bench")
        rpc = PeerRpc(node, "leader", local, timeout=30.0)
        ctx = ClusterContext(
            node_id="leader", config=cfg.cluster, autoscale=AutoscaleConfig(), rpc=rpc, tasks=tasks, cluster=node
        )
        await node.start()
        await ctx.wait_leader()
        say(f"  N={n}: leading ({ctx.token}); linking")
        want = {f"sim{i:04d}" for i in range(n)}
        t0 = time.monotonic()
        while not want <= set(node.links):
            if time.monotonic() - t0 > 120:
                raise RuntimeError(f"linked to {len(node.links)} of {n} simulated nodes in 120 s")
            await asyncio.sleep(0.05)  # polling a counter in a benchmark harness, not synchronisation
        say(f"  N={n}: linked to every simulated node; the run starts")
        live = ctx.live_nodes()
        layout = PartitionLayout(
            spec.name,
            len(spec.sources),
            len(live),
            0,
            partition_costs(spec.mix, spec.source_names(), len(live)),
            ctx.live_nodes,
            "leader",
        )
        runs.run = probe.run = BenchRun(layout, SyntheticLengths(wl, SEQ, seed=0))
        runs.digest = spec.digest()
        probe.traffic = node.traffic
        probe.install()
        coord = Coordinator(ctx, runs)
        coord.on_role("leader")
        for i in range(n):
            nid = f"sim{i:04d}"
            ranks = {str(r): {"pos": [0, 0]} for r in range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE)}
            entry = {"digest": runs.digest, "name": spec.name, "spec": spec.to_dict(), "inst": f"i{i}"}
            entry.update(ranks=ranks, run=None, running=False, next=None, fed=None)
            coord.on_frame({"t": "jobs", "node": nid, "jobs": [entry]})
        first = 1  # warm-up: steps 0 and 1 everywhere
        await sims.wait(first, 600)
        end = first + steps
        got = await sims.wait(end, 900)
        t_start = time.monotonic()
        while end + 1 not in probe.snap:  # the counters at the next plan's readiness close the timed span
            if time.monotonic() - t_start > 300 or not coord.leading:
                raise RuntimeError("the leader planned no step past the timed ones (it lost its lead?)")
            await asyncio.sleep(0.005)  # polling a counter in a benchmark harness, not synchronisation
        figures = _figures(probe, got, first, end, spec, runs.digest, encode_plan)
        window = spec.prefetch_steps + 1
        settle = end + window + 2  # the steps planned ahead before the pacing took hold, and one more
        sim_cpu = 0.0
        for s in range(end + 1, settle + paced + 1):  # each step acknowledged once it is everywhere: the
            got.update(await sims.wait(s, 900))  # leader plans the next (s + 1 - window + window) then, and no
            await sims.ack(s + 1 - window)  # acknowledgement reaches it while a step is distributed
            if s == settle:
                sim_cpu = sims.cpu()
        sim_cpu = sims.cpu() - sim_cpu  # the paced steps' receiving, decoding, reporting and acknowledging
        return (
            figures
            | _latency(probe, got, range(settle + 1, settle + paced + 1))
            | {"nodes": n, "dp": dp, "sources": n_sources, "sim_procs": len(sims.procs)}
            | {"sim_cpu_ms_per_step": sim_cpu / paced * 1e3}
        )
    finally:
        probe.remove()
        if coord is not None:
            await coord.aclose()
        if node is not None:
            await node.aclose()
        sims.close()


def _figures(probe: Probe, got: dict, first: int, end: int, spec, digest: str, encode_plan) -> dict:
    """The case's figures over steps first+1 .. end, from the leader's probe and what the nodes measured."""
    a, b = probe.snap[first], probe.snap[end]  # counters from step first's plan ready to step end's
    k = end - first
    wall, cpu, out = b[0] - a[0], b[1] - a[1], b[2] - a[2]
    etcd_b, etcd_w, plan_cpu, made = b[3] - a[3], b[4] - a[4], b[5] - a[5], b[6] - a[6]
    timed = range(first + 1, end + 1)
    arrive = [(max(r[0] for r in got[s]) - probe.ready[s]) * 1e3 for s in timed]
    node_bytes = max(r[2] for s in timed for r in got[s])
    n = len(got[end])
    plan = probe.last_plan
    h, body = encode_plan(plan, job=spec.name, digest=digest, token=1)
    full = len(orjson.dumps(h)) + len(body)
    return {
        "pieces": len(plan),
        "plan_bytes": full,
        "leader_bytes_per_step": out / k,
        "leader_fanout_ratio": out / k / full,
        "node_bytes_max": node_bytes,
        "node_bytes_ratio": node_bytes * n / full,
        # plan -> all while the leader plans the next steps meanwhile (on two shared cores, the planner thread
        # takes the CPU the nodes decode on; on a cluster it is the leader's own): beside ``_latency``'s
        "plan_to_all_pipelined_ms_p50": float(np.percentile(arrive, 50)),
        "plan_to_all_pipelined_ms_p99": float(np.percentile(arrive, 99)),
        "leader_cpu_s_per_step": cpu / k,
        "planner_cpu_s_per_step": plan_cpu / k,
        "lengths_cpu_s_per_step": made / k,
        # beyond planning: slicing, encoding, sending, etcd, acknowledgements (not making up the synthetic
        # lengths the planner reads, which a cluster's partition owners read; with them: the next key)
        "leader_overhead_ms": (cpu - plan_cpu - made) / k * 1e3,
        "leader_overhead_with_lengths_ms": (cpu - plan_cpu) / k * 1e3,
        "etcd_bytes_per_step": etcd_b / k,
        "etcd_writes_per_step": etcd_w / k,
        "steps_per_s": k / wall,
        "steps": k,
    }


def _latency(probe: Probe, got: dict, steps: range) -> dict:
    """Plan ready -> the last node has decoded its slice over ``steps``, paced (each planned once the one before
    was everywhere: the nodes' decoding shares the cores with the leader's distribution only, not with its
    planner), and its model: the leader's event loop's CPU from the plan ready to its last slice handed to the
    kernel (its wall time when it has a core to itself), then one node's decode CPU (its own core): what plan
    -> all is on machines that do not share two cores among the leader, 512 nodes and the rest, less the wire
    time. ``paced_overlaps``: steps planned before the one before was everywhere (0 when the pacing held)."""
    arrive = [(max(r[0] for r in got[s]) - probe.ready[s]) * 1e3 for s in steps]
    overlaps = sum(1 for s in steps if probe.ready[s] < max(r[0] for r in got[s - 1]))
    out_ms = [(probe.sent[s][0] - probe.ready[s]) * 1e3 for s in steps]
    out_cpu_ms = [(probe.sent[s][1] - probe.ready_cpu[s]) * 1e3 for s in steps]
    dec = float(np.percentile([r[1] for s in got for r in got[s]], 99))
    dec_cpu = float(np.percentile([r[4] for s in got for r in got[s]], 99))
    return {
        "plan_to_all_ms_p50": float(np.percentile(arrive, 50)),
        "plan_to_all_ms_p99": float(np.percentile(arrive, 99)),
        "plan_to_all_model_ms_p99": float(np.percentile([x + dec_cpu for x in out_cpu_ms], 99)),
        "send_all_ms_p99": float(np.percentile(out_ms, 99)),
        "send_all_cpu_ms_p99": float(np.percentile(out_cpu_ms, 99)),
        "node_decode_ms_p99": dec,
        "node_decode_cpu_ms_p99": dec_cpu,
        "paced_steps": len(steps),
        "paced_overlaps": overlaps,
    }


def run_leader(cases: Sequence[tuple[int, ...]], paced: int = PACED, loop: str = "uvloop") -> list[dict]:
    """Each case (N, S, steps[, simulated nodes' processes]) against one etcd, then ``paced`` paced steps; a
    line of figures per case. The leader runs on ``loop`` ("uvloop": as ``msdata-server`` runs, cli.py; or
    "asyncio")."""
    import uvloop

    factory = uvloop.new_event_loop if loop == "uvloop" else None
    sys.path.insert(0, str(ROOT / "tests"))
    from etcd_fixture import EtcdServer

    base = Path(tempfile.mkdtemp(prefix="msdscale-"))
    srv = EtcdServer(base).start()
    try:
        rows = []
        for n, s, steps, *procs in cases:
            with asyncio.Runner(loop_factory=factory) as runner:
                r = runner.run(leader_case(n, s, steps, base, srv.url, *(procs or [0]), paced=paced))
            rows.append(r)
            say(
                f"N={n:>4} dp={r['dp']:>5} S={s:>5}: plan {r['plan_bytes'] / 1e6:.2f} MB ({r['pieces']} pieces); "
                f"leader {r['leader_bytes_per_step'] / 1e6:.2f} MB/step (x{r['leader_fanout_ratio']:.2f}), "
                f"largest node {r['node_bytes_max'] / 1e3:.1f} kB (x{r['node_bytes_ratio']:.2f} of plan/N); "
                f"plan->all p50 {r['plan_to_all_ms_p50']:.1f} p99 {r['plan_to_all_ms_p99']:.1f} ms paced "
                f"({r['paced_steps']} steps, {r['paced_overlaps']} overlapped; pipelined: p99 "
                f"{r['plan_to_all_pipelined_ms_p99']:.1f}; "
                f"sent {r['send_all_ms_p99']:.1f}, nodes in {r['sim_procs']} processes; model: sending CPU "
                f"{r['send_all_cpu_ms_p99']:.1f} + decode CPU {r['node_decode_cpu_ms_p99']:.2f} = "
                f"{r['plan_to_all_model_ms_p99']:.1f}); "
                f"leader CPU {r['leader_cpu_s_per_step'] * 1e3:.0f} ms/step "
                f"(planner {r['planner_cpu_s_per_step'] * 1e3:.0f}, its synthetic lengths "
                f"{r['lengths_cpu_s_per_step'] * 1e3:.0f}; beyond: {r['leader_overhead_ms']:.0f}); "
                f"simulated nodes' CPU {r['sim_cpu_ms_per_step']:.0f} ms/paced step; "
                f"etcd {r['etcd_bytes_per_step'] / 1e3:.1f} kB, {r['etcd_writes_per_step']:.1f} writes/step; "
                f"{r['steps_per_s']:.2f} steps/s"
            )
        return rows
    finally:
        srv.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 8, 64 and 512 with fewer timed steps")
    ap.add_argument("--smoke", action="store_true", help="seconds: N = 2 and 4, small dp")
    ap.add_argument("--case", action="append", help="N,S,STEPS[,PROCS]: run only these leader cases")
    ap.add_argument("--paced", type=int, help=f"steps timed for plan -> all (default {PACED}; --quick 6)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the leader's event loop")
    ap.add_argument("--sim", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sim-first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--etcd", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", help=argparse.SUPPRESS)
    ap.add_argument("--token-file", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where the plot goes")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: where a stuck run waits
    _raise_fd_limit()
    if args.sim:  # on uvloop: a frame's socket reads, callbacks and task wake-ups cost a simulated node less
        # there (its bench overhead beside the real decode, on the cores the leader sends from)
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(sim_nodes(args.sim, args.sim_first, args.etcd, args.prefix, args.token_file, 30.0))
        return
    say(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (1/5/15 min)")
    if args.smoke:
        cases = [(2, 4, 2), (4, 4, 2)]
    elif args.quick:
        cases = [(8, 4, 4), (64, 4, 3), (512, 4, 2), (64, 64, 2), (64, 1024, 2)]
    else:
        cases = [(8, 4, 8), (64, 4, 6), (512, 4, 4), (64, 64, 4), (64, 1024, 4)]
    if args.case:
        cases = [tuple(int(x) for x in c.split(",")) for c in args.case]  # type: ignore[misc]
    rows = run_leader(cases, args.paced or (2 if args.smoke else 6 if args.quick else PACED), args.loop)
    big = max(rows, key=lambda r: (r["nodes"], -r["sources"]))
    result = {
        "leader_fanout_ratio_n512": big["leader_fanout_ratio"],
        "node_bytes_ratio_n512": big["node_bytes_ratio"],
        "plan_to_all_ms_p99_n512": big["plan_to_all_ms_p99"],
        "plan_to_all_model_ms_p99_n512": big["plan_to_all_model_ms_p99"],
        "plan_to_all_pipelined_ms_p99_n512": big["plan_to_all_pipelined_ms_p99"],
        "leader_overhead_ms_n512": big["leader_overhead_ms"],
        "leader_overhead_with_lengths_ms_n512": big["leader_overhead_with_lengths_ms"],
        "sim_cpu_ms_per_step_n512": big["sim_cpu_ms_per_step"],
        "largest_nodes": big["nodes"],
        "leader_loop": args.loop,
        "cases": rows,
        "load": list(os.getloadavg()),
    }
    if not args.case:  # many sources and 100,000 files on one node (issue 29 item 3)
        from _scale_sources import scale_sources

        result.update(scale_sources("smoke" if args.smoke else "quick" if args.quick else "full"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
