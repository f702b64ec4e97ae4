"""Ranks that read a job and ask the lineage of each step they read (the lineage tests, one node or a cluster)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msdata_client as msd

SAVE_AT = 3  # run_job keeps each rank's state after this many steps


def run_job(
    spec,
    endpoint: str | dict[int, str],
    steps: int,
    *,
    state=None,
    skip=None,
    lineage: bool = True,
    save_at: int = SAVE_AT,
    ask: Sequence[int] = (),
):
    """Every rank in a thread: read ``steps`` steps (after load_state_dict/skip), ask lineage(step) of each step
    while connected; returns {rank: [(step, micro, batch)]}, {rank: {step: rows}}, {rank: state after save_at
    steps}. ``endpoint``: one socket, or each rank's (a cluster: its node's). ``ask``: steps whose lineage each
    rank also asks once it read its last step (the steps a skip never delivered)."""
    world = spec.mesh.world_size
    got: dict = {r: [] for r in range(world)}
    lin: dict = {r: {} for r in range(world)}
    saved: dict = {}
    errs: dict = {}

    def body(r):
        try:
            ep = endpoint if isinstance(endpoint, str) else endpoint[r]
            with msd.DataClient(spec, endpoint=ep, rank=r, world_size=world, connect_timeout=30) as dc:
                if state is not None:
                    dc.load_state_dict(state)
                if skip is not None:
                    dc.skip(**skip)
                for _ in range(steps * spec.micro_batches):
                    b = next(dc)
                    step, micro = int(b["step"]), int(b["micro"])
                    got[r].append((step, micro, {k: v.clone() for k, v in b.items()}))
                    dc.release(b)
                    if micro == spec.micro_batches - 1:
                        if lineage:
                            lin[r][step] = dc.lineage(step).to_pylist()
                        if len(got[r]) == save_at * spec.micro_batches:
                            saved[r] = dc.state_dict()
                for step in ask:
                    lin[r][step] = dc.lineage(step).to_pylist()
        except BaseException as e:  # reported to the test
            errs[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
        assert not t.is_alive(), "a rank thread hung"
    if errs:
        raise next(iter(errs.values()))
    return got, lin, saved
