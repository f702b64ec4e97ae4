"""bench/train_e2e.py: per-document attention is each document alone; the placements it times are sound."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("train_e2e", ROOT / "bench" / "train_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_doc_attention_is_each_document_alone(e2e):
    g = torch.Generator().manual_seed(0)
    lens, tail = [5, 1, 17, 9], 4
    q, k, v = (torch.randn(sum(lens) + tail, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32)
    out = e2e.doc_attention(q, k, v, cu)
    a = 0
    for n in lens:
        alone = F.scaled_dot_product_attention(*(x[a : a + n].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True)
        torch.testing.assert_close(out[a : a + n], alone[0].transpose(0, 1), rtol=1e-12, atol=1e-12)
        a += n
    assert out[a:].abs().max() == 0  # tokens past the last segment (padding) attend to nothing


def test_tiny_model_on_a_packed_row_equals_each_document_alone(e2e):
    from msdata_client.calibration import packed_batch

    torch.manual_seed(0)
    model = e2e.TinyLM(d_model=16, heads=2, head_dim=8, layers=2, max_len=64).double()
    lens = [7, 20, 3, 11]
    batch = packed_batch(lens, 48, generator=torch.Generator().manual_seed(1))
    cu = e2e.real_segments(batch)
    assert cu.tolist() == [0, 7, 27, 30, 41]  # the padding tail is dropped
    packed = model(batch["tokens"], batch["position_ids"], cu)
    a = 0
    for n in lens:
        tok, pos = batch["tokens"][:, a : a + n], batch["position_ids"][:, a : a + n]
        alone = model(tok, pos, torch.tensor([0, n], dtype=torch.int32))
        torch.testing.assert_close(packed[a : a + n], alone, rtol=1e-10, atol=1e-10)
        a += n


def test_step_is_forward_and_backward(e2e):
    from msdata_client.calibration import packed_batch

    torch.manual_seed(0)
    model = e2e.TinyLM(d_model=16, heads=1, head_dim=8, layers=1, max_len=64)
    loss = e2e.make_step(model)(packed_batch([30, 20], 64, generator=torch.Generator().manual_seed(0)))
    assert math.isfinite(loss)
    assert loss > 0
    assert all(p.grad is not None for p in model.parameters())


def test_placements_hold_the_same_kind_of_steps(e2e):
    seq_len, dp = 2048, 4
    for placed, tokens in e2e.arrival_steps(seq_len, dp, 2, 0) + e2e.planner_steps(seq_len, dp, 2, 0, 1e-9, 1e-5, 1e-5):
        assert len(placed) == dp
        assert all(len(rank) == e2e.MICRO for rank in placed)
        assert all(sum(mb) <= seq_len for rank in placed for mb in rank)
        assert tokens == sum(sum(mb) for rank in placed for mb in rank)
        assert tokens > 0.5 * dp * e2e.MICRO * seq_len


def test_timed_ranks_takes_the_predicted_slowest_and_a_sample(e2e):
    pred = np.arange(64, dtype=np.float64)
    rng = np.random.default_rng(0)
    assert e2e.timed_ranks(pred[:8], 8, 8, 2, 2, rng) == list(range(8))
    got = e2e.timed_ranks(pred, 64, 8, 2, 3, rng)
    assert len(got) == 5
    assert {63, 62} <= set(got)
    assert got == sorted(got)
