"""What the autoscaling tests share: a transform that burns CPU per document (it runs in the server's workers,
imported there as ``tests.autoscale_util:burner``), jobs of such sources, a paced one-rank trainer, a node's
status, a cluster with autoscaling on or off, and a source's demand."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import msdata_client as msd
from msdata_client.wire import request
from msdata_server.autoscale import SourceDemand

from .e2e_util import batch_record

SHIFT = 80  # the schedule's shift to the expensive source
PACE_S = 0.01  # the simulated trainer's compute per step
ALLOW_TESTS = 'allow_transforms = ["tests"]'  # [node]: the burner transform is ours, not msdata_server's
AUTOSCALE = f"""{ALLOW_TESTS}
[autoscale]
enabled = {{enabled}}
min_workers = 1
max_workers = 2
interval = 0.1
cooldown = 0.3
"""


def burner(ms: float = 1.0):
    """A transform that spends ``ms`` milliseconds of process CPU per document and returns it unchanged."""

    def fn(record, **_):
        end = time.process_time() + ms / 1e3
        while time.process_time() < end:
            pass
        return np.asarray(record)

    fn.needs_rng = False
    return fn


def burner_graph(
    name: str, *, seed: int, ms: dict[str, float], samples: int, median=100.0, sigma=0.5, min_len=8, max_len=512
) -> msd.DGraph:
    """A DGraph of synthetic sources whose transforms burn ``ms[source]`` milliseconds a document (``burner``)."""
    g = msd.DGraph(name, seed=seed)
    for src, cost in ms.items():
        g.source(
            src,
            "synthetic",
            samples=samples,
            median=median,
            sigma=sigma,
            min_len=min_len,
            max_len=max_len,
            transform=f"{__name__}:burner(ms={cost})",
        )
    return g


def job(name: str, *, schedule: bool):
    g = burner_graph(name, seed=3, ms={"a": 0.02, "b": 2.0}, samples=4000)
    if schedule:
        g.mix(schedule=[(0, {"a": 0.98, "b": 0.02}), (SHIFT, {"a": 0.1, "b": 0.9})])
    else:
        g.mix({"a": 0.98, "b": 0.02})
    g.pack(512, rows=1, micro_batches=2).mesh(dp=1).prefetch(2)
    return g.plan()


def train(
    spec, endpoint: str, steps: int, *, mixture_at: int | None = None, before_mixture=None, before_close=None
) -> tuple[list[dict], int | None]:
    """One rank, one step per PACE_S of compute; the batch records (and the step a set_mixture took effect).
    ``before_mixture()`` runs just before the set_mixture, ``before_close()`` while the rank is still connected
    (the job, and its sources, still exist)."""
    recs, cut = [], None
    with msd.DataClient(spec, endpoint=endpoint, rank=0, world_size=1, connect_timeout=30) as dc:
        for step in range(steps):
            if step == mixture_at:
                if before_mixture is not None:
                    before_mixture()
                cut = dc.set_mixture({"a": 0.1, "b": 0.9})
            for _ in range(spec.micro_batches):
                b = next(dc)
                recs.append(batch_record(b))
                del b
            time.sleep(PACE_S)
        if before_close is not None:
            before_close()
    return recs, cut


def status(server) -> dict:
    return request(server.socket, {"t": "status"}, timeout=30)["status"]


def autoscale_cluster(cluster_factory, url: str, enabled: bool):
    """A cluster whose nodes run one worker each with autoscaling on or off (not started yet)."""
    c = cluster_factory(url)
    for srv in c.nodes.values():
        cfg = Path(srv.config)
        cfg.write_text(
            cfg.read_text().replace("workers = 0", f"workers = 1\n{ALLOW_TESTS}")
            + AUTOSCALE.replace(ALLOW_TESTS, "").format(enabled=str(enabled).lower())
        )
    return c.start()


def demand(name: str, workers: float, share: float = 0.5) -> SourceDemand:
    """A demand that keeps ``workers`` workers busy (1000 samples/s at the matching cost)."""
    return SourceDemand(
        name=name, samples_s=1000.0, worker_s_per_sample=workers / 1000.0, share_now=share, share_ahead=share
    )
