"""Source auto-partitioning on three node servers and a real etcd: the leader splits a source whose reading
outgrows its partitions while a job runs, every node switches at the same step (the table rides with the plans,
fenced), the source is merged back when its read need falls, and every rank gets the batches of a server with
autoscaling off. Slow storage is simulated by the fault module (``slow_reads``: the read seconds one source's
nodes report, scaled); the reading, the transforms, the placement and the data are real."""

from __future__ import annotations

import ast
import re
import threading

import msdata_client as msd

from .autoscale_util import ALLOW_TESTS, autoscale_cluster, burner_graph
from .cluster_util import NODES, send_peer_frame
from .e2e_util import batch_record, run_ranks
from .polling import wait_for

# steps of the job; the ranks pause after these (the split asked, then the merge): a change takes effect at the
# next step planned, which may be a ring's depth past the pause
STEPS, PAUSES = 36, (5, 12)


def _job():
    """Two sources of short documents (a block of 64 samples of b per step), b 10x costlier to transform."""
    g = burner_graph(
        "ascsplit", seed=9, ms={"a": 0.02, "b": 0.2}, samples=4000, median=24.0, sigma=0.4, min_len=4, max_len=128
    )
    g.mix({"a": 0.5, "b": 0.5}).pack(512, rows=1, micro_batches=2).mesh(dp=NODES).prefetch(2)
    return g.plan()


def _ranks(c, spec, n: int, pauses: list[int]):
    """One rank per node in a thread, reading n batches and waiting at each pause until its event is set."""
    got: dict[int, list] = {r: [] for r in range(NODES)}
    errs: dict[int, BaseException] = {}
    gos = [threading.Event() for _ in pauses]

    def body(r):
        try:
            with msd.DataClient(spec, endpoint=c.nodes[f"node-{r}"].socket, rank=r, world_size=NODES) as dc:
                for i in range(n):
                    if i in pauses:
                        gos[pauses.index(i)].wait(120)
                    got[r].append(batch_record(next(dc)))
        except BaseException as e:  # reported to the test
            errs[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(NODES)]
    for t in threads:
        t.start()
    return got, errs, gos, threads


def _at(got, errs, k: int) -> None:
    wait_for(lambda: all(len(got[r]) == k for r in range(NODES)) or errs, 90, f"every rank at batch {k}")
    assert not errs, errs


def _applied(log: str) -> list[tuple[dict, int]]:
    """The partition tables a node applied, with the step: [({source: partitions}, step), ...]."""
    found = re.findall(r"job ascsplit: partitions per source (\{[^}]*\}) from step (\d+)", log)
    return [(ast.literal_eval(d), int(s)) for d, s in found]


def test_three_nodes_split_and_merge_a_source_live_and_the_batches_equal_autoscaling_off(
    etcd_server, cluster_factory, server_factory, monkeypatch
):
    monkeypatch.setenv("MSDATA_TEST_FAULTS", "1")
    spec = _job()
    m = spec.micro_batches
    on = autoscale_cluster(cluster_factory, etcd_server.url, True)
    leader, _token = wait_for(lambda: on.settled(set(on.nodes)), 30, "one leader that every node agrees on")
    lead = on.nodes[leader]
    secret = on.token_file.read_text().strip()
    for srv in on.nodes.values():  # b's storage turns slow: its read need outgrows the 3 partitions it has
        send_peer_frame(srv, secret, {"t": "fault", "slow_reads": 1e7, "source": "b"})
    got, errs, gos, threads = _ranks(on, spec, STEPS * m, [p * m for p in PAUSES])

    _at(got, errs, PAUSES[0] * m)
    split = wait_for(lambda: re.search(r"source b partitions 3 -> (\d+): (.*)", lead.log()), 60, "the split")
    assert int(split.group(1)) > 3, split.group(0)
    assert "demand" in split.group(2), split.group(0)
    assert "read need" in split.group(2), split.group(0)
    gos[0].set()

    _at(got, errs, PAUSES[1] * m)
    n_split = int(re.findall(r"source b partitions \d+ -> (\d+)", lead.log())[-1])  # it may have split twice
    assert n_split > 3, lead.log()

    def split_everywhere():
        sts = on.statuses()
        return len(sts) == NODES and all(
            st["autoscale"]["sources"]["b"]["partitions"] == n_split for st in sts.values()
        )

    wait_for(split_everywhere, 60, f"every node to read b in {n_split} partitions")
    runs = [r for st in on.statuses().values() for r in st["cluster"]["runs"]]
    assert all(r["partitions"]["b"] == n_split for r in runs), runs
    assert sum(r["partitions_here"] for r in runs) >= n_split + 3, runs  # the new partitions are open and read

    def over_bound() -> list:
        return [
            (name, fig)
            for st in on.statuses().values()
            for name, fig in st["jobs"][0]["sources"].items()
            if fig["held"] > fig["held_bound"]
        ]

    # what the old partitions read past the split was dropped: within bounds (a status is a snapshot taken while
    # the partitions' reads land: a read that overshoots by one batch settles at the next look; a leak does not)
    wait_for(lambda: not over_bound(), 10, "every source's held payloads within their bound")
    for srv in on.nodes.values():  # the storage is fast again: b's read need falls, it is merged back
        send_peer_frame(srv, secret, {"t": "fault", "slow_reads": 1.0})
    wait_for(lambda: f"source b partitions {n_split} -> 3: " in lead.log(), 60, "the merge")
    gos[1].set()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a rank hung"
    assert not errs, errs

    # every node applied the same tables at the same steps (a burst of demand after a pause may move a too);
    # b was read in its new partitions for steps the ranks took, then merged back for steps they took
    tables = {nid: _applied(srv.log()) for nid, srv in on.nodes.items()}
    applied = tables[leader]
    assert all(t == applied for t in tables.values()), tables
    b, changes = 3, []
    for d, step in applied:
        if d["b"] != b:
            changes.append((b, d["b"], step))
            b = d["b"]
    assert changes[0][0] == 3, changes
    assert changes[0][1] > 3, changes
    assert 0 < changes[0][2] < PAUSES[1], changes
    merged = [step for a, to, step in changes if to == 3 and step > PAUSES[1]]
    assert merged, changes
    assert merged[0] < STEPS - 4, changes  # ranks took steps read in 3 partitions again
    for a, to, _ in changes:  # each change was logged by the leader, with its reason
        assert re.search(rf"source b partitions {a} -> {to}: .*demand", lead.log()), (a, to)
    on.stop()

    # the same job on one server with autoscaling off (three nodes equal one: test_multinode_jobs)
    single = server_factory(workers=1, extra=f"{ALLOW_TESTS}\n[autoscale]\nenabled = false\n").start()
    want = run_ranks(spec, single.socket, STEPS * m)
    for r in range(NODES):
        assert got[r] == want[r], f"rank {r} got other batches with b split and merged than with autoscaling off"
