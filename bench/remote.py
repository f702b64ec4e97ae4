# .venv/bin/python bench/remote.py --quick      (--smoke: seconds; full run: .venv/bin/python bench/remote.py)
"""Sources in object storage (issue 27): the manysources shape (64 Parquet sources) plus one WebDataset source,
served from a local S3 API (moto, in its own process) through a proxy that adds 20 ms to every request, against
the same files on local disk: the same job (only the path prefixes differ), one node server, one trainer.

- ``remote_local_ratio``: steady-state steps/s remote / local with the trainer paced by a fixed compute time per
  step, chosen so that the local arm waits for data < 10% of the time (as a real trainer's compute sets the
  pace): whether read-ahead and partitions hide the latency. ``remote_local_ratio_unpaced`` beside it.
- ``identical``: the remote arm's batches (sample ids included) equal the local arm's, bit for bit;
  ``throttled_identical``: likewise with 5% of GETs answered 503 SlowDown and a 3 s burst of them.
- ``cold_requests_per_object``: listing + metadata requests to open every source / objects (no metadata in
  state_dir); ``warm_start_requests``: the same with the metadata kept in state_dir; ``warm_cold_start_ratio``:
  the warm open's seconds / the cold open's.
- ``cached_epoch2_requests_per_step``: requests per step when the node's object cache holds the data (the same
  steps read again by a restarted server with the same cache_dir and state_dir).

Requests are counted at the proxy. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

SHAPES = {
    #         sources, files/source, rows/file, wds shards, samples/shard, steps, warmup, paced pairs
    "full": dict(sources=64, files=31, rows=48, shards=16, samples=96, steps=800, warmup=300, pairs=5),
    "quick": dict(sources=64, files=31, rows=32, shards=16, samples=64, steps=320, warmup=160, pairs=5),
    "smoke": dict(sources=8, files=4, rows=32, shards=2, samples=32, steps=30, warmup=8, pairs=1),
}
SEQ_LEN, ROWS = 2048, 2


def write_data(root: Path, shape: dict) -> int:
    """Parquet sources src00.. of `files` files (one row group each) and one WebDataset source; objects."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    words = np.array(
        [
            "the",
            "of",
            "and",
            "to",
            "in",
            "a",
            "is",
            "that",
            "for",
            "it",
            "as",
            "was",
            "with",
            "be",
            "by",
            "on",
            "not",
            "he",
            "this",
            "are",
            "or",
        ]
    )
    for s in range(shape["sources"]):
        d = root / f"src{s:02d}"
        d.mkdir(parents=True)
        for f in range(shape["files"]):
            lens = np.clip(rng.lognormal(np.log(60), 0.8, shape["rows"]).astype(int), 3, 600)
            texts = [f"s{s} f{f} r{r} " + " ".join(rng.choice(words, n)) for r, n in enumerate(lens)]
            pq.write_table(pa.table({"text": texts}), d / f"part-{f:03d}.parquet")
    d = root / "wds"
    d.mkdir()
    for k in range(shape["shards"]):
        with tarfile.open(d / f"shard-{k:03d}.tar", "w") as tf:
            for j in range(shape["samples"]):
                for ext, data in (("txt", f"wds {k} {j} ".encode() * 20), ("bin", bytes(200))):
                    ti = tarfile.TarInfo(f"s{j:05d}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
    return shape["sources"] * shape["files"] + shape["shards"]


class S3Proc:
    """moto and the fault proxy in their own process (``python -m tests.s3_util``): the S3 server must not share
    the trainer's interpreter. Knobs and counters through the proxy's control path."""

    def __init__(self) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.s3_util"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=str(ROOT)
        )
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        self.s3, self.endpoint = info["s3"], info["proxy"]

    def ctl(self, **knobs: object) -> dict:
        from urllib.parse import urlencode
        from urllib.request import urlopen

        with urlopen(f"{self.endpoint}/__msd_control?{urlencode(knobs)}", timeout=30) as r:
            return json.loads(r.read())

    def total(self) -> int:
        return sum(self.ctl()["counts"].values())  # (control requests are not counted)

    def upload(self, local: Path, bucket: str) -> None:
        import pyarrow.fs as pafs

        from tests.s3_util import ACCESS_KEY, REGION, SECRET_KEY

        host = self.s3.split("://", 1)[1]
        fs = pafs.S3FileSystem(
            endpoint_override=host,
            scheme="http",
            region=REGION,
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            allow_bucket_creation=True,
        )
        fs.create_dir(bucket)
        for root, _, files in os.walk(local):
            for name in files:
                p = Path(root, name)
                with fs.open_output_stream(f"{bucket}/{p.relative_to(local).as_posix()}") as out:
                    out.write(p.read_bytes())

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def make_job(prefix: str, shape: dict, name: str = "remote"):
    import msdata_client as msd

    g = msd.DGraph(name, seed=1)
    for s in range(shape["sources"]):
        g.source(f"src{s:02d}", "parquet", [f"{prefix}src{s:02d}/"], column="text")
    g.source("wds", "webdataset", [f"{prefix}wds/"], transform="_remote_tf:wds_text")
    weights = {f"src{s:02d}": 1.0 for s in range(shape["sources"])} | {"wds": 4.0}
    g.mix(weights).pack(SEQ_LEN, rows=ROWS, micro_batches=1).mesh(dp=1).prefetch(4)
    return g.plan()


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants so far, from /proc."""
    from msdata_server.ops.memory import cpu_seconds, tree_pids

    return cpu_seconds(tree_pids(pid))


def run_arm(srv, spec, *, steps: int, warmup: int, compute_s: float) -> dict:
    """A trainer of `steps` steps (compute_s of 'compute' after each): steady-state steps/s and data-wait share
    after `warmup` steps, and each batch's record (hashes and sample ids)."""
    import msdata_client as msd
    from tests.e2e_util import batch_record

    recs, waited = [], 0.0
    with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=120) as dc:
        for i in range(steps):
            if i == warmup:
                t0, waited = time.perf_counter(), 0.0
            w0 = time.perf_counter()
            b = next(dc)
            waited += time.perf_counter() - w0
            recs.append(batch_record(b))
            del b
            if compute_s:
                time.sleep(compute_s)  # the trainer's compute per step
        elapsed = time.perf_counter() - t0
    return {"steps_s": (steps - warmup) / elapsed, "wait_frac": waited / elapsed, "records": recs}


def open_all(spec) -> float:
    """Open every source of the job as a server does (listing and metadata); seconds."""
    from msdata_server.sources import open_source

    t0 = time.perf_counter()
    for s in spec.sources:
        open_source(s, seed=spec.seed).close()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=2, help="transform workers of the node server")
    args = ap.parse_args()
    shape = SHAPES["smoke" if args.smoke else "quick" if args.quick else "full"]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE)])  # the servers import _remote_tf

    from msdata_server.config import StorageConfig
    from msdata_server.storage import configure
    from tests.s3_util import s3_env
    from tests.server_util import ServerProc

    class Env:
        def setenv(self, k: str, v: str) -> None:
            os.environ[k] = v

        def delenv(self, k: str, raising: bool = False) -> None:
            os.environ.pop(k, None)

    s3_env(Env())
    work = Path(tempfile.mkdtemp(prefix="msd-remote-"))
    servers: list = []
    proxy: S3Proc | None = None
    try:
        t0 = time.perf_counter()
        objects = write_data(work / "local", shape)
        proxy = S3Proc()
        proxy.upload(work / "local", "bench")
        print(
            f"data: {objects} objects in {shape['sources'] + 1} sources, written and uploaded in "
            f"{time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        proxy.ctl(latency_s=args.latency_ms / 1000.0)
        local = make_job(f"{work}/local/", shape)
        remote = make_job("s3://bench/", shape)

        # listing and metadata: cold (nothing in state_dir), then warm (kept in state_dir)
        state = work / "state"
        configure(StorageConfig(s3_endpoint=proxy.endpoint), state_dir=str(state))
        proxy.ctl(reset=1)
        cold_s = open_all(remote)
        cold_req = proxy.total()
        configure(StorageConfig(s3_endpoint=proxy.endpoint), state_dir=str(state))
        proxy.ctl(reset=1)
        warm_s = open_all(remote)
        warm_req = proxy.total()
        print(
            f"open: cold {cold_req} requests ({cold_req / objects:.3f}/object) in {cold_s:.2f}s; warm {warm_req} "
            f"requests in {warm_s:.3f}s",
            flush=True,
        )

        def server(name: str, *, storage: str = "") -> ServerProc:
            d = work / f"{len(servers):02d}-{name}"  # arms of one name run more than once
            d.mkdir()
            extra = f'allow_transforms = ["_remote_tf"]\nstate_dir = "{state}"\n'
            extra += f'[storage]\ns3_endpoint = "{proxy.endpoint}"\n{storage}'
            srv = ServerProc(str(d), workers=args.workers, extra=extra)
            servers.append(srv)
            return srv.start(timeout=120)

        def arm(name: str, spec, compute_s: float, storage: str = "", steps: int = shape["steps"]) -> dict:
            srv = server(name, storage=storage)
            proxy.ctl(reset=1)
            assert srv.proc is not None
            cpu0 = tree_cpu_s(srv.proc.pid), tree_cpu_s(proxy.proc.pid)
            out = run_arm(srv, spec, steps=steps, warmup=shape["warmup"], compute_s=compute_s)
            cpu1 = tree_cpu_s(srv.proc.pid), tree_cpu_s(proxy.proc.pid)
            counts = proxy.ctl()["counts"]
            n = steps
            out["requests_per_step"] = sum(counts.values()) / n
            out["by_kind"] = {k: round(v / n, 2) for k, v in sorted(counts.items())}
            out["server_cpu_ms"] = (cpu1[0] - cpu0[0]) * 1e3 / n
            out["s3_cpu_ms"] = (cpu1[1] - cpu0[1]) * 1e3 / n
            srv.stop()
            print(
                f"  {name:<16} {out['steps_s']:8.1f} steps/s  wait {out['wait_frac']:6.1%}  "
                f"{out['requests_per_step']:6.2f} requests/step {out['by_kind']}  CPU ms/step: server "
                f"{out['server_cpu_ms']:.1f}, S3 {out['s3_cpu_ms']:.1f}  load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
            return out

        loc_u = arm("local-unpaced", local, 0.0)
        rem_u = arm("remote-unpaced", remote, 0.0)
        compute = max(0.002, 1.0 / loc_u["steps_s"])
        while True:  # the compute time at which the local arm waits < 10% of the time
            loc = arm(f"local-{compute * 1e3:.0f}ms", local, compute)
            if loc["wait_frac"] < 0.1 or compute > 1.0:
                break
            compute *= 2
        # paced pairs back to back (local, then remote at the same compute time); the ratio is the median pair's,
        # so that load from outside drifting between two arms does not decide it
        pairs = [(loc, arm(f"remote-{compute * 1e3:.0f}ms", remote, compute))]
        for _ in range(shape["pairs"] - 1):
            pairs.append(
                (
                    arm(f"local-{compute * 1e3:.0f}ms", local, compute),
                    arm(f"remote-{compute * 1e3:.0f}ms", remote, compute),
                )
            )
        ratios = [r["steps_s"] / lo["steps_s"] for lo, r in pairs]
        loc, rem = pairs[sorted(range(len(pairs)), key=ratios.__getitem__)[len(pairs) // 2]]
        proxy.ctl(slowdown_share=0.05, burst=3.0)
        thr = arm("remote-throttled", remote, 0.0)
        thr_stats = proxy.ctl(slowdown_share=0.0)["faults"]
        cache = f'cache_dir = "{work / "cache"}"\ncache_gib = 4\n'
        # the fill reads as many steps again: what the cached arm's read-ahead reads past its last step is
        # then in the cache too (else requests/step depends on how far each arm's read-ahead got)
        arm("remote-fill-cache", remote, 0.0, storage=cache, steps=shape["steps"] * 2)
        cached = arm("remote-cached", remote, 0.0, storage=cache)

        out = {
            "benchmark": "remote",
            "objects": objects,
            "sources": shape["sources"] + 1,
            "latency_ms": args.latency_ms,
            "compute_ms_per_step": round(compute * 1e3, 2),
            "remote_local_ratio": round(rem["steps_s"] / loc["steps_s"], 3),
            "remote_local_ratio_pairs": [round(r, 3) for r in ratios],
            "remote_local_ratio_unpaced": round(rem_u["steps_s"] / loc_u["steps_s"], 3),
            "local_steps_s": round(loc["steps_s"], 2),
            "remote_steps_s": round(rem["steps_s"], 2),
            "local_wait_frac": round(loc["wait_frac"], 3),
            "remote_wait_frac": round(rem["wait_frac"], 3),
            "remote_requests_per_step": round(rem["requests_per_step"], 2),
            "remote_requests_per_step_by_kind": rem["by_kind"],
            "local_server_cpu_ms_per_step": round(loc["server_cpu_ms"], 2),
            "remote_server_cpu_ms_per_step": round(rem["server_cpu_ms"], 2),
            "remote_s3_cpu_ms_per_step": round(rem["s3_cpu_ms"], 2),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "identical": all(r["records"] == lo["records"] for lo, r in pairs) and rem_u["records"] == loc_u["records"],
            "throttled_identical": thr["records"] == loc_u["records"],
            "throttled_slowdowns": thr_stats.get("slowdown", 0),
            "cold_requests_per_object": round(cold_req / objects, 4),
            "warm_start_requests": warm_req,
            "warm_start_requests_target": objects // 1000 + shape["sources"] + 1,
            "warm_cold_start_ratio": round(warm_s / cold_s, 4),
            "cached_epoch2_requests_per_step": round(cached["requests_per_step"], 3),
        }
        print(json.dumps(out), flush=True)
    finally:
        for s in servers:
            s.kill()
        if proxy is not None:
            proxy.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
