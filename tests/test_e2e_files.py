"""End to end over real files: Parquet, JSON Lines and Arrow sources written here, byte tokens through the
worker pool of a real `msdata-server serve`, two DP ranks; the batches decode back to the documents."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq

import msdata_client as msd

from .e2e_util import status_json

EOS, PAD = 256, 257
SEQ_LEN = 256
ALPHABET = [*"abcdefghijklmnopqrstuvwxyz     .,\n", "é", "ß", "中", "😀"]  # 1- to 4-byte UTF-8


def _texts(rng: np.random.Generator, tag: str, n: int, lo: int, hi: int) -> list[str]:
    """n distinct documents: a unique prefix, then lo..hi random characters (some multi-byte; 60 characters
    are at most 250 bytes, so they fit one row of SEQ_LEN with their EOS)."""
    out = []
    for i in range(n):
        k = int(rng.integers(lo, hi + 1))
        out.append(f"<{tag}:{i}>" + "".join(rng.choice(ALPHABET, size=k).tolist()))
    return out


def _write(root: Path, fmt: str, name: str, files: list[list[str]]) -> tuple[str, dict[int, str]]:
    """Write one source's files (sorted names = file indices); returns its directory and {sample_id: text}."""
    d = root / name
    d.mkdir()
    docs = {}
    for f, texts in enumerate(files):
        if fmt == "parquet":
            pq.write_table(pa.table({"text": texts}), d / f"part-{f}.parquet", row_group_size=8)
        elif fmt == "arrow":
            feather.write_feather(pa.table({"text": texts}), d / f"part-{f}.arrow", chunksize=16)
        else:
            (d / f"part-{f}.jsonl").write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
        docs.update({(f << 32) | r: t for r, t in enumerate(texts)})
    return str(d), docs


def _expected(text: str) -> np.ndarray:
    return np.append(np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64), EOS)


def _pieces(batch) -> list[tuple[int, int, np.ndarray]]:
    """(source_id, sample_id, tokens) of every document piece of a micro-batch, in order of appearance."""
    flat = batch["tokens"].numpy().reshape(-1)
    cu = batch["cu_seqlens"].numpy()
    segs = [flat[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    docs = [s for s in segs if not (s == PAD).all()]  # each row's padding tail is a segment of its own
    sids, srcs = batch["sample_ids"].tolist(), batch["source_ids"].tolist()
    assert len(docs) == len(sids) == len(srcs)
    return [(int(s), int(i), d.copy()) for s, i, d in zip(srcs, sids, docs)]


def _read_steps(spec, endpoint: str, done) -> tuple[list, dict, dict]:
    """Both DP ranks read step by step (round robin, one thread) until done(planner_state) says stop; returns
    every piece, the planner state at the first step not read and the server's status (ranks still there)."""
    world = spec.mesh.world_size
    clients = [
        msd.DataClient(spec, endpoint=endpoint, rank=r, world_size=world, connect_timeout=60) for r in range(world)
    ]
    first: dict[int, list] = {}

    def start(r: int) -> None:  # the job starts when every rank asked for a batch: ask from all at once
        b = next(clients[r])
        first[r] = _pieces(b)

    pieces = []
    try:
        threads = [threading.Thread(target=start, args=(r,), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(first) == world, "the job did not start"
        for step in range(400):
            for r, dc in enumerate(clients):
                for m in range(spec.micro_batches):
                    if step == 0 and m == 0:
                        pieces += first[r]
                        continue
                    b = next(dc)
                    pieces += _pieces(b)
                    del b
            state = clients[0].state_dict()["planner"]
            if done(state):
                return pieces, state, _status(endpoint)
        raise AssertionError("the stop condition never held within 400 steps")
    finally:
        for dc in clients:
            dc.close()


def _epoch_done(s: int, n: int):
    """Source s has given all n documents of its first epoch: its cursor is past them and none is carried."""

    def done(state: dict) -> bool:
        carried = [o for src, o in zip(state["carry"]["source"], state["carry"]["ordinal"]) if src == s]
        return state["cursor"][s] >= n and all(o >= n for o in carried)

    return done


def _check_exactly_once(pieces, s: int, docs: dict[int, str], state: dict) -> None:
    """Every document of source s arrives whole, and exactly once per epoch: the only repeats are documents
    of its second epoch, which the planner state counts (cursor past the first epoch, less what is carried)."""
    assert all(t[-1] == EOS for src, _, t in pieces if src == s)  # short documents: one piece each
    got = Counter(i for src, i, _ in pieces if src == s)
    n = len(docs)
    carried = sum(1 for src in state["carry"]["source"] if src == s)
    second_epoch = state["cursor"][s] - n - carried
    assert set(got) == set(docs)
    assert sum(got.values()) == n + second_epoch
    assert 0 <= second_epoch < n


def _check_whole_documents(pieces, docs_by_source: dict[int, dict[int, str]]) -> int:
    """Concatenating the pieces of each (source, sample id) in offset order gives the document and its EOS;
    returns how many documents came in several pieces."""
    by_doc: dict[tuple[int, int], list[np.ndarray]] = {}
    for s, i, toks in pieces:
        by_doc.setdefault((s, i), []).append(toks)
    split = 0
    for (s, i), parts in by_doc.items():
        want = _expected(docs_by_source[s][i])
        k = -(-len(want) // SEQ_LEN)  # pieces per copy of this document
        assert len(parts) % k == 0, f"source {s} sample {i}: {len(parts)} pieces, not a multiple of {k}"
        placed: dict[int, list[np.ndarray]] = {}
        for p in parts:  # a piece's offset is where its tokens sit in the document (pieces cut at seq_len)
            offs = [o for o in range(0, len(want), SEQ_LEN) if np.array_equal(want[o : o + len(p)], p)]
            assert offs, f"source {s} sample {i}: a piece that is not part of the document"
            placed.setdefault(offs[0], []).append(p)
        for copy in range(len(parts) // k):
            assert np.array_equal(np.concatenate([placed[o][copy] for o in sorted(placed)]), want)
        split += k > 1
    return split


def _job(name: str, sources: list[tuple[str, str, str]], weights: dict[str, float]):
    g = msd.DGraph(name, seed=7)
    for src, fmt, d in sources:
        g.source(src, fmt, [d], column="text", transform="msdata_server.transforms:byte_tokens")
    g.mix(weights).pack(SEQ_LEN, micro_batches=2, rows=2).mesh(dp=2).prefetch(2)
    return g.plan()


_status = status_json  # the one status helper (e2e_util)


def test_three_formats_decode_back_to_their_documents(server_factory, tmp_path):
    rng = np.random.default_rng(3)
    pq_dir, pq_docs = _write(tmp_path, "parquet", "web", [_texts(rng, "w0", 20, 5, 60), _texts(rng, "w1", 17, 5, 60)])
    js_files = [_texts(rng, "c0", 30, 5, 200) + _texts(rng, "L", 3, 300, 700), _texts(rng, "c1", 30, 5, 200)]
    js_dir, js_docs = _write(tmp_path, "jsonl", "code", js_files)  # some documents longer than seq_len
    ar_dir, ar_docs = _write(tmp_path, "arrow", "books", [_texts(rng, "b0", 40, 5, 150)])
    spec = _job(
        "files",
        [("web", "parquet", pq_dir), ("code", "jsonl", js_dir), ("books", "arrow", ar_dir)],
        {"web": 0.3, "code": 0.4, "books": 0.3},
    )
    srv = server_factory(workers=2).start()

    pieces, state, st = _read_steps(spec, srv.socket, _epoch_done(0, len(pq_docs)))

    docs = {0: pq_docs, 1: js_docs, 2: ar_docs}
    assert {s for s, _, _ in pieces} == {0, 1, 2}
    assert _check_whole_documents(pieces, docs) >= 1  # the long JSON Lines documents came in pieces
    _check_exactly_once(pieces, 0, pq_docs, state)  # the small Parquet source: one epoch, each document once
    (job,) = st["jobs"]
    assert set(job["sources"]) == {"web", "code", "books"}
    assert not any(s["bad_samples"] for s in job["sources"].values())


def test_truncated_parquet_file_is_skipped_and_counted(server_factory, tmp_path):
    rng = np.random.default_rng(5)
    files = [_texts(rng, f"g{f}", 24, 5, 60) for f in range(4)]
    pq_dir, pq_docs = _write(tmp_path, "parquet", "web", files)
    bad = Path(pq_dir, "part-2.parquet")
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # cut in the middle: no footer, unreadable
    good = {i: t for i, t in pq_docs.items() if i >> 32 != 2}
    js_dir, js_docs = _write(tmp_path, "jsonl", "code", [_texts(rng, "c", 40, 5, 200)])
    spec = _job("corrupt", [("web", "parquet", pq_dir), ("code", "jsonl", js_dir)], {"web": 0.5, "code": 0.5})
    srv = server_factory(workers=2).start()

    pieces, state, st = _read_steps(spec, srv.socket, _epoch_done(0, len(good)))

    _check_whole_documents(pieces, {0: good, 1: js_docs})  # a piece of the bad file would be a KeyError
    _check_exactly_once(pieces, 0, good, state)
    web = st["jobs"][0]["sources"]["web"]
    assert web["bad_samples"].get("corrupt_file") == 1
    assert "part-2.parquet" in srv.log()  # logged with its path
