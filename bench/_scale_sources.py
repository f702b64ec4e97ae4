"""Many sources and many files on one node (issue 29 item 3), for ``bench/scale.py``.

Two cases, each on a fresh ``msdata-server serve`` process with one real ``DataClient`` rank (a child process):

- S sources of the ``manysources`` shape (/work/shared/workloads.toml, bench/workloads.py ``MANYSOURCES``: 16
  Parquet files of 8 row groups x 128 rows, text lognormal(400 bytes, 1)), at S = 64 and S = 1,024. Every source
  lists the same 16 files (one set on disk; each source opens, indexes and reads them as its own, in its own
  order): the server's cost per source is what is measured, not the page cache.
- one JSON Lines source of 100,000 small files (4 lines each), written with plain file writes into a temp dir.

Per case: the time from the rank's ``DataClient`` to its first batch (the job registers, every source is listed
and indexed, the planner reads lengths, the first batch is built), and, once the rank read a few batches and every
loader is idle, the PSS (/proc/PID/smaps_rollup, ``msdata_server.ops.memory``) summed over the server and its pool
processes, with the server's own per-source breakdown (``status --json``: ``sources[...].memory``). Keys:
``per_source_kib_s1024`` = (PSS at S = 1,024 - PSS at S = 64) / 960, ``first_batch_s_s1024``,
``first_batch_s_files100k``, ``per_source_kib_uss_s1024`` (the same from USS, private memory, which other
processes on the machine mapping the same libraries do not move), ``server_cpu_s_*`` (the server tree's CPU
seconds up to the first batch), ``pss_mib_s64``, ``pss_mib_s1024``, ``pss_mib_files100k`` and the breakdowns.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from msdata_server.ops.memory import cpu_seconds, proc_memory, tree_pids  # noqa: E402

MIB = 1 << 20
SEED = 1234
SEQ = 4096

# (small S, large S, files of the many-files source, batches the rank reads)
SIZES = {"smoke": (2, 8, 300, 2), "quick": (64, 1024, 100_000, 4), "full": (64, 1024, 100_000, 8)}

RANK = textwrap.dedent("""\
    import json, sys, time
    import msdata_client as msd
    job, ep, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spec = msd.JobSpec.from_dict(json.load(open(job)))
    t0 = time.perf_counter()
    dc = msd.DataClient(spec, endpoint=ep, rank=0, world_size=1, connect_timeout=600)
    b = next(dc)
    first = time.perf_counter() - t0
    for _ in range(batches - 1):
        b = next(dc)
    del b
    print(json.dumps({"first_batch_s": first}), flush=True)
    sys.stdin.readline()  # hold the loader live while the driver measures
    dc.close()
    """)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _parquet_files(d: Path) -> list[str]:
    """The 16 files of one manysources source (seeded), written once."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from workloads import MANYSOURCES as M

    d.mkdir(parents=True, exist_ok=True)
    rows = M["row_groups_per_file"] * M["rows_per_row_group"]
    alphabet = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz      \n", dtype=np.uint8)
    out = []
    for f in range(M["files_per_source"]):
        rng = np.random.default_rng([SEED, f])
        lens = np.clip(np.rint(rng.lognormal(math.log(M["text_median_bytes"]), M["text_sigma"], rows)), 16, 1 << 16)
        offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(lens.astype(np.int32), out=offsets[1:])
        data = alphabet[rng.integers(0, len(alphabet), int(offsets[-1]), dtype=np.uint8)]
        text = pa.StringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(data))
        path = d / f"part-{f:03d}.parquet"
        pq.write_table(pa.table({"text": text}), str(path), row_group_size=M["rows_per_row_group"])
        out.append(str(path))
    return out


def _jsonl_files(d: Path, n: int) -> float:
    """n small JSON Lines files of 4 documents each under d (plain writes, 1,000 files per directory);
    returns the seconds it took."""
    t0 = time.perf_counter()
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "and",
        "keeps",
        "on",
        "running",
        "through",
        "the",
        "field",
    ]
    for i in range(n):
        sub = d / f"d{i // 1000:03d}"
        if i % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        lines = "".join(
            '{{"text": "{}"}}\n'.format(" ".join(words[(i + k + j) % len(words)] for j in range(20 + (i * 7 + k) % 40)))
            for k in range(4)
        )
        with open(sub / f"f{i:06d}.jsonl", "w") as fh:
            fh.write(lines)
    return time.perf_counter() - t0


def _job(sources: list[tuple[str, str, list[str]]]) -> dict:
    from msdata_client.graph import DGraph

    g = DGraph("scale-sources", seed=SEED)
    for name, fmt, paths in sources:
        g.source(name, fmt, paths, column="text", transform="msdata_server.transforms:byte_tokens")
    g.mix({name: 1.0 for name, _, _ in sources}).pack(SEQ, micro_batches=1, rows=1)
    g.mesh(dp=1)
    return g.plan().to_dict()


def _status(endpoint: str) -> dict:
    from msdata_client.wire import request

    return request(endpoint, {"t": "status"}, timeout=60).get("status", {})


def _loaders_idle(endpoint: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _status(endpoint)
        srcs = [s for j in st.get("jobs", []) for s in j.get("sources", {}).values()]
        if (srcs and all(s.get("inflight", 0) == 0 for s in srcs)) or time.monotonic() > deadline:
            return st
        time.sleep(0.2)  # polling a steady state, not synchronising


def _breakdown(status: dict) -> dict:
    """The server's own memory figures summed over the job's sources (bytes), where it reports them."""
    srcs = [s for j in status.get("jobs", []) for s in j.get("sources", {}).values()]
    out: dict = {"payload_bytes": sum(s.get("memory_bytes", 0) for s in srcs)}
    for s in srcs:
        for k, v in (s.get("memory") or {}).items():
            out[k] = out.get(k, 0) + int(v)
    out["open_files"] = sum(s.get("open_files", 0) for s in srcs)
    return out


def run_case(tag: str, sources: list[tuple[str, str, list[str]]], work: Path, batches: int) -> dict:
    """One server, one rank: first-batch time, then PSS of the server tree with every loader idle."""
    d = Path(tempfile.mkdtemp(prefix="mss-", dir=work))  # short: a Unix socket path is at most 107 bytes
    endpoint = str(d / "s.sock")
    (d / "job.json").write_text(json.dumps(_job(sources)))
    (d / "node.toml").write_text(
        f'[node]\nid = "scale"\nsocket = "{endpoint}"\nshm_prefix = "sc{secrets.token_hex(3)}"\nworkers = 2\n'
        f'log_level = "WARNING"\nstate_dir = "{d / "state"}"\n'
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(d / "server.log", "wb") as log:  # the server has its own descriptor of it
        server = subprocess.Popen(
            [sys.executable, "-m", "msdata_server", "serve", "--config", str(d / "node.toml")],
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=ROOT,
            env=env,
        )
    rank = None
    try:
        assert server.stdout is not None
        while (line := server.stdout.readline()) and b'"ready"' not in line:
            pass  # lines before the ready event (a profiler's, when the server runs under one)
        if b'"ready"' not in line:
            raise RuntimeError(f"server did not start: {(d / 'server.log').read_text()[-3000:]}")
        rank = subprocess.Popen(
            [sys.executable, "-c", RANK, str(d / "job.json"), endpoint, str(batches)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            text=True,
        )
        assert rank.stdout is not None
        assert rank.stdin is not None
        got = rank.stdout.readline()
        if not got:
            raise RuntimeError(f"rank failed; server log: {(d / 'server.log').read_text()[-3000:]}")
        first = json.loads(got)["first_batch_s"]
        cpu = cpu_seconds(tree_pids(server.pid))  # after the rank's batches: the job's start, its first reads and plans
        status = _loaders_idle(endpoint)
        mems = [[proc_memory(p) for p in tree_pids(server.pid)] for _ in range(3)]
        pss = max(sum(m["pss"] for m in ms) for ms in mems)
        uss = max(sum(m["uss"] for m in ms) for ms in mems)  # private: what other processes' sharing cannot move
        rank.stdin.write("\n")
        rank.stdin.flush()
        rank.wait(60)
        out = {
            "first_batch_s": round(first, 3),
            "cpu_s": round(cpu, 2),
            "pss_bytes": pss,
            "uss_bytes": uss,
            "breakdown": _breakdown(status),
        }
        say(
            f"  [{tag}] first batch {first:.2f} s (server CPU {cpu:.1f} s by then), server PSS {pss / MIB:.1f} MiB "
            f"(USS {uss / MIB:.1f}), load {os.getloadavg()[0]:.1f}, {out['breakdown']}"
        )
        return out
    finally:
        for p in (rank, server):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(d, ignore_errors=True)


def scale_sources(size: str = "quick") -> dict:
    """The keys of this benchmark at a size of SIZES ("smoke": seconds; the same keys over 2 and 8 sources and 300
    files, so they measure nothing)."""
    small, large, nfiles, batches = SIZES[size]
    work = Path(tempfile.mkdtemp(prefix="msscale-"))
    try:
        t0 = time.process_time()
        files = _parquet_files(work / "pq")
        load0 = os.getloadavg()[0]
        res = {}
        for s in (small, large):
            srcs = [(f"s{i:04d}", "parquet", files) for i in range(s)]
            res[s] = run_case(f"S={s}", srcs, work, batches)
        gen_s = _jsonl_files(work / "many", nfiles)
        os.sync()  # written back before the server lists them: the first batch waits on no writeback
        say(f"  wrote {nfiles} files in {gen_s:.1f} s")
        many = run_case(f"files={nfiles}", [("many", "jsonl", [str(work / "many" / "*" / "*.jsonl")])], work, batches)
        per = (res[large]["pss_bytes"] - res[small]["pss_bytes"]) / (large - small) / 1024
        per_uss = (res[large]["uss_bytes"] - res[small]["uss_bytes"]) / (large - small) / 1024
        return {
            "per_source_kib_s1024": round(per, 1),
            "first_batch_s_s1024": res[large]["first_batch_s"],
            "first_batch_s_files100k": many["first_batch_s"],
            "per_source_kib_uss_s1024": round(per_uss, 1),
            "pss_mib_s64": round(res[small]["pss_bytes"] / MIB, 1),
            "pss_mib_s1024": round(res[large]["pss_bytes"] / MIB, 1),
            "pss_mib_files100k": round(many["pss_bytes"] / MIB, 1),
            "server_cpu_s_s1024": res[large]["cpu_s"],
            "server_cpu_s_files100k": many["cpu_s"],
            "scale_sources_breakdown": {f"s{small}": res[small]["breakdown"], f"s{large}": res[large]["breakdown"]}
            | {f"files{nfiles}": many["breakdown"]},
            "scale_sources_shape": {"size": size, "sources": [small, large], "files": nfiles, "batches": batches},
            "scale_sources_files_write_s": round(gen_s, 2),
            "scale_sources_driver_cpu_s": round(time.process_time() - t0, 2),
            "scale_sources_loadavg": round(load0, 2),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # run alone: python bench/_scale_sources.py [--smoke | --quick] (bench/scale.py runs it too)
    arg = sys.argv[1].lstrip("-") if len(sys.argv) > 1 else "full"
    print(json.dumps(scale_sources(arg if arg in SIZES else "quick")))
