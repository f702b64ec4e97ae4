"""msdata_client.calibrate: recovers a known cost from a step function whose time is known (a fake clock)."""

import subprocess
import sys
import tomllib

import numpy as np
import pytest

import msdata_client as msd
from msdata_client.calibration import Sample, calibrate, fit, packed_batch
from msdata_client.errors import ConfigError
from msdata_client.spec import BalanceSpec

pytest.importorskip("torch")


class FakeClock:
    """A clock that only moves when the fake model "computes": alpha*L^2 + beta*L per document."""

    def __init__(self, alpha, beta, *, noise=None):
        self.t, self.alpha, self.beta, self.noise, self.calls = 100.0, alpha, beta, noise, 0

    def __call__(self):
        return self.t

    def step(self, batch):
        lens = np.diff(batch["cu_seqlens"].numpy()).astype(np.float64)
        self.t += float(self.alpha * (lens * lens).sum() + self.beta * lens.sum())
        if self.noise is not None:  # a busy machine: some runs take longer, none shorter
            self.t += self.noise(self.calls)
        self.calls += 1


def test_recovers_known_alpha_beta():
    clock = FakeClock(3e-9, 2e-5)
    cal = calibrate(clock.step, seq_len=4096, repeats=2, clock=clock)
    assert cal.alpha == pytest.approx(3e-9, rel=1e-6)
    assert cal.beta == pytest.approx(2e-5, rel=1e-6)
    assert cal.r2 == pytest.approx(1.0, abs=1e-9)
    assert cal.seq_len == 4096
    # default lengths: seq_len/64 ... seq_len; one warm-up call, then each length `repeats` times
    assert sorted({s.lengths[0] for s in cal.samples}) == [64, 256, 1024, 2048, 4096]
    assert len(cal.samples) == 10
    assert clock.calls == 11
    assert all(sum(s.lengths) == 4096 for s in cal.samples)  # full rows
    assert cal.predict([4096]) == pytest.approx(3e-9 * 4096**2 + 2e-5 * 4096)


def test_noise_only_adds_time_and_the_fastest_run_wins():
    rng = np.random.default_rng(0)
    spikes = rng.random(64) < 0.3  # about a third of the runs are slowed down, at random
    clock = FakeClock(1e-8, 5e-6, noise=lambda i: 0.5 * float(spikes[i]))
    cal = calibrate(clock.step, lengths=[100, 1000, 3000], seq_len=3000, repeats=4, clock=clock)
    assert cal.alpha == pytest.approx(1e-8, rel=1e-6)
    assert cal.beta == pytest.approx(5e-6, rel=1e-6)


def test_toml_is_a_balance_table_the_job_accepts():
    clock = FakeClock(2.5e-9, 1.25e-5)
    cal = calibrate(clock.step, lengths=[512, 8192], seq_len=8192, repeats=1, clock=clock)
    text = cal.toml()
    table = tomllib.loads(text)["balance"]
    assert table["cost"] == "attention"
    assert table["alpha"] == pytest.approx(2.5e-9, rel=1e-5)
    assert table["beta"] == pytest.approx(1.25e-5, rel=1e-5)
    spec = BalanceSpec.from_dict(table)
    assert spec.alpha == table["alpha"]
    assert spec.beta == table["beta"]
    assert "R^2 1.0000" in text
    assert "beta/alpha = 5000" in text


def test_costs_stay_non_negative():
    # a model whose time does not grow with the square of the length: alpha is 0, never negative
    samples = [Sample(lengths=(n,) * (1024 // n), seconds=1e-5 * 1024 - 1e-12 * n) for n in (16, 256, 1024)]
    cal = fit(samples, seq_len=1024)
    assert cal.alpha == 0.0
    assert cal.beta > 0


def test_bad_arguments_say_what_to_do():
    clock = FakeClock(1e-9, 1e-6)
    with pytest.raises(ConfigError, match="at least two different document lengths"):
        calibrate(clock.step, lengths=[1024], seq_len=1024, clock=clock)
    with pytest.raises(ConfigError, match=r"lengths=\[4096\] must be document lengths in \[1, seq_len=1024\]"):
        calibrate(clock.step, lengths=[4096], seq_len=1024, clock=clock)
    with pytest.raises(ConfigError, match="repeats=0 must be an int >= 1"):
        calibrate(clock.step, seq_len=1024, repeats=0, clock=clock)


def test_packed_batch_follows_the_batch_contract():
    b = packed_batch([3, 2], 8, generator=None)
    assert b["tokens"].shape == (1, 8)
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 8]  # the padding tail is its own segment
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    assert b["loss_mask"].tolist() == [[1, 1, 0, 1, 0, 0, 0, 0]]
    assert b["tokens"][0, 5:].tolist() == [257, 257, 257]
    assert b["labels"][0, :-1].tolist() == b["tokens"][0, 1:].tolist()
    with pytest.raises(ConfigError, match="sum to at most seq_len=4"):
        packed_batch([3, 2], 4)


def test_lazy_export_without_torch_at_import():
    assert msd.calibrate is calibrate
    code = "import sys, msdata_client as m; m.calibrate; m.Calibration; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
