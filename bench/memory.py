# .venv/bin/python bench/memory.py --quick      (full run: .venv/bin/python bench/memory.py)
"""CPU-memory benchmark (issue 3): per-rank torch DataLoaders against one msdata node server, many sources.

Workload ``manysources`` (bench/workloads.py): S Parquet sources of 16 files x 8 row groups x 128 rows,
text lognormal(median 400 bytes, sigma 1), seq_len 4096, R trainer ranks on one node, W DataLoader
workers per rank. Both sides read the same files and deliver packed 4096-token rows of byte tokens.

- torch: every rank runs ``DataLoader(num_workers=W)`` over an IterableDataset written the way users mix
  sources today: each worker opens a ``pq.ParquetFile`` for every file of every source, keeps a per-source
  index of row-group offsets and the current decoded row group, blends sources Megatron-style (the source
  furthest behind its weight goes next), tokenizes and packs.
- msdata: one ``msdata-server serve`` (its transform worker pool included) serves the same R ranks
  (one job, S parquet sources, dp = R).

Memory is PSS summed over every process tree involved (trainers with their DataLoader workers, or server +
pool zygote + pool workers + trainers), minus the PSS of the same R trainer processes measured just before,
idle, after they imported torch and msdata_client and before they built a loader (or after they closed
the previous one), so only the loaders' memory is compared. It is taken while everything is live and warmed
up: each rank has read its batches (enough that every DataLoader worker drew from every source) and holds
them; the msdata server has filled its read-ahead.

PSS is reported two ways. smaps_rollup's PSS divides a page among every process on the machine that maps it,
so any other Python that happens to run (a colleague's benchmark importing pyarrow) shrinks the server's
share of library pages and moves the figures by tens of MiB. PSS within the measured set (from the page
frame numbers in /proc/PID/pagemap, root only) divides a page only among the measured processes: the PSS
they would show alone on the node. That one is the headline where it can be read; smaps_rollup otherwise.

Trainer processes persist across phases (importing torch 8 times takes 20 s here); msdata phases run before
baseline ones so that no trainer has pyarrow mapped when the server is measured; --fresh starts new ones
every phase. The driver imports neither numpy, pyarrow nor torch. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from progress import bar, say  # noqa: E402

from msdata_server.ops.memory import proc_memory, tree_pids  # noqa: E402  (stdlib only)

MIB = 2**20
SEED = 1234
EOS = 256
MAX_DOC_BYTES = 1 << 16  # generated documents are clipped to [16, 64 KiB] bytes
PHASE_TIMEOUT = 900.0
LOADERS = {"torch": "baseline", "msdata": "msdata"}  # seconds any phase may take before the benchmark gives up


# ---------------------------------------------------------------------------------------------------------
# data: generated once per data directory, with a fixed seed; bigger S reuses the files of smaller S


def _gen_main(root: str, n_sources: int, part: int = 0, parts: int = 1) -> None:
    """Write sources s000..s{S-1} (those with s % parts == part) under root, skipping files already there;
    print the shape as JSON. Document texts are slices of one seeded random blob (cheap to make)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from workloads import MANYSOURCES as M

    rows = M["row_groups_per_file"] * M["rows_per_row_group"]
    alphabet = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz      \n", dtype=np.uint8)  # words, lines
    t0 = time.perf_counter()
    blob = alphabet[np.random.default_rng(SEED).integers(0, len(alphabet), 16 << 20, dtype=np.uint8)]
    written = nbytes = 0
    for s in range(part, n_sources, parts):
        d = os.path.join(root, f"s{s:03d}")
        os.makedirs(d, exist_ok=True)
        for f in range(M["files_per_source"]):
            path = os.path.join(d, f"part-{f:03d}.parquet")
            if os.path.exists(path):
                continue
            rng = np.random.default_rng([SEED, s, f])
            lens = rng.lognormal(math.log(M["text_median_bytes"]), M["text_sigma"], rows)
            lens = np.clip(np.rint(lens), 16, MAX_DOC_BYTES).astype(np.int32)
            offsets = np.zeros(rows + 1, dtype=np.int32)
            np.cumsum(lens, out=offsets[1:])
            total = int(offsets[-1])
            if total <= len(blob):
                at = int(rng.integers(0, len(blob) - total + 1))
                data = blob[at : at + total]
            else:
                data = alphabet[rng.integers(0, len(alphabet), total, dtype=np.uint8)]
            text = pa.StringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(data))
            tmp = path + ".tmp"
            pq.write_table(pa.table({"text": text}), tmp, row_group_size=M["rows_per_row_group"])
            os.replace(tmp, path)  # a file that exists is complete: an interrupted run resumes safely
            written += 1
            nbytes += int(offsets[-1])
    print(
        json.dumps({"shape": M, "files_written": written, "text_bytes": nbytes, "seconds": time.perf_counter() - t0}),
        flush=True,
    )


def _generate(data: str, n_sources: int) -> dict:
    """Run the generator in os.cpu_count() child processes (the driver imports no numpy or pyarrow)."""
    t0 = time.perf_counter()
    parts = max(1, min(os.cpu_count() or 1, 8))
    cmd = [sys.executable, os.path.abspath(__file__), "gen", data, str(n_sources)]
    procs = [
        subprocess.Popen(
            [*cmd, str(i), str(parts)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        for i in range(parts)
    ]
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"data generation failed:\n{err}")
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    return {
        "shape": got[0]["shape"],
        "files_written": sum(x["files_written"] for x in got),
        "seconds": time.perf_counter() - t0,
    }


def _source_paths(root: str, n_sources: int, files: int) -> list[list[str]]:
    return [[os.path.join(root, f"s{s:03d}", f"part-{f:03d}.parquet") for f in range(files)] for s in range(n_sources)]


# ---------------------------------------------------------------------------------------------------------
# trainer processes (``memory.py trainer KIND CONFIG_JSON``): import, say "imported", wait for "go",
# read N batches, say "ready", hold everything until stdin closes


def _baseline_dataset(cfg: dict):
    """The per-rank loader users write today: every worker opens every file of every source."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import IterableDataset, get_worker_info

    class MixedParquet(IterableDataset):
        def __init__(self, sources: list[list[str]], weights: list[float], seq_len: int, rank: int, world: int):
            self.sources, self.weights, self.seq_len, self.rank, self.world = sources, weights, seq_len, rank, world

        def __iter__(self):
            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
            shard, nshards = self.rank * nw + wid, self.world * nw
            n = len(self.sources)
            files = [[pq.ParquetFile(p) for p in paths] for paths in self.sources]
            units, offsets = [], []  # per source: this worker's (file, row group) units and their row offsets
            for fl in files:
                u = np.array([(f, g) for f, pf in enumerate(fl) for g in range(pf.metadata.num_row_groups)], np.int32)
                rows = np.array([fl[f].metadata.row_group(g).num_rows for f, g in u], np.int64)
                units.append(u[shard::nshards])
                offsets.append(np.concatenate(([0], np.cumsum(rows)))[shard::nshards])
            cursor = np.zeros(n, np.int64)
            current: list[list | None] = [None] * n  # the decoded row group each source is reading
            pos = np.zeros(n, np.int64)
            taken = np.zeros(n, np.float64)
            w = np.asarray(self.weights, np.float64)
            buf: list[np.ndarray] = []
            have = 0
            while True:
                s = int(np.argmax(w * (taken.sum() + 1) - taken))  # Megatron blending: furthest behind goes next
                taken[s] += 1
                if current[s] is None or pos[s] >= len(current[s]):
                    f, g = units[s][cursor[s] % len(units[s])]
                    current[s] = files[s][f].read_row_group(int(g), columns=["text"]).column(0).to_pylist()
                    cursor[s] += 1
                    pos[s] = 0
                text = current[s][pos[s]]
                pos[s] += 1
                doc = np.empty(len(text.encode()) + 1, np.int64)
                doc[:-1] = np.frombuffer(text.encode(), np.uint8)
                doc[-1] = EOS
                buf.append(doc)
                have += len(doc)
                while have > self.seq_len:
                    cat = np.concatenate(buf)
                    row = torch.from_numpy(cat[: self.seq_len + 1].copy())
                    yield {"tokens": row[:-1], "labels": row[1:]}
                    buf, have = [cat[self.seq_len :]], len(cat) - self.seq_len

    return MixedParquet(cfg["sources"], cfg["weights"], cfg["seq_len"], cfg["rank"], cfg["ranks"])


def _trainer_main() -> None:
    """A trainer rank: import torch and msdata_client, then run loaders as the driver asks (one JSON line
    per phase), say "ready" after the batches, hold the loader live until "stop", close it, say "stopped"."""
    import gc

    import torch

    import msdata_client as msd
    from msdata_client.client import DataClient  # noqa: F401  (the trainer-side import, in every kind)

    torch.set_num_threads(1)
    print("imported", flush=True)
    while (line := sys.stdin.readline().strip()) not in ("", "exit"):
        cfg = json.loads(line)
        tokens = 0
        if cfg["kind"] == "baseline":
            import pyarrow.parquet  # noqa: F401  (the dataset module's import, in the parent as users do it)
            from torch.utils.data import DataLoader

            dl = DataLoader(_baseline_dataset(cfg), batch_size=1, num_workers=cfg["workers"], prefetch_factor=2)
            it = iter(dl)
            for _ in range(cfg["batches"]):
                b = next(it)
                tokens += int((b["tokens"] != cfg["pad_id"]).sum())
            del b
        else:
            spec = msd.JobSpec.from_dict(cfg["job"])
            dc = msd.DataClient(
                spec, endpoint=cfg["endpoint"], rank=cfg["rank"], world_size=cfg["ranks"], connect_timeout=120
            )
            for _ in range(cfg["batches"]):
                b = next(dc)
                tokens += int((b["tokens"] != spec.pad_id).sum())
                del b
        print("ready " + json.dumps({"tokens": tokens}), flush=True)
        sys.stdin.readline()  # hold the loader, live, until the benchmark has measured
        if cfg["kind"] == "baseline":
            it._shutdown_workers()
            del it, dl
        else:
            dc.close()
            del dc
        gc.collect()
        print("stopped", flush=True)


# ---------------------------------------------------------------------------------------------------------
# the driver: process trees, PSS, phases


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def pss(pids) -> int:
    return sum(proc_memory(p)["pss"] for p in pids)


def _setpss_main(pids: list[int]) -> None:
    """Print {pid: bytes}: PSS as if the given processes were alone on the machine.

    Reads every resident page's frame number from /proc/PID/pagemap (needs root) and divides each page by the
    number of mappings of it within this set only, so unrelated processes that share library pages (another
    Python importing pyarrow, say) do not shrink the figures. Prints null without the privilege.
    """
    import numpy as np

    frames, owners = [], []
    for k, pid in enumerate(pids):
        try:
            with open(f"/proc/{pid}/smaps") as f:
                ranges, cur = [], None
                for line in f:
                    head = line.split(None, 1)[0]
                    if not head.endswith(":") or "-" in head:
                        lo, hi = (int(x, 16) for x in head.split("-"))
                        cur = [lo, hi, 0]
                        ranges.append(cur)
                    elif head == "Rss:":
                        cur[2] = int(line.split()[1])
            fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
        except OSError:
            continue
        try:
            for lo, hi, rss in ranges:
                if rss == 0:
                    continue
                raw = os.pread(fd, (hi - lo) // 4096 * 8, lo // 4096 * 8)
                e = np.frombuffer(raw, dtype=np.uint64)
                pfn = e[(e >> np.uint64(63)) == 1] & np.uint64((1 << 55) - 1)
                frames.append(pfn)
                owners.append(np.full(len(pfn), k, dtype=np.int32))
        except OSError:
            pass
        finally:
            os.close(fd)
    if not frames:
        print("null")
        return
    pfn, own = np.concatenate(frames), np.concatenate(owners)
    if pfn.size and not pfn.any():  # frame numbers are hidden without CAP_SYS_ADMIN
        print("null")
        return
    _, inv, counts = np.unique(pfn, return_inverse=True, return_counts=True)
    share = 4096.0 / counts[inv]
    per = np.bincount(own, weights=share, minlength=len(pids))
    print(json.dumps({str(pid): int(per[k]) for k, pid in enumerate(pids)}))


def set_pss(pids: list[int]) -> dict[int, int] | None:
    """_setpss_main in a child process (the driver imports no numpy); None where frames are not readable."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "setpss", *map(str, pids)], capture_output=True, text=True, cwd=ROOT
    )
    got = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else None
    return {int(k): v for k, v in got.items()} if got else None


class Lines:
    """Line-oriented stdout of several child processes, read without blocking on any one of them."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.bufs: dict[int, bytes] = {}

    def add(self, key, proc: subprocess.Popen) -> None:
        self.bufs[proc.stdout.fileno()] = b""
        self.sel.register(proc.stdout, selectors.EVENT_READ, (key, proc))

    def wait_all(self, keys, prefix: str, timeout: float, logs: dict) -> dict:
        """Wait until every key printed a line starting with prefix; returns {key: rest of the line}."""
        got: dict = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(keys):
            left = deadline - time.monotonic()
            events = self.sel.select(max(left, 0)) if left > 0 else []
            if not events:
                missing = sorted(set(keys) - set(got))
                raise RuntimeError(f"timed out waiting for {prefix!r} from {missing}" + _tails(logs))
            for sk, _ in events:
                key, proc = sk.data
                fd = sk.fileobj.fileno()
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.sel.unregister(sk.fileobj)
                    if key not in got:
                        raise RuntimeError(f"{key} exited (rc={proc.wait()}) before {prefix!r}" + _tails(logs))
                    continue
                self.bufs[fd] += chunk
                while b"\n" in self.bufs[fd]:
                    line, self.bufs[fd] = self.bufs[fd].split(b"\n", 1)
                    text = line.decode()
                    if text.startswith(prefix) and key not in got:
                        got[key] = text[len(prefix) :].strip()
        return got

    def remove(self, proc: subprocess.Popen) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(proc.stdout)

    def close(self) -> None:
        self.sel.close()


def _tails(logs: dict) -> str:
    out = []
    for name, path in logs.items():
        try:
            with open(path, errors="replace") as f:
                t = f.read()[-3000:]
        except OSError:
            continue
        if t.strip():
            out.append(f"\n--- {name} ({path}) ---\n{t}")
    return "".join(out)


def _status(endpoint: str) -> dict:
    from msdata_client.wire import FrameReader, encode, recv_into_reader

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    with s:
        s.connect(endpoint)
        s.sendall(encode({"t": "status"}))
        r = FrameReader()
        while (f := r.next_frame()) is None:
            recv_into_reader(s, r)
    return f.get("status", {})


def _wait_loaders_idle(endpoint: str, timeout: float = 60.0) -> dict:
    """Poll the server's status until no loader has reads in flight (its read-ahead is as full as it gets)."""
    deadline = time.monotonic() + timeout
    while True:
        st = _status(endpoint)
        srcs = [s for j in st.get("jobs", []) for s in j.get("sources", {}).values()]
        if srcs and all(s.get("inflight", 0) == 0 for s in srcs):
            return st
        if time.monotonic() > deadline:
            return st
        time.sleep(0.2)  # polling a benchmark's steady state, not synchronising


def _msdata_job(paths: list[list[str]], ranks: int, seq_len: int) -> dict:
    from msdata_client.graph import DGraph

    g = DGraph("memory", seed=SEED)
    names = [f"s{i:03d}" for i in range(len(paths))]
    for name, p in zip(names, paths):
        g.source(name, "parquet", p, column="text", transform="msdata_server.transforms:byte_tokens")
    g.mix({n: 1.0 / len(names) for n in names}).pack(seq_len, micro_batches=1, rows=1)
    g.mesh(dp=ranks)
    return g.plan().to_dict()


class Trainers:
    """R trainer processes (``memory.py trainer``) that run one loader after another; PSS is measured per
    phase against the same processes idle just before it, so what a previous phase left behind cancels."""

    def __init__(self, ranks: int, work: str):
        self.ranks = ranks
        self.dir = tempfile.mkdtemp(prefix=f"trainers-R{ranks}-", dir=work)
        self.logs: dict[str, str] = {}
        self.procs: list[subprocess.Popen] = []
        self.lines = Lines()
        self.keys = [f"rank {r}" for r in range(ranks)]
        t0 = time.perf_counter()
        for r, key in enumerate(self.keys):
            self.logs[key] = os.path.join(self.dir, f"rank{r}.log")
            with open(self.logs[key], "wb") as log:
                p = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "trainer"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    cwd=ROOT,
                )
            self.procs.append(p)
            self.lines.add(key, p)
        self.lines.wait_all(self.keys, "imported", PHASE_TIMEOUT, self.logs)
        self.seconds_start = time.perf_counter() - t0

    def send(self, msgs: list[str]) -> None:
        for p, m in zip(self.procs, msgs):
            p.stdin.write(m.encode() + b"\n")
            p.stdin.flush()

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        self.lines.close()


def run_phase(
    kind: str, tr: Trainers, *, paths, workers: int, batches: int, seq_len: int, server_workers: int, verbose: bool
) -> dict:
    """One configuration on live trainer processes, from idle to measurement and back to idle."""
    ranks = tr.ranks
    tag = f"{kind}-S{len(paths)}-R{ranks}"
    server = None
    sockdir = tempfile.mkdtemp(prefix="msm-")  # short: Unix socket paths are limited to 107 bytes
    endpoint = os.path.join(sockdir, "msdata.sock")
    logs = dict(tr.logs)
    t0 = time.perf_counter()
    stop_sent = False
    try:
        # the same processes with no loader: smaps_rollup PSS, and PSS within the measured set (see set_pss)
        idle_roll = {p.pid: pss(tree_pids(p.pid)) for p in tr.procs}
        idle_iso = set_pss([p.pid for p in tr.procs])
        job = _msdata_job(paths, ranks, seq_len) if kind == "msdata" else None
        if kind == "msdata":
            conf = os.path.join(sockdir, "node.toml")
            with open(conf, "w") as f:
                f.write(
                    f'[node]\nid = "bench"\nsocket = "{endpoint}"\nshm_prefix = "bm{secrets.token_hex(3)}"\n'
                    f'workers = {server_workers}\nlog_level = "WARNING"\n'
                )
            logs["server"] = os.path.join(tr.dir, f"server-S{len(paths)}.log")
            with open(logs["server"], "wb") as log:
                server = subprocess.Popen(
                    [sys.executable, "-m", "msdata_server", "serve", "--config", conf],
                    stdout=subprocess.PIPE,
                    stderr=log,
                    cwd=ROOT,
                )
            tr.lines.add("server", server)
            tr.lines.wait_all(["server"], '{"event":"ready"', 120, logs)
        t_server = time.perf_counter() - t0
        weights = [1.0 / len(paths)] * len(paths)
        tr.send(
            [
                json.dumps(
                    {
                        "kind": kind,
                        "rank": r,
                        "ranks": ranks,
                        "workers": workers,
                        "batches": batches,
                        "seq_len": seq_len,
                        "pad_id": 257,
                        "endpoint": endpoint,
                        "job": job,
                        "sources": paths,
                        "weights": weights,
                    }
                )
                for r in range(ranks)
            ]
        )
        ready = tr.lines.wait_all(tr.keys, "ready", PHASE_TIMEOUT, logs)
        t_read = time.perf_counter() - t0 - t_server
        status = _wait_loaders_idle(endpoint) if kind == "msdata" else {}
        samples = []
        for _ in range(3):
            trees = {p.pid: tree_pids(p.pid) for p in tr.procs}
            srv_pids = tree_pids(server.pid) if server is not None else []
            roll = {q: proc_memory(q)["pss"] for q in [q for t in trees.values() for q in t] + srv_pids}
            samples.append((sum(roll.values()), roll, trees, srv_pids))
            time.sleep(0.1)  # three samples of a steady state; the largest counts
        total_roll, roll, trees, srv_pids = max(samples, key=lambda x: x[0])
        iso = set_pss(list(roll)) if idle_iso is not None else None
        tr.send(["stop"] * ranks)
        stop_sent = True
        tr.lines.wait_all(tr.keys, "stopped", PHASE_TIMEOUT, logs)
        # the headline: PSS within the measured set where frame numbers are readable (root), else smaps_rollup
        per, idle = (iso, idle_iso) if iso is not None else (roll, idle_roll)
        out = {
            "kind": kind,
            "S": len(paths),
            "R": ranks,
            "W": workers if kind == "baseline" else None,
            "batches": batches,
            "method": "isolated" if iso is not None else "rollup",
            "loader_pss": sum(per.values()) - sum(idle.values()),
            "loader_pss_rollup": total_roll - sum(idle_roll.values()),
            "loader_pss_isolated": None if iso is None else sum(iso.values()) - sum(idle_iso.values()),
            "idle_pss": sum(idle.values()),
            "trainer_pss": sum(per.get(q, 0) for t in trees.values() for q in t),
            "trainer_processes": sum(len(t) for t in trees.values()),
            "tokens": sum(json.loads(v)["tokens"] for v in ready.values()),
            "seconds_read": t_read,
        }
        if server is not None:
            out["server"] = _server_breakdown(server.pid, {q: per.get(q, 0) for q in srv_pids}, status)
        if verbose:
            print(
                f"  [{tag}] server start {t_server:.1f}s, read {t_read:.1f}s, loader {out['loader_pss'] / MIB:.0f} MiB",
                flush=True,
            )
        return out
    except BaseException:
        if not stop_sent:
            with contextlib.suppress(OSError):
                tr.send(["stop"] * ranks)
        raise
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            tr.lines.remove(server)
            server.stdout.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def _server_breakdown(server_pid: int, srv: dict[int, int], status: dict) -> dict:
    """PSS of the server, the pool's zygote and each pool worker, and what the loaders hold."""
    out = {"server": srv.get(server_pid, 0), "zygote": 0, "workers": [], "other": 0}
    for pid, v in srv.items():
        if pid == server_pid:
            continue
        if _ppid(pid) == server_pid and "zygote" in _cmdline(pid):
            out["zygote"] += v  # the pool's forkserver; workers are its children (spawned ones the server's)
        elif "msdata_server.pool.worker" in _cmdline(pid):
            out["workers"].append(v)
        else:
            out["other"] += v
    srcs = [s for j in status.get("jobs", []) for s in j.get("sources", {}).values()]
    out["loader_payload_bytes"] = sum(s.get("memory_bytes", 0) for s in srcs)
    out["loader_ready_samples"] = sum(s.get("ready", 0) for s in srcs)
    out["rings_bytes"] = sum(r["slots"] * r["slot_size"] for j in status.get("jobs", []) for r in j.get("rings", []))
    return out


def _fmt_breakdown(m: dict) -> str:
    b = m["server"]
    idle_each = m["idle_pss"] / m["R"]
    rank_each = m["trainer_pss"] / m["R"]
    ws = ", ".join(f"{w / MIB:.0f}" for w in sorted(b["workers"]))
    return (
        f"    S={m['S']:<3d} R={m['R']}: server {b['server'] / MIB:.0f} MiB (read-ahead payloads "
        f"{b['loader_payload_bytes'] / MIB:.0f} MiB in {b['loader_ready_samples']} samples, rings "
        f"{b['rings_bytes'] / MIB:.0f} MiB), zygote {b['zygote'] / MIB:.0f} MiB, pool workers [{ws}] MiB, "
        f"per rank {rank_each / MIB:.0f} MiB vs idle {idle_each / MIB:.0f} MiB "
        f"(client side {(rank_each - idle_each) / MIB:+.1f} MiB)"
    )


def _batches_for(S: int, W: int, seq_len: int, median: float, sigma: float) -> int:
    """Per rank: enough that every DataLoader worker has drawn from every source (Megatron blending visits
    all S sources in S documents), plus the prefetch, so both loaders are measured warm."""
    mean_doc = median * math.exp(sigma**2 / 2) + 1
    docs_per_batch = max(1.0, seq_len / mean_doc)
    return W * math.ceil(S / docs_per_batch) + 2 * W


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="S in 8, 64 only (under two minutes)")
    ap.add_argument("--sources", default=None, help="comma-separated S values (default 8,32,64,128)")
    ap.add_argument("--ranks", type=int, default=None, help="R trainer ranks (default 8)")
    ap.add_argument("--workers-per-rank", type=int, default=None, help="W DataLoader workers per rank (default 4)")
    ap.add_argument("--server-workers", type=int, default=4, help="msdata transform pool size")
    ap.add_argument(
        "--scale-ranks",
        default=None,
        help="extra R values at S=64 to show how each side scales with R*W (default 4; '' for none)",
    )
    ap.add_argument("--batches", type=int, default=None, help="batches per rank (default: enough to warm up)")
    ap.add_argument("--loader", choices=("both", "torch", "msdata"), default="both")
    ap.add_argument("--fresh", action="store_true", help="new trainer processes for every phase (slower)")
    ap.add_argument("--data", default=None, help="data directory to reuse (generated there if missing)")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="seconds: S=3, R=2 (and R=1), W=1, 2 batches, both loaders")
    args = ap.parse_args(argv)
    scale_S = 64  # the S at which --scale-ranks adds rows
    if args.smoke:  # both loaders, a trainer restart for another R, the scaling rows: at S=3, not 64
        args.sources, args.ranks, args.workers_per_rank, args.server_workers = "3", 2, 1, 1
        args.scale_ranks, args.batches, args.loader, scale_S = "1", 2, "both", 3

    t_start = time.perf_counter()
    S_list = [int(x) for x in (args.sources or ("8,64" if args.quick else "8,32,64,128")).split(",") if x]
    scale = args.scale_ranks if args.scale_ranks is not None else ("" if args.quick else "4")
    scale_R = [int(x) for x in scale.split(",") if x]
    work = tempfile.mkdtemp(prefix="msdata-memory-")
    data = args.data or os.path.join(work, "data")
    try:
        os.makedirs(data, exist_ok=True)
        g = _generate(data, max([*S_list, scale_S if scale_R else 0]))
        M = g["shape"]
        R = args.ranks or M["ranks"]
        W = args.workers_per_rank or M["workers_per_rank"]
        seq_len = M["seq_len"]
        say(
            f"memory benchmark: manysources, {M['files_per_source']} files x {M['row_groups_per_file']} row groups x "
            f"{M['rows_per_row_group']} rows per source, text lognormal(median {M['text_median_bytes']} B, sigma "
            f"{M['text_sigma']}), seq_len {seq_len}; torch: R={R} ranks x W={W} DataLoader workers; msdata: one "
            f"server, {args.server_workers} pool workers"
        )
        say(f"data: {g['files_written']} parquet files written in {g['seconds']:.1f}s under {data}")

        # msdata phases run before baseline phases on the same trainers: a trainer that ran the baseline has
        # pyarrow mapped, which would make the server's pyarrow pages look free
        configs = [(S, R) for S in S_list] + [(scale_S, r) for r in scale_R if r != R]
        kinds = [k for k in ("msdata", "baseline") if args.loader == "both" or LOADERS[args.loader] == k]
        rows = {
            (S, r): {
                "S": S,
                "R": r,
                "W": W,
                "batches": args.batches or _batches_for(S, W, seq_len, M["text_median_bytes"], M["text_sigma"]),
            }
            for S, r in configs
        }
        trainers: Trainers | None = None
        prog = bar(len(configs) * len(kinds), "memory", "phase")
        try:
            for r in dict.fromkeys(r for _, r in configs):
                for kind in kinds:
                    for S in [S for S, rr in configs if rr == r]:
                        if trainers is not None and (args.fresh or trainers.ranks != r):
                            trainers.close()
                            trainers = None
                        if trainers is None:
                            trainers = Trainers(r, work)
                            if args.verbose:
                                say(f"  [R={r}] trainers imported torch in {trainers.seconds_start:.1f}s")
                        row = rows[(S, r)]
                        row[kind] = run_phase(
                            kind,
                            trainers,
                            paths=_source_paths(data, S, M["files_per_source"]),
                            workers=W,
                            batches=row["batches"],
                            seq_len=seq_len,
                            server_workers=args.server_workers,
                            verbose=args.verbose,
                        )
                        prog.update(1)
        finally:
            prog.close()
            if trainers is not None:
                trainers.close()
        results = list(rows.values())
        for i, row in enumerate(results):
            _print_row(row, header=i == 0)

        say("\nmsdata per-process PSS (server tree and trainer side):")
        for row in results:
            if "msdata" in row:
                say(_fmt_breakdown(row["msdata"]))
        say("\nbaseline per-process PSS:")
        for row in results:
            if "baseline" in row:
                m = row["baseline"]
                procs = m["trainer_processes"]
                say(
                    f"    S={m['S']:<3d} R={m['R']} W={m['W']}: {procs} processes, loader "
                    f"{m['loader_pss'] / MIB:.0f} MiB = {m['loader_pss'] / MIB / max(procs - m['R'], 1):.0f} MiB "
                    f"per DataLoader worker (rank and worker growth together)"
                )
        _print_scaling(results, R, scale_S)
        summary = _summary(results, R, W)
        summary["seconds"] = round(time.perf_counter() - t_start, 1)
        say(json.dumps(summary))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _ratio(row: dict, key: str = "loader_pss") -> float | None:
    b, m = row.get("baseline", {}).get(key), row.get("msdata", {}).get(key)
    return b / m if b is not None and m else None


def _print_row(row: dict, header: bool) -> None:
    if header:
        say(f"\n{'':>20} {'PSS (smaps_rollup)':^33}   {'PSS within the measured set':^33}")
        say(
            f"{'S':>4} {'R':>3} {'W':>3} {'batches':>8} {'baseline MiB':>13} {'msdata MiB':>11} {'ratio':>7}"
            f"   {'baseline MiB':>13} {'msdata MiB':>11} {'ratio':>7}"
        )
    cells = []
    for key in ("loader_pss_rollup", "loader_pss_isolated"):
        b = row.get("baseline", {}).get(key)
        m = row.get("msdata", {}).get(key)
        r = _ratio(row, key)
        cells += [
            "-" if b is None else f"{b / MIB:.0f}",
            "-" if m is None else f"{m / MIB:.0f}",
            "-" if r is None else f"{r:.1f}x",
        ]
    say(
        f"{row['S']:>4} {row['R']:>3} {row['W']:>3} {row['batches']:>8} {cells[0]:>13} {cells[1]:>11} {cells[2]:>7}"
        f"   {cells[3]:>13} {cells[4]:>11} {cells[5]:>7}"
    )


def _print_scaling(results: list[dict], R: int, S: int = 64) -> None:
    at64 = sorted((row for row in results if row["S"] == S), key=lambda x: x["R"])
    if len(at64) < 2:
        return
    say(f"\nscaling with R*W at S={S}:")
    for row in at64:
        parts = [f"R={row['R']} (R*W={row['R'] * row['W']})"]
        for kind in ("baseline", "msdata"):
            if kind in row:
                parts.append(f"{kind} {row[kind]['loader_pss'] / MIB:.0f} MiB")
        say("    " + ", ".join(parts))


def _summary(results: list[dict], R: int, W: int) -> dict:
    out: dict = {"benchmark": "memory", "workload": "manysources", "R": R, "W": W, "rows": []}
    for row in results:
        rec = {"S": row["S"], "R": row["R"], "W": row["W"], "batches": row["batches"]}
        for kind in ("baseline", "msdata"):
            if kind in row:
                m = row[kind]
                rec[f"{kind}_mib"] = round(m["loader_pss"] / MIB, 1)
                rec[f"{kind}_rollup_mib"] = round(m["loader_pss_rollup"] / MIB, 1)
                iso = m["loader_pss_isolated"]
                rec[f"{kind}_isolated_mib"] = None if iso is None else round(iso / MIB, 1)
                out["method"] = m["method"]
        for key, name in (
            ("loader_pss", "ratio"),
            ("loader_pss_rollup", "rollup_ratio"),
            ("loader_pss_isolated", "isolated_ratio"),
        ):
            r = _ratio(row, key)
            rec[name] = None if r is None else round(r, 2)
        out["rows"].append(rec)
        if row["S"] == 64 and row["R"] == R:
            out["memory_ratio_s64"] = rec["ratio"]
            out["msdata_mib_s64"] = rec.get("msdata_mib")
            out["baseline_mib_s64"] = rec.get("baseline_mib")
            out["rollup_ratio_s64"] = rec["rollup_ratio"]
    by_r = {row["R"]: row["msdata"]["loader_pss"] for row in results if row["S"] == 64 and "msdata" in row}
    if len(by_r) >= 2:
        lo, hi = min(by_r), max(by_r)
        out["msdata_r_scaling_s64"] = round(by_r[hi] / by_r[lo], 3)  # 1.0 = flat in R*W
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "gen":
        _gen_main(sys.argv[2], int(sys.argv[3]), *map(int, sys.argv[4:6]))
    elif len(sys.argv) > 1 and sys.argv[1] == "setpss":
        _setpss_main([int(x) for x in sys.argv[2:]])
    elif len(sys.argv) > 1 and sys.argv[1] == "trainer":
        _trainer_main()
    else:
        sys.exit(main())
