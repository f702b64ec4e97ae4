"""Two renderings of one status dict: the Prometheus exporter (scraped over real HTTP and parsed) and the
`status --watch` screen."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import io
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from msdata_server.errors import ConfigError
from msdata_server.ops.memory import cpu_seconds, tree_memory, tree_pids
from msdata_server.ops.prometheus import METRICS, families, start_metrics_server
from msdata_server.ops.watch import CLEAR, render, watch

from .polling import wait_for
from .status_sample import SAMPLE

NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def _scrape(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers["Content-Type"], e.read().decode()


def _values(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_scrape_over_http_parses_with_the_status_values(arun):
    calls = []

    def status() -> dict:
        calls.append(1)
        return SAMPLE

    async def main() -> tuple:
        server, port = await start_metrics_server("127.0.0.1:0", status)
        try:
            assert calls == []  # registering does not call status()
            first = await asyncio.to_thread(_scrape, port)
            second = await asyncio.to_thread(_scrape, port)
            missing = await asyncio.to_thread(_scrape, port, "/")
        finally:
            server.close()
            await server.wait_closed()
        with pytest.raises(ConnectionRefusedError):  # closed: nobody listens any more
            await asyncio.open_connection("127.0.0.1", port)
        return first, second, missing

    first, second, missing = arun(main())
    assert len(calls) == 2  # once per scrape, nothing cached
    code, ctype, text = first
    assert code == 200
    assert ctype.startswith("text/plain")
    assert "version=" in ctype
    assert second[0] == 200
    assert missing[0] == 404
    v = _values(text)
    web, rank1, g0 = (
        (("job", "pretrain"), ("source", "web")),
        (("job", "pretrain"), ("rank", "1")),
        (("group", "0"), ("job", "pretrain")),
    )
    assert v[("msdata_source_samples_done_total", web)] == 50_000
    assert v[("msdata_source_tokens_read_total", web)] == 4_500_000
    assert v[("msdata_source_read_bytes_total", web)] == 350_000
    assert v[("msdata_source_bad_samples_total", (*web[:1], ("kind", "decode"), web[1]))] == 3
    assert v[("msdata_source_held_payloads", web)] == 40
    assert v[("msdata_source_readahead_fill_ratio", web)] == 0.625
    assert v[("msdata_source_workers", web)] == 3
    assert v[("msdata_job_steps_planned_total", (("job", "pretrain"),))] == 1200
    assert v[("msdata_job_plan_seconds_total", (("job", "pretrain"),))] == pytest.approx(3.0)
    assert v[("msdata_job_tokens_planned_total", (("job", "pretrain"), ("source", "code")))] == 3_000_000
    assert v[("msdata_job_tokens_delivered_total", web)] == 8_998_000
    assert v[("msdata_job_bad_samples_total", web)] == 4
    assert v[("msdata_job_mixture_target_ratio", web)] == 0.75
    assert v[("msdata_job_epoch_progress_ratio", web)] == 0.25
    assert v[("msdata_rank_wait_seconds_total", rank1)] == 4.25
    assert v[("msdata_rank_micro_batches_delivered_total", rank1)] == 1200
    assert v[("msdata_ring_slots_in_use", g0)] == 5  # two rings of group 0 summed: one series per group
    assert v[("msdata_role", (("role", "leader"),))] == 1
    assert v[("msdata_role", (("role", "single"),))] == 0
    assert v[("msdata_cluster_peer_sent_bytes_total", ())] == 654321
    assert v[("msdata_memory_total_pss_bytes", ())] == 812 << 20
    assert v[("msdata_autoscale_supply_samples_per_second", (("source", "web"),))] == 950.0
    assert v[("msdata_storage_throttled_total", ())] == 37
    assert v[("msdata_storage_latency_p99_seconds", ())] == 0.088


def test_names_types_and_label_sets_follow_the_conventions(arun):
    async def main() -> str:
        server, port = await start_metrics_server("127.0.0.1:0", lambda: SAMPLE)
        try:
            return (await asyncio.to_thread(_scrape, port))[2]
        finally:
            server.close()
            await server.wait_closed()

    fams = list(text_string_to_metric_families(arun(main())))
    assert {f.name for f in fams} == {n.removesuffix("_total") for n in METRICS}
    for f in fams:
        assert f.name.startswith("msdata_"), f.name
        assert NAME.match(f.name), f.name
        if f.type == "counter":
            assert all(s.name == f.name + "_total" for s in f.samples), f.name
        else:
            assert not f.name.endswith("_total"), f.name
        keys = [tuple(sorted(s.labels.items())) for s in f.samples]
        assert len(keys) == len(set(keys)), f"{f.name} repeats a series"
        if "job" in (METRICS.get(f.name) or METRICS[f.name + "_total"])[2]:
            assert all(s.labels["job"] == "pretrain" for s in f.samples)


def test_each_scrape_reflects_the_status_of_that_moment():
    st = copy.deepcopy(SAMPLE)
    before = {f.name: f for f in families(st)}
    st["jobs"][0]["sources"]["web"]["samples_done"] += 7
    after = {f.name: f for f in families(st)}

    def pick(fams: dict) -> float:
        return next(s.value for s in fams["msdata_source_samples_done"].samples if s.labels["source"] == "web")

    assert pick(after) - pick(before) == 7


def test_a_partial_status_and_a_failing_status_do_not_break_the_exporter(arun):
    assert families({"node": "n", "role": "single", "jobs": []})  # no cluster, no autoscale, no jobs

    def broken() -> dict:
        raise RuntimeError("status is broken")

    async def main() -> int:
        server, port = await start_metrics_server("127.0.0.1:0", broken)
        try:
            return (await asyncio.to_thread(_scrape, port))[0]
        finally:
            server.close()
            await server.wait_closed()

    assert arun(main()) == 500


@pytest.mark.parametrize("addr", ["9460", "nohost:9460", "127.0.0.1:99999", ""])
def test_a_bad_metrics_address_is_a_config_error(addr, arun):
    with pytest.raises(ConfigError, match="metrics"):
        arun(start_metrics_server(addr, lambda: SAMPLE))


def test_a_port_in_use_is_a_config_error(arun):
    async def main() -> None:
        server, port = await start_metrics_server("127.0.0.1:0", lambda: SAMPLE)
        try:
            with pytest.raises(ConfigError, match=rf"metrics = '127\.0\.0\.1:{port}' cannot be served.*free port"):
                await start_metrics_server(f"127.0.0.1:{port}", lambda: SAMPLE)
        finally:
            server.close()
            await server.wait_closed()

    arun(main())


# ---- the watch screen ---------------------------------------------------------------------------------------
def _many_ranks() -> dict:
    st = copy.deepcopy(SAMPLE)
    job = st["jobs"][0]
    job["name"] = "a-job-name-that-is-far-too-long-to-fit-in-one-line-of-eighty-columns-of-text"
    job["error"] = "source 'web': file /data/web/part-00017.parquet is truncated " * 3
    job["ranks_detail"] = {str(r): {**job["ranks_detail"]["0"], "wait_frac": r / 100} for r in range(40)}
    job["sources"]["a-source-name-longer-than-its-column"] = job["sources"]["web"]
    return st


def _two_stage() -> dict:
    """A job with the two-stage cost (cost = "vlm"): the status has each stage's imbalance."""
    st = copy.deepcopy(SAMPLE)
    job = st["jobs"][0]
    job.update(encoder_imbalance=1.02134, backbone_imbalance=1.00809)
    job["last_step"].update(encoder_imbalance=1.0304, backbone_imbalance=1.0101)
    return st


@pytest.mark.parametrize("width", [80, 60])
def test_render_fits_the_width_and_shows_the_figures(width):
    for st in (SAMPLE, _many_ranks(), _two_stage()):
        screen = render(st, width)
        assert all(len(line) <= width for line in screen.splitlines()), screen
    screen = render(SAMPLE)
    assert "…" not in screen  # the sample needs no clipping at 80 columns
    assert "pretrain [running]" in screen
    assert "node-0  leader" in screen
    assert "storage 5120 req  3.0 GiB  retries 41  throttled 37  errors 0" in screen, screen
    assert "sources 2.2 MiB (read-ahead 2.0 MiB, handles 93.8 KiB)  open files 4/256" in screen, screen
    assert "latency p50 21.5 ms  p99 88.0 ms  cache 900 hit / 100 miss" in screen, screen
    assert re.search(r"^\s+1\s+299\s+1200\s+4\.25s\s+1\.1ms\s+15\.0ms\s+1\.2%$", screen, re.MULTILINE), screen
    assert re.search(r"^  web\s+812\.5\s+341\.8 KiB\s+40/96\s+0\.62\s+4\s+1$", screen, re.MULTILINE), screen
    assert "g0 5/8" not in screen
    assert "g0 5/16" in screen
    assert "g1 1/8" in screen
    assert "… 24 more ranks; most waiting: rank 39 39.0%" in render(_many_ranks())
    assert render({"node": "n", "role": "single", "jobs": []}).endswith("no jobs")


def test_render_shows_the_stage_imbalances_of_a_two_stage_job():
    screen = render(_two_stage())
    assert "…" not in screen
    assert all(len(line) <= 80 for line in screen.splitlines())
    lines = screen.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("job pretrain"))
    assert lines[at + 2] == "  stage imbalance: encoder 1.021  backbone 1.008  (last step 1.030 / 1.010)"
    # a one-stage job: the keys absent (older servers) or None (job/status.py) -> no line
    assert "stage imbalance" not in render(SAMPLE)
    one = copy.deepcopy(SAMPLE)
    one["jobs"][0].update(encoder_imbalance=None, backbone_imbalance=None)
    one["jobs"][0]["last_step"].update(encoder_imbalance=None, backbone_imbalance=None)
    assert "stage imbalance" not in render(one)
    # before a step is planned the status has the means only
    early = _two_stage()
    early["jobs"][0]["last_step"] = None
    assert "  stage imbalance: encoder 1.021  backbone 1.008\n" in render(early)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_watch_redraws_and_clears_only_a_terminal():
    piped, tty = io.StringIO(), _Tty()
    assert watch("/nowhere.sock", 0.01, iterations=2, stream=piped, fetch=lambda: SAMPLE) == 0
    assert CLEAR not in piped.getvalue()
    assert piped.getvalue().count("pretrain [running]") == 2
    watch("/nowhere.sock", 0.01, iterations=1, stream=tty, fetch=lambda: SAMPLE)
    assert tty.getvalue().startswith(CLEAR)

    def down() -> dict:
        raise ConnectionRefusedError(111, "Connection refused")

    out = io.StringIO()
    watch("/nowhere.sock", 0.01, iterations=1, stream=out, fetch=down)
    assert "no server at '/nowhere.sock'" in out.getvalue()


def test_a_process_tree_its_memory_and_cpu_from_proc():
    """tree_pids finds a child and its grandchild; cpu_seconds counts what the tree burnt; tree_memory sums PSS
    (the figures `status` and the benchmarks report)."""
    burn = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\nsys.stdin.read()"
    grand = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {burn!r}]).wait()"
    child = subprocess.Popen([sys.executable, "-c", grand], stdin=subprocess.PIPE, stdout=None)
    try:
        pids = wait_for(lambda: len(t := tree_pids(child.pid)) == 2 and t, 30, "the child and its grandchild")
        assert pids[0] == child.pid
        wait_for(lambda: cpu_seconds(pids) >= 0.25, 30, "the grandchild's 0.3 s of CPU")
        mem = tree_memory(pids)
        assert mem["pss"] > 0
        assert mem["uss"] <= mem["pss"] <= mem["rss"]
        assert cpu_seconds([2**22 + 12345]) == 0  # gone (or never there): nothing
    finally:
        for p in reversed(tree_pids(child.pid)):
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        child.wait()
        child.stdin.close()
