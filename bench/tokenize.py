# PYTHONPATH=$PWD .venv/bin/python bench/tokenize.py [--quick | --smoke]
"""Tokenization throughput: a text source through ``hf_tokenizer`` in the worker pool vs the ``tokenizers``
library itself on one thread, over the same texts.

A BPE tokenizer is trained here with ``tokenizers`` on generated text (words of a Zipf vocabulary, documents of
50-800 words; nothing downloaded). Arms, alternating round by round so they see the same machine load:
- ``library``: ``Tokenizer.encode_batch`` over all the texts on one thread (TOKENIZERS_PARALLELISM=false), and
  ``encode`` record by record beside it (what a per-record transform gets);
- ``pool wN``: a Parquet source of the same texts read by a SourceLoader (64 records a batch, its read-ahead)
  whose transform ``msdata_server.transforms:hf_tokenizer(...)`` runs in a WorkerPool of N workers, N = 1, 2.
``tokenize_efficiency`` = pool w1 tokens/s / library tokens/s (the worker's whole cost: records pickled to it,
token arrays back through its segment); tokens/s per core = tokens / the workers' CPU seconds (measured in the
workers), beside the library's tokens per CPU second (``tokenize_efficiency_cpu``: steadier on a loaded
machine); ``pool_scaling_1_2`` = w2 / w1 tokens/s (on 2 shared cores the server process competes with the
workers). Medians over rounds; the last line is one JSON object.
"""

from __future__ import annotations

import os
import sys

if __name__ == "tokenize":
    # DESIGN 4.7 fixes this file's name, which is the standard library's: another bench/*.py (bench/ first on its
    # sys.path) that imports the standard ``tokenize`` (linecache, inspect do) finds this file. Be that module:
    # load the standard library's and put it in our place, which is what ``import tokenize`` then returns.
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "tokenize", os.path.join(os.path.dirname(os.__file__), "tokenize.py")
    )
    assert _spec is not None
    assert _spec.loader is not None
    _std = importlib.util.module_from_spec(_spec)
    sys.modules["tokenize"] = _std
    _spec.loader.exec_module(_std)
else:
    # run as the benchmark: the standard library's tokenize first, this directory last (for ``progress``)
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE] + [_HERE]
    sys.path.insert(0, os.path.dirname(_HERE))  # the repo: msdata_server
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the library arm on one thread (the pool's workers set it too)

    import argparse
    import asyncio
    import json
    import statistics
    import tempfile
    import time
    from pathlib import Path

    import numpy as np
    from progress import say

WORDS, SEED = 8000, 0


def corpus(n_docs: int, seed: int = SEED) -> list[str]:
    """Generated English-like text: lowercase words of a Zipf-distributed vocabulary, 50-800 words a document."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(["".join(rng.choice(letters, int(rng.integers(1, 11)))) for _ in range(WORDS)])
    p = 1.0 / np.arange(1, WORDS + 1)
    p /= p.sum()
    out = []
    for _ in range(n_docs):
        words = vocab[rng.choice(WORDS, int(rng.integers(50, 801)), p=p)]
        out.append(" ".join(words).capitalize() + ".")
    return out


def train(texts: list[str], path: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on ``texts``, saved as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


def library(path: Path, texts: list[str]) -> dict:
    """tokens/s of encode_batch over all texts (one thread; also per CPU second), and of encode record by record."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    batch, cpu = n / (time.perf_counter() - t0), n / max(time.process_time() - c0, 1e-9)
    t0 = time.perf_counter()
    m = sum(len(tok.encode(t, add_special_tokens=False).ids) for t in texts)
    single = m / (time.perf_counter() - t0)
    return {"batch": batch, "cpu": cpu, "single": single, "tokens": n}


async def pooled(transform: str, data: Path, workers: int, n_docs: int, prefix: str) -> dict:
    """tokens/s of the source through the loader and a pool of ``workers`` (the pool started and warm), and the
    tokens per CPU second of its workers."""
    import msdata_client as msd
    from msdata_server.loader import SourceLoader
    from msdata_server.pool import WorkerPool
    from msdata_server.sources import open_source

    g = msd.DGraph("tok", seed=1)
    g.source("web", "parquet", str(data), transform=transform)
    spec = g.mix({"web": 1.0}).pack(4096).mesh(dp=1).plan()
    src = await asyncio.to_thread(open_source, spec.sources[0], seed=spec.seed)
    async with WorkerPool(workers, shm_prefix=prefix) as pool:
        await pool.wait_ready()
        warm = SourceLoader(src, pool, transform=transform, seed=spec.seed)  # each worker loads the tokenizer
        await warm.lengths(0, min(n_docs, 64 * workers))
        await warm.aclose()
        before = pool.usage().get("web")
        ld = SourceLoader(src, pool, transform=transform, seed=spec.seed)
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = 0
        for start in range(0, n_docs, 64):
            count = min(64, n_docs - start)
            tokens += int((await ld.lengths(start, count)).sum())
            ld.release(np.arange(start, start + count))
        secs, here = time.perf_counter() - t0, time.process_time() - c0
        after = pool.usage()["web"]
        await ld.aclose()
    cpu = after.cpu_s - (before.cpu_s if before is not None else 0.0)
    src.close()
    return {
        "tokens_per_s": tokens / secs,
        "tokens_per_cpu_s": tokens / cpu if cpu > 0 else 0.0,
        "server_cpu_s_per_mtok": here / tokens * 1e6,
        "worker_busy": cpu / secs / workers,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer documents and rounds")
    ap.add_argument("--smoke", action="store_true", help="seconds: a few hundred documents, one round")
    ap.add_argument("--docs", type=int, default=None, help="documents per round (default 4000; --quick 2000)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds, arms alternating (default 5; --quick 3)")
    args = ap.parse_args()
    docs, rounds, vocab = (args.docs or 4000), (args.rounds or 5), 16000
    if args.quick:
        docs, rounds = args.docs or 2000, args.rounds or 3
    if args.smoke:
        docs, rounds, vocab = 200, 1, 2000
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = corpus(docs)
    res: dict[str, list[float]] = {
        k: [] for k in ("library", "library_cpu", "library_single", "w1", "w2", "w1_cpu", "w2_cpu")
    }
    with tempfile.TemporaryDirectory(prefix="msd-tok-bench-") as d:
        tmp = Path(d)
        t0 = time.perf_counter()
        train(corpus(max(200, docs // 4), seed=SEED + 1), tmp / "tokenizer.json", vocab)  # other texts, same words
        trained = time.perf_counter() - t0
        (tmp / "data").mkdir()
        pq.write_table(pa.table({"text": texts}), tmp / "data" / "texts.parquet", row_group_size=256)
        transform = f"msdata_server.transforms:hf_tokenizer({str(tmp / 'tokenizer.json')!r}, eos=1)"
        prefix = "msdtk" + os.urandom(3).hex()
        ntok = 0
        for _ in range(rounds):
            lib = library(tmp / "tokenizer.json", texts)
            res["library"].append(lib["batch"])
            res["library_cpu"].append(lib["cpu"])
            res["library_single"].append(lib["single"])
            ntok = lib["tokens"]
            for w in (1, 2):
                r = asyncio.run(pooled(transform, tmp / "data", w, docs, prefix))
                if r["tokens"] != ntok + docs:  # every document's tokens and its eos
                    raise RuntimeError(f"the pool made {r['tokens']} tokens, the library {ntok} + {docs} eos")
                res[f"w{w}"].append(r["tokens_per_s"])
                res[f"w{w}_cpu"].append(r["tokens_per_cpu_s"])
    med = {k: statistics.median(v) for k, v in res.items()}
    load = os.getloadavg()[0]
    say(
        f"{docs} documents, {ntok} tokens ({ntok / docs:.0f} a document), BPE vocab {vocab} trained in "
        f"{trained:.1f}s; {rounds} rounds, arms alternating; load {load:.2f} on {os.cpu_count()} cores"
    )
    say(f"{'arm':<34}{'Mtok/s (median)':>16}  rounds")
    rows = (
        ("library encode_batch, 1 thread", "library"),
        ("library encode_batch, per CPU s", "library_cpu"),
        ("library encode, record by record", "library_single"),
        ("pool, 1 worker", "w1"),
        ("pool, 2 workers", "w2"),
        ("pool, 1 worker, per worker-CPU s", "w1_cpu"),
        ("pool, 2 workers, per worker-CPU s", "w2_cpu"),
    )
    for label, k in rows:
        say(f"{label:<34}{med[k] / 1e6:>16.3f}  {' '.join(f'{x / 1e6:.3f}' for x in res[k])}")
    eff, scaling = med["w1"] / med["library"], med["w2"] / med["w1"]
    eff_cpu = med["w1_cpu"] / med["library_cpu"]
    say(
        f"tokenize_efficiency (pool w1 / library, tokens/s) {eff:.2f}; per CPU second {eff_cpu:.2f}; "
        f"pool scaling 1 -> 2 workers {scaling:.2f}x"
    )
    say(
        json.dumps(
            {
                "bench": "tokenize",
                "docs": docs,
                "tokens": ntok,
                "rounds": rounds,
                "tokenize_efficiency": round(eff, 3),
                "tokenize_efficiency_cpu": round(eff_cpu, 3),
                "tokens_per_s_library": round(med["library"]),
                "tokens_per_cpu_s_library": round(med["library_cpu"]),
                "tokens_per_s_library_single": round(med["library_single"]),
                "tokens_per_s_pool_w1": round(med["w1"]),
                "tokens_per_s_pool_w2": round(med["w2"]),
                "tokens_per_s_per_core": round(med["w1_cpu"]),
                "tokens_per_s_per_core_w2": round(med["w2_cpu"]),
                "pool_scaling_1_2": round(scaling, 3),
                "load_avg": round(load, 2),
                "cores": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
