"""Operations wired into a real server: /metrics scraped while a job runs, systemd notify messages in order."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from .e2e_util import run_ranks, small_job


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_metrics_of_a_running_job_move(server_factory):
    srv = server_factory(extra='metrics = "127.0.0.1:0"\n').start()
    port = srv.ready["metrics"]
    assert isinstance(port, int)
    assert port > 0
    spec = small_job("metrics", dp=2, samples=300, prefetch=1)
    n = spec.micro_batches * 6
    go = threading.Event()
    ranks = threading.Thread(target=run_ranks, args=(spec, srv.socket, n), kwargs={"pause": (n // 2, go)}, daemon=True)
    ranks.start()
    job = (("job", "metrics"),)

    def published(m) -> float:
        return sum(
            v for (name, lab), v in m.items() if name == "msdata_job_micro_batches_published_total" and lab == job
        )

    deadline = time.monotonic() + 60
    while (first := scrape(port)) and published(first) < n // 2 * 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the endpoint under test until the ranks reach their pause
    go.set()
    ranks.join(60)
    assert published(first) >= n // 2 * 2, sorted(k for k in first if k[0].startswith("msdata_job"))
    src = [
        v
        for (name, lab), v in first.items()
        if name == "msdata_source_samples_done_total" and dict(lab).get("job") == "metrics"
    ]
    assert src
    assert all(v > 0 for v in src)
    assert any(name.startswith("msdata_job_steps") for name, _ in first)


def test_systemd_ready_and_stopping_reach_the_notify_socket(server_factory, sockdir, monkeypatch):
    path = os.path.join(sockdir, "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # 0.2 s: pings every 0.1 s from the loop
    try:
        srv = server_factory().start()
        msgs = [sock.recv(4096).decode() for _ in range(3)]
        assert msgs[0].startswith("READY=1"), msgs
        assert any(m.startswith("WATCHDOG=1") for m in msgs[1:]), msgs
        assert srv.stop() == 0
        rest = []
        while not any(m.startswith("STOPPING=1") for m in rest):
            rest.append(sock.recv(4096).decode())
    finally:
        sock.close()


def test_data_wait_per_rank_is_measured_where_it_happens(server_factory):
    """A rank that computes 30 ms per batch finds its data ready: it waits for the first batch (the job's
    start) and hardly after; the server reports every next() it made and how long each blocked."""
    import msdata_client as msd
    from msdata_client.wire import request

    srv = server_factory().start()
    spec = small_job("waits", dp=1, samples=300)
    n, compute = 24, 0.03
    with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=30) as dc:
        t0 = time.perf_counter()
        for _ in range(n):
            b = next(dc)
            time.sleep(compute)  # the rank's "training step"
            dc.release(b)  # flushes the release, and the waits with it
        wall = time.perf_counter() - t0
        job = request(srv.socket, {"t": "status"})["status"]["jobs"][0]
    fig = job["ranks_detail"]["0"]
    assert fig["delivered"] == n
    assert fig["step"] == n // spec.micro_batches
    assert 0 <= fig["wait_p50_s"] < compute  # data was ready: the median next() did not block for long
    assert fig["wait_s"] < wall - n * compute * 0.9  # waits are what the wall time had beyond computing
    assert fig["wait_frac"] is not None
    assert fig["wait_frac"] < 0.5


def test_status_breaks_down_each_sources_memory_within_the_node_bounds(server_factory, tmp_path):
    """Four JSON Lines sources of 9 files each on a node that keeps 3 files open and 16 samples of read-ahead:
    the same batches as with the defaults; status says what each source holds by kind, and the node's totals."""
    import msdata_client as msd
    from msdata_server.ops.memory import MEMORY_KINDS

    from .e2e_util import status_json

    names = [f"s{i}" for i in range(4)]
    for n in names:
        (tmp_path / n).mkdir()
        for f in range(9):
            text = "".join(f'{{"text": "{n} file {f} line {k} {"y" * (k * 7 % 90)}"}}\n' for k in range(20))
            (tmp_path / n / f"{f}.jsonl").write_text(text)
    g = msd.DGraph("mem", seed=2)
    for n in names:
        g.source(n, "jsonl", [str(tmp_path / n)], column="text", transform="msdata_server.transforms:byte_tokens")
    spec = g.mix(dict.fromkeys(names, 1.0)).pack(256, micro_batches=2, rows=1).mesh(dp=2).plan()
    steps = spec.micro_batches * 5
    plain = server_factory().start()
    want = run_ranks(spec, plain.socket, steps + 1)
    plain.stop()
    srv = server_factory(extra="open_files = 3\nreadahead_samples = 16\n").start()
    go, got = threading.Event(), {}

    def ranks():  # they hold the job open after their batches until the status is taken
        got.update(run_ranks(spec, srv.socket, steps + 1, pause=(steps, go)))

    t = threading.Thread(target=ranks, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = status_json(srv.socket)
        if st["jobs"] and st["jobs"][0].get("micro_batches_published", 0) >= steps * 2:
            break
        time.sleep(0.05)  # polling the status under test until the ranks reach their pause
    go.set()
    t.join(60)
    assert got == want  # the node's bounds change what is held, never what is delivered
    sources = st["jobs"][0]["sources"]
    assert sorted(sources) == names
    for s in sources.values():
        assert set(s["memory"]) == set(MEMORY_KINDS)
        assert s["memory"]["read_ahead"] == s["memory_bytes"]
        assert s["memory"]["metadata"] > 0
        assert s["readahead"] == 8  # 16 / 4 loaders, at least the floor
    mem = st["memory"]
    assert mem["sources"]["total"] == sum(v for s in sources.values() for v in s["memory"].values())
    assert mem["read_ahead_budget"]["samples"] == 16
    assert mem["read_ahead_budget"]["loaders"] == 4
    assert mem["open_files"]["limit"] == 3
    assert mem["open_files"]["open"] <= 3 + len(names)  # the bound, passed over only for sources reading now
    assert mem["open_files"]["evictions"] > 0
