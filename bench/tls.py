# PYTHONPATH=$PWD .venv/bin/python bench/tls.py            (--smoke: a few MiB, a check that it runs)
"""Peer-link payload throughput with mutual TLS on beside off, in one process tree.

A receiver process (a PeerServer, uvloop) and this process as the sender (PeerLink.send_payload of 1 MiB
payload frames, uvloop) on loopback; the same link code with ``tls=`` contexts from throwaway certificates
(openssl CLI, tests/pki.py) or without. Rounds alternate off/on so both see the same machine load; each round
sends ``--mib`` MiB after a warm-up of 16 frames and ends when the receiver confirms every byte. Reports GB/s per
mode (median of rounds) and the ratio on/off; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo: msdata_server and tests/pki.py

from msdata_server.cluster.net.peers import PeerLink, PeerServer
from msdata_server.cluster.net.tls import peer_tls
from tests.pki import CA

TOKEN = "bench-token-" + "x" * 20
FRAME = 1 << 20


def _receiver(tls_paths: tuple[str, str, str] | None, port_q: mp.Queue) -> None:
    async def main() -> None:
        tls = peer_tls(*tls_paths).server if tls_paths else None
        total = 0
        done = asyncio.Event()
        srv: PeerServer

        async def handler(peer: str, frame: dict, payload: memoryview | None) -> None:
            nonlocal total
            if payload is not None:
                total += len(payload)
            elif frame["t"] == "count":
                await srv.links[peer].send({"t": "counted", "bytes": total})
                total = 0
            elif frame["t"] == "stop":
                done.set()

        srv = PeerServer(token=TOKEN, node_id="rx", handler=handler, tls=tls)
        port_q.put(await srv.start())
        await done.wait()
        await srv.aclose()

    uvloop.run(main())


async def _send(port: int, tls_paths: tuple[str, str, str] | None, mib: int, rounds: int) -> list[float]:
    """GB/s of each round over one link."""
    tls = peer_tls(*tls_paths).client if tls_paths else None
    answers: asyncio.Queue[int] = asyncio.Queue()

    def handler(peer: str, frame: dict, payload: memoryview | None) -> None:
        if frame["t"] == "counted":
            answers.put_nowait(int(frame["bytes"]))

    link = await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="tx", handler=handler, tls=tls)
    buf = os.urandom(FRAME)
    out = []
    for r in range(rounds + 1):  # round 0: warm-up, not reported
        frames = 16 if r == 0 else mib
        t0 = time.perf_counter()
        for _ in range(frames):
            await link.send_payload({"t": "p"}, buf, copy=False)
        await link.send({"t": "count"})
        got = await answers.get()
        dt = time.perf_counter() - t0
        assert got == frames * FRAME, (got, frames * FRAME)
        if r:
            out.append(got / dt / 1e9)
    await link.send({"t": "stop"})
    await link.aclose()
    return out


def run_mode(tls_paths: tuple[str, str, str] | None, mib: int, rounds: int) -> list[float]:
    ctx = mp.get_context("spawn")
    port_q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(tls_paths, port_q), daemon=True)
    proc.start()
    try:
        port = port_q.get(timeout=60)
        return uvloop.run(_send(port, tls_paths, mib, rounds))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB sent per round (1 MiB frames)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode, alternating off/on")
    ap.add_argument("--smoke", action="store_true", help="8 MiB, 1 round: a check that it runs")
    a = ap.parse_args()
    if a.smoke:
        a.mib, a.rounds = 8, 1
    with tempfile.TemporaryDirectory(prefix="msd-tls-bench-") as d:
        ca = CA(Path(d) / "ca")
        node = ca.issue("node")  # both ends present it; each verifies the other's against the CA
        paths = (str(node.cert), str(node.key), str(node.ca))
        res: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(a.rounds):
            res["off"] += run_mode(None, a.mib, 1)
            res["on"] += run_mode(paths, a.mib, 1)
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    print(f"{'mode':<6}{'GB/s (median)':>15}  rounds")
    for mode, v in (("off", off), ("on", on)):
        print(f"{mode:<6}{v:>15.3f}  {' '.join(f'{x:.3f}' for x in res[mode])}")
    print(f"TLS on/off = {on / off:.2f}x  ({a.mib} MiB per round, {FRAME >> 20} MiB frames, {a.rounds} rounds)")
    print(
        json.dumps(
            {
                "bench": "tls",
                "frame_bytes": FRAME,
                "mib": a.mib,
                "rounds": a.rounds,
                "gbps_off": round(off, 3),
                "gbps_on": round(on, 3),
                "ratio_on_off": round(on / off, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
