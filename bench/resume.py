# .venv/bin/python bench/resume.py --quick
"""Cold-resume benchmark: a fresh server process, ranks that load_state_dict, time to the first batch.

A job with 64 Parquet sources (text, byte tokens through the worker pool), dp=8 ranks, seq_len 8192, 4
micro-batches per rank: a global batch of 262k tokens. Run A trains some steps, saves rank 0's state and
records the next batch of every rank; its server is stopped. Then a new server process starts cold and the
ranks restore the state: we time from launching that process to every rank holding its first batch, check
the batches equal what run A would have delivered, and report the state's size. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import bar, say  # noqa: E402

import msdata_client as msd  # noqa: E402


def make_data(root: str, sources: int, files: int, rows: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"etaoinshrdlu cmfwyp", dtype=np.uint8)
    dirs = []
    for s in range(sources):
        d = os.path.join(root, f"src{s:03d}")
        os.makedirs(d)
        for f in range(files):
            lens = np.clip(rng.lognormal(np.log(400), 1.0, rows), 16, 8000).astype(np.int64)
            blob = alphabet[rng.integers(0, len(alphabet), int(lens.sum()))].tobytes().decode()
            ends = np.cumsum(lens)
            texts = [blob[e - n : e] for e, n in zip(ends.tolist(), lens.tolist())]
            pq.write_table(pa.table({"text": texts}), os.path.join(d, f"part-{f}.parquet"), row_group_size=128)
        dirs.append(d)
    return dirs


def job(dirs: list[str], dp: int, seq_len: int, micro: int):
    g = msd.DGraph("resume-bench", seed=7)
    for i, d in enumerate(dirs):
        g.source(f"s{i:03d}", "parquet", [d], column="text")
    g.mix({f"s{i:03d}": 1.0 + (i % 4) for i in range(len(dirs))}).pack(seq_len, micro_batches=micro)
    return g.mesh(dp=dp).plan()


def start_server(d: str, workers: int) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(d, "msdata.sock")
    cfg = os.path.join(d, "node.toml")
    with open(cfg, "w") as f:
        f.write(
            f'[node]\nid = "bench"\nsocket = "{sock}"\nshm_prefix = "msdrb"\nworkers = {workers}\n'
            f'state_dir = "{os.path.join(d, "state")}"\n'
        )
    p = subprocess.Popen(
        [sys.executable, "-m", "msdata_server", "serve", "--config", cfg],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    return p, sock


def digest(b) -> str:
    h = hashlib.sha256()
    for k in sorted(b):
        h.update(b[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def run_ranks(spec, sock, n, state=None, save=False):
    """All ranks in threads; returns ({rank: [digests]}, {rank: state}, {rank: seconds to first batch})."""
    out, states, first, errs = {}, {}, {}, []
    t0 = time.perf_counter()

    def body(r):
        try:
            with msd.DataClient(
                spec, endpoint=sock, rank=r, world_size=spec.mesh.world_size, connect_timeout=120
            ) as dc:
                if state is not None:
                    dc.load_state_dict(state)
                ds = []
                for i in range(n):
                    b = next(dc)
                    if i == 0:
                        first[r] = time.perf_counter() - t0
                    ds.append(digest(b))
                    del b
                out[r] = ds
                if save:
                    states[r] = dc.state_dict()
        except BaseException as e:
            errs.append(e)

    ts = [threading.Thread(target=body, args=(r,)) for r in range(spec.mesh.world_size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return out, states, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sources", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny sizes, every code path (CI)")
    args = ap.parse_args()
    dp, seq_len, micro = 8, 8192, 4
    steps = 3 if args.quick else 10
    rows = 512 if args.quick else 2048
    if args.smoke:
        dp, seq_len, micro, steps, rows, args.sources = 2, 1024, 2, 2, 64, 3
    root = tempfile.mkdtemp(prefix="msdata-resume-")
    prog = bar(3, "resume", "phase")  # data, run A, cold resume
    try:
        t = time.perf_counter()
        dirs = make_data(os.path.join(root, "data"), args.sources, 2, rows)
        say(f"data: {args.sources} parquet sources in {time.perf_counter() - t:.1f}s")
        prog.update(1)
        spec = job(dirs, dp, seq_len, micro)
        run_a = os.path.join(root, "a")
        os.makedirs(run_a)
        pa_, sock = start_server(run_a, 2)
        pa_.stdout.readline()
        _, states, first_a = run_ranks(spec, sock, steps * micro, save=True)
        state = states[0]
        ref, _, _ = run_ranks(spec, sock, micro, state=state)  # what the next step is, from the same server
        pa_.terminate()
        pa_.wait()
        prog.update(1)
        run_b = os.path.join(root, "b")
        os.makedirs(run_b)
        t0 = time.perf_counter()
        pb, sock_b = start_server(run_b, 2)  # cold: a fresh process, nothing cached
        t_ranks = time.perf_counter()  # ranks start now and retry until the server accepts
        got, _, first = run_ranks(spec, sock_b, micro, state=state)
        total = time.perf_counter() - t0
        resume_s = (t_ranks - t0) + max(first.values())  # process launch -> the last rank's first batch
        pb.terminate()
        pb.wait()
        prog.close()
        same = got == ref
        state_bytes = len(json.dumps(state).encode())
        say(f"cold start of run A (first batch, fresh job):   {max(first_a.values()):.2f}s")
        say(f"cold resume (server launch -> every rank's first batch): {resume_s:.2f}s  (whole step {total:.2f}s)")
        say(f"state size: {state_bytes} bytes; resumed batches identical to the uninterrupted run: {same}")
        if not same:
            raise SystemExit("resumed batches differ from the uninterrupted run")
        say(
            json.dumps(
                {
                    "resume_first_batch_s": round(resume_s, 3),
                    "state_bytes": state_bytes,
                    "sources": args.sources,
                    "dp": dp,
                    "global_batch_tokens": dp * micro * seq_len,
                    "identical": same,
                }
            )
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
