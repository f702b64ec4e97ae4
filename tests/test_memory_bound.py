"""Held payloads stay bounded over thousands of steps (the server's memory growth, issue 16).

Documents much longer than seq_len are split into pieces that the planner may spread over several steps.
Before the fix a payload was freed when the pieces of one step were built, its carried pieces then re-read
its whole read-ahead batch, and that batch's other samples were held for ever: about 1.8 KiB per step. The
loader's invariant (``held <= held_bound``: the read-ahead plus what planned-but-unbuilt pieces pin) is
read from ``status`` at every sample, and the bound itself must not grow with the step count.
"""

from __future__ import annotations

import threading

import pytest

import msdata_client as msd
from msdata_client.wire import request

from .polling import wait_for

STEPS = 1500
SAMPLE_EVERY = 100  # steps between two reads of the status


def long_doc_job(long_docs: str, *, tp: int = 2) -> msd.JobSpec:
    g = msd.DGraph(f"long-{long_docs}", seed=3)
    # web/code reach 16x seq_len (up to 16 pieces); chat stays short
    g.source("chat", "synthetic", samples=30000, median=40.0, sigma=0.8, min_len=4, max_len=256)
    g.source("web", "synthetic", samples=30000, median=150.0, sigma=1.0, min_len=4, max_len=2048)
    g.source("code", "synthetic", samples=30000, median=300.0, sigma=1.0, min_len=4, max_len=2048)
    g.mix({"chat": 0.3, "web": 0.5, "code": 0.2}).pack(128, rows=1, micro_batches=3, long_docs=long_docs)
    g.balance("karmarkar_karp")
    g.mesh(dp=2, tp=tp).prefetch(2)
    return g.plan()


def run_and_sample(spec: msd.JobSpec, endpoint: str, steps: int, node_endpoints: list[str]) -> list[dict]:
    """Every rank iterates ``steps`` steps; rank 0 reads each node's per-source figures every SAMPLE_EVERY."""
    micro = spec.micro_batches
    samples: list[dict] = []
    errors: list[BaseException] = []
    eps = endpoint if isinstance(endpoint, list) else [endpoint] * spec.mesh.world_size

    def body(r: int) -> None:
        try:
            with msd.DataClient(
                spec, endpoint=eps[r], rank=r, world_size=spec.mesh.world_size, connect_timeout=30
            ) as dc:
                for i in range(steps * micro):
                    b = next(dc)
                    del b
                    if r == 0 and i % (SAMPLE_EVERY * micro) == 0 and i:
                        for ep in node_endpoints:
                            st = request(ep, {"t": "status"})["status"]
                            for job in st["jobs"]:
                                if job["name"] == spec.name:
                                    samples.append({"node": st["node"], "step": i // micro, "sources": job["sources"]})
        except BaseException as e:  # reported to the test
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(spec.mesh.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
        assert not t.is_alive(), "a rank thread hung"
    if errors:
        raise errors[0]
    return samples


def check_bounded(samples: list[dict], steps: int, nodes: int = 1) -> None:
    assert len(samples) >= nodes * (steps // SAMPLE_EVERY - 1)
    for smp in samples:
        for name, src in smp["sources"].items():
            assert src["held"] <= src["held_bound"], (
                f"step {smp['step']} node {smp['node']}: source {name} holds {src['held']} payloads, more than "
                f"its bound {src['held_bound']} (read-ahead + {src['held_pinned']} pinned)"
            )
    # the bound does not drift: late samples pin no more than a step's worth above the early ones
    for node in {s["node"] for s in samples}:
        mine = [s for s in samples if s["node"] == node]
        half = len(mine) // 2
        for name in mine[0]["sources"]:
            early = max(s["sources"][name]["held_bound"] for s in mine[:half])
            late = max(s["sources"][name]["held_bound"] for s in mine[half:])
            assert late <= 2 * early + 64, f"node {node} source {name}: bound grew from {early} to {late}"


@pytest.mark.slow
@pytest.mark.parametrize("long_docs", ["split", "truncate"])
def test_held_payloads_bounded_one_node(server_factory, long_docs):
    srv = server_factory().start()
    spec = long_doc_job(long_docs)
    samples = run_and_sample(spec, srv.socket, STEPS, [srv.socket])
    check_bounded(samples, STEPS)
    # the job's own figures: every source read far more than it holds
    last = samples[-1]["sources"]
    assert last["web"]["samples_done"] > 10 * last["web"]["held"]


@pytest.mark.slow
def test_held_payloads_bounded_three_nodes(etcd_server, cluster_factory):
    """The same on three nodes: each owner holds payloads of its partitions only for the plans that need
    them; TP pairs span nodes (rank r on node r % 3), so payloads cross the peer links."""
    c = cluster_factory(etcd_server.url).start()
    wait_for(lambda: c.settled(set(c.nodes)), 30, "one leader that every node agrees on")
    spec = long_doc_job("split")
    socks = [c.nodes[f"node-{i}"].socket for i in range(3)]
    steps = 600
    samples = run_and_sample(spec, [socks[r % 3] for r in range(spec.mesh.world_size)], steps, socks)
    check_bounded(samples, steps, nodes=3)
    # every node owns partitions of every source and holds payloads for them at some point
    for name in ("chat", "web", "code"):
        assert sum(s["sources"][name]["partitions_here"] for s in samples[-3:]) >= 3
