"""The end-of-run summary in a real server's log: one line per run, with the steps the ranks received, the
sources' tokens and delivered mixture; the same figures as JSON fields under ``log_format = "json"``."""

from __future__ import annotations

import re

import orjson

import msdata_client as msd
from msdata_server.job.summary import run_summary, summary_text

from .e2e_util import run_ranks, small_job
from .polling import wait_for

STEPS = 5


def test_a_run_that_ends_leaves_its_summary_in_the_log(server_factory):
    srv = server_factory().start()
    spec = small_job("summed", dp=2, samples=300)
    run_ranks(spec, srv.socket, spec.micro_batches * STEPS)
    line = wait_for(
        lambda: next((x for x in srv.log().splitlines() if "job summed run ended" in x), None),
        30,
        "the end-of-run summary",
        log=srv.log,
    )
    assert "(every rank left)" in line
    assert re.search(rf"\b{STEPS} steps delivered \({2 * spec.micro_batches * STEPS} micro-batches", line), line
    for name in ("a", "b"):
        assert re.search(rf"; {name}: \d+ tokens, \d+\.\d% of the tokens \(target \d+\.\d%\), 0 bad", line), line
    assert "imbalance 1." in line


def test_a_server_that_drains_logs_the_summary_of_each_running_job(server_factory):
    srv = server_factory().start()
    spec = small_job("drained", dp=1, samples=300)
    dc = msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=1)
    try:
        for _ in range(spec.micro_batches * 3):
            dc.release(next(dc))  # flushes the waits: the server counts what this rank received
        assert srv.stop() == 0
    finally:
        dc.close()
    line = next((x for x in srv.log().splitlines() if "job drained run ended" in x), None)
    assert line is not None, srv.log()[-3000:]
    assert "(the server is shutting down): 3 steps delivered" in line, line


def test_json_logs_carry_the_summary_as_fields(server_factory):
    srv = server_factory(extra='log_format = "json"\n').start()
    spec = small_job("summedjson", dp=1, samples=300)
    run_ranks(spec, srv.socket, spec.micro_batches * STEPS)

    def summary() -> dict | None:
        docs = [orjson.loads(x) for x in srv.log().splitlines() if x.startswith("{")]
        return next((d for d in docs if "run_summary" in d.get("fields", {})), None)

    doc = wait_for(summary, 30, "the end-of-run summary as JSON", log=srv.log)
    s = doc["fields"]["run_summary"]
    assert doc["level"] == "INFO"
    assert doc["message"].startswith("job summedjson run ended")
    assert s["job"] == "summedjson"
    assert s["steps_delivered"] == STEPS
    assert s["micro_batches_delivered"] == spec.micro_batches * STEPS
    assert sorted(s["sources"]) == ["a", "b"]
    assert all(f["tokens_delivered"] > 0 for f in s["sources"].values())
    assert abs(sum(f["delivered"] for f in s["sources"].values()) - 1) < 1e-3
    assert s["sources"]["a"]["target"] == 0.4
    assert s["wall_s"] > 0


def test_bad_samples_are_summed_with_their_dominant_reason():
    status = {
        "name": "j",
        "steps_planned": 9,
        "imbalance": 1.0421,
        "ranks_detail": {"0": {"micro_batches_delivered": 16}, "1": {"micro_batches_delivered": 12}},
        "accounting": {"web": {"tokens_delivered": 700}, "code": {"tokens_delivered": 300}},
        "mixture": {"web": {"delivered": 0.7, "target": 0.75}, "code": {"delivered": 0.3, "target": 0.25}},
        "sources": {"web": {"bad_samples": {"decode_error": 3, "oversize": 1}}, "code": {"bad_samples": {}}},
    }
    s = run_summary(status, why="failed: x", wall_s=2.0, micro_batches=4)
    assert s["steps_delivered"] == 4  # the furthest rank: 16 micro-batches of 4 per step
    assert s["sources"]["web"]["bad_samples"] == 4
    assert s["sources"]["web"]["bad_reason"] == "decode_error"
    text = summary_text(s)
    assert "web: 700 tokens, 70.0% of the tokens (target 75.0%), 4 bad (mostly decode_error)" in text
    assert "code: 300 tokens, 30.0% of the tokens (target 25.0%), 0 bad;" not in text
    assert text.endswith("code: 300 tokens, 30.0% of the tokens (target 25.0%), 0 bad")
    assert "imbalance 1.042" in text
