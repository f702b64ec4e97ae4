"""Scale benchmark (issue 29): the real leader against N simulated nodes, and many sources on one node.

    python bench/scale.py [--quick | --smoke]

Leader part: one process runs the real leader code (``ClusterNode``: etcd membership, election and peer links;
``Coordinator``/``JobCoordinator``: start barrier, planner in a thread, fenced etcd state writes, per-node plan
slices over the links). A second process runs N simulated nodes: each a real ``PeerServer`` (the peer protocol
and its token handshake) registered in the same etcd, owning 8 ranks (8 data groups: tp = 1) and its share of
the partitions; it decodes each slice (``planwire.decode_plan``) and acknowledges the step with what it
received, building no batch. The planner reads synthetic text4 lengths (``workloads.SyntheticLengths``) through
the leader's own run; nothing is read from disk. Cases: N = 8, 64, 512 (dp 64, 512, 4,096), 16k context, 4
micro-batches, text4's 4 sources; and S = 64 and 1,024 sources at N = 64.

Measured per case, over the steps after the first: leader bytes sent per step (its peer links' counter) and
the ratio to one full plan's frame; the largest node's bytes per step; plan ready -> the last node has decoded
its slice (p50/p99 ms; both processes read the one system-wide monotonic clock); leader CPU s per step (the
process) beside the planner's own (its thread's CPU); etcd request bytes and writes per step (the leader's
client); steps/s the leader sustains (nodes acknowledge at once: planning and distribution are the limit).
The plan-ready instant and the planner's CPU are read by wrapping ``JobCoordinator.frames`` and
``Planner.plan_step`` in this process (measurement only).

The last line is one JSON object (keys of DESIGN 4.7). Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
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


# ---- the simulated nodes (a child process) ----------------------------------------------------------------
async def sim_nodes(n: int, first: int, etcd_url: str, prefix: str, token_file: str, ttl: float) -> None:
    """N PeerServers registered under one lease; each decodes its slices and acknowledges them."""
    from msdata_server.cluster import Etcd
    from msdata_server.cluster.net.peers import PeerServer
    from msdata_server.cluster.planwire import decode_plan, plan_state
    from msdata_server.errors import PeerLostError, ProtocolError

    token = Path(token_file).read_text().strip()  # noqa: ASYNC240  (once, before the loop serves anything)
    servers: list[PeerServer] = []

    def handler_of(i: int):
        nid = f"sim{i:04d}"

        async def handle(peer: str, frame: dict, payload: memoryview | None) -> None:
            if frame.get("t") != "plan":
                return
            t0 = time.perf_counter()
            try:
                plan = decode_plan(frame, payload)
                plan_state(frame, payload)
            except ProtocolError:
                return
            got = time.monotonic()
            decode_ms = (time.perf_counter() - t0) * 1e3
            size = len(orjson.dumps(frame)) + (0 if payload is None else len(payload))
            link = servers[i - first].links.get(peer)
            if link is None:
                return
            ack = {
                "t": "ack",
                "digest": frame["digest"],
                "run": frame["run"],
                "node": nid,
                "step": plan.step,
                "at": got,
                "decode_ms": decode_ms,
                "bytes": size,
                "pieces": len(plan),
            }
            with contextlib.suppress(PeerLostError, ConnectionError):
                await link.send(ack)

        return handle

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
        print("ready", flush=True)
        asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)
        await stop.wait()
        await keeper
        await etcd.lease_revoke(lease)
        for srv in servers:
            await srv.aclose()


# ---- the leader (this process) -----------------------------------------------------------------------------
class BenchRun:
    """The leader node's own run (``HeldRun``): the partition layout over the live members, synthetic lengths."""

    def __init__(self, layout, lengths: SyntheticLengths) -> None:
        self.id = ""
        self._layout = layout
        self._lengths = lengths

    @property
    def layout(self):
        return self._layout

    async def lengths(self, s: int, start: int, count: int) -> np.ndarray:
        return self._lengths.lengths(s, start, count)

    async def vision(self, s: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError("text only")


class BenchRuns:
    def __init__(self) -> None:
        self.run: BenchRun | None = None
        self.digest = ""

    def held(self, digest: str, run_id: str) -> BenchRun | None:
        run = self.run
        return run if run is not None and digest == self.digest and run.id == run_id else None


def timed_rpc():
    from msdata_server.cluster.net.rpc import PeerRpc

    class TimedRpc(PeerRpc):
        """The leader's PeerRpc, noting when each step's plan frames leave (the last one per step)."""

        sent: dict[int, float]

        async def quiet_send(self, nid, frame, payload=None):
            await super().quiet_send(nid, frame, payload)
            if frame.get("t") == "plan":
                self.sent[int(frame["step"])] = time.monotonic()

    return TimedRpc


class Probe:
    """Measurement wrappers: when each step's plan was ready, the planner thread's CPU, etcd requests."""

    def __init__(self) -> None:
        self.ready: dict[int, float] = {}
        self.sent: dict[int, float] = {}  # step -> when the leader handed its last slice to the kernel
        self.snap: dict[int, tuple[float, float, int, int, int, float]] = {}  # step -> counters when ready
        self.plan_cpu = 0.0  # the planner thread's CPU seconds so far
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
        frames0, plan0, raw0 = coordinator.JobCoordinator.frames, Planner.plan_step, Etcd._raw

        def frames(self, plan, extra, table, nodes, only=None):
            if only is None and plan.step not in probe.ready:
                now = probe.ready[plan.step] = time.monotonic()
                out = probe.traffic.bytes_out if probe.traffic is not None else 0
                probe.snap[plan.step] = (
                    now,
                    time.process_time(),
                    out,
                    probe.etcd_bytes,
                    probe.etcd_writes,
                    probe.plan_cpu,
                )
                probe.last_plan = plan
            return frames0(self, plan, extra, table, nodes, only)

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

        coordinator.JobCoordinator.frames = frames
        Planner.plan_step = plan_step
        Etcd._raw = raw
        self._undo = [
            (coordinator.JobCoordinator, "frames", frames0),
            (Planner, "plan_step", plan0),
            (Etcd, "_raw", raw0),
        ]

    def remove(self) -> None:
        for cls, name, fn in self._undo:
            setattr(cls, name, fn)


async def leader_case(n: int, n_sources: int, steps: int, base: Path, etcd_url: str) -> dict:
    from msdata_client.spec import JobSpec
    from msdata_server.cluster.context import ClusterContext
    from msdata_server.cluster.leader.coordinator import Coordinator
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
    sim = subprocess.Popen(  # noqa: ASYNC220  (started once, before the measured steps)
        [
            sys.executable,
            __file__,
            "--sim",
            str(n),
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
    probe = Probe()
    TimedRpc = timed_rpc()
    acks: dict[int, dict[str, tuple[float, int]]] = {}
    decode_ms: list[float] = []
    runs = BenchRuns()
    coord: Coordinator | None = None
    node: ClusterNode | None = None
    try:
        assert sim.stdout is not None
        line = await asyncio.to_thread(sim.stdout.readline)
        if line.strip() != b"ready":
            raise RuntimeError(f"the simulated nodes did not start: {line!r}")

        async def on_frame(peer: str, frame: dict, payload: memoryview | None) -> None:
            t = frame.get("t")
            if t == "ack" and "at" in frame:
                acks.setdefault(int(frame["step"]), {})[str(frame["node"])] = (float(frame["at"]), int(frame["bytes"]))
                decode_ms.append(float(frame["decode_ms"]))
            if coord is not None and t in ("ack", "need", "jobs"):
                coord.on_frame(frame)

        async def local(nid: str, frame: dict, payload: memoryview | None) -> None:
            if frame.get("t") == "jstart" and runs.run is not None:
                runs.run.id = str(frame["run"])

        say(f"  N={n}: {n} simulated nodes registered; the leader joins")
        node = ClusterNode(cfg, handler=on_frame)
        tasks = TaskSet("bench")
        rpc = TimedRpc(node, "leader", local, timeout=30.0)
        rpc.sent = probe.sent
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
        runs.run = BenchRun(layout, SyntheticLengths(wl, SEQ, seed=0))
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
        t0 = time.monotonic()
        while len([s for s in acks if len(acks[s]) == n]) < 1:  # warm-up: the first step everywhere
            if not want <= set(node.members) or not coord.leading:
                raise RuntimeError("the leader lost its lead or simulated nodes left the cluster (a lease expired)")
            if time.monotonic() - t0 > 600:
                raise RuntimeError("no step reached every simulated node in 600 s")
            await asyncio.sleep(0.01)
        first = max(acks)
        end = first + steps
        t_start = time.monotonic()
        while not (end in acks and len(acks[end]) == n and end + 1 in probe.snap):
            if time.monotonic() - t_start > 900:
                raise RuntimeError("the timed steps did not complete in 900 s")
            await asyncio.sleep(0.005)
        a, b = probe.snap[first], probe.snap[end]  # counters from step first's plan ready to step end's
        k = end - first
        wall, cpu, out = b[0] - a[0], b[1] - a[1], b[2] - a[2]
        etcd_b, etcd_w, plan_cpu = b[3] - a[3], b[4] - a[4], b[5] - a[5]
        timed = range(first + 1, end + 1)
        arrive = [(max(t for t, _ in acks[s].values()) - probe.ready[s]) * 1e3 for s in timed if s in probe.ready]
        out_ms = [(probe.sent[s] - probe.ready[s]) * 1e3 for s in timed if s in probe.sent and s in probe.ready]
        dec = float(np.percentile(decode_ms, 99)) if decode_ms else 0.0
        lat = [x + dec for x in out_ms]  # the last slice handed to the kernel, then one node's decode
        node_bytes = max(b for s in timed for _, b in acks[s].values())
        plan = probe.last_plan
        h, b = encode_plan(plan, job=spec.name, digest=runs.digest, token=1)
        full = len(orjson.dumps(h)) + len(b)
        return {
            "nodes": n,
            "dp": dp,
            "sources": n_sources,
            "pieces": len(plan),
            "plan_bytes": full,
            "leader_bytes_per_step": out / k,
            "leader_fanout_ratio": out / k / full,
            "node_bytes_max": node_bytes,
            "node_bytes_ratio": node_bytes * n / full,
            "plan_to_all_ms_p50": float(np.percentile(lat, 50)),
            "plan_to_all_ms_p99": float(np.percentile(lat, 99)),
            "send_all_ms_p99": float(np.percentile(out_ms, 99)),
            "node_decode_ms_p99": dec,
            "plan_to_all_ms_sim_p50": float(np.percentile(arrive, 50)),
            "plan_to_all_ms_sim_p99": float(np.percentile(arrive, 99)),
            "leader_cpu_s_per_step": cpu / k,
            "planner_cpu_s_per_step": plan_cpu / k,
            "leader_overhead_ms": (cpu - plan_cpu) / k * 1e3,
            "etcd_bytes_per_step": etcd_b / k,
            "etcd_writes_per_step": etcd_w / k,
            "steps_per_s": k / wall,
            "steps": k,
        }
    finally:
        probe.remove()
        if coord is not None:
            await coord.aclose()
        if node is not None:
            await node.aclose()
        if sim.stdin is not None:
            sim.stdin.close()
        try:
            sim.wait(30)
        except subprocess.TimeoutExpired:
            sim.kill()
            sim.wait()


def run_leader(cases: list[tuple[int, int, int]]) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    from etcd_fixture import EtcdServer

    base = Path(tempfile.mkdtemp(prefix="msdscale-"))
    srv = EtcdServer(base).start()
    try:
        rows = []
        for n, s, steps in cases:
            r = asyncio.run(leader_case(n, s, steps, base, srv.url))
            rows.append(r)
            say(
                f"N={n:>4} dp={r['dp']:>5} S={s:>5}: plan {r['plan_bytes'] / 1e6:.2f} MB ({r['pieces']} pieces); "
                f"leader {r['leader_bytes_per_step'] / 1e6:.2f} MB/step (x{r['leader_fanout_ratio']:.2f}), "
                f"largest node {r['node_bytes_max'] / 1e3:.1f} kB (x{r['node_bytes_ratio']:.2f} of plan/N); "
                f"plan->all p50 {r['plan_to_all_ms_p50']:.1f} p99 {r['plan_to_all_ms_p99']:.1f} ms "
                f"(sent {r['send_all_ms_p99']:.1f} + decode {r['node_decode_ms_p99']:.2f}; all {n} in one process: "
                f"p99 {r['plan_to_all_ms_sim_p99']:.0f}); "
                f"leader CPU {r['leader_cpu_s_per_step'] * 1e3:.0f} ms/step "
                f"(planner {r['planner_cpu_s_per_step'] * 1e3:.0f}); "
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
    ap.add_argument("--case", action="append", help="N,S,STEPS: run only these leader cases")
    ap.add_argument("--sim", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--etcd", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", help=argparse.SUPPRESS)
    ap.add_argument("--token-file", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where the plot goes")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: where a stuck run waits
    _raise_fd_limit()
    if args.sim:
        asyncio.run(sim_nodes(args.sim, 0, args.etcd, args.prefix, args.token_file, 30.0))
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
    rows = run_leader(cases)
    big = max(rows, key=lambda r: (r["nodes"], -r["sources"]))
    result = {
        "leader_fanout_ratio_n512": big["leader_fanout_ratio"],
        "node_bytes_ratio_n512": big["node_bytes_ratio"],
        "plan_to_all_ms_p99_n512": big["plan_to_all_ms_p99"],
        "leader_overhead_ms_n512": big["leader_overhead_ms"],
        "largest_nodes": big["nodes"],
        "cases": rows,
        "load": list(os.getloadavg()),
    }
    if not args.case:  # many sources and 100,000 files on one node (issue 29 item 3)
        from _scale_sources import scale_sources

        result.update(scale_sources("smoke" if args.smoke else "quick" if args.quick else "full"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
