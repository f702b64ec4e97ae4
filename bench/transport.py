# .venv/bin/python bench/transport.py --quick
"""Transport benchmark: micro-batches from a producer process to trainer processes.

Arms, side by side in one process tree:
  msdata   a producer built from the node server's own transport parts (pre-touched shared-memory ring
           from msdata_server.shm, SlotTable, the ClientConn endpoint with descriptor passing, uvloop) and
           trainer processes using the real msdata_client.DataClient (private COW mappings, finalizer
           releases). With 2 readers both map the same slot (a TP pair).
  torch    torch.utils.data.DataLoader(num_workers=2, persistent_workers=True) per trainer process, yielding
           the same tensors (with 2 readers, each trainer has its own loader, as per-rank loading does).
In both arms the producer writes every byte of every batch and the trainer reads every byte (a sum).
Reports GB/s delivered to each trainer process, next() latency p50/p99, and single-thread memcpy bandwidth.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np
import torch
from progress import bar, say  # bench/ is the script's directory, first on sys.path
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

SIZES = {"64k": 64 << 10, "1m": 1 << 20, "16m": 16 << 20}


# ---------------------------------------------------------------------------------------------- memcpy
def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _checksum(t) -> int:
    """Sum of the batch as 64-bit words (mod 2**64): reads every byte at memory speed in both arms
    (torch's own int32 sum runs at ~0.3 GB/s on one thread and would hide the transport)."""
    return int(np.add.reduce(t.numpy().view(np.uint64)))


# ---------------------------------------------------------------------------------------------- msdata
def _producer(sock_path: str, nbytes: int, n: int, readers: int, slots: int, ready) -> None:
    """Serve `readers` DataClients of a one-field job: every batch is written in full into a ring slot."""
    import uvloop

    from msdata_client.ring import HEADER_SIZE, SlotTable, layout_fields
    from msdata_client.wire import PROTOCOL_VERSION
    from msdata_server.endpoint import UnixEndpoint
    from msdata_server.shm import create_segment
    from msdata_server.tasks import TaskSet

    async def main():
        layouts, end = layout_fields([("tokens", "<i4", (nbytes // 4,)), ("step", "<i8", ()), ("micro", "<i8", ())])
        slot_size = max(1 << 16, 1 << (end - 1).bit_length())
        seg = create_segment("msdbench", "ring", slots * slot_size)
        table = SlotTable(slots)
        freed = asyncio.Event()
        buf = np.frombuffer(seg.mm, dtype=np.uint8)
        patterns = [np.full(nbytes, i + 1, dtype=np.uint8) for i in range(2)]
        conns = {}
        all_in = asyncio.Event()

        async def handle(conn):
            try:
                await serve(conn)
            finally:  # a reader that left holds no slot (its last releases may still have been batched)
                if getattr(conn, "rank", None) is not None and table.drop_reader(conn.rank):
                    freed.set()

        async def serve(conn):
            async for f in conn.frames():
                if f["t"] == "hello":
                    if f.get("v") != PROTOCOL_VERSION:
                        return
                    conn.rank = f["rank"]
                    conns[conn.rank] = conn
                    conn.send(
                        {
                            "t": "welcome",
                            "node": "bench",
                            "job": "bench",
                            "rank": conn.rank,
                            "group": 0,
                            "rings": [{"id": 1, "slots": slots, "slot_size": slot_size, "base": HEADER_SIZE}],
                            "fds": 1,
                        },
                        fds=[seg.fd],
                    )
                    if len(conns) == readers:
                        all_in.set()
                elif f["t"] == "release":
                    for _ring, s in f["s"]:
                        if table.release(s, conn.rank):
                            freed.set()
                elif f["t"] == "bye":
                    return

        tasks = TaskSet("bench")
        ep = UnixEndpoint(sock_path, handle)
        ep.bind()
        tasks.spawn(ep.serve(tasks))
        ready.set()
        await all_in.wait()
        fields = [f.to_wire() for f in layouts]
        for i in range(n):
            while (slot := table.acquire()) is None:
                freed.clear()
                await freed.wait()
            base = HEADER_SIZE + slot * slot_size
            np.copyto(buf[base : base + nbytes], patterns[i & 1])  # the producer writes every byte
            for f in layouts[1:]:
                buf[base + f.offset : base + f.offset + 8].view("<i8")[0] = i if f.name == "step" else 0
            table.publish(slot, set(conns))
            for c in conns.values():
                c.send({"t": "batch", "ring": 1, "slot": slot, "base": base, "step": i, "micro": 0, "fields": fields})
        while table.in_use:
            freed.clear()
            await freed.wait()
        ep.close()
        await tasks.cancel_all()
        del buf
        seg.close()

    uvloop.run(main())


def _msdata_reader(sock_path: str, rank: int, readers: int, n: int, q) -> None:
    import torch

    import msdata_client as msd

    torch.set_num_threads(1)
    spec = msd.DGraph("bench", seed=0).source("s", "synthetic").mix({"s": 1.0}).pack(64).mesh(dp=1, tp=readers).plan()
    lat = []
    total = 0
    chk = 0
    with msd.DataClient(spec, endpoint=sock_path, rank=rank, world_size=readers) as dc:
        b = next(dc)  # warm-up: connect, start barrier, first mapping
        del b
        t0 = time.perf_counter()
        for _ in range(n - 1):
            s = time.perf_counter()
            b = next(dc)
            lat.append(time.perf_counter() - s)
            t = b["tokens"]
            chk = (chk + _checksum(t)) % (1 << 64)  # read every byte
            total += t.numel() * t.element_size()
            del b, t
        el = time.perf_counter() - t0
    q.put({"rank": rank, "bytes": total, "seconds": el, "lat": lat, "chk": chk})


def run_msdata(nbytes: int, n: int, readers: int, slots: int = 8) -> dict:
    ctx = mp.get_context("spawn")
    d = tempfile.mkdtemp(prefix="msdbench-")
    sock = os.path.join(d, "s.sock")
    ready = ctx.Event()
    prod = ctx.Process(target=_producer, args=(sock, nbytes, n, readers, slots, ready))
    prod.start()
    ready.wait(60)
    q = ctx.Queue()
    rs = [ctx.Process(target=_msdata_reader, args=(sock, r, readers, n, q)) for r in range(readers)]
    for p in rs:
        p.start()
    res = [q.get(timeout=600) for _ in rs]
    for p in [*rs, prod]:
        p.join(60)
    os.rmdir(d) if os.path.isdir(d) and not os.listdir(d) else None
    return _combine(res, n - 1, nbytes, readers, expect_chk=True)


# ---------------------------------------------------------------------------------------------- torch
class _TensorStream(IterableDataset):
    """An iterable dataset yielding n tensors of nbytes; every byte written by the worker."""

    def __init__(self, nbytes: int, n: int):
        self.nbytes, self.n = nbytes, n

    def __iter__(self):
        wi = get_worker_info()
        k, w = (wi.id, wi.num_workers) if wi else (0, 1)
        patterns = [torch.full((self.nbytes // 4,), 0x01010101 * (i + 1), dtype=torch.int32) for i in range(2)]
        for i in range(k, self.n, w):
            t = torch.empty(self.nbytes // 4, dtype=torch.int32)
            t.copy_(patterns[i & 1])
            yield t


def _torch_reader(nbytes: int, n: int, rank: int, q) -> None:
    torch.set_num_threads(1)
    dl = DataLoader(
        _TensorStream(nbytes, n), batch_size=None, num_workers=2, persistent_workers=True, prefetch_factor=4
    )
    it = iter(dl)
    b = next(it)
    del b
    lat = []
    total = chk = 0
    t0 = time.perf_counter()
    for _ in range(n - 1):
        s = time.perf_counter()
        t = next(it)
        lat.append(time.perf_counter() - s)
        chk = (chk + _checksum(t)) % (1 << 64)
        total += t.numel() * t.element_size()
        del t
    el = time.perf_counter() - t0
    del it, dl
    q.put({"rank": rank, "bytes": total, "seconds": el, "lat": lat, "chk": chk})


def run_torch(nbytes: int, n: int, readers: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rs = [ctx.Process(target=_torch_reader, args=(nbytes, n, r, q)) for r in range(readers)]
    for p in rs:
        p.start()
    res = [q.get(timeout=600) for _ in rs]
    for p in rs:
        p.join(60)
    return _combine(res, n - 1, nbytes, readers, expect_chk=False)


def _combine(res: list, n: int, nbytes: int, readers: int, expect_chk: bool) -> dict:
    lat = np.concatenate([np.asarray(r["lat"]) for r in res]) * 1e6
    per = [r["bytes"] / r["seconds"] / 1e9 for r in res]
    if expect_chk:
        # batches alternate between two fill patterns: every byte really arrived
        want = sum((nbytes // 8) * (0x0101010101010101 * (1 + ((i + 1) & 1))) for i in range(n)) % (1 << 64)
        for r in res:
            if r["chk"] != want:
                raise SystemExit(f"checksum mismatch: reader {r['rank']} got {r['chk']}, want {want}")
    return {
        "gbps": float(np.mean(per)),
        "gbps_total": float(np.sum(per)),
        "p50_us": float(np.percentile(lat, 50)),
        "p99_us": float(np.percentile(lat, 99)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches (under a minute)")
    ap.add_argument("--sizes", default="64k,1m,16m")
    ap.add_argument("--readers", default="1,2")
    ap.add_argument("--loader", default="msdata,torch", help="arms to run: msdata,torch")
    ap.add_argument("--smoke", action="store_true", help="seconds: 1 MiB, 8 batches, both arms, 1 and 2 readers")
    args = ap.parse_args()
    if args.smoke:
        args.sizes = "1m"
    budget = 256 << 20 if args.quick else 2 << 30  # bytes per arm and size
    reps = 2 if args.smoke else 20
    memcpy = {k: memcpy_gbps(SIZES[k], reps) for k in ("1m", "16m")}
    memcpy["64m"] = memcpy_gbps(64 << 20, min(reps, 5))
    say(
        f"single-thread memcpy: 1 MiB {memcpy['1m']:.1f} GB/s, 16 MiB {memcpy['16m']:.1f} GB/s, "
        f"64 MiB {memcpy['64m']:.1f} GB/s"
    )
    rows = []
    results = {}
    sizes, readers_list, arms = args.sizes.split(","), args.readers.split(","), args.loader.split(",")
    prog = bar(len(sizes) * len(readers_list) * len(arms), "transport", "arm")
    for size in sizes:
        nb = SIZES[size]
        n = 8 if args.smoke else int(min(4000 if args.quick else 20000, max(40, budget // nb)))
        for readers in map(int, readers_list):
            for arm in arms:
                r = run_msdata(nb, n, readers) if arm == "msdata" else run_torch(nb, n, readers)
                results[(arm, size, readers)] = r
                rows.append((arm, size, readers, n, r))
                say(
                    f"  {arm:6s} {size:>4s} readers={readers} batches={n:5d}  {r['gbps']:7.2f} GB/s per reader  "
                    f"next() p50 {r['p50_us']:8.1f} us  p99 {r['p99_us']:8.1f} us"
                )
                prog.update(1)
    prog.close()
    say("")
    say(
        f"{'size':>5} {'readers':>7} {'msdata GB/s':>12} {'torch GB/s':>11} {'ratio':>7} "
        f"{'msdata p50 us':>14} {'torch p50 us':>13}"
    )
    for size in args.sizes.split(","):
        for readers in map(int, args.readers.split(",")):
            m, t = results.get(("msdata", size, readers)), results.get(("torch", size, readers))
            if m and t:
                say(
                    f"{size:>5} {readers:>7} {m['gbps']:12.2f} {t['gbps']:11.2f} {m['gbps'] / t['gbps']:7.1f} "
                    f"{m['p50_us']:14.1f} {t['p50_us']:13.1f}"
                )

    def ratio(size, readers=1):
        m, t = results.get(("msdata", size, readers)), results.get(("torch", size, readers))
        return round(m["gbps"] / t["gbps"], 2) if m and t else None

    m16 = results.get(("msdata", "16m", 1))
    out = {
        "ratio_vs_dataloader_64kib": ratio("64k"),
        "ratio_vs_dataloader_1mib": ratio("1m"),
        "ratio_vs_dataloader_16mib": ratio("16m"),
        "ratio_vs_dataloader_1mib_2readers": ratio("1m", 2),
        "ratio_vs_dataloader_16mib_2readers": ratio("16m", 2),
        "fraction_of_memcpy_16mib": round(m16["gbps"] / memcpy["64m"], 3) if m16 else None,
        "next_p50_us": round(results[("msdata", "1m", 1)]["p50_us"], 1) if ("msdata", "1m", 1) in results else None,
        "next_p99_us": round(results[("msdata", "1m", 1)]["p99_us"], 1) if ("msdata", "1m", 1) in results else None,
        "msdata_gbps_16mib": round(m16["gbps"], 2) if m16 else None,
        "memcpy_gbps_64mib": round(memcpy["64m"], 2),
    }
    say(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
