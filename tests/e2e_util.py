"""Helpers for end-to-end tests: small synthetic jobs, rank threads and rank processes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import orjson

import msdata_client as msd

HERE = Path(__file__).resolve().parent


def small_job(
    name="t",
    *,
    dp=2,
    tp=1,
    cp=1,
    pp=1,
    seq_len=512,
    micro_batches=2,
    rows=1,
    seed=0,
    samples=400,
    method="karmarkar_karp",
    prefetch=2,
    median=(60.0, 150.0),
    max_len=None,
):
    """Two synthetic sources; documents no longer than seq_len unless max_len says otherwise."""
    max_len = max_len or seq_len
    g = msd.DGraph(name, seed=seed)
    g.source("a", "synthetic", samples=samples, median=median[0], sigma=0.8, min_len=4, max_len=max_len)
    g.source("b", "synthetic", samples=samples, median=median[1], sigma=1.0, min_len=4, max_len=max_len)
    g.mix({"a": 0.4, "b": 0.6}).pack(seq_len, rows=rows, micro_batches=micro_batches).balance(method)
    g.mesh(dp=dp, tp=tp, cp=cp, pp=pp).prefetch(prefetch)
    return g.plan()


def batch_record(batch) -> dict:
    rec = {"step": int(batch["step"]), "micro": int(batch["micro"])}
    for k, v in sorted(batch.items()):
        if k not in ("step", "micro"):
            rec[k] = hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()[:16]
    if "sample_ids" in batch:
        rec["ids"] = [[int(s), int(i)] for s, i in zip(batch["source_ids"], batch["sample_ids"])]
    return rec


def run_ranks(
    spec, endpoint, n, ranks=None, *, keep=False, timeout=60.0, states=None, saved=None, mixture=None, pause=None
):
    """Each rank in its own thread with its own DataClient; returns {rank: [records]} (and batches if keep).

    states: {rank: state} loaded before iterating; saved: a dict that receives each rank's state_dict() after
    its n batches; mixture: (after_batches, weights), or a list of them, for rank 0 to call set_mixture (the
    result lands in saved["mixture_step"]; a ConfigError refusal in saved["mixture_refused"]); pause:
    (after_batches, threading.Event) every rank waits for before going on.
    """
    ranks = range(spec.mesh.world_size) if ranks is None else ranks
    out, errs, kept = {}, {}, {}
    changes = [] if mixture is None else [mixture] if isinstance(mixture[0], int) else list(mixture)

    def body(r):
        try:
            with msd.DataClient(
                spec, endpoint=endpoint, rank=r, world_size=spec.mesh.world_size, connect_timeout=30
            ) as dc:
                if states is not None and r in states:
                    dc.load_state_dict(states[r])
                recs, bs = [], []
                for i in range(n):
                    if pause is not None and i == pause[0]:
                        pause[1].wait(timeout)
                    for at, weights in changes if r == 0 else ():
                        if i == at:
                            try:
                                saved["mixture_step"] = dc.set_mixture(weights)
                            except msd.errors.ConfigError as e:
                                saved["mixture_refused"] = str(e)
                    b = next(dc)
                    recs.append(batch_record(b))
                    if keep:
                        bs.append({k: v.clone() for k, v in b.items()})
                    del b
                out[r] = recs
                kept[r] = bs
                if saved is not None:
                    saved[r] = dc.state_dict()
        except BaseException as e:  # reported to the test
            errs[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank thread hung"
    if errs:
        raise next(iter(errs.values()))
    return (out, kept) if keep else out


def start_rank_process(spec, endpoint, rank, n, outdir, *extra) -> tuple[subprocess.Popen, str]:
    job = os.path.join(outdir, f"job-{spec.name}.json")
    Path(job).write_bytes(orjson.dumps(spec.to_dict()))
    out = os.path.join(outdir, f"rank{rank}-{spec.name}.json")
    with open(out + ".log", "ab") as log:
        p = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "rank_worker.py"),
                job,
                endpoint,
                str(rank),
                str(spec.mesh.world_size),
                str(n),
                out,
                *map(str, extra),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
        )
    return p, out


def finish(p: subprocess.Popen, kill: bool = True) -> int:
    """Kill (or wait for) a rank process and close its pipe."""
    if kill and p.poll() is None:
        p.kill()
    rc = p.wait(60)
    p.stdout.close()
    return rc


def read_out(path) -> dict:
    return json.loads(Path(path).read_text())


def status_json(endpoint: str) -> dict:
    """A server's `msdata-server status --json`, run as a user would (a subprocess of the CLI)."""
    out = subprocess.run(
        [sys.executable, "-m", "msdata_server", "status", "--endpoint", endpoint, "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)
