"""Autoscaling in a real node server: a set_mixture re-allocates the workers at once, with that reason."""

from __future__ import annotations

from .test_autoscale_e2e import job, serve, status, train


def test_set_mixture_reallocates_at_once(server_factory):
    spec = job("mix", schedule=False)
    srv = serve(server_factory, True, 1)
    _, cut = train(spec, srv.socket, 70, mixture_at=40)
    a = status(srv)["autoscale"]
    moved = [d for d in a["decisions"] if "mixture changed" in d["reason"]]
    assert cut is not None and moved, a["decisions"]
    d = moved[0]
    assert d["reason"].startswith(f"job mix: mixture changed from step {cut}")
    assert d["workers_to"].get("b", 0) > d["workers_from"].get("b", 0) or d["size_to"] > d["size_from"]
