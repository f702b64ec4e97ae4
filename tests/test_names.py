"""README's table of figure names (Operations, "One name per figure") against the code: every status path it
names is in a real server's ``status --json``, every state key in a real planner state, every metric in
``METRICS`` with the status figure behind it; and every job, source and rank counter, accounting and mixture
figure has its row. Nothing can be renamed in one place only."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msdata_client as msd
from msdata_client.wire import request
from msdata_server.ops.prometheus import METRICS, families
from msdata_server.planner.accounting import accounting

from .e2e_util import small_job
from .server_util import ROOT

_CELL = re.compile(r"`([^`]+)`")


def readme_rows() -> list[list[list[str]]]:
    """The table's rows, each as its four cells' backticked names."""
    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- names:begin -->", 1)[1].split("<!-- names:end -->", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in table.strip().splitlines()[2:]]
    assert rows, "README's names table is empty"
    assert all(len(r) == 4 for r in rows), [r for r in rows if len(r) != 4]
    return [[_CELL.findall(cell) for cell in r] for r in rows]


def resolve(doc: Any, path: str) -> Iterator[Any]:
    """Values at ``path`` (``a.b``; ``[]``: each item of a list, ``{}``: each value of a dict)."""
    values = [doc]
    for part in path.split("."):
        name, many = part.rstrip("[]{}"), part[len(part.rstrip("[]{}")) :]
        values = [v[name] for v in values if isinstance(v, dict) and name in v]
        if many:
            values = [x for v in values for x in (v if isinstance(v, list) else v.values())]
    return iter(values)


def test_the_readme_names_table_matches_status_state_and_metrics(server_factory):
    srv = server_factory().start()
    spec = small_job("names", dp=1, samples=300)
    with msd.DataClient(spec, endpoint=srv.socket, rank=0, world_size=1, connect_timeout=30) as dc:
        for _ in range(spec.micro_batches * 4):
            dc.release(next(dc))  # flushes the waits: ranks_detail has this rank
        status = request(srv.socket, {"t": "status"})["status"]
        state = dc.state_dict()["planner"]
    rows = readme_rows()
    exported = {f.name for f in families(status)}
    for concept, paths, keys, metrics in rows:
        assert paths, f"README row {concept}: no status name"
        for path in paths:
            assert list(resolve(status, path)), f"README names {path!r}: not in a running server's status"
        for key in keys:
            assert list(resolve(state, key)), f"README names state key {key!r}: not in a planner state"
        for metric in metrics:
            name = metric.split("{", 1)[0]
            assert name in METRICS, f"README names metric {name!r}: not in ops/prometheus.py METRICS"
            kind = METRICS[name][0]
            assert (kind == "counter") == name.endswith("_total"), name
            assert name.removesuffix("_total") in exported, f"{name}: the status above exports no sample of it"
        for path, metric in zip(paths[:1], metrics[:1], strict=False):
            key = path.split(".")[-1].rstrip("{}[]")
            stem = metric.split("{", 1)[0].removeprefix("msdata_").removesuffix("_total")
            # units as Prometheus names them
            words = {"s": "seconds", "ms": "seconds", "frac": "ratio", "fraction": "ratio"}
            want = {words.get(w, w) for w in key.split("_")}
            assert want <= set(stem.split("_")), f"{metric} is not named after {path}"

    named = {m.split("{", 1)[0] for r in rows for m in r[3]}
    counters = {n for n, (kind, _, _) in METRICS.items() if kind == "counter"}
    scoped = {n for n in counters if n.startswith(("msdata_job_", "msdata_source_", "msdata_rank_"))}
    assert scoped <= named, f"counters without a README row: {sorted(scoped - named)}"
    paths = {p for r in rows for p in r[1]}
    for key in accounting(state, spec)[spec.source_names()[0]]:
        assert f"jobs[].accounting{{}}.{key}" in paths, f"accounting figure {key!r} has no README row"
    for key in status["jobs"][0]["mixture"][spec.source_names()[0]]:
        assert f"jobs[].mixture{{}}.{key}" in paths, f"mixture figure {key!r} has no README row"


def test_resolve_walks_lists_and_tables():
    doc = {"jobs": [{"sources": {"a": {"n": 1}, "b": {"n": 2}}}, {"sources": {}}]}
    assert list(resolve(doc, "jobs[].sources{}.n")) == [1, 2]
    assert list(resolve(doc, "jobs[].missing")) == []
    assert list(resolve({"counts": {"bad": [0]}}, "counts.bad")) == [[0]]
