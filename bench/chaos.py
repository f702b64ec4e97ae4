# .venv/bin/python bench/chaos.py --quick          (90 s; default --minutes 5, a fault every --interval 10 s)
"""Chaos (issue 13): three node servers and etcd on loopback, six ranks (dp 3 x tp 2, TP pairs spanning nodes),
and for ``--minutes`` a seeded schedule of faults, one every ``--interval`` seconds, each on a victim of one
kind (``--kinds``):

- ``worker``: SIGKILL one transform worker of a node (its pool replaces it);
- ``rank``: SIGKILL one rank process; the launcher, as torchrun does, stops the job's other ranks and starts
  all six again from their newest common checkpoint (each rank saves its state_dict every ``--ckpt`` steps).
  Like a launcher with hot spares it does not import torch again at a restart: ranks are forked from a fork
  server that imported it once (see ``Ranks``);
- ``follower`` / ``leader``: SIGKILL that node server and start it again, as systemd would (its ranks keep
  running and reconnect);
- ``etcd``: SIGKILL etcd and start it again on the same data;
- ``socket``: the rank process shuts down its own socket to its node (the client reconnects).

Every delivered micro-batch goes into a per-rank ledger (time, step, micro, sha256 of every field); at the end
the same job runs without faults on one node and the ledgers are compared with it: ``lost`` (a micro-batch
of the reference that a rank never got below its last step), ``duplicated`` (a micro-batch delivered again
outside the replay a rank restart legitimately causes: from its checkpoint up to where it was), ``mismatched``
(a delivered micro-batch, replayed ones included, whose content differs from the reference). Per fault kind:
count and time to recover (the fault until every rank has received a batch again), p50 and max; the longest
stall (the largest gap between two batches of one rank). The last line is one JSON object. Loopback only;
stops by itself; the servers are stopped gracefully at the end and /dev/shm is checked for leftovers.

After the chaos (skip it with ``--no-takeover``; ``--takeover-only`` runs only this) comes the failover of a
data-owning node, with and without shadow loaders, side by side on the same job (dp 2 on two nodes; the third
node only owns data and is SIGKILLed after ``--takeover-at`` steps): ``takeover_s_shadow`` / ``takeover_s_cold``
are the longest wait for a batch on any surviving rank from the kill on (the step that needed the dead node's
payloads). Without shadows the partitions move when the node's lease ends (``--ttl``) and are opened cold; with
``shadow_loaders = 1`` their standbys serve as soon as the peer link breaks. Both arms' batches are compared
with each other. It adds about 20 s.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("worker", "rank", "follower", "leader", "etcd", "socket")
NODES, DP, TP, MICRO = 3, 3, 2, 2
WORLD = DP * TP


# ---- the job ------------------------------------------------------------------------------------------------
def write_data(d: Path, seed: int) -> dict[str, str]:
    """Two JSONL sources of random text, four files each (partitions spread over the nodes)."""
    rng = random.Random(seed)
    out = {}
    for name, median in (("web", 160), ("code", 400)):
        sd = d / name
        sd.mkdir(parents=True)
        for f in range(4):
            with open(sd / f"part-{f}.jsonl", "w") as fh:
                for i in range(1500):
                    n = max(4, int(rng.lognormvariate(0, 0.8) * median))
                    text = f"{name}{f}-{i} " + "".join(rng.choice("abcdefghij klmnop\n") for _ in range(n))
                    fh.write(json.dumps({"text": text}) + "\n")
        out[name] = str(sd)
    return out


def job_dict(data: dict[str, str]) -> dict:
    import msdata_client as msd

    g = msd.DGraph("chaos", seed=13)
    for name, d in data.items():
        g.source(name, "jsonl", [d], column="text", transform="msdata_server.transforms:byte_tokens")
    g.mix({"web": 0.6, "code": 0.4}).pack(512, micro_batches=MICRO, rows=1).mesh(dp=DP, tp=TP).prefetch(1)
    return g.to_dict()


def batch_hash(batch) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(batch[k].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ---- a rank process ------------------------------------------------------------------------------------------
def _shut_own_sockets(*_a) -> None:
    """The ``socket`` fault: shut down this process's Unix stream sockets (its connection to its node)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.family == socket.AF_UNIX and s.type == socket.SOCK_STREAM:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()


def rank_main(argv: list[str]) -> None:
    """``chaos.py --rank JOB ENDPOINT RANK LEDGER CKPT_DIR EVERY PACE STOP BARRIER [STATE]``: read batches
    until the STOP file exists, a ledger line per batch, a checkpoint every EVERY steps; the ranks keep in step
    as training does (their collectives): a rank starts step s+1 once every rank finished step s-1."""
    import orjson

    import msdata_client as msd

    job, endpoint, rank_s, ledger, ckpt_dir, every_s, pace_s, stop, barrier = argv[:9]
    rank, every, pace = int(rank_s), int(every_s), float(pace_s)
    state = orjson.loads(Path(argv[9]).read_bytes()) if len(argv) > 9 else None
    me = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    mine = f"{barrier}.{rank}"
    if os.path.exists(mine):
        os.unlink(mine)
    me.bind(mine)
    allowed = -(1 << 62)

    def step_done(step: int) -> None:
        """The training step's collective: go on once every rank finished the step before (one of slack)."""
        nonlocal allowed
        _post(me, f"{rank} {step}", barrier)
        me.settimeout(0.5)
        while allowed < step - 1:
            try:
                allowed = max(allowed, int(me.recv(64)))
            except TimeoutError:
                _post(me, f"{rank} {step}", barrier)  # the launcher may have restarted our peers

    signal.signal(signal.SIGUSR1, _shut_own_sockets)
    spec = msd.DGraph.from_dict(orjson.loads(Path(job).read_bytes())).spec
    with (
        open(ledger, "a") as out,
        msd.DataClient(spec, endpoint=endpoint, rank=rank, world_size=WORLD, connect_timeout=120) as dc,
    ):
        if state is not None:
            dc.load_state_dict(state)
        _say(f"rank {rank} connected")
        while True:
            b = dc.__next__()
            step, micro = int(b["step"]), int(b["micro"])
            out.write(f"{time.time():.4f} {step} {micro} {batch_hash(b)}\n")
            out.flush()
            del b
            if micro == MICRO - 1:
                step_done(step)
                if (step + 1) % every == 0:
                    tmp = os.path.join(ckpt_dir, f".r{rank}.tmp")
                    Path(tmp).write_bytes(orjson.dumps(dc.state_dict()))
                    os.replace(tmp, os.path.join(ckpt_dir, f"r{rank}-{step + 1:08d}.json"))
                if os.path.exists(stop) and step >= int(Path(stop).read_text() or 0):
                    return  # every rank stops after the same step (the launcher wrote it)
            time.sleep(pace)


def _rank_entry(argv: list[str], log: str) -> None:
    """A rank in a child of the launcher's fork server (see ``Ranks``): its stderr to its log, then ``rank_main``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    _say(f"rank {argv[2]} forked ({'torch already imported' if 'torch' in sys.modules else 'torch NOT imported'})")
    rank_main(argv)


def _post(sock: socket.socket, msg: str, to: str) -> None:
    """One collective datagram, never waiting: a full queue at the other end (it is busy, or blocked on its
    data while a node restarts) drops it; the sender says it again after its 0.5 s wait."""
    wait = sock.gettimeout()
    sock.settimeout(0)  # non-blocking (its recv keeps its timeout): a datagram socket has no other user here
    try:
        sock.sendto(msg.encode(), to)
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(wait)


def _say(what: str) -> None:
    """A timestamped line on stderr (the rank's log)."""
    print(f"{time.time():.3f} pid {os.getpid()}: {what}", file=sys.stderr, flush=True)


# ---- the harness ---------------------------------------------------------------------------------------------
def node_of(rank: int) -> int:
    return rank % NODES  # TP pairs (2k, 2k+1) land on two nodes


class _Forked:
    """A rank process forked by the launcher's fork server, with the calls of ``subprocess.Popen`` the harness
    makes (poll, wait, kill, send_signal)."""

    def __init__(self, proc: multiprocessing.process.BaseProcess):
        self.proc = proc

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.proc.pid}", timeout or 0.0)
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def send_signal(self, sig: int) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, sig)


class Ranks:
    """The launcher: six rank processes; on a rank's death it restarts all of them from the newest common
    checkpoint (the replay that follows is legitimate).

    Like a launcher with hot spares it does not pay a trainer's imports at a restart: the rank processes are
    forked from a fork server that imported ``msdata_client.DataClient`` (and with it torch) once, at the start
    (``multiprocessing`` forkserver with a preload; a torch DataLoader forks its workers after the same import).
    A cold torch import takes 3 s on an idle core and 20-50 s for six at once on two busy ones, which would be
    measured as the data system's restart time."""

    def __init__(self, base: Path, job: Path, sockets: dict[int, str], every: int, pace: float):
        self.base, self.job, self.sockets, self.every, self.pace = base, job, sockets, every, pace
        self.ckpt = base / "ckpt"
        self.ckpt.mkdir()
        self.stop_file = base / "stop"
        self.procs: dict[int, _Forked] = {}
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["msdata_client.client"])
        self.ledgers = {r: base / f"ledger-{r}.txt" for r in range(WORLD)}
        self.restarts = 0
        self.barrier = str(base / "barrier")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.barrier)
        self._sock.settimeout(0.2)
        self.done = {r: -1 for r in range(WORLD)}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._collective, daemon=True, name="collective")
        self._thread.start()

    def _collective(self) -> None:
        """The ranks' collective: each says the step it finished; all hear the lowest."""
        while not self._closed:
            try:
                msg = self._sock.recv(64).split()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.done[int(msg[0])] = max(self.done[int(msg[0])], int(msg[1]))
                low = min(self.done.values())
            for r in range(WORLD):
                with contextlib.suppress(OSError):  # that rank is restarting
                    _post(self._sock, str(low), f"{self.barrier}.{r}")

    def _spawn(self, r: int, state: Path | None) -> None:
        argv = [str(self.job), self.sockets[node_of(r)], str(r), str(self.ledgers[r]), str(self.ckpt)]
        argv += [str(self.every), str(self.pace), str(self.stop_file), self.barrier]
        if state is not None:
            argv.append(str(state))
        log = str(self.base / f"rank-{r}.log")
        proc = self._ctx.Process(target=_rank_entry, args=(argv, log), name=f"rank-{r}", daemon=False)
        proc.start()
        self.procs[r] = _Forked(proc)

    def start(self) -> None:
        for r in range(WORLD):
            self._spawn(r, None)

    def common_checkpoint(self) -> int | None:
        have: dict[int, set[int]] = {r: set() for r in range(WORLD)}
        for p in self.ckpt.glob("r*-*.json"):
            r, s = p.stem[1:].split("-")
            have[int(r)].add(int(s))
        common = set.intersection(*have.values())
        return max(common) if common else None

    def restart_all(self) -> int:
        """Every rank stopped and started again from the newest common checkpoint (0: the beginning)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()
        step = self.common_checkpoint()
        with self._lock:
            self.done = {r: (step or 0) - 1 for r in range(WORLD)}
        for r in range(WORLD):
            with open(self.ledgers[r], "a") as f:
                f.write(f"R {step or 0}\n")  # a replay from this step on is legitimate
        for r in range(WORLD):
            self._spawn(r, self.ckpt / f"r{r}-{step:08d}.json" if step else None)
        self.restarts += 1
        return step or 0

    def running(self) -> bool:
        """Every rank received a batch since the last (re)start: a rank or socket fault has a live victim."""
        for p in self.ledgers.values():
            rows = read_ledger(p)
            if not rows or rows[-1][0] == "R":
                return False
        return True

    def dead(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.poll() is not None]

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        self._thread.join(5)

    def finish(self, timeout: float) -> None:
        """Every rank stops after the same step, a few steps past the newest any rank reached."""
        reached = [row[1] for p in self.ledgers.values() for row in read_ledger(p) if row[0] != "R"]
        tmp = self.base / "stop.tmp"
        tmp.write_text(str(max(reached, default=0) + 3))
        os.replace(tmp, self.stop_file)
        end = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, depth) of every process below ``pid``."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier, depth = [], [pid], 0
    while frontier:
        depth += 1
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out += [(p, depth) for p in frontier]
    return out


def read_ledger(path: Path) -> list[tuple]:
    rows: list[tuple] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts and parts[0] == "R":
            rows.append(("R", int(parts[1])))
        elif len(parts) == 4:
            rows.append((float(parts[0]), int(parts[1]), int(parts[2]), parts[3]))
    return rows


def analyse(
    ledgers: dict[int, list[tuple]], ref: dict[int, dict[tuple[int, int], str]], stuck_at: float | None
) -> dict:
    """Lost, duplicated and mismatched micro-batches against the reference; the longest stall (to ``stuck_at``
    for a job that never recovered)."""
    lost = duplicated = mismatched = replayed = 0
    max_stall = 0.0
    for r, rows in ledgers.items():
        seen: dict[tuple[int, int], str] = {}
        high: tuple[int, int] = (-1, -1)
        replay_until: tuple[int, int] = (-1, -1)
        last_t = None
        for row in rows:
            if row[0] == "R":
                replay_until = high
                continue
            t, step, micro, h = row
            pos = (step, micro)
            if last_t is not None:
                max_stall = max(max_stall, t - last_t)
            last_t = t
            want = ref[r].get(pos)
            if want is not None and want != h:
                mismatched += 1
            if pos in seen:
                if pos <= replay_until:
                    replayed += 1
                else:
                    duplicated += 1
            seen[pos] = h
            high = max(high, pos)
        if stuck_at is not None and last_t is not None:
            max_stall = max(max_stall, stuck_at - last_t)
        last = high[0]
        lost += sum(1 for pos in ref[r] if pos[0] < last and pos not in seen)
    return {
        "lost": lost,
        "duplicated": duplicated,
        "mismatched": mismatched,
        "replayed": replayed,
        "max_stall_s": round(max_stall, 2),
    }


def recover_times(faults: list[tuple[float, str]], ledgers: dict[int, list[tuple]], end: float) -> list[float | None]:
    """Per fault: seconds until every rank received a batch after it (None: not before the end)."""
    times = {r: sorted(row[0] for row in rows if row[0] != "R") for r, rows in ledgers.items()}
    out: list[float | None] = []
    for t0, _kind in faults:
        firsts = []
        for ts in times.values():
            nxt = next((t for t in ts if t > t0), None)
            firsts.append(nxt)
        out.append(None if any(x is None for x in firsts) else max(firsts) - t0)  # type: ignore[type-var,operator]
    return out


def reference(job: dict, steps: int, shm_dir: Path) -> dict[int, dict[tuple[int, int], str]]:
    """The same job on one node without faults: each rank's (step, micro) -> hash for ``steps`` steps."""
    import msdata_client as msd
    from tests.server_util import ServerProc

    srv = ServerProc(str(shm_dir), workers=2).start()
    spec = msd.DGraph.from_dict(job).spec
    out: dict[int, dict[tuple[int, int], str]] = {r: {} for r in range(WORLD)}
    errs: list[BaseException] = []

    def body(r: int) -> None:
        try:
            with msd.DataClient(spec, endpoint=srv.socket, rank=r, world_size=WORLD, connect_timeout=60) as dc:
                for _ in range(steps * MICRO):
                    b = next(dc)
                    out[r][(int(b["step"]), int(b["micro"]))] = batch_hash(b)
                    del b
        except BaseException as e:  # reported below
            errs.append(e)

    try:
        ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(WORLD)]
        for t in ts:
            t.start()
        end = time.monotonic() + 600
        for t in ts:
            t.join(max(0.1, end - time.monotonic()))
        if any(t.is_alive() for t in ts):
            raise SystemExit(f"the reference run on one node hung; its log:\n{srv.log()[-3000:]}")
    finally:
        srv.stop()
        if srv.proc is not None and srv.proc.stdout:
            srv.proc.stdout.close()
    if errs:
        raise errs[0]
    return out


def _pct(xs: list[float], q: float) -> float:
    """The median for q = 0.5 (statistics.median), else the nearest rank."""
    if q == 0.5:
        return statistics.median(xs)
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="90 seconds")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--ckpt", type=int, default=10, help="ranks save their state every N steps")
    ap.add_argument("--pace", type=float, default=0.05, help="seconds a rank 'trains' on each micro-batch")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds the job may take to recover at the end")
    ap.add_argument("--ttl", type=float, default=3.0, help="the nodes' etcd lease, seconds")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, ledgers)")
    ap.add_argument("--no-takeover", action="store_true", help="skip the failover measurement after the chaos")
    ap.add_argument("--takeover-only", action="store_true", help="only the failover measurement")
    ap.add_argument("--takeover-at", type=int, default=8, help="the step after which the data owner is killed")
    ap.add_argument(
        "--smoke", action="store_true", help="seconds: each fault kind once, 3 s apart; lease 2 s; a short takeover"
    )
    args = ap.parse_args()
    if args.smoke:
        args.interval, args.ttl, args.settle, args.ckpt, args.pace, args.takeover_at = 3.0, 2.0, 40.0, 3, 0.02, 3
    if args.takeover_only:
        print(json.dumps(takeover_phase(args), sort_keys=True))
        return
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := sorted(set(kinds) - set(KINDS)):
        raise SystemExit(f"--kinds: unknown {bad}; choose from {', '.join(KINDS)}")
    duration = len(kinds) * args.interval + 1 if args.smoke else 90.0 if args.quick else args.minutes * 60.0
    rng = random.Random(args.seed)

    import tests.cluster_util as tm
    from tests.etcd_fixture import EtcdServer

    base = Path(tempfile.mkdtemp(prefix="msdx-", dir="/tmp"))  # short: Unix socket paths are limited
    etcd = EtcdServer(base).start()
    (base / "c").mkdir()
    cluster = tm.Cluster(base / "c", etcd.url, NODES)
    for srv in cluster.nodes.values():  # two transform workers per node: the worker fault has victims
        cfg = Path(srv.config)
        text = cfg.read_text().replace("workers = 0", "workers = 2")
        cfg.write_text(text.replace(f"lease_ttl = {tm.TTL}", f"lease_ttl = {args.ttl}"))
    prefixes = [srv.prefix for srv in cluster.nodes.values()]
    faults: list[tuple[float, str]] = []
    skipped: dict[str, int] = {}
    ranks: Ranks | None = None
    t_end = t_stop = 0.0
    stuck = False
    try:
        data = write_data(base / "data", args.seed)
        job = job_dict(data)
        job_path = base / "job.json"
        job_path.write_text(json.dumps(job))
        cluster.start()
        tm.wait_for(lambda: cluster.settled(set(cluster.nodes)), 60, "one leader that every node agrees on")
        sockets = {i: cluster.nodes[f"node-{i}"].socket for i in range(NODES)}
        ranks = Ranks(base, job_path, sockets, args.ckpt, args.pace)
        ranks.start()
        tm.wait_for(
            lambda: all(p.exists() and p.stat().st_size > 0 for p in ranks.ledgers.values()),
            120,
            "every rank's first batch",
        )
        t_start = time.monotonic()
        next_fault = t_start + args.interval
        print(
            f"chaos: {duration:.0f} s, a fault every {args.interval:.0f} s among {kinds} (seed {args.seed})", flush=True
        )
        while time.monotonic() < t_start + duration:
            time.sleep(0.1)
            if ranks.dead():  # a rank died on its own (or was killed): the launcher restarts the job's ranks
                print(f"  {time.monotonic() - t_start:6.1f}s  rank(s) {ranks.dead()} died: restarting", flush=True)
                ranks.restart_all()
            if time.monotonic() < next_fault:
                continue
            next_fault += args.interval
            kind = kinds[len(faults) % len(kinds)] if args.smoke else rng.choice(kinds)  # smoke: every kind
            t0 = inject(kind, cluster, etcd, ranks, rng)
            for other in rng.sample(kinds, len(kinds)) if t0 is None else ():  # no victim of that kind now
                skipped[kind] = skipped.get(kind, 0) + 1
                kind = other
                if (t0 := inject(kind, cluster, etcd, ranks, rng)) is not None:
                    break
            if t0 is None:
                continue
            faults.append((t0, kind))
            at = time.strftime("%H:%M:%S", time.localtime(t0)) + f"{t0 % 1:.2f}"[1:]  # to read the logs by
            print(f"  {time.monotonic() - t_start:6.1f}s  fault {len(faults):3d}: {kind:8} at {at}", flush=True)
        t_end = time.time()
        # let every rank get past the last fault, then stop them at a step boundary; a job that does not recover
        # within --settle seconds is reported as stuck (with its open stall), not waited for
        deadline = time.monotonic() + args.settle
        while not _all_after(ranks, t_end) and time.monotonic() < deadline:
            time.sleep(0.2)
        stuck = not _all_after(ranks, t_end)
        t_stop = time.time()
        if stuck:
            print(f"  the job did not recover within {args.settle:.0f} s of the last fault: stopping it", flush=True)
        ranks.finish(10 if stuck else 60)
    finally:
        if ranks is not None:
            for p in ranks.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
            ranks.close()
        cluster.stop()
        etcd.stop()
    assert ranks is not None
    ledgers = {r: read_ledger(p) for r, p in ranks.ledgers.items()}
    last_step = max((row[1] for rows in ledgers.values() for row in rows if row[0] != "R"), default=0)
    ref_dir = Path(tempfile.mkdtemp(prefix="msdr-", dir="/tmp"))
    try:
        ref = reference(job, last_step + 1, ref_dir)
    finally:
        shutil.rmtree(ref_dir, ignore_errors=True)
    result = analyse(ledgers, ref, t_stop if stuck else None)
    rec = recover_times(faults, ledgers, t_end)
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(p) for p in prefixes)]
    print(f"{'fault':10} {'count':>5} {'recover p50':>12} {'max':>8}")
    per_kind = {}
    for k in kinds:
        xs = [x for (t, kk), x in zip(faults, rec) if kk == k and x is not None]
        n = sum(1 for _, kk in faults if kk == k)
        per_kind[k] = {
            "count": n,
            "recover_p50_s": round(_pct(xs, 0.5), 2) if xs else None,
            "recover_max_s": round(max(xs), 2) if xs else None,
        }
        p50 = f"{_pct(xs, 0.5):12.2f}" if xs else f"{'-':>12}"
        mx = f"{max(xs):8.2f}" if xs else f"{'-':>8}"
        print(f"{k:10} {n:5d} {p50} {mx}")
    all_rec = [x for x in rec if x is not None]
    print(
        f"steps {last_step + 1}, rank restarts {ranks.restarts}, lost {result['lost']}, duplicated "
        f"{result['duplicated']} (legitimate replays {result['replayed']}), mismatched {result['mismatched']}, "
        f"longest stall {result['max_stall_s']:.2f} s, /dev/shm leftovers {len(left)}",
        flush=True,
    )
    phase = None if args.no_takeover else takeover_phase(args)  # after the chaos: its own clusters, side by side
    out = {
        "faults": len(faults),
        **result,
        "recover_p50_s": round(_pct(all_rec, 0.5), 2) if all_rec else None,
        "recover_max_s": round(max(all_rec), 2) if all_rec else None,
        "unrecovered": sum(1 for x in rec if x is None),
        "takeover_s_cold": phase["takeover_s_cold"] if phase else None,  # None: --no-takeover
        "takeover_s_shadow": phase["takeover_s_shadow"] if phase else None,
        **({"takeover": phase} if phase else {}),
        "per_kind": per_kind,
        "skipped": skipped,
        "steps": last_step + 1,
        "rank_restarts": ranks.restarts,
        "shm_left": len(left),
        "stuck": stuck,
        "seed": args.seed,
        "minutes": round(duration / 60, 2),
    }
    if args.keep:
        print(f"work directory kept: {base}")
    else:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out, sort_keys=True))


# ---- the failover of a data-owning node, with and without shadow loaders --------------------------------------
def takeover_phase(args) -> dict:
    """Both arms (cold, then shadows) on one etcd, each on a fresh cluster: see the module docstring."""
    import tests.cluster_util as tm
    from tests.etcd_fixture import EtcdServer

    base = Path(tempfile.mkdtemp(prefix="msdt-", dir="/tmp"))
    etcd = EtcdServer(base).start()
    try:
        data = write_data(base / "data", args.seed)
        arms = {n: _takeover_arm(base / f"arm{n}", etcd.url, data, n, args, tm) for n in (0, 1)}
    finally:
        etcd.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    cold, shadow = arms[0], arms[1]
    out = {
        "takeover_s_cold": cold["stall_s"],
        "takeover_s_shadow": shadow["stall_s"],
        "next_batch_s_cold": cold["next_s"],
        "next_batch_s_shadow": shadow["next_s"],
        "ratio": round(shadow["stall_s"] / cold["stall_s"], 3) if cold["stall_s"] else None,
        "standby_takeovers": shadow["takeovers"],
        "batches": len(cold["hashes"]),
        "arms_equal": cold["hashes"] == shadow["hashes"],
        "ttl_s": args.ttl,
    }
    print(
        f"takeover of a data owner's partitions: cold {out['takeover_s_cold']:.2f} s, with shadows "
        f"{out['takeover_s_shadow']:.2f} s (ratio {out['ratio']}), lease {args.ttl} s, batches equal: "
        f"{out['arms_equal']}",
        flush=True,
    )
    return out


def _takeover_arm(base: Path, etcd_url: str, data: dict, shadows: int, args, tm) -> dict:
    import msdata_client as msd

    base.mkdir()
    g = msd.DGraph.from_dict(job_dict(data))
    spec = g.mesh(dp=2).shadow_loaders(shadows).plan()
    steps = args.takeover_at + 12
    cluster = tm.Cluster(base, etcd_url, NODES)
    for srv in cluster.nodes.values():
        cfg = Path(srv.config)
        cfg.write_text(cfg.read_text().replace(f"lease_ttl = {tm.TTL}", f"lease_ttl = {args.ttl}"))
    times: dict[int, list[float]] = {0: [], 1: []}
    hashes: dict[tuple[int, int, int], str] = {}
    errs: list[BaseException] = []
    try:
        cluster.start()
        leader, _ = tm.wait_for(lambda: cluster.settled(set(cluster.nodes)), 60, "one leader")
        owner = next(nid for nid in sorted(cluster.nodes) if nid != leader)
        rank_nodes = [nid for nid in sorted(cluster.nodes) if nid != owner]

        def body(r: int) -> None:
            try:
                sock = cluster.nodes[rank_nodes[r]].socket
                with msd.DataClient(spec, endpoint=sock, rank=r, world_size=2, connect_timeout=60) as dc:
                    for _ in range(steps * MICRO):
                        b = next(dc)
                        times[r].append(time.monotonic())
                        hashes[(r, int(b["step"]), int(b["micro"]))] = batch_hash(b)
                        del b
                        time.sleep(args.pace / 5)  # a light trainer: the wait is the data's
            except BaseException as e:  # reported below
                errs.append(e)

        ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
        for t in ts:
            t.start()
        tm.wait_for(lambda: all(len(x) >= args.takeover_at * MICRO for x in times.values()) or errs, 120, "steps")
        t0 = time.monotonic()
        cluster.nodes[owner].kill()
        for t in ts:
            t.join(180)
        if errs or any(t.is_alive() for t in ts):
            raise SystemExit(f"takeover arm (shadow_loaders={shadows}) failed: {errs or 'a rank hung'}")
        logs = "".join(cluster.nodes[nid].log() for nid in rank_nodes)
    finally:
        cluster.stop()
    stall = next_s = 0.0
    for x in times.values():
        after = [t for t in x if t > t0]
        gaps = [b - a for a, b in zip([t0, *after], after)]
        stall = max(stall, max(gaps, default=0.0))
        next_s = max(next_s, after[0] - t0 if after else float("inf"))
    return {
        "stall_s": round(stall, 3),
        "next_s": round(next_s, 3),
        "hashes": hashes,
        "takeovers": logs.count("(standby, seek to"),
    }


def _all_after(ranks: Ranks, t: float) -> bool:
    for p in ranks.ledgers.values():
        rows = [row for row in read_ledger(p) if row[0] != "R"]
        if not rows or rows[-1][0] <= t:
            return False
    return True


def inject(kind: str, cluster, etcd, ranks: Ranks, rng: random.Random) -> float | None:
    """One fault on a victim of ``kind``: the time it struck, or None when there is no victim right now."""
    sts = cluster.statuses()
    leader = next((n for n, st in sts.items() if st["role"] == "leader"), None)
    if kind == "worker":
        nid = rng.choice(sorted(cluster.nodes))
        proc = cluster.nodes[nid].proc
        workers = [p for p, depth in descendants(proc.pid) if depth == 2] or [p for p, _ in descendants(proc.pid)]
        if not workers:
            return None
        t0 = time.time()
        os.kill(rng.choice(sorted(workers)), signal.SIGKILL)
        return t0
    if kind in ("follower", "leader"):
        if leader is None:
            return None
        nid = leader if kind == "leader" else rng.choice(sorted(n for n in cluster.nodes if n != leader))
        srv = cluster.nodes[nid]
        t0 = time.time()
        srv.kill()
        srv.start()  # the supervisor starts it again
        return t0
    if kind == "etcd":
        t0 = time.time()
        etcd.stop(signal.SIGKILL)
        etcd.start()
        return t0
    if kind in ("rank", "socket") and not ranks.running():
        return None  # the ranks are (re)starting: no rank to fail yet
    if kind == "rank":
        r = rng.randrange(WORLD)
        t0 = time.time()
        ranks.procs[r].kill()
        ranks.procs[r].wait()
        ranks.restart_all()
        return t0
    if kind == "socket":
        r = rng.randrange(WORLD)
        if ranks.procs[r].poll() is not None:
            return None
        t0 = time.time()
        ranks.procs[r].send_signal(signal.SIGUSR1)
        return t0
    raise ValueError(kind)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2:])
    else:
        main()
