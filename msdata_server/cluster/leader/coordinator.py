"""The leader's side of cluster jobs: the start barrier across nodes, one planner per job, plans to every node.

From the nodes' reports the leader sees which ranks of which job are registered where. A new run starts when
the whole mesh is registered (start state as on one node: states brought by ranks, else the etcd checkpoint
when ranks resume, else the beginning). A run that nodes report as already running (the old leader died)
resumes from the etcd state at or before the lowest step any node still lacks; plans are deterministic, so
re-sent ones equal the old ones and nodes ignore them. The planner state of each step goes to etcd, fenced.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from msdata_client.spec import JobSpec

from ...autoscale.cluster import RunView, Scaler, run_view, start_costs
from ...autoscale.controller import SPINUP_S
from ...checkpoint import RankStart, start_point
from ...errors import CheckpointError, ClosedError, MsdataError, PeerLostError
from ...job.view import ThreadView
from ...lineage.skip import skip_ahead
from ...planner import Planner
from ...planner.history import StateHistory
from ...planner.spec import planner_config
from ...tasks import TaskSet
from ..parts import PartsTable, RunParts, longest
from ..placement import partition_costs, place_split
from ..planwire import encode_plan
from .catchup import CatchUp
from .statestore import EtcdStateStore

__all__ = ["Coordinator", "JobCoordinator"]

log = logging.getLogger(__name__)


def _resuming(entry: dict) -> bool:
    """A registration whose ranks reconnect mid-run (their node server restarted): it rejoins the run."""
    return any(info.get("resume") for info in entry["ranks"].values())


def _pick(entries: list[tuple[str, dict]], keep) -> dict[str, dict]:
    """At most one entry per node among those ``keep(nid, entry)`` keeps (the one with the most ranks)."""
    per: dict[str, dict] = {}
    for nid, j in entries:
        if keep(nid, j) and (nid not in per or len(j["ranks"]) > len(per[nid]["ranks"])):
            per[nid] = j
    return per


class Coordinator:
    """All job coordinators of this node while it leads; the latest report of every node."""

    def __init__(self, jobs) -> None:
        self.jobs = jobs
        self.reports: dict[str, dict] = {}  # node -> its latest "jobs" report
        self.coords: dict[str, JobCoordinator] = {}
        self.ended: dict[str, JobCoordinator] = {}  # the last run of a job that ended (a new run waits for it)
        self.leading = False
        cfg = jobs.node.config.autoscale
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
        live = set(self.jobs.live_nodes())
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
            c.catchup.resend(str(frame["node"]), int(frame["step"]))

    def scale(self) -> None:
        """Send the nodes whose worker targets moved their new ones (fenced; only while we lead)."""
        if not self.leading:
            return
        runs = [v for v in (c.scale_view() for c in self.coords.values()) if v is not None]
        reports = {nid: r["autoscale"] for nid, r in self.reports.items() if isinstance(r.get("autoscale"), dict)}
        token = int(self.jobs.cluster.election.token or 0)
        lead_s = self.jobs.node.config.autoscale.interval + SPINUP_S
        for nid, frame in self.scaler.update(runs, reports, token=token, lead_s=lead_s).items():
            self.jobs.tasks.spawn(self.jobs.rpc.quiet_send(nid, frame), name="scale")
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
            c.catchup.update(c.own(by.get(digest, [])))
            c.catchup.relink(nid, c.acks.get(nid, c.low_ack()) + 1)

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
        live = set(self.jobs.live_nodes())
        for digest, entries in by.items():
            running = self.coords.get(digest)
            if running is not None:
                running.catchup.update(running.own(entries, adopt=True))
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
            c = self.coords[digest] = JobCoordinator(self, spec, digest, rid, per)
            c.tasks.spawn(c.run(per, resume=resume, after=self.ended.pop(digest, None)), name=f"coordinate-{spec.name}")

    async def aclose(self) -> None:
        for c in list(self.coords.values()):
            c.stop()
            await c.tasks.cancel_all("closing")
        self.coords.clear()


class JobCoordinator:
    """One job run on the leader: its planner (in a thread), plans to every node, states to etcd."""

    def __init__(self, parent: Coordinator, spec: JobSpec, digest: str, run_id: str, per: dict[str, dict]):
        self.parent = parent
        self.jobs = parent.jobs
        self.spec = spec
        self.digest = digest
        self.run_id = run_id
        self.insts: dict[str, set[str]] = {nid: {str(j["inst"])} for nid, j in per.items()}  # registrations in it
        self._closed = asyncio.Event()
        self.views: set[ThreadView] = set()  # planner threads' look-ups, cancelled when we stop
        self.tasks = TaskSet(f"coordinator {spec.name}", on_error=self._failed)
        cl = self.jobs.cluster
        self.store = EtcdStateStore(
            cl.etcd, cl.election, prefix=self.jobs.node.config.cluster.prefix, job=spec.name, digest=digest, keep=32
        )
        self.acks: dict[str, int] = {}
        self.acked = asyncio.Event()
        self.rank_nodes: dict[int, str] = {}
        self.start_frame: dict | None = None
        self.stopped = False
        self.planned = 0  # the next step the main planner will send
        self.sent: dict[int, tuple[dict, bytes]] = {}  # encoded plans not yet fed on every live node (to re-send)
        self.catchup = CatchUp(self)
        self.planner: Planner | None = None
        self._plan_lock = asyncio.Lock()  # one step planned and sent, or one mixture change, at a time
        self.gen = 0  # mixture changes so far (plans carry it; nodes drop plans of an older one)
        self.last_cut: int | None = None  # the step of the latest change (plans carry it: a node that missed it)
        self.mixing = False  # a change holds the nodes right now
        self.states = StateHistory(256)  # recent planner states by step (a mixture change re-plans from one)
        self.mix_states: dict[int, dict] = {}  # cut -> the state with that change (a replay switches to it)
        self.parts = RunParts(spec.name, spec.source_names(), PartsTable.base(len(spec.sources), 1))

    def _failed(self, task, exc) -> None:
        log.error("coordinator of %s failed: %s", self.spec.name, exc, exc_info=exc)

    def stop(self, end: bool = False) -> None:
        self.stopped = True
        for view in list(self.views):
            view.close()
        self.acked.set()

        async def wind_down():
            try:
                await self.tasks.cancel_all("coordinator stopped")
            finally:
                self._closed.set()

        self.jobs.tasks.spawn(wind_down(), name="coordinator-stop")
        if end:
            frame = {"t": "jstop", "digest": self.digest, "run": self.run_id}
            for nid in self.jobs.live_nodes():
                self.jobs.tasks.spawn(self.jobs.rpc.quiet_send(nid, frame), name="jstop")

    def own(self, entries: list[tuple[str, dict]], adopt: bool = False) -> dict[str, dict]:
        """The nodes' entries that belong to this run; with ``adopt``, registrations that rejoin it (ranks that
        reconnect after their node server restarted) become part of it. Fresh ones are the next run's."""
        if adopt:
            for nid, j in entries:
                if not j.get("run") and j["ranks"] and _resuming(j):
                    self.insts.setdefault(nid, set()).add(str(j["inst"]))
        return _pick(entries, lambda n, j: j.get("run") == self.run_id or str(j.get("inst")) in self.insts.get(n, ()))

    def ack(self, nid: str, step: int) -> None:
        if step > self.acks.get(nid, -1):
            self.acks[nid] = step
            self.acked.set()

    @property
    def token(self) -> int:
        return int(self.jobs.cluster.election.token or 0)

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
            state, skipped = await skip_ahead(self.spec, state, sp.skip, self.jobs.node.pool, defer=sp.defer)
            for step, st in skipped.items():
                await self.store.save(step, st)
        return state, {r: list(p) for r, p in sp.positions.items()}

    def scale_view(self) -> RunView | None:
        """This run as the autoscaler sizes it (None until it plans, or once it stopped)."""
        run = self.jobs.runs.get(self.digest)
        if self.stopped or self.planner is None or run is None or run.id != self.run_id:
            return None
        return run_view(self.spec, self.planner, run.shard.where, self.run_id)

    def insts_frame(self) -> dict[str, list[str]]:
        return {nid: sorted(v) for nid, v in self.insts.items()}

    async def run(self, per: dict[str, dict], resume: bool, after: JobCoordinator | None = None) -> None:
        if after is not None:  # the previous run of this job winds down first (its last etcd writes included)
            await after._closed.wait()
        try:
            state, positions = await self._start_state(per, resume)
        except MsdataError as e:
            log.error("job %s cannot start: %s", self.spec.name, e)
            if self.parent.coords.get(self.digest) is self:  # the next report tries again (a stale one failed)
                del self.parent.coords[self.digest]
            return
        cfg = planner_config(self.spec)
        planner = Planner(cfg, state=state)
        self.rank_nodes = {int(r): nid for nid, j in per.items() for r in j["ranks"]}
        live = self.jobs.live_nodes()
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
        held = self.jobs.runs.get(self.digest)  # a resumed run keeps the partitions of the run the nodes hold
        held = held if resume and held is not None and held.id == self.run_id else None
        self.start_frame["nparts"] = held.shard.nparts if held is not None else self.start_frame["nparts"]
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
            await self.jobs.rpc.quiet_send(nid, frame)
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

    def _costs(self, nparts: int, resume: bool, held) -> list[float] | None:
        """Partition costs for placement: a resumed run keeps those of the run the nodes hold; a new one weighs
        the declared share by the measured cost per token (``autoscale.cluster.start_costs``)."""
        if resume:
            return list(held.shard.costs) if held is not None else None
        declared = partition_costs(self.spec.mix, self.spec.source_names(), nparts)
        return start_costs(self.spec.name, self.spec.source_names(), declared, self.parent.reports)

    # ---- planning -------------------------------------------------------------------------------------------
    @property
    def _planning(self) -> Planner:
        """The planner of this run (set when it starts planning; a mixture change replaces it)."""
        if self.planner is None:
            raise ClosedError(f"job {self.spec.name}: the run has not started planning")
        return self.planner

    async def _plan_loop(self, planner: Planner) -> None:
        loop = asyncio.get_running_loop()
        run = self.jobs.runs.get(self.digest)  # our own jstart went through the same handler, synchronously
        if run is None or run.id != self.run_id:
            raise ClosedError(f"job {self.spec.name}: this node did not take up the run it started")
        view = self.view(run, loop)
        window = self.spec.prefetch_steps + 1
        self.planner, self.parts.table = planner, run.shard.where.table  # a resumed run: the table nodes hold
        while not self.stopped:
            while not self.stopped and self._planning.step > self.low_ack() + window:
                self.acked.clear()
                await self.acked.wait()
            if self.stopped:
                return
            async with self._plan_lock:
                if not await self._plan_one(view):
                    return

    async def _plan_one(self, view) -> bool:
        """Plan, record and send one step (under the plan lock); False once we no longer lead."""
        planner = self._planning
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
        header, buf = encode_plan(plan, job=self.spec.name, digest=self.digest, token=self.token)
        parts = self.parts.at(step, state.get("cursor"))  # splits and merges from this step (cluster.parts)
        header.update(state=state, gen=self.gen, run=self.run_id, cut=self.last_cut, parts=parts)
        self.sent[step] = (header, buf)
        self.states.record(step, state)
        low = self.low_ack()
        for old in [s for s in self.sent if s <= low]:
            del self.sent[old]
        self.planned = step + 1
        for nid in self.jobs.live_nodes():
            await self.jobs.rpc.quiet_send(nid, header, buf)
        return True

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
            nodes = self.jobs.live_nodes()
            frame: dict = {"t": "mixcut", "digest": self.digest, "run": self.run_id, "cut": None, "token": self.token}
            self.mixing = True
            try:
                replies = await asyncio.gather(
                    *(
                        self.jobs.rpc.request(
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
                    await self.jobs.rpc.quiet_send(n, frame)
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
        self.parent.scale()  # the nodes' workers follow the new mixture at once
        return cut

    def view(self, run, loop: asyncio.AbstractEventLoop) -> ThreadView:
        """The planner's MetadataView here: lengths asked of the partition owners (from the planner thread)."""
        view = ThreadView(run.shard.lengths, loop, closed="no longer leader", ask_vision=run.shard.vision)
        self.views.add(view)
        if self.stopped:
            view.close()
        return view

    def low_ack(self) -> int:
        """The lowest step fed on a live node that has ranks of the job (a dead node never holds planning back)."""
        live = set(self.jobs.live_nodes())
        nodes = {n for n in self.rank_nodes.values() if n in live}
        return min((self.acks.get(n, -1) for n in nodes), default=-(1 << 62))
