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
    assert isinstance(port, int) and port > 0
    spec = small_job("metrics", dp=2, samples=300, prefetch=1)
    n = spec.micro_batches * 6
    go = threading.Event()
    ranks = threading.Thread(target=run_ranks, args=(spec, srv.socket, n), kwargs={"pause": (n // 2, go)},
                             daemon=True)
    ranks.start()
    job = (("job", "metrics"),)

    def published(m) -> float:
        return sum(v for (name, lab), v in m.items() if name == "msdata_job_micro_batches_published_total"
                   and lab == job)

    deadline = time.monotonic() + 60
    while (first := scrape(port)) and published(first) < n // 2 * 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the endpoint under test until the ranks reach their pause
    go.set()
    ranks.join(60)
    assert published(first) >= n // 2 * 2, sorted(k for k in first if k[0].startswith("msdata_job"))
    src = [v for (name, lab), v in first.items()
           if name == "msdata_source_samples_total" and dict(lab).get("job") == "metrics"]
    assert src and all(v > 0 for v in src)
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
