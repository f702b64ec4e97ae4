"""The data constructor of one receiving group: one loop for one node and for a cluster.

It takes up the group's steps in order (through the plan feed's gate), fetches a step's payloads from the
payload source while the step before is being built, builds each micro-batch once, in place, in a ring slot
(``batch.build_micro_batch``), and sends a small notice to every reader of the group (TP ranks share the
slot; CP ranks read their own zig-zag slice; PP stages see their fields). Bounded: one step staged, ring
slots waited for, never dropped or overwritten.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

import numpy as np

from msdata_client.ring import FieldLayout, layout_fields
from msdata_client.spec import JobSpec

from ..batch import (
    ImageShape,
    MicroBatchPieces,
    VideoShape,
    build_micro_batch,
    count_segments,
    field_specs,
    image_shape,
    video_shape,
)
from ..document import VlmSample
from ..planner import StepPlan
from ..tasks import TaskSet
from .images import image_keys
from .ranks import RankPosition, RankRegistry
from .rings import ServerRing, round_slot
from .seams import PayloadSource, PlanFeed
from .steps import Group

__all__ = ["Constructor", "estimate_slot"]

log = logging.getLogger(__name__)

THREAD_BUILD_BYTES = 4 << 20  # build larger micro-batches in a thread so the loop keeps serving

_Staged = tuple[StepPlan, list[tuple[int, slice]], list[np.ndarray]]


def estimate_slot(spec: JobSpec, cp: int) -> int:
    """Slot size for a typical micro-batch: row fields exactly, per-document ids for docs of >= 64 tokens; with
    pictures, pixels for half the tokens as image placeholders; with video, for a quarter as image and a quarter
    as video placeholders (a fuller micro-batch grows the ring)."""
    tokens = spec.rows * spec.seq_len
    docs = tokens // 64 + spec.rows + 1
    keys = image_keys(spec)
    images = videos = None
    if keys is not None:
        share = 2 if keys.video is None else 4
        images = ImageShape(patches=tokens // share * keys.merge**2, images=docs, row=keys.row)
        if keys.video is not None:
            rows = tokens // share * keys.merge**2
            videos = VideoShape(rows=rows, videos=docs, blocks=rows // keys.merge**2, row=keys.video_row)
    _, nbytes = layout_fields(
        field_specs(
            rows=spec.rows,
            seq_len=spec.seq_len,
            n_pieces=docs,
            n_segments=docs + spec.rows,
            cp=cp,
            images=images,
            videos=videos,
        )
    )
    return round_slot(nbytes)


class Constructor:
    """Builds the micro-batches of one group whose ranks read on this node."""

    def __init__(
        self,
        *,
        spec: JobSpec,
        group: Group,
        ranks: RankRegistry,
        feed: PlanFeed,
        payloads: PayloadSource,
        cp: int,
        tasks: TaskSet,
    ):
        assert group.rings is not None, "a constructor needs the group's rings"
        self.spec = spec
        self.group = group
        self.rings = group.rings
        self.ranks = ranks
        self.feed = feed
        self.payloads = payloads
        self.cp = cp
        self.tasks = tasks
        self.images = image_keys(spec)  # None: a job without pictures has no image keys

    async def run(self) -> None:
        staged: asyncio.Queue[_Staged] = asyncio.Queue(1)
        fetching = self.tasks.spawn(self._fetch(staged), name=f"{self.spec.name}-fetch-{self.group.index}")
        scratch: dict = {}
        try:
            while True:
                plan, want, toks = await staged.get()
                at = 0
                for m, sl in want:
                    n = sl.stop - sl.start
                    part, at = toks[at : at + n], at + n
                    readers = self._readers(plan.step, m)
                    if readers:  # else its readers left meanwhile (its pieces were counted done when fetched)
                        await self._build(plan, m, sl, part, readers, scratch)
        finally:
            fetching.cancel()

    def _readers(self, step: int, micro: int) -> list[int]:
        return self.ranks.readers(self.group.readers, RankPosition(step, micro))

    async def _fetch(self, staged: asyncio.Queue[_Staged]) -> None:
        """Take up steps in order; fetch what has readers, skip what has none (their pieces count done)."""
        while True:
            plan = await self.group.queue.get()
            if not await self.feed.take(plan):
                continue  # a mixture change cut this step while it waited at the gate
            self.group.committed = plan.step  # from here on this step is built as planned, whatever happens
            want: list[tuple[int, slice]] = []
            skip: list[tuple[int, slice]] = []
            for m, sl in self._micro_slices(plan):
                (want if self._readers(plan.step, m) else skip).append((m, sl))
            if skip:
                await self.payloads.skip(*_columns(plan, skip, ("source", "ordinal")))
            toks = (
                await self.payloads.fetch(*_columns(plan, want, ("source", "ordinal", "offset", "length")))
                if want
                else []
            )
            await staged.put((plan, want, toks))

    def _micro_slices(self, plan: StepPlan):
        """(micro-batch, slice of the plan) of this group's micro-batches of a step, in order."""
        mb = self.spec.micro_batches
        key = plan.group.astype(np.int64) * mb + plan.micro
        g = self.group.index
        for m in range(mb):
            lo, hi = np.searchsorted(key, [g * mb + m, g * mb + m + 1])
            yield m, slice(int(lo), int(hi))

    async def _build(self, plan: StepPlan, m: int, sl: slice, toks: list, readers: list[int], scratch: dict) -> None:
        spec = self.spec
        pos = RankPosition(plan.step, m)
        src, ords = plan.source[sl], plan.ordinal[sl]
        sids = np.empty(len(src), dtype=np.int64)
        for s in np.unique(src).tolist():
            sel = src == s
            sids[sel] = self.payloads.sample_ids(s, ords[sel])
        keys = self.images
        video = keys is not None and keys.video is not None
        pieces = _pieces(plan.row[sl], toks, sids, src.astype(np.int64), pictures=keys is not None, video=video)
        nseg = count_segments(pieces, spec.rows, spec.seq_len)
        images = None if keys is None else image_shape(pieces, keys.row)
        videos = video_shape(pieces, keys.video_row) if keys is not None and video else None
        layouts, nbytes = layout_fields(
            field_specs(
                rows=spec.rows,
                seq_len=spec.seq_len,
                n_pieces=len(toks),
                n_segments=nseg,
                cp=self.cp,
                images=images,
                videos=videos,
            )
        )
        ring, slot = await self.rings.acquire(nbytes)
        try:
            out = ring.views(slot, layouts)
            build = partial(
                build_micro_batch,
                out,
                pieces,
                rows=spec.rows,
                seq_len=spec.seq_len,
                pad_id=spec.pad_id,
                cp=self.cp,
                step=pos.step,
                micro=pos.micro,
                scratch=scratch,
            )
            if nbytes >= THREAD_BUILD_BYTES:
                await asyncio.to_thread(build)
            else:
                build()
            del build
            del out
        except BaseException:
            ring.table.abandon(slot)
            raise
        self._publish(ring, slot, pos, layouts, readers, nbytes)

    def _publish(
        self,
        ring: ServerRing,
        slot: int,
        pos: RankPosition,
        layouts: list[FieldLayout],
        readers: list[int],
        nbytes: int,
    ) -> None:
        live = self.ranks.present(readers)  # an away rank keeps its notices until it comes back (ranks.py)
        ring.table.publish(slot, live)
        if not live:
            ring.freed.set()
        base = ring.offset(slot)
        for r in live:
            self.ranks.deliver(
                r,
                {
                    "t": "batch",
                    "ring": ring.id,
                    "slot": slot,
                    "base": base,
                    "step": pos.step,
                    "micro": pos.micro,
                    "fields": self.ranks.fields(r, layouts),
                },
            )
        self.group.published += 1
        self.group.bytes_published += nbytes


def _pieces(
    row: np.ndarray, docs: list, sids: np.ndarray, srcs: np.ndarray, *, pictures: bool, video: bool = False
) -> MicroBatchPieces:
    """MicroBatchPieces of fetched pieces: token arrays, or picture pieces (``VlmSample``) whose images go to
    the image keys and clips to the video keys (a job without pictures refuses them: its batches have no image
    keys; one without video refuses clips)."""
    tokens, images, videos = [], [], []
    for d in docs:
        if isinstance(d, VlmSample):
            if not pictures:
                raise ValueError(
                    "a transform returned a picture document in a job without pictures; use the "
                    "msdata_server.transforms:vlm transform or cost = 'vlm'"
                )
            if len(d.video_grid_thw) and not video:
                raise ValueError("a transform returned a clip in a job without video; set video_key in its vlm")
            tokens.append(d.tokens)
            images.append((d.pixel_values, d.image_grid_thw) if len(d.image_grid_thw) else None)
            videos.append((d.pixel_values_videos, d.video_grid_thw) if len(d.video_grid_thw) else None)
        else:
            tokens.append(d)
            images.append(None)
            videos.append(None)
    return MicroBatchPieces(
        row=row,
        tokens=tokens,
        sample_ids=sids,
        source_ids=srcs,
        images=images if pictures else None,
        videos=videos if video else None,
    )


def _columns(plan: StepPlan, parts: list[tuple[int, slice]], names: tuple[str, ...]) -> list[np.ndarray]:
    """The named plan columns of several micro-batches' slices, concatenated in order."""
    return [np.concatenate([getattr(plan, k)[sl] for _, sl in parts]) for k in names]
