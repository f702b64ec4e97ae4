"""Autoscaling in a real node server: a set_mixture re-allocates the workers at once, with that reason."""

from __future__ import annotations

import pytest

from .autoscale_util import ALLOW_TESTS, job, status, train
from .polling import wait_for

# the pool starts at its largest size and a long cooldown keeps it there, so that what a mixture change moves is
# the sources' apportionment, whatever pace this machine gives the trainer: b (2 ms a sample) holds at most one
# of the two workers at 2% of the mixture, and both once it has 90%
FIXED = f"""{ALLOW_TESTS}
[autoscale]
enabled = true
min_workers = 1
max_workers = 2
interval = 0.1
cooldown = 600
"""


def test_set_mixture_reallocates_at_once(server_factory):
    spec = job("mix", schedule=False)
    srv = server_factory(workers=2, extra=FIXED).start()

    def both_measured() -> None:
        # until a's cost is measured its need counts as 0 and b holds both workers (seen on a loaded machine):
        # the change must find the apportionment of the old mixture, b at most one worker
        wait_for(
            lambda: status(srv)["autoscale"]["sources"].get("b", {}).get("workers", 2) <= 1,
            30,
            "the old mixture's apportionment (b at most one worker, once a's cost is measured)",
        )

    _, cut = train(spec, srv.socket, 70, mixture_at=40, before_mixture=both_measured)
    a = status(srv)["autoscale"]
    moved = [d for d in a["decisions"] if "mixture changed" in d["reason"]]
    assert cut is not None, a["decisions"]
    assert moved, a["decisions"]
    d = moved[0]
    assert d["reason"].startswith(f"job mix: mixture changed from step {cut}")
    assert d["ahead"]["b"] == pytest.approx(0.9), d  # decided on the new mixture, before its first step is planned
    assert srv.log().count(d["message"]) == 1  # logged once
    # The change wakes the autoscaler at once. A periodic decision (every 0.1 s here) can still fall between the
    # planner taking the new weights and that wake: the state write between them yields. That decision then moves
    # the workers, on the new mixture, and the mixture's own finds them moved (seen once on a loaded machine).
    # Either way the first decision on the new mixture moves them, and it comes no later than d.
    decs = a["decisions"]
    first = next(x for x in decs if x["ahead"].get("b", 0) == pytest.approx(0.9))
    assert decs.index(first) <= decs.index(d), decs
    assert first["size_to"] == 2, decs
    assert first["workers_to"]["b"] == 2 > first["workers_from"].get("b", 0), decs
