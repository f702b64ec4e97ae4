# .venv/bin/python bench/autoscale.py --quick
"""Autoscaling benchmark (issue 11): the `shift` workload of ../shared/workloads.toml.

A cheap text source (byte tokens: microseconds a document) and an expensive image source (real JPEGs written
here, side lognormal(640, 0.4), decoded, resized and patchified by the `vlm` transform in the workers:
milliseconds each) under a schedule text-heavy -> image-heavy -> text-heavy. Two trainer ranks (dp 2) each
take one step per fixed compute time (a sleep), pulling their micro-batches from a real node server; the time
a rank spends blocked in next() is its data wait. The compute time is chosen from the image transform's CPU
CPU time measured here first, so that the image-heavy phase needs 1.5 CPUs of decoding: static-peak (a worker
per CPU) keeps up on 2 free cores, a pool sized for the mean (1 worker) cannot. On a machine that others load,
every arm gets less; the bench prints how much of the CPUs were free and each arm's load average.

Arms, one after another in this process tree, each with its own server and ranks (side by side at the same
time they would share the 2 cores, and no pool could keep up):
  static-peak  a fixed pool sized for the image-heavy phase (autoscale off)
  static-mean  a fixed pool sized for the mean demand over the schedule (autoscale off)
  autoscale    [autoscale] on, min 1, max = the CPUs, starting from 1 worker
Reported per arm: data-wait fraction of the ranks' wall time (overall, and over the 10 steps after each
shift), worker-seconds provisioned (the pool's integral of live workers over the training window), CPU
seconds (server process + the workers' task CPU), peak PSS of server + workers, and for autoscale the
reaction lead (the shift's step minus the trainer's step when the scale-up it anticipated was decided).
The last line is one JSON object; results also go to bench/results/autoscale.json.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import tomllib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

WORKLOADS = ROOT.parent / "shared" / "workloads.toml"
TRANSFORM = "_autoscale_tf:image_tokens"  # the vlm transform, tokens kept (bench/_autoscale_tf.py)
DEFAULT_SHIFT = {
    "seq_len": 4096,
    "micro_batches": 2,
    "dp": 2,
    "schedule": [
        {"step": 0, "weights": {"text": 0.9, "image": 0.1}},
        {"step": 60, "weights": {"text": 0.3, "image": 0.7}},
        {"step": 120, "weights": {"text": 0.9, "image": 0.1}},
    ],
    "steps": 180,
}
AFTER = 10  # steps after a shift whose waits are reported apart
WARMUP = 5  # first steps (the job starts, the first reads): their wait is reported apart
SMOKE_SHIFT = {  # --smoke: the same three phases, short, at a quarter of the tokens per step
    "seq_len": 1024,
    "micro_batches": 2,
    "dp": 2,
    "schedule": [
        {"step": 0, "weights": {"text": 0.9, "image": 0.1}},
        {"step": 12, "weights": {"text": 0.3, "image": 0.7}},
        {"step": 24, "weights": {"text": 0.9, "image": 0.1}},
    ],
    "steps": 36,
}
IMAGE_NEED = 1.5  # CPU seconds per second of image decoding in the image-heavy phase: 1.5 of the 2 cores


def workload() -> dict:
    try:
        return tomllib.loads(WORKLOADS.read_text())["shift"]
    except (OSError, KeyError):
        return DEFAULT_SHIFT


def cpus() -> int:
    return len(os.sched_getaffinity(0))


# ---- data ------------------------------------------------------------------------------------------------
def jpeg(rng: np.random.Generator, side: float = 640.0) -> bytes:
    from PIL import Image

    h, w = (int(x) for x in np.clip(rng.lognormal(math.log(side), 0.4, 2), 64, 2048))
    small = rng.integers(0, 256, (max(2, h // 64), max(2, w // 64), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR)  # a smooth field with some grain
    grain = rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
    arr = np.clip(np.asarray(img, np.int16) + grain, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_data(d: Path, images: int, texts: int, seed: int) -> tuple[list[dict], float]:
    """Parquet files of the two sources; returns some image records and the mean text length (bytes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
        "data",
        "model",
        "train",
        "token",
    ]
    text = [" ".join(rng.choice(words, int(rng.lognormal(math.log(120), 0.6)) + 4)) for _ in range(texts)]
    (d / "text").mkdir()
    (d / "image").mkdir()
    pq.write_table(pa.table({"text": text}), d / "text" / "part-0.parquet")
    recs = [{"image": jpeg(rng), "caption": " ".join(rng.choice(words, 12))} for _ in range(images)]
    pq.write_table(
        pa.table({"image": pa.array([r["image"] for r in recs], pa.binary()), "caption": [r["caption"] for r in recs]}),
        d / "image" / "part-0.parquet",
        row_group_size=8,
    )
    return recs, float(np.mean([len(t) + 1 for t in text]))


def _decode_for(args: tuple[list[dict], float]) -> int:
    """In a child process: decode images until ``seconds`` have passed; how many."""
    recs, seconds = args
    sys.path.insert(0, str(HERE))
    from _autoscale_tf import image_tokens

    image_tokens(recs[0])
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        image_tokens(recs[n % len(recs)])
        n += 1
    return n


def decode_rate(recs: list[dict], procs: int, seconds: float) -> float:
    """Images per second that ``procs`` processes decode side by side on this machine now (its load included)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(procs) as pool:
        return sum(pool.map(_decode_for, [(recs, seconds)] * procs)) / seconds


def image_cost(recs: list[dict]) -> tuple[float, float]:
    """CPU seconds and tokens per image of the transform, measured in this process (after one warm-up)."""
    sys.path.insert(0, str(HERE))
    from _autoscale_tf import image_tokens

    image_tokens(recs[0])
    t = time.process_time()
    toks = [len(image_tokens(r)) for r in recs[1:]]
    return (time.process_time() - t) / len(toks), float(np.mean(toks))


# ---- one arm ---------------------------------------------------------------------------------------------
class Server:
    def __init__(self, base: Path, name: str, *, workers: int, autoscale: bool, max_workers: int):
        from msdata_client.wire import request

        self._request = request
        self.dir = base / name
        self.dir.mkdir()
        self.socket = str(self.dir / "msdata.sock")
        cfg = self.dir / "node.toml"
        cfg.write_text(
            textwrap.dedent(f"""\
            [node]
            id = "{name}"
            socket = "{self.socket}"
            shm_prefix = "as{secrets.token_hex(3)}"
            workers = {workers}
            state_dir = "{self.dir / "state"}"
            allow_transforms = ["_autoscale_tf"]
            [autoscale]
            enabled = {"true" if autoscale else "false"}
            min_workers = 1
            max_workers = {max_workers}
            interval = 0.25
            cooldown = 2.0
            """)
        )
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
        self.log = open(self.dir / "server.log", "ab")  # noqa: SIM115  (the server's log: open while it runs, closed when it stops)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "msdata_server", "serve", "--config", str(cfg), "--log-level", "INFO"],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=str(ROOT),
        )
        if not self.proc.stdout or not self.proc.stdout.readline():
            raise SystemExit(f"{name}: the server did not start; see {self.dir / 'server.log'}")

    def status(self) -> dict:
        return self._request(self.socket, {"t": "status"}, timeout=30)["status"]

    def cpu_s(self) -> float:
        f = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()


def job_spec(data: Path, wl: dict, seed: int):
    import msdata_client as msd

    g = msd.DGraph("shift", seed=seed)
    g.source("text", "parquet", str(data / "text"))
    g.source("image", "parquet", str(data / "image"), columns=["image", "caption"], transform=TRANSFORM)
    g.mix(schedule=[(p["step"], p["weights"]) for p in wl["schedule"]])
    g.pack(wl["seq_len"], rows=1, micro_batches=wl["micro_batches"]).mesh(dp=wl["dp"])
    return g.plan()


def train(spec, endpoint: str, steps: int, compute_s: float) -> list[list[tuple[float, float, float]]]:
    """Every rank in a thread: per step (start time, data wait, end time)."""
    import msdata_client as msd

    out: list[list[tuple[float, float, float]]] = [[] for _ in range(spec.mesh.world_size)]
    errs: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with msd.DataClient(spec, endpoint=endpoint, rank=r, world_size=spec.mesh.world_size) as dc:
                for _ in range(steps):
                    t0 = time.monotonic()
                    wait = 0.0
                    for _ in range(spec.micro_batches):
                        a = time.monotonic()
                        b = next(dc)
                        wait += time.monotonic() - a
                        del b
                    time.sleep(max(0.0, compute_s - (time.monotonic() - t0 - wait)))
                    out[r].append((t0, wait, time.monotonic()))
        except BaseException as e:
            errs.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(spec.mesh.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        raise errs[0]
    return out


def wait_frac(ranks: list[list[tuple[float, float, float]]], lo: int = 0, hi: int | None = None) -> float:
    waited = sum(w for r in ranks for _, w, _ in r[lo:hi])
    wall = sum(e - s for r in ranks for s, _, e in r[lo:hi])
    return waited / wall if wall > 0 else 0.0


def reaction_lead(decisions: list[dict], r0: list[tuple[float, float, float]], shift: int) -> int | None:
    """Steps between the scale-up that met a shift and the shift: the last scale-up before the shift's first
    step with no scale-down after it before that step (the shift minus the trainer's step at that decision);
    negative when the first scale-up came after the shift; None when there was none."""
    ts = r0[shift][0]

    def step_at(t: float) -> int:
        return sum(1 for s, _, _ in r0 if s <= t) - 1

    before = [d for d in decisions if d["t"] <= ts and d["size_to"] != d["size_from"]]
    up = None
    for d in before:
        up = d if d["size_to"] > d["size_from"] else None  # a scale-down undoes an earlier scale-up
    if up is not None:
        return shift - step_at(up["t"])
    late = next((d for d in decisions if d["t"] > ts and d["size_to"] > d["size_from"]), None)
    return shift - step_at(late["t"]) if late is not None else None


def run_arm(name: str, base: Path, data: Path, wl: dict, *, workers: int, autoscale: bool, compute_s: float,
            seed: int) -> dict:  # fmt: skip
    srv = Server(base, name, workers=workers, autoscale=autoscale, max_workers=cpus())
    spec = job_spec(data, wl, seed)
    polls: list[tuple[float, int, int, float]] = []  # (time, pool size, total PSS, worker-seconds)
    load0 = os.getloadavg()[0]
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.5):
            try:
                st = srv.status()
            except OSError:
                continue
            polls.append(
                (time.monotonic(), int(st["workers"]), int(st["memory"]["total_pss"]), st["autoscale"]["worker_s"])
            )

    poller = threading.Thread(target=poll, daemon=True)
    try:
        cpu0 = srv.cpu_s()
        poller.start()
        ranks = train(spec, srv.socket, wl["steps"], compute_s)
        st = srv.status()
        cpu = srv.cpu_s() - cpu0
    finally:
        done.set()
        poller.join()
        srv.close()
    a = st["autoscale"]
    shifts = [p["step"] for p in wl["schedule"][1:]]
    r0 = ranks[0]
    t_start, t_end = r0[WARMUP][0], r0[-1][2]
    # worker-seconds over the measured window: from the last poll before it starts (the pool integral)
    w_start = max((p for p in polls if p[0] <= t_start), default=polls[0])[3]

    def step_at(t: float) -> int:
        return sum(1 for s, _, _ in r0 if s <= t) - 1

    res = {
        "arm": name,
        "data_wait_frac": round(wait_frac(ranks, WARMUP), 4),
        "warmup_wait_s": round(sum(w for r in ranks for _, w, _ in r[:WARMUP]) / len(ranks), 3),
        "data_wait_frac_after_shift": {str(s): round(wait_frac(ranks, s, s + AFTER), 4) for s in shifts},
        "worker_s": round(a["worker_s"] - w_start, 2),
        "cpu_s": round(cpu + sum(v.get("cpu_s", 0.0) for v in a["sources"].values()), 2),
        "peak_pss_mib": round(max((p[2] for p in polls), default=0) / 2**20, 1),
        "wall_s": round(t_end - t_start, 2),
        "step_s": round((t_end - t_start) / (len(r0) - WARMUP), 4),
        "load_avg": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "workers_max": max((p[1] for p in polls), default=workers),
        "workers_min": min((p[1] for p in polls), default=workers),
    }
    if autoscale:
        leads = {}
        for p, q in zip(wl["schedule"][1:], wl["schedule"]):
            if p["weights"].get("image", 0) > q["weights"].get("image", 0):  # a shift that needs more workers
                leads[str(p["step"])] = reaction_lead(a["decisions"], r0, p["step"])
        res["react_lead_steps"] = leads
        res["decisions"] = [
            {"step": step_at(d["t"]), "from": d["size_from"], "to": d["size_to"], "reason": d["reason"]}
            for d in a["decisions"]
            if d["t"] >= t_start
        ]
        res["trace"] = [
            {"t": round(t - t_start, 3), "workers": n, "step": step_at(t)} for t, n, _, _ in polls if t >= t_start
        ]
        res["sources"] = {
            k: {
                kk: v[kk]
                for kk in ("cpu_s_per_sample", "worker_s_per_sample", "read_s_per_sample", "tokens_per_sample")
            }
            for k, v in a["sources"].items()
        }
    return res


# ---- main ------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer distinct images (under three minutes on 2 cores)")
    ap.add_argument("--images", type=int, default=None, help="distinct JPEGs written (default 400, quick 160)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default="static-peak,static-mean,autoscale")
    ap.add_argument("--out", default=str(HERE / "results" / "autoscale.json"))
    ap.add_argument("--smoke", action="store_true", help="seconds: 36 short steps per arm, 32 images; writes no --out")
    args = ap.parse_args()
    wl = SMOKE_SHIFT if args.smoke else workload()
    n_img = args.images or (32 if args.smoke else 160 if args.quick else 400)
    n_text = 400 if args.smoke else 4000
    base = Path(tempfile.mkdtemp(prefix="msd-as-"))
    try:
        t = time.perf_counter()
        recs, _text_len = write_data(base, n_img, n_text, args.seed)
        cost, img_tokens = image_cost(recs[:24])
        print(f"data: {n_img} JPEGs, {n_text} texts in {time.perf_counter() - t:.1f}s; image transform "
              f"{cost * 1e3:.2f} ms CPU and {img_tokens:.0f} tokens each", flush=True)  # fmt: skip
        tokens_per_step = wl["seq_len"] * wl["micro_batches"] * wl["dp"]
        shares = [p["weights"].get("image", 0.0) for p in wl["schedule"]]
        per_step = [tokens_per_step * s / img_tokens for s in shares]  # images per step
        n = cpus()
        peak = n
        steps_in = np.diff([p["step"] for p in wl["schedule"]] + [wl["steps"]])
        mean_need = float(np.dot([x / max(per_step) * IMAGE_NEED for x in per_step], steps_in) / wl["steps"])
        mean = max(1, round(mean_need))
        arms = {
            "static-peak": {"workers": peak, "autoscale": False},
            "static-mean": {"workers": mean, "autoscale": False},
            "autoscale": {"workers": 1, "autoscale": True},
        }
        names = args.arms.split(",")
        compute_s = max(per_step) * cost / IMAGE_NEED
        need = [x * cost / compute_s for x in per_step]  # CPUs of decoding per phase
        # how much of its CPUs this shared machine gives us now
        rate = decode_rate(recs[:24], n, 0.3 if args.smoke else 1.5)
        print(f"machine: {n} CPUs decode {rate:.0f} images/s side by side now ({rate * cost / n:.0%} of them free); "
              f"trainer: {compute_s * 1e3:.0f} ms compute per step; image decoding per phase "
              f"{[round(x, 2) for x in need]} CPUs (mean {mean_need:.2f}); static-peak {peak}, static-mean {mean}",
              flush=True)  # fmt: skip
        t = time.perf_counter()
        results = {}
        for name in names:
            results[name] = r = run_arm(name, base, base, wl, compute_s=compute_s, seed=args.seed, **arms[name])
            print(
                f"{name:12s} wait {r['data_wait_frac']:.3f} (after shifts {r['data_wait_frac_after_shift']})  "
                f"worker-s {r['worker_s']:.1f}  cpu-s {r['cpu_s']:.1f}  peak PSS {r['peak_pss_mib']:.0f} MiB  "
                f"workers {r['workers_min']}..{r['workers_max']}  step {r['step_s'] * 1e3:.0f} ms  "
                f"load {r['load_avg'][0]:.1f}->{r['load_avg'][1]:.1f}",
                flush=True,
            )
            if name == "autoscale":
                print(f"  reaction lead {r['react_lead_steps']}; decisions:", flush=True)
                for d in r["decisions"]:
                    print(f"    step {d['step']:4d}: {d['from']} -> {d['to']}  {d['reason']}", flush=True)
        print(f"arms in {time.perf_counter() - t:.0f}s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    auto, peak_r, mean_r = results.get("autoscale"), results.get("static-peak"), results.get("static-mean")
    leads = [v for v in (auto or {}).get("react_lead_steps", {}).values() if v is not None]
    summary = {
        "workload": "shift",
        "quick": args.quick,
        "cpus": cpus(),
        "compute_s_per_step": round(compute_s, 4),
        "image_cpu_ms": round(cost * 1e3, 3),
        "cpu_free_frac": round(rate * cost / cpus(), 3),
        "arms": results,
        "data_wait_frac_autoscale": auto["data_wait_frac"] if auto else None,
        "data_wait_frac_static_mean": mean_r["data_wait_frac"] if mean_r else None,
        "data_wait_frac_static_peak": peak_r["data_wait_frac"] if peak_r else None,
        "worker_s_saving_vs_peak": round(1 - auto["worker_s"] / peak_r["worker_s"], 4) if auto and peak_r else None,
        "react_lead_steps": min(leads) if leads else None,
        "trace": (auto or {}).get("trace", []),
    }
    if not args.smoke:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1))
    short = {k: v for k, v in summary.items() if k != "arms"}  # the trace too: bench/suite.py plots it from this line
    print(json.dumps(short))


if __name__ == "__main__":
    main()
