"""Bring your own tokenizer: a tiny BPE trained here (nothing downloaded), a job that names it by a relative
path, the pad_id it implies, validate and data_roots, and a real server tokenizing with it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import msdata_client as msd
from msdata_client.tokenizer import pad_warning, resolve_tokenizer, tokenizer_pad, tokenizer_path
from msdata_server.admission import check_paths

tk = pytest.importorskip("tokenizers")

TEXTS = ["the quick brown fox jumps", "over the lazy dog", "pack my box with five dozen jugs"] * 4


def train_bpe(path, *, pad: bool) -> tk.Tokenizer:
    """A BPE tokenizer of a few hundred tokens trained on TEXTS, with <eos> (and <pad> when asked)."""
    tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = ["<unk>", "<eos>"] + (["<pad>"] if pad else [])
    trainer = tk.trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS, trainer)
    tok.save(str(path))
    return tok


def write_job(tmp_path, transform: str, extra: str = ""):
    (tmp_path / "data").mkdir(exist_ok=True)
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "data" / "x.parquet")
    p = tmp_path / "job.toml"
    p.write_text(
        textwrap.dedent(f"""\
        [job]
        name = "tok"
        seq_len = 64
        {extra}
        [mesh]
        dp = 1
        [[source]]
        name = "web"
        format = "parquet"
        paths = ["data/"]
        transform = "{transform}"
        [mix]
        weights = {{ web = 1.0 }}
        """)
    )
    return p


def cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run(
        [sys.executable, "-m", "msdata_server", *args], capture_output=True, text=True, cwd=cwd, timeout=120, env=env
    )


def test_relative_tokenizer_path_resolves_against_the_job_file(tmp_path, monkeypatch):
    (tmp_path / "tok").mkdir()
    train_bpe(tmp_path / "tok" / "tokenizer.json", pad=True)
    job = write_job(tmp_path, "msdata_server.transforms:hf_tokenizer('tok/tokenizer.json', eos=1)")
    monkeypatch.chdir("/")  # the process that reads the job (a server, a trainer) runs elsewhere
    spec = msd.DGraph.from_toml(job).spec
    assert tokenizer_path(spec.sources[0].transform) == str(tmp_path / "tok" / "tokenizer.json")
    assert spec.sources[0].transform.endswith(", eos=1)")  # the other arguments as written
    # vlm(tokenizer=...) too; absolute paths and other transforms are left exactly as written
    vlm = "msdata_server.transforms:vlm(patch=14, tokenizer='t.json')"
    assert resolve_tokenizer(vlm, "/base") == "msdata_server.transforms:vlm(patch=14, tokenizer='/base/t.json')"
    for same in ("msdata_server.transforms:hf_tokenizer('/abs/t.json')", "msdata_server.transforms:byte_tokens"):
        assert resolve_tokenizer(same, "/base") == same


def test_pad_id_is_the_tokenizers_pad_token_else_257_with_a_warning(tmp_path):
    with_pad = train_bpe(tmp_path / "p.json", pad=True)
    train_bpe(tmp_path / "n.json", pad=False)
    assert tokenizer_pad(str(tmp_path / "p.json"))[0] == with_pad.token_to_id("<pad>")
    t = "msdata_server.transforms:hf_tokenizer('{}')"
    spec = msd.DGraph.from_toml(write_job(tmp_path, t.format("p.json"))).spec
    assert spec.pad_id == with_pad.token_to_id("<pad>")
    assert msd.DGraph.from_dict(spec.to_dict()).spec.pad_id == spec.pad_id  # round trip: now explicit
    spec = msd.DGraph.from_toml(write_job(tmp_path, t.format("n.json"))).spec
    assert spec.pad_id == 257
    warning = pad_warning(spec.pad_id, [s.transform for s in spec.sources])
    assert warning is not None
    assert "pad_id=257" in warning
    assert "no pad token" in warning
    spec = msd.DGraph.from_toml(write_job(tmp_path, t.format("n.json"), "pad_id = 5000")).spec
    assert spec.pad_id == 5000
    assert pad_warning(5000, [s.transform for s in spec.sources]) is None
    # byte tokens: 257 as before, nothing to warn about
    spec = msd.DGraph.from_toml(write_job(tmp_path, "msdata_server.transforms:byte_tokens")).spec
    assert spec.pad_id == 257
    assert pad_warning(257, [s.transform for s in spec.sources]) is None


def test_validate_loads_the_tokenizer_and_warns_about_pad_id(tmp_path):
    node = tmp_path / "node.toml"
    node.write_text(f'[node]\nid = "n1"\nsocket = "{tmp_path}/s.sock"\n')
    job = write_job(tmp_path, "msdata_server.transforms:hf_tokenizer('missing.json')")
    out = cli("validate", "--config", str(node), "--job", str(job), cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "web" in out.stderr
    assert "missing.json" in out.stderr
    assert "Traceback" not in out.stderr
    train_bpe(tmp_path / "n.json", pad=False)
    job = write_job(tmp_path, "msdata_server.transforms:hf_tokenizer('n.json')")
    out = cli("validate", "--config", str(node), "--job", str(job), cwd="/")
    assert out.returncode == 0, out.stderr
    assert "warning: pad_id=257 is a token of the tokenizer" in out.stdout


def test_tokenizer_outside_data_roots_is_refused(tmp_path):
    (tmp_path / "roots").mkdir()
    train_bpe(tmp_path / "t.json", pad=True)
    spec = msd.DGraph.from_toml(
        write_job(tmp_path / "roots", f"msdata_server.transforms:hf_tokenizer('{tmp_path}/t.json')")
    ).spec
    with pytest.raises(msd.ConfigError, match=r"tokenizer file .* lies outside \[node\] data_roots"):
        check_paths(spec, (str(tmp_path / "roots"),))
    check_paths(spec, (str(tmp_path),))


def test_a_server_tokenizes_with_a_relative_tokenizer(server_factory, tmp_path, monkeypatch):
    tok = train_bpe(tmp_path / "tokenizer.json", pad=True)
    eos = tok.token_to_id("<eos>")
    job = write_job(tmp_path, f"msdata_server.transforms:hf_tokenizer('tokenizer.json', eos={eos})")
    srv = server_factory().start()  # its working directory is not tmp_path
    spec = msd.DGraph.from_toml(job)
    want = {tuple([*tok.encode(t).ids, eos]) for t in TEXTS}
    with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1) as dc:
        b = next(dc)
        tokens, cu, counts = b["tokens"].flatten().tolist(), b["cu_seqlens"].tolist(), b["doc_counts"].tolist()
        docs = [tuple(tokens[cu[i] : cu[i + 1]]) for i in range(counts[0])]
    assert docs
    assert all(d in want for d in docs if d[-1] == eos)
    assert tokens[cu[counts[0]] :] == [spec.spec.pad_id] * (len(tokens) - cu[counts[0]])
