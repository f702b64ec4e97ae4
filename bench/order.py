# PYTHONPATH=$PWD .venv/bin/python bench/order.py --smoke
"""Source order benchmark (issue 26): how well the default order mixes a source's files, beside what it costs
the loader, against the file-local order (``shuffle = { mode = "file" }``) and the fixed order (``false``).

A 256-file Parquet source (a column of ~200-byte texts) is written to a temporary directory in two layouts:
small row groups (several per 4096-row window) and one row group per file (cut into several windows). For
each (layout, order) arm a fresh child process opens the source and reads one pass of ordinals through a real
``SourceLoader`` (the default byte_tokens transform run inline, read-ahead 64 batches of 64, the reads
released as a trainer would), so each arm's memory is its own. Reported per arm:

- ``files/1k min`` and ``mean``: distinct files in any 1,000 consecutive ordinals of epoch 0 (the order
  function alone; the issue's target is min >= min(files, 32));
- ``warm rows/s``: the first 5% of the pass (handles opened, first row groups decoded); ``rows/s``: the rest;
- ``decoded/read``: rows of Parquet row groups decoded per row delivered (read amplification; 1.0 reads
  each row group once, more means row groups were evicted from the reader's LRU and read again);
- ``cache MiB``: the peak bytes of decoded row groups held (the reader's LRU, bounded by cache_bytes);
  ``open``: the peak open files; ``rss +MiB``: the peak resident memory above that after opening.

Timings on these shared 2-core machines are noisy: the arms run one after another, alternating, and the
ratios to the file-local order of the same layout are printed. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FILES = 256
ORDERS = {"mix": True, "file": {"mode": "file"}, "none": False}


def distinct_per_run(files: np.ndarray, run: int) -> np.ndarray:
    """Distinct values in each run of `run` consecutive entries (O(n), as tests/test_order.py)."""
    n = len(files)
    order = np.lexsort((np.arange(n), files))
    prev = np.full(n, -1, dtype=np.int64)
    same = files[order][1:] == files[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    j = np.arange(n)
    lo = np.maximum(prev + 1, j - run + 1).clip(0)
    hi = np.minimum(j, n - run)
    ok = lo <= hi
    diff = np.zeros(n + 1, dtype=np.int64)
    np.add.at(diff, lo[ok], 1)
    np.add.at(diff, hi[ok] + 1, -1)
    return np.cumsum(diff)[: n - run + 1]


def write_source(d: Path, rows: int, group: int, seed: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(FILES):
        n = rng.integers(150, 250, size=rows)
        texts = [f"f{i} r{r} " + "x" * int(k) for r, k in enumerate(n.tolist())]
        pq.write_table(pa.table({"text": texts}), d / f"part-{i:03d}.parquet", row_group_size=group)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_arm(path: str, order: str, count: int) -> dict:
    """One arm in this (child) process: the mixing figure, then a loader pass over `count` ordinals."""
    import asyncio

    import pyarrow.parquet as pq

    from msdata_client.source import SourceSpec
    from msdata_server.loader import SourceLoader
    from msdata_server.sources import open_source

    decoded = [0]
    real = pq.ParquetFile.read_row_group

    def counting(self, i, *a, **kw):  # the bench's probe: rows of every row group decoded
        t = real(self, i, *a, **kw)
        decoded[0] += t.num_rows
        return t

    pq.ParquetFile.read_row_group = counting  # type: ignore[method-assign]
    spec = SourceSpec(name="web", format="parquet", paths=(path,), shuffle=ORDERS[order])
    src = open_source(spec, seed=1)
    n = src.num_samples
    _, f, _ = src.locate_many(np.arange(n))
    runs = distinct_per_run(f, 1000)
    base = rss_bytes()
    peak = {"cache": 0, "open": 0}
    step = 1024
    warm_end = max(step, (count // 20) // step * step)

    async def walk() -> tuple[float, float]:
        async with SourceLoader(src, None, transform=spec.transform, seed=1) as ld:
            t0 = time.perf_counter()
            t_warm = t0
            for lo in range(0, count, step):
                await ld.lengths(lo, step)
                ld.release(np.arange(lo, lo + step))
                peak["cache"] = max(peak["cache"], src._groups.total)
                peak["open"] = max(peak["open"], src.statistics().open_files)
                if lo + step == warm_end:
                    t_warm = time.perf_counter()
            return t_warm - t0, time.perf_counter() - t_warm

    warm_s, steady_s = asyncio.run(walk())
    src.close()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "order": order,
        "lanes": src.order.lanes if src.order is not None else 0,
        "files_1k_min": int(runs.min()),
        "files_1k_mean": round(float(runs.mean()), 1),
        "warm_rows_s": round(warm_end / warm_s),
        "rows_s": round((count - warm_end) / steady_s),
        "decoded_per_read": round(decoded[0] / count, 3),
        "cache_mib": round(peak["cache"] / 2**20, 1),
        "open": peak["open"],
        "rss_mib": round(max(0, peak_rss - base) / 2**20, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--smoke", action="store_true", help="256 files of 512 rows, one pass, one repeat")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--arm", nargs=3, metavar=("PATH", "ORDER", "COUNT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        path, order, count = args.arm
        print(json.dumps(run_arm(path, order, int(count))))
        return
    rows, small = (512, 64) if args.smoke else (4096, 512)
    repeats = args.repeats or (1 if args.smoke else 2)
    layouts = {f"rg={small}": small, "rg=file": rows}
    count = FILES * rows if args.smoke else FILES * rows // 2  # a whole epoch, or half of one
    count -= count % 1024
    results: dict[str, dict[str, list[dict]]] = {}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="msdata-order-") as tmp:
        for layout, group in layouts.items():
            write_source(Path(tmp) / layout, rows, group)
        for _ in range(repeats):
            for layout in layouts:
                for order in ORDERS:
                    cmd = [sys.executable, __file__, "--arm", str(Path(tmp) / layout), order, str(count)]
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
                    results.setdefault(layout, {}).setdefault(order, []).append(json.loads(out.splitlines()[-1]))
    print(f"# {FILES} Parquet files of {rows} rows (~200 B texts); {count} ordinals per pass; {repeats} repeat(s)")
    head = (
        f"{'layout':<8} {'order':<5} {'lanes':>5} {'files/1k min':>12} {'mean':>6} {'warm rows/s':>11} "
        f"{'rows/s':>8} {'x file':>6} {'decoded/read':>12} {'cache MiB':>9} {'open':>4} {'rss +MiB':>8}"
    )
    print(head)
    summary: dict[str, dict[str, dict]] = {}
    for layout, arms in results.items():
        med = {o: {k: float(np.median([r[k] for r in rs])) for k in rs[0] if k != "order"} for o, rs in arms.items()}
        for order, m in med.items():
            ratio = m["rows_s"] / med["file"]["rows_s"]
            summary.setdefault(layout, {})[order] = dict(m, rows_s_vs_file=round(ratio, 3))
            print(
                f"{layout:<8} {order:<5} {int(m['lanes']):>5} {int(m['files_1k_min']):>12} {m['files_1k_mean']:>6.1f} "
                f"{int(m['warm_rows_s']):>11} {int(m['rows_s']):>8} {ratio:>6.2f} {m['decoded_per_read']:>12.3f} "
                f"{m['cache_mib']:>9.1f} {int(m['open']):>4} {m['rss_mib']:>8.1f}"
            )
    print(json.dumps({"files": FILES, "rows_per_file": rows, "ordinals": count, "arms": summary}))


if __name__ == "__main__":
    main()
