"""The leader's side of cluster jobs: the start barrier across nodes, one planner per job, plans to every node.

From the nodes' reports the leader sees which ranks of which job are registered where. A new run starts when
the whole mesh is registered (start state as on one node: states brought by ranks, else the etcd checkpoint
when ranks resume, else the beginning). A run that nodes report as already running (the old leader died)
resumes from the etcd state at or before the lowest step any node still lacks; plans are deterministic, so
re-sent ones equal the old ones and nodes ignore them. The planner state of each step goes to etcd, fenced.

Plan slices: every node receives only its slice of each step (the pieces its groups build and those of the
partitions it reads or stands by for, with the step's figures; ``slices``, ``planwire.encode_slices``), so the
leader's bytes per step stay near one plan's whatever the node count. Re-sends and re-plans slice again.
Planning runs at most ``prefetch_steps + 1`` steps past the lowest step a node acknowledged it fed; nodes
acknowledge every few steps, and at once when that bound is one step from holding the leader back
(``context.ack_due``).

Catching up: links break and nodes restart; frames sent meanwhile are lost. The leader keeps the encoded plans
of the steps not yet fed on every live node and re-sends them; a step it no longer holds (or that an earlier
leader planned) is planned again from the etcd state at or before it (deterministic: the same plans). A node
whose ranks rejoin a run (its server restarted) is told the run again first.

Mixture changes: the leader answers a rank's ``mix`` request (with the cut step, a refusal for bad weights, or
the error that stopped it) and a held node's ``mixstate`` (``Coordinator.on_mix``, ``on_mixstate``).

The coordinators use the node through its ``ClusterContext``; this node's own run of a job (the partition
layout and the lengths the planner reads) through ``LocalRuns``/``HeldRun``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import numpy as np

from msdata_client.spec import JobSpec

from ...autoscale.cluster import RunView, Scaler, run_view, start_costs
from ...autoscale.controller import SPINUP_S
from ...checkpoint import RankStart, start_point
from ...datachange import data_start
from ...errors import CheckpointError, ClosedError, ConfigError, MsdataError, PeerLostError
from ...job.view import ThreadView
from ...lineage.skip import skip_ahead, skip_pending, source_sizes
from ...planner import Planner, StepPlan
from ...planner.history import StateHistory
from ...planner.spec import planner_config
from ...tasks import TaskSet
from ..context import ClusterContext
from ..net.rpc import error_reply
from ..parts import PartsTable, RunParts, longest
from ..placement import PartitionLayout, partition_costs, place_split
from ..planwire import encode_plan, iter_slices
from .slices import PlanSlicer
from .statestore import EtcdStateStore

__all__ = ["Coordinator", "HeldRun", "JobCoordinator", "LocalRuns"]

log = logging.getLogger(__name__)
SEND_BATCH = 64  # nodes whose slices are encoded together (``frame_batches``)


def _resuming(entry: dict) -> bool:
    """A registration whose ranks reconnect mid-run (their node server restarted): it rejoins the run."""
    return any(info.get("resume") for info in entry["ranks"].values())


class HeldRun(Protocol):
    """This node's own run of a job, as the leader here reads it (``cluster.run.Run``)."""

    @property
    def id(self) -> str: ...

    @property
    def layout(self) -> PartitionLayout: ...  # who owns each partition, the costs, the partition table

    async def lengths(self, s: int, start: int, count: int) -> np.ndarray: ...

    async def vision(self, s: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]: ...


class LocalRuns(Protocol):
    """This node's runs, as the leader here asks them (``cluster.run.RunTable``)."""

    def held(self, digest: str, run_id: str) -> HeldRun | None: ...


def _pick(entries: list[tuple[str, dict]], keep: Callable[[str, dict], bool]) -> dict[str, dict]:
    """At most one entry per node among those ``keep(nid, entry)`` keeps (the one with the most ranks)."""
    per: dict[str, dict] = {}
    for nid, j in entries:
        if keep(nid, j) and (nid not in per or len(j["ranks"]) > len(per[nid]["ranks"])):
            per[nid] = j
    return per


class Coordinator:
    """All job coordinators of this node while it leads; the latest report of every node."""

    def __init__(self, ctx: ClusterContext, runs: LocalRuns) -> None:
        self.ctx = ctx
        self.runs = runs
        self.reports: dict[str, dict] = {}  # node -> its latest "jobs" report
        self.coords: dict[str, JobCoordinator] = {}
        self.ended: dict[str, JobCoordinator] = {}  # the last run of a job that ended (a new run waits for it)
        self.leading = False
        cfg = ctx.autoscale
        self.scaler = Scaler(headroom=cfg.headroom, cooldown_s=cfg.cooldown_s)  # targets, partitions (autoscale)

    def on_role(self, role: str) -> None:
        leading = role == "leader"
        if leading == self.leading:
            return
        self.leading = leading
        self.scaler.reset()  # a new leadership sends every node fresh targets with its own token
        if not leading:  # a leader that lost its lease stops planning at once
            for c in list(self.coords.values()):
                c.stop()
            self.coords.clear()
            self.ended.clear()
        else:
            self.evaluate()

    def members_changed(self) -> None:
        live = set(self.ctx.live_nodes())
        for nid in [n for n in self.reports if n not in live]:
            del self.reports[nid]
            self.scaler.forget(nid)
        for c in self.coords.values():
            c.acked.set()  # a node that left no longer holds planning back
        self.evaluate()

    def coordinating(self, frame: dict) -> JobCoordinator | None:
        """The coordinator of the run a frame names, while we lead it."""
        c = self.coords.get(frame.get("digest", "")) if self.leading else None
        return c if c is not None and c.run_id == frame.get("run") else None

    def on_frame(self, frame: dict) -> None:
        if frame["t"] == "jobs":
            self.reports[str(frame["node"])] = frame
            self.evaluate()
            self.scale()
            return
        c = self.coords.get(frame.get("digest", ""))
        if c is None and frame["t"] == "need" and self.leading:
            self._refresh(frame)
            return
        if c is None or frame.get("run") != c.run_id:
            return  # about a run that ended (or another leader's): nothing to do
        if frame["t"] == "ack":
            c.ack(str(frame["node"]), int(frame["step"]))
        elif frame["t"] == "need":
            c.ack(str(frame["node"]), int(frame["fed"]))
            c.resend(str(frame["node"]), int(frame["step"]))

    def scale(self) -> None:
        """Send the nodes whose worker targets moved their new ones (fenced; only while we lead)."""
        if not self.leading:
            return
        runs = [v for v in (c.scale_view() for c in self.coords.values()) if v is not None]
        reports = {nid: r["autoscale"] for nid, r in self.reports.items() if isinstance(r.get("autoscale"), dict)}
        lead_s = self.ctx.autoscale.interval + SPINUP_S
        for nid, frame in self.scaler.update(runs, reports, token=self.ctx.token, lead_s=lead_s).items():
            self.ctx.tasks.spawn(self.ctx.rpc.quiet_send(nid, frame), name="scale")
        coords = {c.run_id: c for c in self.coords.values()}
        for sp in self.scaler.repartition(runs, reports, now=time.monotonic(), lead_s=lead_s):
            c = coords.get(sp.run_id)
            if c is not None:  # placed now, applied by the run at its next planned step (cluster.parts)
                owners = place_split(sp.n_to, sp.cost, sp.load, sp.budget)
                c.parts.want(c.spec.source_names().index(sp.source), sp.n_to, owners, sp.reason)

    def _refresh(self, frame: dict) -> None:
        """A node waits for plans of a run nobody plans (its start failed on an older report, whose "next" etcd
        no longer holds): its probe says where it is now; resume from there."""
        for j in self.reports.get(str(frame["node"]), {}).get("jobs", ()):
            if j["digest"] == frame.get("digest") and j.get("run") == frame.get("run") and j.get("running"):
                j["next"], j["fed"] = int(frame["step"]), int(frame["fed"])
                self.evaluate()
                return

    def link_up(self, nid: str) -> None:
        """Our link to a node is (back) up: it may have missed a start or plans meanwhile; send them again."""
        if not self.leading:
            return
        by = self._entries()
        for digest, c in self.coords.items():
            c.update_ranks(c.own(by.get(digest, [])))
            c.relink(nid, c.acks.get(nid, c.low_ack()) + 1)

    def _entries(self) -> dict[str, list[tuple[str, dict]]]:
        """Every node's job entries by digest (a node may hold two of one job: a run and the next one waiting)."""
        by: dict[str, list[tuple[str, dict]]] = {}
        for nid, rep in self.reports.items():
            for j in rep.get("jobs", ()):
                by.setdefault(j["digest"], []).append((nid, j))
        return by

    def evaluate(self) -> None:
        """Start, resume or end job runs from the latest reports (only while we lead).

        A run is told apart from the next run of the same job by the job registrations (``inst``) it started
        with, those that rejoined it (their ranks reconnect with ``resume``), and the run id nodes attach to
        them. A new run (fresh registrations) waits until no node has ranks of the old one left."""
        if not self.leading:
            return
        by = self._entries()
        for digest, c in list(self.coords.items()):
            if not any(j["ranks"] for j in c.own(by.get(digest, [])).values()):
                c.stop(end=True)
                del self.coords[digest]
                self.ended[digest] = c
        live = set(self.ctx.live_nodes())
        for digest, entries in by.items():
            running = self.coords.get(digest)
            if running is not None:
                running.update_ranks(running.own(entries, adopt=True))
                continue
            runs = sorted({str(j["run"]) for _, j in entries if j.get("run") and j["ranks"]})
            if runs:  # a run in progress whose leader died: resume it once every live node has reported
                if not live <= set(self.reports):
                    continue
                if len(runs) > 1:
                    log.warning(
                        "job %s: nodes report ranks of %d runs (%s); resuming %s",
                        entries[0][1]["name"],
                        len(runs),
                        runs,
                        runs[0],
                    )
                rid = runs[0]
                per = _pick(entries, lambda _n, j: j.get("run") == rid or (not j.get("run") and _resuming(j)))  # noqa: B023 (_pick calls it at once)
                resume = True
            else:
                rid = uuid.uuid4().hex[:16]
                per = _pick(entries, lambda _n, j: not j.get("run") and bool(j["ranks"]))
                resume = False
            ranks = {int(r) for j in per.values() for r in j["ranks"]}
            if not ranks:
                continue
            spec = JobSpec.from_dict(next(iter(per.values()))["spec"])
            if not resume and len(ranks) < spec.mesh.world_size:
                continue  # the start barrier: the whole mesh, across nodes
            c = self.coords[digest] = JobCoordinator(self.ctx, self.runs, spec, digest, rid, per, self.reports)
            after = self.ended.pop(digest, None)
            c.tasks.spawn(self._coordinate(c, per, resume, after), name=f"coordinate-{spec.name}")

    async def _coordinate(
        self, c: JobCoordinator, per: dict[str, dict], resume: bool, after: JobCoordinator | None
    ) -> None:
        if not await c.run(per, resume=resume, after=after) and self.coords.get(c.digest) is c:
            del self.coords[c.digest]  # its start failed: the next report tries again (a stale one failed)

    # ---- mixture changes: the leader's answers ----------------------------------------------------------
    async def on_mix(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        """A rank's set_mixture, relayed by its node: cut, re-plan, answer with the cut step (or the refusal)."""
        self.ctx.tasks.spawn(self._serve_mix(frame), name="serve-mix")

    async def _serve_mix(self, frame: dict) -> None:
        c = self.coordinating(frame)
        rpc = self.ctx.rpc
        try:
            if c is None:
                raise PeerLostError(
                    f"node {self.ctx.node_id} does not coordinate job {str(frame.get('digest'))[:12]} "
                    "(the leader changed); retry"
                )
            step = await c.set_mixture(dict(frame["weights"]))
            self.scale()  # the nodes' workers follow the new mixture at once
            await rpc.reply(frame, {"step": step})
        except ConfigError as e:
            await rpc.reply(frame, {"refused": str(e)})
        except (MsdataError, KeyError, TypeError, ValueError) as e:
            await rpc.reply(frame, error_reply(e))

    async def on_mixstate(self, peer: str, frame: dict, payload: memoryview | None) -> None:
        """A held node asks where the leader's mixture changes stand."""
        c = self.coordinating(frame)
        if c is None:
            err = PeerLostError(f"node {self.ctx.node_id} does not coordinate that run")
            await self.ctx.rpc.reply(frame, error_reply(err))
        else:
            await self.ctx.rpc.reply(frame, {"busy": c.mixing, "token": c.token, "gen": c.gen, "cut": c.last_cut})

    async def aclose(self) -> None:
        for c in list(self.coords.values()):
            c.stop()
            await c.tasks.cancel_all("closing")
        self.coords.clear()


class JobCoordinator:
    """One job run on the leader: its planner (in a thread), plans to every node, states to etcd; the plans
    again for a node that lacks some (from memory, else re-planned from etcd); its mixture changes.

    Size: the start, the planning loop, the catch-up and the mixture changes share one run's planned steps,
    sent plans, acks, generation and cuts; split apart, each would need all of that state (the catch-up once
    had a 19-member protocol onto this class)."""

    def __init__(
        self,
        ctx: ClusterContext,
        runs: LocalRuns,
        spec: JobSpec,
        digest: str,
        run_id: str,
        per: dict[str, dict],
        reports: Mapping[str, dict],
    ) -> None:
        self.ctx = ctx
        self.runs = runs  # this node's runs: its own of this job gives the planner its lengths
        self.reports = reports  # the nodes' latest reports (the autoscalers' measured costs)
        self.spec = spec
        self.digest = digest
        self.run_id = run_id
        self.insts: dict[str, set[str]] = {nid: {str(j["inst"])} for nid, j in per.items()}  # registrations in it
        self._closed = asyncio.Event()
        self.views: set[ThreadView] = set()  # planner threads' look-ups, cancelled when we stop
        self.tasks = TaskSet(f"coordinator {spec.name}", on_error=self._failed)
        cl = ctx.cluster
        self.store = EtcdStateStore(
            cl.etcd, cl.election, prefix=ctx.config.prefix, job=spec.name, digest=digest, keep=32
        )
        self.acks: dict[str, int] = {}
        self.acked = asyncio.Event()
        self.rank_nodes: dict[int, str] = {}
        self._ranks_moved = 0  # changes to rank_nodes after the start (the cached node set below follows them)
        self._rank_set: tuple[int, int, frozenset[str]] = (-1, -1, frozenset())  # (size, moves, its nodes)
        self._low: tuple[int, int] = (1 << 62, 0)  # (the lowest ack last found, nodes at it): ack() wakes at 0
        self.start_frame: dict | None = None
        self.stopped = False
        self.planned = 0  # the next step the main planner will send
        # plans not yet fed on every live node (to re-send), with their frames' extra header and partition table
        self.sent: dict[int, tuple[StepPlan, dict, PartsTable]] = {}
        self.slicer = PlanSlicer(
            spec.group_of, spec.readers
        )  # which pieces go to which node (maps cached by the layout)
        self._resending: dict[str, asyncio.Task] = {}  # node -> the re-send under way to it (one at a time)
        self.planner: Planner | None = None
        self._plan_lock = asyncio.Lock()  # one step planned and sent, or one mixture change, at a time
        self.gen = 0  # mixture changes so far (plans carry it; nodes drop plans of an older one)
        self.last_cut: int | None = None  # the step of the latest change (plans carry it: a node that missed it)
        self.mixing = False  # a change holds the nodes right now
        self.states = StateHistory(256)  # recent planner states by step (a mixture change re-plans from one)
        self.mix_states: dict[int, dict] = {}  # cut -> the state with that change (a replay switches to it)
        self.parts = RunParts(spec.name, spec.source_names(), PartsTable.base(len(spec.sources), 1))

    def _failed(self, task: asyncio.Task, exc: BaseException) -> None:
        log.error("coordinator of %s failed: %s", self.spec.name, exc, exc_info=exc)

    def stop(self, end: bool = False) -> None:
        self.stopped = True
        for view in list(self.views):
            view.close()
        self.acked.set()

        async def wind_down() -> None:
            try:
                await self.tasks.cancel_all("coordinator stopped")
            finally:
                self._closed.set()

        self.ctx.tasks.spawn(wind_down(), name="coordinator-stop")
        if end:
            frame = {"t": "jstop", "digest": self.digest, "run": self.run_id}
            for nid in self.ctx.live_nodes():
                self.ctx.tasks.spawn(self.ctx.rpc.quiet_send(nid, frame), name="jstop")

    def own(self, entries: list[tuple[str, dict]], adopt: bool = False) -> dict[str, dict]:
        """The nodes' entries that belong to this run; with ``adopt``, registrations that rejoin it (ranks that
        reconnect after their node server restarted) become part of it. Fresh ones are the next run's."""
        if adopt:
            for nid, j in entries:
                if not j.get("run") and j["ranks"] and _resuming(j):
                    self.insts.setdefault(nid, set()).add(str(j["inst"]))
        return _pick(entries, lambda n, j: j.get("run") == self.run_id or str(j.get("inst")) in self.insts.get(n, ()))

    def ack(self, nid: str, step: int) -> None:
        """A node fed up to ``step``. Planning waits for the lowest ack: it is woken only when the last node at
        that lowest step moves on (``_at_low``), not by every ack (N acks per step, each O(N) to re-check)."""
        old = self.acks.get(nid, -1)
        if step > old:
            self.acks[nid] = step
            if old <= self._low[0]:
                self._low = (self._low[0], self._low[1] - 1)
                if self._low[1] <= 0:
                    self.acked.set()

    @property
    def token(self) -> int:
        return self.ctx.token

    # ---- start --------------------------------------------------------------------------------------------
    async def _start_state(self, per: dict[str, dict], resume: bool) -> tuple[dict | None, dict[int, list[int]]]:
        ranks = {int(r): info for j in per.values() for r, info in j["ranks"].items()}
        positions = {r: list(info["pos"]) for r, info in ranks.items()}
        if resume:  # the previous leader died: continue from the lowest step a node still lacks
            lows = [int(j["next"]) for j in per.values() if j["running"] and j["next"] is not None and j["ranks"]]
            low = min(lows) if lows else min(p[0] for p in positions.values())
            found = await self.store.load_at_or_before(low)
            if found is None:
                raise CheckpointError(f"job {self.spec.name!r}: no planner state in etcd at or before step {low}")
            return found[1], positions
        sp = start_point(
            {
                r: RankStart((int(info["pos"][0]), int(info["pos"][1])), info.get("state"), bool(info.get("resume")))
                for r, info in ranks.items()
            },
            self.spec.layout(),
        )
        if sp.clear:
            await self.store.clear()
        state = sp.planner
        if sp.load_at is not None:
            found = await self.store.load_at_or_before(sp.load_at)
            state = found[1] if found else None
        if sp.skip:  # loader.skip: plan the skipped steps here, the run starts after them
            state, skipped = await skip_ahead(self.spec, state, sp.skip, self.ctx.pool, defer=sp.defer)
            for step, st in skipped.items():
                await self.store.save(step, st)
        return state, {r: list(p) for r, p in sp.positions.items()}

    def scale_view(self) -> RunView | None:
        """This run as the autoscaler sizes it (None until it plans, or once it stopped)."""
        run = self.runs.held(self.digest, self.run_id)
        if self.stopped or self.planner is None or run is None:
            return None
        return run_view(self.spec, self.planner, run.layout, self.run_id)

    def insts_frame(self) -> dict[str, list[str]]:
        return {nid: sorted(v) for nid, v in self.insts.items()}

    async def run(self, per: dict[str, dict], resume: bool, after: JobCoordinator | None = None) -> bool:
        """Start (or resume) the run and plan it until it stops; False if it could not start."""
        if after is not None:  # the previous run of this job winds down first (its last etcd writes included)
            await after._closed.wait()
        try:
            state, positions = await self._start_state(per, resume)
            # the files the leader lists now against those the state was planned over (datachange.py); the
            # leader keeps no manifests: an error names the counts and digests
            listing = await data_start(self.spec, state, None)
        except MsdataError as e:
            log.error("job %s cannot start: %s", self.spec.name, e)
            await self._fail_start(per, e)
            return False
        cfg = planner_config(self.spec)
        planner = Planner(cfg, state=state)
        planner.set_listing(listing)
        self.rank_nodes = {int(r): nid for nid, j in per.items() for r in j["ranks"]}
        self._ranks_moved += 1
        live = self.ctx.live_nodes()
        self.start_frame = {
            "t": "jstart",
            "digest": self.digest,
            "run": self.run_id,
            "spec": self.spec.to_dict(),
            "nparts": max(1, len(live)),
            "start_step": planner.step,
            "positions": {str(r): p for r, p in positions.items()},
            "cursor": planner.state_dict().get("cursor"),
        }
        held = self.runs.held(self.digest, self.run_id) if resume else None  # it keeps the partitions nodes hold
        self.start_frame["nparts"] = held.layout.nparts if held is not None else self.start_frame["nparts"]
        self.start_frame["parts"] = longest(j.get("parts") for j in per.values()) if resume else None
        costs = self._costs(int(self.start_frame["nparts"]), resume, held)
        if costs is not None:  # placement by measured cost x share (autoscale.cluster), the same on every node
            self.start_frame["costs"] = costs
        frame = {
            **self.start_frame,
            "rank_nodes": {str(r): n for r, n in self.rank_nodes.items()},
            "token": self.token,
            "insts": self.insts_frame(),
        }
        self.acks = {nid: planner.step - 1 for nid in set(self.rank_nodes.values())}
        if resume:
            for nid, j in per.items():
                if j.get("fed") is not None and nid in self.acks:
                    self.acks[nid] = max(self.acks[nid], int(j["fed"]))
        for nid in live:
            await self.ctx.rpc.quiet_send(nid, frame)
        log.info(
            "job %s: %s run %s across %d node(s) from step %d (token %d)",
            self.spec.name,
            "resumed" if resume else "started",
            self.run_id,
            len(live),
            planner.step,
            self.token,
        )
        await self._plan_loop(planner)
        return True

    async def _fail_start(self, per: dict[str, dict], error: MsdataError) -> None:
        """Tell the nodes whose ranks registered why the run cannot start (a state that does not fit, changed
        files...): they fail those registrations, so their ranks get the error instead of waiting."""
        frame = {
            "t": "jfail",
            "job": self.spec.name,
            "digest": self.digest,
            "insts": self.insts_frame(),
            "kind": type(error).__name__,
            "message": str(error),
            "token": self.token,
        }
        for nid in per:
            await self.ctx.rpc.quiet_send(nid, frame)

    def _costs(self, nparts: int, resume: bool, held: HeldRun | None) -> list[float] | None:
        """Partition costs for placement: a resumed run keeps those of the run the nodes hold; a new one weighs
        the declared share by the measured cost per token (``autoscale.cluster.start_costs``)."""
        if resume:
            return list(held.layout.costs) if held is not None else None
        declared = partition_costs(self.spec.mix, self.spec.source_names(), nparts)
        return start_costs(self.spec.name, self.spec.source_names(), declared, self.reports)

    # ---- planning -------------------------------------------------------------------------------------------
    @property
    def _planning(self) -> Planner:
        """The planner of this run (set when it starts planning; a mixture change replaces it)."""
        if self.planner is None:
            raise ClosedError(f"job {self.spec.name}: the run has not started planning")
        return self.planner

    async def _plan_loop(self, planner: Planner) -> None:
        loop = asyncio.get_running_loop()
        run = self.runs.held(self.digest, self.run_id)  # our own jstart went through the same handler, at once
        if run is None:
            raise ClosedError(f"job {self.spec.name}: this node did not take up the run it started")
        view = self.view(run, loop)
        window = self.spec.prefetch_steps + 1
        self.planner, self.parts.table = planner, run.layout.table  # a resumed run: the table nodes hold
        while not self.stopped:
            while not self.stopped and self._planning.step > self.low_ack() + window:
                self.acked.clear()
                await self.acked.wait()
            if self.stopped:
                return
            async with self._plan_lock:
                if not await self._plan_one(view):
                    return

    async def _plan_one(self, view: ThreadView) -> bool:
        """Plan, record and send one step (under the plan lock); False once we no longer lead."""
        planner = self._planning
        if planner.pending_skip is not None and not await self._skip_pending(planner, view):
            return False
        step = planner.step
        state = planner.state_dict()
        # the fenced etcd write overlaps the planning (no plan leaves before its state is stored)
        saving = asyncio.ensure_future(self.store.save(step, state))
        try:
            plan = await asyncio.to_thread(planner.plan_step, view)
        except BaseException:
            saving.cancel()
            await asyncio.gather(saving, return_exceptions=True)
            raise
        if not await saving:
            log.warning("job %s: no longer leader at step %d; planning stops", self.spec.name, step)
            return False
        parts = self.parts.at(step, state.get("cursor"))  # splits and merges from this step (cluster.parts)
        extra = {"state": state, "gen": self.gen, "run": self.run_id, "cut": self.last_cut, "parts": parts}
        self.sent[step] = (plan, extra, self.parts.table)
        self.states.record(step, state)
        low = self.low_ack()
        for old in [s for s in self.sent if s <= low]:
            del self.sent[old]
        self.planned = step + 1
        for batch in self.frame_batches(plan, extra, self.parts.table, self.ctx.live_nodes()):
            for nid, (header, buf) in batch.items():
                await self.ctx.rpc.quiet_send(nid, header, buf)
        return True

    async def _skip_pending(self, planner: Planner, view: ThreadView) -> bool:
        """``loader.skip(steps=(A, B))`` at A: plan A..B-1 (``lineage.skip.skip_pending``), store their states and
        send their plans marked skipped (nodes release their pieces and hand them to nobody); False once we no
        longer lead. Nothing at any other step."""
        sizes = await source_sizes(self.spec) if planner.pending_skip and planner.pending_skip.defer else []
        skipped, states, cursors = await asyncio.to_thread(skip_pending, planner, view, sizes)
        for plan in skipped:
            state = states[plan.step]
            if not await self.store.save(plan.step, state):
                log.warning("job %s: no longer leader at step %d; planning stops", self.spec.name, plan.step)
                return False
            parts = self.parts.at(plan.step, cursors[plan.step])
            extra = {"state": state, "gen": self.gen, "run": self.run_id, "cut": self.last_cut, "parts": parts}
            extra["skipped"] = True  # nodes release the step's pieces and hand it to nobody
            self.sent[plan.step] = (plan, extra, self.parts.table)
            self.states.record(plan.step, state)
            self.planned = plan.step + 1
            for batch in self.frame_batches(plan, extra, self.parts.table, self.ctx.live_nodes()):
                for nid, (header, buf) in batch.items():
                    await self.ctx.rpc.quiet_send(nid, header, buf)
        if skipped:
            log.info("job %s: skipped steps %d..%d (loader.skip)", self.spec.name, skipped[0].step, skipped[-1].step)
        return True

    def frames(
        self, plan: StepPlan, extra: dict, table: PartsTable, nodes: list[str], only: str | None = None
    ) -> Mapping[str, tuple[dict, bytes | memoryview]]:
        """The plan frame of every node in ``nodes`` (``only``: of that one): its slice, with ``extra`` in the
        header. Without this node's run of the job (no layout to slice by) every node gets the whole plan."""
        out: dict[str, tuple[dict, bytes | memoryview]] = {}
        for batch in self.frame_batches(plan, extra, table, nodes, only):
            out.update(batch)
        return out

    def frame_batches(
        self, plan: StepPlan, extra: dict, table: PartsTable, nodes: list[str], only: str | None = None
    ) -> Iterator[Mapping[str, tuple[dict, bytes | memoryview]]]:
        """``frames``, ``SEND_BATCH`` nodes at a time, each batch encoded when the one before is taken: a
        step's first slices leave while the rest are encoded (its nodes decode meanwhile)."""
        run = self.runs.held(self.digest, self.run_id)
        if run is None:
            whole = encode_plan(plan, job=self.spec.name, digest=self.digest, token=self.token)
            whole[0].update(extra)
            yield {nid: whole for nid in nodes if only in (None, nid)}
            return
        cuts = self.slicer.cuts(
            plan.source,
            plan.ordinal,
            plan.group,
            dp=int(plan.stats.micro_cost.shape[0]),
            nodes=sorted(set(nodes) | ({only} if only else set())),
            rank_nodes=self.rank_nodes,
            layout=run.layout,
            table=table,
        )
        if only is not None:
            cuts = {only: cuts[only]}
        rest = {k: v for k, v in extra.items() if k != "state"}
        me = self.ctx.node_id
        for got in iter_slices(
            plan,
            cuts,
            job=self.spec.name,
            digest=self.digest,
            token=self.token,
            state=extra.get("state"),
            batch=SEND_BATCH,
        ):
            out: dict[str, tuple[dict, bytes | memoryview]] = dict(got)
            for header, _ in out.values():
                header.update(rest)
            # this node's own slice is handed over in memory, not sent: a copy of it, or the plans this node
            # holds (up to KEEP_STATES steps) would each keep the one buffer of its batch's slices alive
            if me in out:
                header, buf = out[me]
                out[me] = (header, bytes(buf))
            yield out

    async def set_mixture(self, weights: dict) -> int:
        """Change the mixture from the first step no constructor on any node has taken up (returned): hold every
        node, cut there, re-plan from that step's state; nodes drop their later plans.

        The nodes are told the cut before etcd records it: a leader that dies in between leaves nodes that
        dropped plans and an etcd without the change, so its successor re-plans those steps with the old
        mixture (the rank is told to retry); once etcd has it, a successor plans with the new one. Either way
        every node builds one consistent sequence of steps."""
        async with self._plan_lock:
            if self.stopped or self.planner is None:
                raise PeerLostError(f"job {self.spec.name}: not planning here (starting or leader changed); retry")
            nodes = self.ctx.live_nodes()
            frame: dict = {"t": "mixcut", "digest": self.digest, "run": self.run_id, "cut": None, "token": self.token}
            self.mixing = True
            try:
                replies = await asyncio.gather(
                    *(
                        self.ctx.rpc.request(
                            n, {"t": "mixhold", "digest": self.digest, "run": self.run_id, "token": self.token}
                        )
                        for n in nodes
                    )
                )
                cut = min(max(int(h["committed"]) for h, _ in replies) + 1, self.planner.step)
                planner = self.states.rebase(self.planner, cut, weights)  # ConfigError: nothing changed
                state = planner.state_dict()
                frame.update(cut=cut, gen=self.gen + 1)
            finally:  # release every node (with the cut, or without one when the change failed)
                for n in nodes:
                    await self.ctx.rpc.quiet_send(n, frame)
                self.mixing = False
            end = self.planner.step
            self.gen += 1  # the nodes dropped plans of steps >= cut: never send those again
            self.last_cut = cut
            self.planned = min(self.planned, cut)
            for s in [s for s in self.sent if s >= cut]:
                del self.sent[s]
            for n in self.acks:
                self.acks[n] = min(self.acks[n], cut - 1)
            if not await self.store.save_cut(cut, state, end):
                raise PeerLostError(
                    f"job {self.spec.name}: lost the leadership while changing the mixture; the "
                    "next leader continues without the change: call set_mixture again"
                )
            self.planner, self.planned = planner, cut
            self.mix_states[cut] = state
            for s in [s for s in self.mix_states if s > cut]:
                del self.mix_states[s]
        self.acked.set()
        log.info(
            "job %s: mixture %s from step %d (%d planned step(s) re-planned)", self.spec.name, weights, cut, end - cut
        )
        return cut

    def view(self, run: HeldRun, loop: asyncio.AbstractEventLoop) -> ThreadView:
        """The planner's MetadataView here: lengths asked of the partition owners (from the planner thread)."""
        view = ThreadView(run.lengths, loop, closed="no longer leader", ask_vision=run.vision)
        self.views.add(view)
        if self.stopped:
            view.close()
        return view

    def low_ack(self) -> int:
        """The lowest step fed on a live node that has ranks of the job (a dead node never holds planning back)."""
        live = set(self.ctx.live_nodes())
        if self._rank_set[0] != len(self.rank_nodes) or self._rank_set[1] != self._ranks_moved:
            self._rank_set = (len(self.rank_nodes), self._ranks_moved, frozenset(self.rank_nodes.values()))
        nodes = self._rank_set[2] & live
        low = min((self.acks.get(n, -1) for n in nodes), default=-(1 << 62))
        self._low = (low, sum(1 for n in nodes if self.acks.get(n, -1) <= low))
        return low

    # ---- catching up (a node that lacks plans, ranks that rejoin) -------------------------------------------
    def update_ranks(self, per: dict[str, dict]) -> None:
        """A later report: ranks that (re)joined on a node are told the run (a restarted follower rejoins)."""
        if self.start_frame is None:
            return
        changed = False
        for nid, j in per.items():
            for r in j["ranks"]:
                if self.rank_nodes.get(int(r)) != nid:
                    self.rank_nodes[int(r)] = nid
                    self._ranks_moved += 1
                    changed = True
            if j["ranks"] and not j["running"]:
                changed = True
        if changed:
            self.tasks.spawn(self._rejoin(per), name="rejoin")

    async def _rejoin(self, per: dict[str, dict]) -> None:
        if self.start_frame is None:
            return  # not started (update_ranks() checks it too)
        positions = dict(self.start_frame["positions"])
        for j in per.values():
            for r, info in j["ranks"].items():
                if info.get("resume"):
                    positions[str(r)] = info["pos"]
        frame = {
            **self.start_frame,
            "rank_nodes": {str(r): n for r, n in self.rank_nodes.items()},
            "positions": positions,
            "token": self.token,
            "insts": self.insts_frame(),
        }
        for nid, j in per.items():
            if j["ranks"] and not j["running"]:
                low = min(int(info["pos"][0]) for info in j["ranks"].values())
                delay = 0.05
                while not self.stopped:  # a node that restarted at once is linked again shortly
                    try:
                        await self.ctx.rpc.send(nid, frame)
                        break
                    except PeerLostError:
                        await asyncio.sleep(delay)  # back-off until the link to the restarted node is up
                        delay = min(2 * delay, 0.5)
                await self.replay(nid, low)

    def relink(self, nid: str, step: int) -> None:
        """Our link to ``nid`` is (back) up: tell it the run first, then send it the plans from ``step`` again. A
        node that restarted with no ranks of the job (it only owns data) has not heard of the run otherwise, yet
        the others deal it partitions again and fetch from it. The frame names no registrations: it starts no job
        there (``_rejoin`` does, for ranks that come back)."""
        if self.stopped or self.start_frame is None:
            return
        frame = {
            **self.start_frame,
            "rank_nodes": {str(r): n for r, n in self.rank_nodes.items()},
            "token": self.token,
            "insts": {},
        }
        self.tasks.spawn(self._relink(nid, frame, step), name=f"relink-{nid}")

    async def _relink(self, nid: str, frame: dict, step: int) -> None:
        await self.ctx.rpc.quiet_send(nid, frame)
        self.resend(nid, step)

    def resend(self, nid: str, step: int) -> None:
        """Send a node the plans of [step, planned) again (it lost some): from memory, else re-planned."""
        if self.stopped or self.start_frame is None or step >= self.planned or nid in self._resending:
            return
        t = self.tasks.spawn(self._resend(nid, max(step, 0)), name=f"resend-{nid}")
        self._resending[nid] = t
        t.add_done_callback(lambda _t: self._resending.pop(nid, None))

    async def _resend(self, nid: str, step: int) -> None:
        end = self.planned
        log.info("job %s: re-sending the plans of steps %d..%d to %s", self.spec.name, step, end - 1, nid)
        for s in range(step, end):
            kept = self.sent.get(s)
            if kept is None:  # no longer in memory (or planned by an earlier leader): re-plan from etcd
                await self.replay(nid, s)
                return
            plan, extra, table = kept
            for header, buf in self.frames(plan, extra, table, self.ctx.live_nodes(), only=nid).values():
                await self.ctx.rpc.quiet_send(nid, header, buf)

    async def replay(self, nid: str, low: int) -> None:
        """Re-plan steps [low, now) for a node that rejoined (deterministic: the same plans)."""
        found = await self.store.load_at_or_before(low)
        if found is None:
            return
        step, state = found
        planner = Planner(planner_config(self.spec), state=state)
        run = self.runs.held(self.digest, self.run_id)
        if run is None:
            return
        view = self.view(run, asyncio.get_running_loop())
        gen, last_cut = self.gen, self.last_cut  # a mixture change meanwhile makes these plans stale (nodes drop them)
        try:
            while planner.step < self.planned and not self.stopped:
                if planner.step in self.mix_states and planner.step > step:  # a mixture change from this step on
                    planner = Planner(planner_config(self.spec), state=self.mix_states[planner.step])
                pending = planner.pending_skip
                sizes = await source_sizes(self.spec) if pending is not None and pending.defer else []
                skipped, states, _ = await asyncio.to_thread(skip_pending, planner, view, sizes)  # loader.skip
                for p in skipped:
                    table = self.parts.table
                    extra = {"state": states[p.step], "gen": gen, "run": self.run_id, "cut": last_cut, "skipped": True}
                    extra["parts"] = table.wire()
                    for header, buf in self.frames(p, extra, table, self.ctx.live_nodes(), only=nid).values():
                        await self.ctx.rpc.quiet_send(nid, header, buf)
                if skipped:
                    continue
                st = planner.state_dict()
                plan = await asyncio.to_thread(planner.plan_step, view)
                table = self.parts.table
                extra = {"state": st, "gen": gen, "run": self.run_id, "cut": last_cut, "parts": table.wire()}
                for header, buf in self.frames(plan, extra, table, self.ctx.live_nodes(), only=nid).values():
                    await self.ctx.rpc.quiet_send(nid, header, buf)
        finally:
            self.views.discard(view)
