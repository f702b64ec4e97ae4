"""`msdata-server demo`: the embedded default, end to end, with no arguments and no network.

Makes a small four-source dataset shaped like the text4 workload (JSON Lines, Parquet and Arrow files of
generated text), starts a node server in this process, runs simulated trainer ranks as separate processes
(dp=2 x tp=2: TP pairs read one shared slot), shows progress and prints a summary: throughput, DP imbalance
against a plain per-rank loader on the same documents, and the loader's memory.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
from tqdm import tqdm

from .config import NodeConfig, ServerConfig
from .ops.memory import tree_memory

__all__ = ["make_dataset", "run_demo", "serve_in_thread", "server_status", "stop_server"]

# text4 shapes (bench/workloads.py keeps the canonical copy): median bytes, sigma, docs, files, format
DEMO_SOURCES = {
    "chat": (300, 0.8, 6000, 3, "jsonl"),
    "web": (900, 1.0, 4000, 4, "parquet"),
    "code": (2000, 1.0, 1500, 2, "parquet"),
    "books": (8000, 1.0, 150, 2, "arrow"),
}
DEMO_WEIGHTS = {"chat": 0.3, "web": 0.4, "code": 0.2, "books": 0.1}


def _texts(rng: np.random.Generator, n: int, median: float, sigma: float, cap: int = 64_000) -> list[str]:
    lens = np.clip(rng.lognormal(np.log(median), sigma, n), 16, cap).astype(np.int64)
    alphabet = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz     \n", dtype=np.uint8)
    blob = alphabet[rng.integers(0, len(alphabet), int(lens.sum()))].tobytes().decode("ascii")
    ends = np.cumsum(lens)
    return [blob[e - n_ : e] for e, n_ in zip(ends.tolist(), lens.tolist())]


def make_dataset(root: str, seed: int = 0) -> dict[str, tuple[str, str]]:
    """Write the demo files under root; returns {source: (format, directory)}."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (median, sigma, docs, files, fmt) in DEMO_SOURCES.items():
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        per = docs // files
        for i in range(files):
            texts = _texts(rng, per, median, sigma)
            if fmt == "jsonl":
                import orjson

                with open(os.path.join(d, f"part-{i:03d}.jsonl"), "wb") as f:
                    for t in texts:
                        f.write(orjson.dumps({"text": t, "id": f"{name}-{i}"}) + b"\n")
            elif fmt == "parquet":
                pq.write_table(pa.table({"text": texts}), os.path.join(d, f"part-{i:03d}.parquet"), row_group_size=256)
            else:
                feather.write_feather(pa.table({"text": texts}), os.path.join(d, f"part-{i:03d}.arrow"))
        out[name] = (fmt, d)
    return out


def demo_job(data: dict[str, tuple[str, str]]):
    from msdata_client.graph import DGraph

    g = DGraph("demo", seed=1234)
    for name, (fmt, d) in data.items():
        g.source(name, fmt, [d], column="text")
    g.mix(DEMO_WEIGHTS).pack(4096, micro_batches=4, rows=1).cost("attention", alpha=1.0, beta=4096.0)
    g.balance("karmarkar_karp").mesh(dp=2, tp=2).prefetch(3)
    return g.plan()


def _rank_main(job_dict: dict, endpoint: str, rank: int, world: int, steps: int, q) -> None:
    """A simulated trainer rank (separate process): reads every byte of every batch, reports progress."""
    import torch

    import msdata_client as msd

    torch.set_num_threads(1)
    spec = msd.JobSpec.from_dict(job_dict)
    n = steps * spec.micro_batches
    nbytes = 0
    tokens = 0
    waits = []
    t0 = time.perf_counter()
    with msd.DataClient(spec, endpoint=endpoint, rank=rank, world_size=world) as dc:
        for i in range(n):
            w0 = time.perf_counter()
            b = next(dc)
            waits.append(time.perf_counter() - w0)
            for v in b.values():
                nbytes += v.numel() * v.element_size()
                v.sum()  # touch every byte, as a trainer copying to the GPU would
            tokens += int((b["tokens"] != spec.pad_id).sum())
            del b
            if (i + 1) % spec.micro_batches == 0:
                q.put(("step", rank, (i + 1) // spec.micro_batches))
    el = time.perf_counter() - t0
    q.put(
        (
            "done",
            rank,
            {
                "seconds": el,
                "bytes": nbytes,
                "tokens": tokens,
                "batches": n,
                "wait_p50_us": float(np.percentile(waits[1:] or waits, 50) * 1e6),
            },
        )
    )


def serve_in_thread(cfg: ServerConfig):
    """Run a NodeServer on a uvloop in a thread; returns (server, loop, thread) once it is ready."""
    import uvloop

    from .node import NodeServer

    holder: dict = {}
    ready = threading.Event()

    async def main():
        server = NodeServer(cfg)
        holder["server"] = server
        holder["loop"] = asyncio.get_running_loop()
        try:
            await server.start()
            ready.set()
            await server.serve_forever()
        finally:
            await server.aclose()
            ready.set()

    def body():
        try:
            uvloop.run(main())
        except BaseException as e:  # surfaced to the caller
            holder["error"] = e
            ready.set()

    t = threading.Thread(target=body, name="msdata-server", daemon=True)
    t.start()
    ready.wait()
    if "error" in holder:
        raise holder["error"]
    return holder["server"], holder["loop"], t


def run_demo(steps: int = 40, ranks: int = 4) -> int:
    if ranks != 4:
        print("the demo mesh is dp=2 x tp=2: running 4 ranks", file=sys.stderr)
    root = tempfile.mkdtemp(prefix="msdata-demo-")
    try:
        return _run(root, steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(root: str, steps: int) -> int:
    """Write the dataset, start a server and the simulated ranks, follow them, print the summary. One linear
    script (a user reads it as the tour of what msdata does), so it is kept whole."""
    t0 = time.perf_counter()
    print(f"msdata demo: writing a four-source dataset (jsonl, parquet, arrow) under {root} ...", flush=True)
    data = make_dataset(os.path.join(root, "data"))
    spec = demo_job(data)
    cfg = ServerConfig(
        node=NodeConfig(
            id="demo", socket=os.path.join(root, "msdata.sock"), workers=2, shm_prefix="msddemo", log_level="WARNING"
        )
    )
    server, loop, thread = serve_in_thread(cfg)
    print(
        f"  dataset ready in {time.perf_counter() - t0:.1f}s; server on {cfg.node.socket} with {cfg.node.workers} "
        f"transform workers",
        flush=True,
    )
    world = spec.mesh.world_size
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(spec.to_dict(), cfg.node.socket, r, world, steps, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    print(
        f"  {world} trainer ranks (mesh dp={spec.mesh.dp} tp={spec.mesh.tp}), {steps} steps of "
        f"{spec.micro_batches} micro-batches x {spec.seq_len} tokens each",
        flush=True,
    )
    bar = tqdm(total=steps, unit="step", desc="  demo", disable=not sys.stdout.isatty())  # quiet in logs
    peak_pss = 0

    def tick(status: dict, progress: dict[int, int]) -> None:
        nonlocal peak_pss
        pids = [os.getpid()] + (server.pool.pids() + server.pool.helper_pids() if server.pool is not None else [])
        peak_pss = max(peak_pss, tree_memory(pids)["pss"])
        lo = min(progress.values())
        if not status:
            bar.set_postfix_str(f"waiting for the ranks to start ({sum(p.is_alive() for p in procs)} up)")
            line = f"  waiting for the ranks to start ({sum(p.is_alive() for p in procs)} processes up)"
        else:
            j = status["jobs"][0]
            imb = j.get("imbalance")
            bar.update(lo - bar.n)
            bar.set_postfix(mb_per_s=round(j["micro_batches_per_s"], 1), imbalance=imb and round(imb, 3))
            line = (
                f"  step {lo:4d}/{steps}  {j['micro_batches_per_s']:7.1f} micro-batches/s  "
                f"imbalance {imb if imb is None else round(imb, 3)}  "
                + " ".join(f"r{r}:{s}" for r, s in sorted(progress.items()))
            )
        if bar.disable:  # not a terminal: a plain line now and then, for logs
            print(line, flush=True)

    followed = follow_ranks(procs, q, server, loop, tick)
    if followed is None:
        bar.close()
        stop_server(server, loop, thread)
        return 1
    done, status = followed
    bar.close()
    for p in procs:
        p.join(30)
    stop_server(server, loop, thread)
    _summary(spec, steps, done, status, peak_pss, data)
    print(f"demo finished in {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


async def server_status(server) -> dict:
    return server.status()


def follow_ranks(procs: list, q, server, loop, tick: Callable[[dict, dict[int, int]], None], every: float = 2.0):
    """Follow the demo's rank processes until each reports ``done``, reading the server's status after every
    report; every ``every`` seconds (and at the end) call ``tick(status, progress)`` (status: the newest with a
    job; progress: the step each rank reported). Returns (done per rank, status); None, after printing why,
    when a rank failed."""
    world = len(procs)
    done: dict[int, dict] = {}
    status: dict = {}
    progress = dict.fromkeys(range(world), 0)
    last = 0.0
    while len(done) < world:
        try:
            kind, rank, val = q.get(timeout=1.0)
        except Exception:  # queue.Empty: nothing this second
            kind = None
        if kind == "step":
            progress[rank] = val
        elif kind == "done":
            done[rank] = val
        if any(p.exitcode not in (None, 0) for p in procs):
            print("a trainer rank failed; see the error above", file=sys.stderr)
            return None
        now = time.perf_counter()
        due = now - last > every or len(done) == world
        if kind is not None or due:  # after every report: the job's figures are read while it still runs
            st = asyncio.run_coroutine_threadsafe(server_status(server), loop).result()
            if st.get("jobs"):
                status = st
        if due:
            last = now
            tick(status, progress)
    return done, status


def stop_server(server, loop, thread) -> None:
    loop.call_soon_threadsafe(server.request_stop)
    thread.join(30)


def _summary(spec, steps, done, status, peak_pss, data) -> None:
    seconds = max(d["seconds"] for d in done.values())
    batches = sum(d["batches"] for d in done.values())
    nbytes = sum(d["bytes"] for d in done.values())
    job = (status.get("jobs") or [{}])[0]
    imb = job.get("imbalance")
    pad = job.get("padding_fraction")
    base = baseline_imbalance(data, spec, steps)
    rows = [
        ("micro-batches delivered (all ranks)", f"{batches}"),
        ("micro-batches / s (all ranks)", f"{batches / seconds:.1f}"),
        ("GB/s delivered to trainer processes", f"{nbytes / seconds / 1e9:.2f}"),
        (
            "tokens / s (useful, per DP group)",
            f"{sum(d['tokens'] for d in done.values()) / spec.mesh.tp / seconds:,.0f}",
        ),
        ("next() wait p50 (us)", f"{np.median([d['wait_p50_us'] for d in done.values()]):.0f}"),
        ("DP imbalance, msdata planner (max/mean cost)", "n/a" if imb is None else f"{imb:.3f}"),
        ("DP imbalance, plain per-rank loader", f"{base:.3f}"),
        ("padding fraction, msdata", "n/a" if pad is None else f"{pad:.3f}"),
        ("loader memory: server + workers PSS (MiB)", f"{peak_pss / 2**20:.0f}"),
    ]
    w = max(len(r[0]) for r in rows)
    print("\nsummary")
    print("-" * (w + 14))
    for k, v in rows:
        print(f"{k:<{w}}  {v:>10}")
    print("-" * (w + 14))


def baseline_imbalance(data, spec, steps: int) -> float:
    """Imbalance (max/mean attention cost over DP ranks) of per-rank loaders packing in arrival order."""
    from .planner.baseline import per_rank_steps

    lengths = {}
    for name, (fmt, d) in data.items():
        ls = []
        for f in sorted(os.listdir(d)):
            p = os.path.join(d, f)
            if fmt == "jsonl":
                import orjson

                with open(p, "rb") as fh:
                    ls += [len(orjson.loads(line)["text"].encode()) + 1 for line in fh]
            elif fmt == "parquet":
                ls += [len(t) + 1 for t in pq.read_table(p, columns=["text"]).column("text").to_pylist()]
            else:
                ls += [len(t) + 1 for t in feather.read_table(p).column("text").to_pylist()]
        lengths[name] = np.asarray(ls, dtype=np.int64)
    names = list(DEMO_WEIGHTS)

    def draw(s: int, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(lengths[names[s]], size=n)

    res = per_rank_steps(
        draw,
        DEMO_WEIGHTS,
        {n: float(lengths[n].mean()) for n in names},
        seq_len=spec.seq_len,
        dp=spec.mesh.dp,
        micro_batches=spec.micro_batches,
        rows=spec.rows,
        steps=max(steps, 50),
        seed=spec.seed,
        alpha=spec.balance.alpha,
        beta=spec.balance.beta,
    )
    return float(np.mean([r["imbalance"] for r in res]))
