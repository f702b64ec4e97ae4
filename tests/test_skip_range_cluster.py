"""``loader.skip(steps=(A, B))`` on three node servers with a real etcd: the leader skips A..B-1 when it gets
there and the batches are those one node delivers (the plain run before A, ``skip(steps=B-A)`` from the state
at A from B on)."""

from __future__ import annotations

import numpy as np

from .e2e_util import small_job
from .lineage_util import run_job
from .polling import wait_for

S, A, B, N = 1, 3, 5, 7


def test_range_skip_on_three_nodes_is_one_nodes(etcd_server, cluster_factory, server_factory):
    spec = small_job("skr3", dp=3, samples=300, seed=7)
    one = server_factory().start()
    plain, _, at_s = run_job(spec, one.socket, N, save_at=S, lineage=False)
    _, _, at_a = run_job(spec, one.socket, A, save_at=A, lineage=False)
    ref, _, _ = run_job(spec, one.socket, N - B, state=at_a[0], skip={"steps": B - A}, lineage=False)

    c = cluster_factory(etcd_server.url).start()
    wait_for(lambda: c.settled(set(c.nodes)), 30, "one leader that every node agrees on")
    got, lin, _ = run_job(
        spec,
        {r: c.nodes[f"node-{r}"].socket for r in range(3)},
        (A - S) + (N - B),
        state=at_s[0],
        skip={"steps": (A, B)},
        ask=range(A, B),
    )
    for r in got:
        want = [x for x in plain[r] if S <= x[0] < A] + ref[r]
        assert [(s, m) for s, m, _ in got[r]] == [(s, m) for s, m, _ in want]
        for (s, m, b1), (_, _, b2) in zip(got[r], want):
            assert set(b1) == set(b2), (s, m)
            assert all(np.array_equal(b1[k].numpy(), b2[k].numpy()) for k in b1), (s, m)
        for step in range(A, B):
            assert lin[r][step]
            assert all(x["skipped"] for x in lin[r][step])
