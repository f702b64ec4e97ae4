"""Lineage on three node servers with a real etcd: each node answers from the plan states that came with the
leader's plans, and its rows are the pieces its rank received (tokens regenerated from the synthetic sources);
the offline replay from the job's beginning gives the same rows."""

from __future__ import annotations

import asyncio

import numpy as np

from msdata_client.lineage import from_wire, to_pylist
from msdata_server.lineage.command import offline
from msdata_server.lineage.query import Query
from msdata_server.sources import open_source

from .e2e_util import small_job
from .lineage_util import run_job
from .polling import wait_for

STEPS = 4


def test_lineage_on_three_nodes_is_what_ranks_received(etcd_server, cluster_factory):
    spec = small_job("lin3", dp=3, samples=300, seed=7)
    c = cluster_factory(etcd_server.url).start()
    wait_for(lambda: c.settled(set(c.nodes)), 30, "one leader that every node agrees on")
    got, lin, _ = run_job(spec, {r: c.nodes[f"node-{r}"].socket for r in range(3)}, STEPS)

    sources = [open_source(s, seed=spec.seed) for s in spec.sources]
    for r, batches in got.items():
        for step, micro, b in batches:
            rows = [x for x in lin[r][step] if x["micro"] == micro]
            assert rows
            assert {x["dp_rank"] for x in rows} == {spec.group_of(r)}
            assert [(x["source_id"], x["sample_id"]) for x in rows] == list(
                zip(b["source_ids"].tolist(), b["sample_ids"].tolist())
            )
            tokens = b["tokens"].numpy()
            for x in rows:
                doc = sources[x["source_id"]].tokens_of_rows([x["file_row"]])[0]
                want = doc[x["doc_offset"] : x["doc_offset"] + x["length"]]
                assert np.array_equal(tokens[x["row"], x["offset"] : x["offset"] + x["length"]], want), x
    for s in sources:
        s.close()

    # the offline replay from the beginning names the same pieces as the three servers did
    rows = to_pylist(from_wire(asyncio.run(offline(spec, Query(start=0, stop=STEPS), None))))
    served = sorted(
        (x for r in range(3) for s in range(STEPS) for x in lin[r][s]),
        key=lambda x: (x["step"], x["dp_rank"], x["micro"], x["row"], x["offset"]),
    )
    assert rows == served
