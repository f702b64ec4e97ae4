"""examples/train_hf.py: two CPU ranks train a Hugging Face Llama on msdata batches; the loss falls, and a new
run resumed from a mid-run checkpoint gives the uninterrupted run's losses bit for bit."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import orjson
import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE = 6, 3
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "was", "red", "big"]


def _job(tmp: Path) -> Path:
    """Two JSONL sources of short sentences from a small vocabulary: byte tokens a tiny model learns fast."""
    rng = np.random.default_rng(0)
    for name in ("chat", "web"):
        d = tmp / name
        d.mkdir()
        texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 60)))) + "." for _ in range(600)]
        (d / "part-0.jsonl").write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
    job = tmp / "job.toml"
    job.write_text(
        textwrap.dedent(f"""\
        [job]
        name = "hf"
        seed = 0
        seq_len = 256
        micro_batches = 2
        [mesh]
        dp = 2
        [[source]]
        name = "chat"
        format = "jsonl"
        paths = ["{tmp / "chat"}"]
        column = "text"
        transform = "msdata_server.transforms:byte_tokens"
        [[source]]
        name = "web"
        format = "jsonl"
        paths = ["{tmp / "web"}"]
        column = "text"
        transform = "msdata_server.transforms:byte_tokens"
        [mix]
        weights = {{ chat = 0.5, web = 0.5 }}
        """)
    )
    return job


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(job: Path, endpoint: str, ckpt: Path, losses: Path, *extra: str) -> None:
    """Two ranks as torchrun would start them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), to the end of the run."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONHASHSEED="0",
        )
        cmd = [
            sys.executable,
            str(ROOT / "examples" / "train_hf.py"),
            "--job",
            str(job),
            "--endpoint",
            endpoint,
            "--steps",
            str(STEPS),
            "--ckpt",
            str(ckpt),
            "--save-every",
            str(SAVE),
            "--losses",
            str(losses),
            *extra,
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    try:
        outs = [p.communicate(timeout=150)[0].decode(errors="replace") for p in procs]
    finally:  # a rank that failed leaves its peer waiting in a collective: never leave either behind
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(400)  # about 20 s on an idle 2-core machine; loaded CI machines import torch slowly
def test_hf_llama_trains_and_resumes_bit_for_bit(server_factory, tmp_path):
    srv = server_factory(workers=1).start()
    job = _job(tmp_path)
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    ckpt = tmp_path / "ckpt"
    _train(job, srv.socket, ckpt, whole)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-3.pt", "step-6.pt"]
    # a new run (new processes, a new registration with the server) from the checkpoint of step 3
    _train(job, srv.socket, tmp_path / "ckpt-resumed", resumed, "--resume", str(ckpt / f"step-{SAVE}.pt"))

    a, b = _losses(whole), _losses(resumed)
    assert len(a) == STEPS
    assert len(b) == STEPS - SAVE
    assert b == a[SAVE:]  # the same floats as the uninterrupted run
    assert a[-1] < 0.8 * a[0], a  # the model learns the byte statistics of its data
