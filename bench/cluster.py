# PYTHONPATH=$PWD .venv/bin/python bench/cluster.py [--quick | --smoke]
"""Cluster benchmark: leader failover time with three real node servers and a real etcd, the cost of the
fenced per-step planner-state write to etcd, planner load (plans/s) at simulated dp 512 and 4096, the data
path: steps/s and bytes/s of one job with a rank on each of three nodes vs the same job on one node
(``cross_node_ratio``), and one peer link's payload throughput beside raw loopback TCP (``peer_link_efficiency``).

Peer link: a receiver process and this process as the sender, 1 MiB frames on loopback, rounds alternating
between a raw socket (blocking ``sendmsg`` of a 4-byte length and the frame; the receiver ``recv_into`` one
preallocated buffer) and a plain (non-TLS) PeerLink (``send_payload`` of 1 MiB payloads into a PeerServer on
uvloop, as the node servers run), so both arms see the same machine load; median bytes/s of each.

Failover: three `msdata-server serve` processes on loopback share an etcd (default lease 3 s); the leader is
SIGKILLed (no goodbye: its lease must expire) and we time until a surviving node reports role "leader" and
every survivor agrees on it. Planner load: the Planner directly over metadata only (workload text4, 16k
context, 4 micro-batches per rank), warm-up apart, medians. The state write: put_fenced of a dp-4096 planner
state through a real LeaderElection. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from progress import bar, say  # noqa: E402
from workloads import COST, TEXT4, SyntheticLengths  # noqa: E402

from msdata_client.wire import request  # noqa: E402
from msdata_server.planner import Mixture, Planner, PlannerConfig  # noqa: E402

SEQ, MICRO = 16384, 4


def plan_load(dp: int, steps: int) -> dict:
    cfg = PlannerConfig(
        sources=tuple(TEXT4.sources),
        seq_len=SEQ,
        dp=dp,
        micro_batches=MICRO,
        rows=1,
        mixture=Mixture.constant(TEXT4.weights),
        **COST,
    )
    view = SyntheticLengths(TEXT4, SEQ, seed=0)
    planner = Planner(cfg)
    walls, cpus, docs, computes = [], [], [], []
    for i in range(steps + 1):
        t, c = time.perf_counter(), time.thread_time()
        plan = planner.plan_step(view)
        if i:  # the first step is warm-up
            walls.append((time.perf_counter() - t) * 1e3)
            cpus.append((time.thread_time() - c) * 1e3)  # (CPU: what other processes on the machine cannot add)
            docs.append(len(plan))
            computes.append(plan.stats.plan_ms)  # (wall less the view's reads of lengths)
    state = orjson.dumps(planner.state_dict())
    ms = statistics.median(walls)
    return {
        "dp": dp,
        "plan_ms": ms,
        "plan_cpu_ms": statistics.median(cpus),
        "plan_compute_ms": statistics.median(computes),
        "pieces_per_s": statistics.median(docs) / ms * 1e3,
        "load": os.getloadavg()[0],
        "plans_per_s": 1e3 / ms,
        "docs": int(statistics.median(docs)),
        "state_bytes": len(state),
        "state": state,
    }


def _etcd_cmd(d: Path, cport: int, pport: int) -> list[str]:
    etcd = os.environ.get("MSDATA_ETCD") or shutil.which("etcd") or "/usr/bin/etcd"
    c, p = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
    return [
        etcd,
        "--name",
        "b",
        "--data-dir",
        str(d / "etcd"),
        "--listen-client-urls",
        c,
        "--advertise-client-urls",
        c,
        "--listen-peer-urls",
        p,
        "--initial-advertise-peer-urls",
        p,
        "--initial-cluster",
        f"b={p}",
    ]


def _status(sock: str) -> dict | None:
    """The server's status over its Unix socket (None while it is down)."""
    try:
        return request(sock, {"t": "status"}, timeout=5)["status"]
    except OSError:
        return None


def failover(ttl: float, rounds: int) -> list[float]:
    """Seconds from SIGKILL of the leader to a new leader that every survivor agrees on, per round."""
    sys.path.insert(0, str(ROOT / "tests"))
    from etcd_fixture import EtcdServer

    base = Path(tempfile.mkdtemp(prefix="msdb-"))
    etcd = EtcdServer(base).start()
    procs: dict[str, subprocess.Popen] = {}
    socks: dict[str, str] = {}
    token = base / "token"
    token.write_text(secrets.token_hex(24))
    token.chmod(0o600)  # the server refuses a token others may read
    cfgs = {}
    for i in range(3):
        nid = f"node-{i}"
        d = base / nid
        d.mkdir()
        socks[nid] = str(d / "s.sock")
        cfgs[nid] = d / "node.toml"
        cfgs[nid].write_text(
            f'[node]\nid = "{nid}"\nsocket = "{socks[nid]}"\nlisten = "127.0.0.1:0"\n'
            f'shm_prefix = "b{secrets.token_hex(3)}"\nworkers = 0\n'
            f'[cluster]\netcd = ["{etcd.url}"]\ntoken_file = "{token}"\nlease_ttl = {ttl}\n'
        )

    def start(nid: str) -> None:
        p = subprocess.Popen(
            [sys.executable, "-m", "msdata_server", "serve", "--config", str(cfgs[nid])],
            stdout=subprocess.PIPE,
            stderr=open(base / f"{nid}.log", "ab"),  # noqa: SIM115  (the child holds it; ours closes at exit)
            cwd=str(ROOT),
        )
        p.stdout.readline()  # the readiness line
        procs[nid] = p

    def settled(alive: set[str]) -> str | None:
        sts = {n: _status(socks[n]) for n in alive}
        if any(s is None for s in sts.values()):
            return None
        lead = [n for n, s in sts.items() if s["role"] == "leader"]
        if len(lead) == 1 and all(s["cluster"]["leader"] == lead[0] for s in sts.values()):
            return lead[0]
        return None

    def wait(alive: set[str], timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if (got := settled(alive)) is not None:
                return got
            time.sleep(0.02)
        raise RuntimeError(f"no leader within {timeout}s; logs in {base}")

    out = []
    try:
        for nid in cfgs:
            start(nid)
        alive = set(cfgs)
        for _ in range(rounds):
            leader = wait(alive, 30)
            t0 = time.monotonic()
            procs[leader].send_signal(signal.SIGKILL)
            procs[leader].wait()
            alive.discard(leader)
            wait(alive, 10 * ttl)
            out.append(time.monotonic() - t0)
            procs[leader].stdout.close()
            start(leader)  # rejoins as a follower for the next round
            alive.add(leader)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
            p.stdout.close()
        etcd.stop()
        shutil.rmtree(base, ignore_errors=True)
    return out


def data_path(steps: int) -> dict:
    """steps/s and bytes/s of one job (dp 3, one rank per node) on three node servers vs the same job on one."""
    import threading

    sys.path.insert(0, str(ROOT))
    import msdata_client as msd
    from tests.cluster_util import Cluster, wait_for
    from tests.e2e_util import small_job
    from tests.etcd_fixture import EtcdServer
    from tests.server_util import ServerProc

    spec = small_job(
        "bench", dp=3, seq_len=4096, micro_batches=4, samples=4000, seed=3, prefetch=2, median=(400.0, 900.0)
    )
    n = steps * spec.micro_batches

    def run(endpoints: list[str]) -> tuple[float, int]:
        nbytes, t0s, t1s, errs = [0] * 3, [0.0] * 3, [0.0] * 3, []

        def body(r):
            try:
                with msd.DataClient(spec, endpoint=endpoints[r], rank=r, world_size=3, connect_timeout=60) as dc:
                    for i in range(n):
                        b = next(dc)
                        if i == 0:
                            t0s[r] = time.perf_counter()
                        nbytes[r] += sum(v.numel() * v.element_size() for v in b.values())
                        del b
                    t1s[r] = time.perf_counter()
            except BaseException as e:  # reported below
                errs.append(e)

        ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        if errs:
            raise errs[0]
        return max(t1s) - min(t0s), sum(nbytes)

    base = Path(tempfile.mkdtemp(prefix="msdb-"))
    out = {}
    try:
        d1 = base / "one"
        d1.mkdir()
        one = ServerProc(str(d1), workers=0).start()  # as the cluster nodes
        try:
            secs, nb = run([one.socket] * 3)
        finally:
            one.stop()
        out["one"] = {"steps_per_s": (steps - 1) / secs, "bytes_per_s": nb / secs}
        etcd = EtcdServer(base).start()
        (base / "c").mkdir()
        c = Cluster(base / "c", etcd.url, 3)
        try:
            c.start()
            wait_for(lambda: c.settled(set(c.nodes)), 30, "a leader")
            socks = [c.nodes[f"node-{i}"].socket for i in range(3)]

            def peer_bytes() -> int:
                return sum(_status(s)["cluster"]["traffic"]["bytes_in"] for s in socks)

            before = peer_bytes()
            secs, nb = run(socks)
            peer = peer_bytes() - before
        finally:
            c.stop()
            etcd.stop()
        out["three"] = {
            "steps_per_s": (steps - 1) / secs,
            "bytes_per_s": nb / secs,
            "peer_bytes_per_s": peer / secs,
            "peer_bytes_per_batch_byte": peer / nb,
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def failover_data(ttl: float) -> dict:
    """A job running with one rank per node; the leader is SIGKILLed mid-run. Seconds from the kill to (a) the
    new leader's resume (it plans again) and (b) the surviving ranks' first batch after the stall."""
    import threading

    sys.path.insert(0, str(ROOT))
    import msdata_client as msd
    import tests.cluster_util as tm
    from tests.e2e_util import small_job
    from tests.etcd_fixture import EtcdServer

    tm.TTL = ttl  # the Cluster helper writes this lease into node.toml
    spec = small_job("fo", dp=3, samples=4000, seed=5, prefetch=2)
    base = Path(tempfile.mkdtemp(prefix="msdb-"))
    etcd = EtcdServer(base).start()
    (base / "c").mkdir()
    c = tm.Cluster(base / "c", etcd.url, 3)
    stop = threading.Event()
    times: dict[int, list[float]] = {r: [] for r in range(3)}
    try:
        c.start()
        leader, _ = tm.wait_for(lambda: c.settled(set(c.nodes)), 30, "a leader")
        li = int(leader.split("-")[1])

        def body(r):
            try:
                with msd.DataClient(
                    spec,
                    endpoint=c.nodes[f"node-{r}"].socket,
                    rank=r,
                    world_size=3,
                    connect_timeout=3 if r == li else 60,
                ) as dc:
                    while not stop.is_set():
                        b = next(dc)
                        times[r].append(time.monotonic())
                        del b
            except Exception:  # the killed node's rank loses its server: expected
                pass

        ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(3)]
        for t in ts:
            t.start()
        tm.wait_for(lambda: all(len(times[r]) >= 20 for r in range(3)), 60, "the job to run")
        t0 = time.monotonic()
        c.nodes[leader].kill()
        new_log = None
        planned = None
        while time.monotonic() - t0 < 20 * ttl and planned is None:
            for nid, srv in c.nodes.items():
                if nid != leader and "job fo: resumed" in srv.log():
                    planned, new_log = time.monotonic() - t0, nid
            time.sleep(0.01)
        survivors = [r for r in range(3) if r != li]
        n0 = {r: len(times[r]) for r in survivors}
        tm.wait_for(lambda: all(len(times[r]) >= n0[r] + 10 for r in survivors), 20 * ttl, "the ranks to continue")
        stop.set()
        delivered = []
        for r in survivors:  # the first batch after the longest gap following the kill
            after = [x for x in times[r] if x > t0]
            gaps = [(b - a, b) for a, b in zip([t0, *after], after)]
            delivered.append(max(gaps)[1] - t0)
        for t in ts:
            t.join(30)
    finally:
        stop.set()
        c.stop()
        etcd.stop()
        shutil.rmtree(base, ignore_errors=True)
    return {"planned_s": planned, "delivered_s": max(delivered), "new_leader": new_log}


async def state_write(state: bytes, n: int) -> float:
    """Median ms of put_fenced of one planner state through a real election (etcd on loopback)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from etcd_fixture import EtcdServer

    from msdata_server.cluster import Etcd, LeaderElection, Membership

    base = Path(tempfile.mkdtemp(prefix="msdb-"))
    srv = EtcdServer(base).start()
    try:
        async with Etcd([srv.url]) as etcd:
            m = Membership(etcd, node_id="bench", prefix="/bench", ttl=3)
            e = LeaderElection(etcd, m)
            await m.start()
            await e.start()
            await e.wait_leader()
            ts = []
            for i in range(n + 1):
                t = time.perf_counter()
                ok = await e.put_fenced(f"/bench/jobs/j/d/state/{i:012d}", state)
                ts.append((time.perf_counter() - t) * 1e3)
                assert ok
            await e.aclose()
            await m.aclose()
        return statistics.median(ts[1:])
    finally:
        srv.stop()
        shutil.rmtree(base, ignore_errors=True)


LINK_FRAME = 1 << 20
LINK_TOKEN = "bench-link-token-" + "x" * 16


def _raw_receiver(port_q) -> None:
    """Raw arm, receiving side: frames (4-byte length + bytes) read into one buffer; a 0 length: reply the
    byte count; EOF: exit."""
    ls = socket.create_server(("127.0.0.1", 0))
    port_q.put(ls.getsockname()[1])
    conn, _ = ls.accept()
    ls.close()
    buf, head = memoryview(bytearray(LINK_FRAME)), memoryview(bytearray(4))
    total = 0

    def fill(view: memoryview) -> bool:
        got = 0
        while got < len(view):
            n = conn.recv_into(view[got:])
            if not n:
                return False
            got += n
        return True

    while fill(head):
        (n,) = struct.unpack(">I", head)
        if n == 0:
            conn.sendall(struct.pack(">Qd", total, time.process_time()))
            total = 0
        elif fill(buf[:n]):
            total += n
    conn.close()


def _link_receiver(port_q) -> None:
    """Link arm, receiving side: a PeerServer on uvloop counting payload bytes; "count" is answered, "stop" ends."""
    import uvloop

    from msdata_server.cluster.net.peers import PeerServer

    async def run() -> None:
        done, total = asyncio.Event(), 0

        async def handler(peer: str, frame: dict, payload) -> None:
            nonlocal total
            if payload is not None:
                total += len(payload)
            elif frame["t"] == "count":
                await srv.links[peer].send({"t": "counted", "bytes": total, "cpu": time.process_time()})
                total = 0
            elif frame["t"] == "stop":
                done.set()

        srv = PeerServer(token=LINK_TOKEN, node_id="rx", handler=handler)
        port_q.put(await srv.start())
        await done.wait()
        await srv.aclose()

    uvloop.run(run())


def _raw_send(port: int, frames: int) -> tuple[float, float]:
    """Bytes/s of ``frames`` 1 MiB frames over a raw socket, until the receiver confirms every byte; and the CPU
    seconds per GB both processes spent."""
    s = socket.create_connection(("127.0.0.1", port))
    buf, head = os.urandom(LINK_FRAME), struct.pack(">I", LINK_FRAME)
    for _ in range(16):  # warm-up
        s.sendmsg([head, buf])
    s.sendall(struct.pack(">I", 0))
    _, rx0 = struct.unpack(">Qd", s.recv(16, socket.MSG_WAITALL))
    t0, tx0 = time.perf_counter(), time.process_time()
    for _ in range(frames):
        s.sendmsg([head, buf])
    s.sendall(struct.pack(">I", 0))
    got, rx1 = struct.unpack(">Qd", s.recv(16, socket.MSG_WAITALL))
    dt, cpu = time.perf_counter() - t0, time.process_time() - tx0 + rx1 - rx0
    s.close()
    if got != frames * LINK_FRAME:
        raise RuntimeError(f"raw arm: the receiver got {got} of {frames * LINK_FRAME} bytes")
    return got / dt, cpu / (got / 1e9)


async def _link_send(port: int, frames: int) -> tuple[float, float]:
    """Payload bytes/s of ``frames`` 1 MiB payload frames over one plain PeerLink (a warm-up apart); and the
    CPU seconds per GB both processes spent."""
    from msdata_server.cluster.net.peers import PeerLink

    answers: asyncio.Queue[tuple[int, float]] = asyncio.Queue()

    def handler(peer: str, frame: dict, payload) -> None:
        if frame["t"] == "counted":
            answers.put_nowait((int(frame["bytes"]), float(frame["cpu"])))

    link = await PeerLink.connect("127.0.0.1", port, token=LINK_TOKEN, node_id="tx", handler=handler)
    buf = os.urandom(LINK_FRAME)
    rate = cpu = rx0 = 0.0
    for n in (16, frames):  # warm-up, then the measured round
        t0, tx0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            await link.send_payload({"t": "p"}, buf)
        await link.send({"t": "count"})
        got, rx1 = await answers.get()
        rate = got / (time.perf_counter() - t0)
        cpu, rx0 = (time.process_time() - tx0 + rx1 - rx0) / (got / 1e9), rx1
        if got != n * LINK_FRAME:
            raise RuntimeError(f"link arm: the receiver got {got} of {n * LINK_FRAME} bytes")
    await link.send({"t": "stop"})
    await link.aclose()
    return rate, cpu


def _link_arm(kind: str, frames: int) -> tuple[float, float]:
    import multiprocessing as mp

    import uvloop

    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    proc = ctx.Process(target=_raw_receiver if kind == "raw" else _link_receiver, args=(port_q,), daemon=True)
    proc.start()
    try:
        port = port_q.get(timeout=60)
        return _raw_send(port, frames) if kind == "raw" else uvloop.run(_link_send(port, frames))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def link_efficiency(mib: int, rounds: int) -> dict:
    """Payload bytes/s over one plain peer link vs raw loopback TCP, 1 MiB frames, rounds alternating."""
    res: dict[str, list[float]] = {"raw": [], "link": []}
    cpu: dict[str, list[float]] = {"raw": [], "link": []}
    for _ in range(rounds):
        for kind in res:
            rate, c = _link_arm(kind, mib)
            res[kind].append(rate)
            cpu[kind].append(c)
    raw, link = statistics.median(res["raw"]), statistics.median(res["link"])
    return {
        "raw": raw,
        "link": link,
        "efficiency": link / raw,
        "rounds": res,
        "cpu_s_per_gb": {k: statistics.median(v) for k, v in cpu.items()},
        "load": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    ap.add_argument("--ttl", type=float, default=3.0, help="lease TTL of the failover run (default 3 s)")
    ap.add_argument("--smoke", action="store_true", help="seconds: 1 plan step, 1 failover round, lease 2 s, 3 steps")
    ap.add_argument("--link-only", action="store_true", help="only the peer-link phase (raw TCP vs PeerLink)")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)  # the election's step-down notices are expected here
    steps = 8  # planner load: the median of 8 steps (of 3, --quick's figure moved by a millisecond with one step)
    rounds = 2 if args.quick else 4
    writes, data_steps = 20, 10 if args.quick else 30
    link_mib, link_rounds = (512, 5) if args.quick else (1024, 5)  # (3 rounds of 256 MiB: 0.37-0.74 on one tree)
    if args.smoke:  # every phase once, at its smallest
        steps, rounds, writes, data_steps = 1, 1, 3, 3
        link_mib, link_rounds = 8, 1
        args.ttl = min(args.ttl, 2.0)

    link = link_efficiency(link_mib, link_rounds)
    say(
        f"peer link (plain, 1 MiB payloads, {link_mib} MiB x {link_rounds} rounds alternating; load "
        f"{link['load']:.2f}): raw TCP {link['raw'] / 1e9:.2f} GB/s, PeerLink {link['link'] / 1e9:.2f} GB/s, "
        f"efficiency {link['efficiency']:.2f}; CPU s per GB (both ends): raw {link['cpu_s_per_gb']['raw']:.3f}, "
        f"PeerLink {link['cpu_s_per_gb']['link']:.3f}"
    )
    say(
        "  rounds GB/s: "
        + "; ".join(f"{k} " + " ".join(f"{x / 1e9:.2f}" for x in v) for k, v in link["rounds"].items())
    )
    link_keys = {
        "peer_link_efficiency": round(link["efficiency"], 3),
        "peer_link_payload_bytes_per_s": round(link["link"]),
        "raw_tcp_bytes_per_s": round(link["raw"]),
        "peer_link_cpu_s_per_gb": round(link["cpu_s_per_gb"]["link"], 4),
        "raw_tcp_cpu_s_per_gb": round(link["cpu_s_per_gb"]["raw"], 4),
        "link_load_avg": round(link["load"], 2),
    }
    if args.link_only:
        say(json.dumps(link_keys))
        return

    say(
        f"planner load: text4, seq_len {SEQ}, {MICRO} micro-batches per rank, metadata only; "
        f"median of {steps} steps after 1 warm-up"
    )
    say(f"{'dp':>5} {'plan ms':>9} {'CPU ms':>8} {'plans/s':>8} {'docs/step':>10} {'pieces/s':>10} {'state B':>8}")
    prog = bar(6, "cluster", "phase")  # plan x2, state write, failover x2, data path
    res = {}
    for dp in (512, 4096):
        r = plan_load(dp, steps)
        prog.update(1)
        res[dp] = r
        say(
            f"{dp:>5} {r['plan_ms']:>9.1f} {r['plan_cpu_ms']:>8.1f} {r['plans_per_s']:>8.2f} {r['docs']:>10} "
            f"{r['pieces_per_s']:>10.0f} {r['state_bytes']:>8}"
        )
    w = asyncio.run(state_write(res[4096]["state"], writes))
    prog.update(1)
    say(f"fenced etcd write of the dp-4096 planner state ({res[4096]['state_bytes']} B): {w:.2f} ms median")
    fo = failover(args.ttl, rounds)
    prog.update(1)
    say(
        f"failover (3 nodes, lease {args.ttl:g} s, leader SIGKILLed -> new leader agreed): "
        + ", ".join(f"{x:.2f}s" for x in fo)
    )
    fd = failover_data(args.ttl)
    prog.update(1)
    fd["planned_s"] = -1.0 if fd["planned_s"] is None else fd["planned_s"]  # -1: the resume was not seen
    say(
        f"failover with a job running (lease {args.ttl:g} s, leader SIGKILLed -> new leader plans): "
        f"{fd['planned_s']:.2f}s; -> surviving ranks get their next batch: {fd['delivered_s']:.2f}s"
    )
    dpath = data_path(data_steps)
    prog.close()
    for k, label in (("one", "one node, 3 ranks"), ("three", "three nodes, 1 rank each")):
        say(
            f"data path ({label}; dp 3, 16 KiB-token steps): {dpath[k]['steps_per_s']:.1f} steps/s, "
            f"{dpath[k]['bytes_per_s'] / 2**20:.1f} MiB/s to ranks"
        )
    say(
        f"  across nodes: {dpath['three']['peer_bytes_per_s'] / 2**20:.1f} MiB/s over the peer links "
        f"({dpath['three']['peer_bytes_per_batch_byte']:.2f} B per batch byte; cross_node_ratio (three/one nodes "
        f"steps/s) {dpath['three']['steps_per_s'] / dpath['one']['steps_per_s']:.2f}; load {os.getloadavg()[0]:.2f})"
    )
    say(
        json.dumps(
            {
                "failover_s": round(statistics.median(fo), 3),
                "failover_max_s": round(max(fo), 3),
                "failover_planned_s": round(fd["planned_s"], 3),
                "failover_delivered_s": round(fd["delivered_s"], 3),
                "lease_ttl_s": args.ttl,
                "plan_ms_dp512": round(res[512]["plan_ms"], 2),
                "plan_ms_dp4096": round(res[4096]["plan_ms"], 2),
                "plan_cpu_ms_dp512": round(res[512]["plan_cpu_ms"], 2),
                "plan_cpu_ms_dp4096": round(res[4096]["plan_cpu_ms"], 2),
                "plan_load_avg": round(res[4096]["load"], 2),
                "plans_per_s_dp4096": round(res[4096]["plans_per_s"], 3),
                "plan_compute_ms_dp512": round(res[512]["plan_compute_ms"], 2),
                "plan_compute_ms_dp4096": round(res[4096]["plan_compute_ms"], 2),
                "pieces_per_s_dp512": round(res[512]["pieces_per_s"]),
                "pieces_per_s_dp4096": round(res[4096]["pieces_per_s"]),
                "state_bytes_dp4096": res[4096]["state_bytes"],
                "state_write_ms": round(w, 3),
                "cross_node_steps_per_s": round(dpath["three"]["steps_per_s"], 2),
                "cross_node_bytes_per_s": round(dpath["three"]["bytes_per_s"]),
                "peer_link_bytes_per_s": round(dpath["three"]["peer_bytes_per_s"]),
                "one_node_steps_per_s": round(dpath["one"]["steps_per_s"], 2),
                "one_node_bytes_per_s": round(dpath["one"]["bytes_per_s"]),
                "cross_node_ratio": round(dpath["three"]["steps_per_s"] / dpath["one"]["steps_per_s"], 3),
                **link_keys,
            }
        )
    )


if __name__ == "__main__":
    main()
