"""SourceLoader: one per (source, partition); a bounded read-ahead of transformed samples, addressed by ordinal.

Partition (k, n) owns the ordinals whose batch index ``ordinal // batch`` is congruent to k modulo n, so n
loaders (on one node or several) split a source's work by whole batches without changing its order.

Bound: the loader schedules a batch only when its last ordinal is at most ``readahead`` of this partition's
samples beyond the highest ordinal asked for so far (by ``lengths``/``tokens``; ``seek`` resets it), and, past
that ordinal, only while the payloads held weigh less than ``readahead_bytes`` (decoded pictures are large),
with a few batches in flight; payloads stay until ``release``d. Batches asked for explicitly are always read,
and a released batch asked for again is read again (reads are deterministic). A loader built without its own
``readahead`` takes its share of the node's budget (``budget.py``): both bounds shrink as loaders are added.

Plans followed (``follow_plans``, the single-node jobs): a loader told how far the plans reach (``planned_to``)
whose read-ahead is less than a batch (a node of more than 64 sources) keeps the payloads of samples up to
``readahead`` past that point and only the lengths of those beyond (the planner reads at least a batch of
lengths of every source it draws from, far ahead of what it plans); such a sample asked for later is read
again with the next ``readahead`` samples (``_refill``). With a batch or more of read-ahead, every payload read
is held, as without plans followed (reading twice would cost the throughput of a few busy sources).

First read in parts: such a loader (plans followed, read-ahead under a batch) reads the first batch it reads in
two parts: its first ``HEAD`` samples (or as many as asked for, if more), then, when a sample beyond them is
asked for or the read-ahead reaches the batch, the rest; later batches are read whole. The planner's first request
to a source is ``HEAD`` lengths (planner/lengths.py FIRST_CHUNK; 1,024 sources' first step takes one sample of
each), and a batch of 64 samples spread over 16 files decodes some 58 row groups where 4 samples decode 4 at most.

This module schedules; ``_readbuffer`` accounts for what is held, ``_readcounts`` for what was read,
``_sampleread`` reads and transforms, ``_ordinals`` maps ordinals to this partition's batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BadSampleError, ClosedError, ConfigError, MsdataError
from ..sources.base import BadSample, Source
from .budget import ReadAheadBudget, node_budget
from .ordinals import Partition
from .readbuffer import ReadBatch, ReadBuffer, compact
from .readcounts import ReadCounts
from .sampleread import SampleReader

if TYPE_CHECKING:
    from ..pool import WorkerPool

__all__ = ["LoaderStats", "SourceLoader"]

log = logging.getLogger(__name__)

READAHEAD_BYTES = 256 << 20  # payloads held past the highest ordinal asked for (decoded pictures are large)
HEAD = 4  # samples a batch's first part reads, where batches are read in parts (module doc)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderStats:
    """A loader's progress and buffer; ``ready`` counts samples read and not yet released."""

    name: str
    partition: tuple[int, int]
    samples_per_s: float
    samples_done: int
    bytes_read: int
    ready: int
    buffer_fill: float  # ready / readahead
    memory_bytes: int  # payloads held
    read_s: float  # seconds spent reading records (cumulative)
    tokens_read: int  # tokens of the samples read (cumulative)
    bad_samples: Mapping[str, int]
    errors: int
    inflight: int
    cursor: int  # the next ordinal the read-ahead will schedule
    held_ahead: int  # of ``ready``: payloads beyond the highest ordinal asked for; at most ``readahead``
    readahead: int  # the read-ahead bound, in samples of this partition
    readahead_bytes: int  # ...and in bytes of payloads held (past the highest ordinal asked for)
    memory: Mapping[str, int]  # bytes by what holds them: read_ahead, order, metadata, handles, decoded
    open_files: int  # of the node's open-handle LRU, this loader's source's

    def figures(self) -> dict:
        """These statistics as status JSON (scalars and tables only; the tables copied). What ``asdict`` gave,
        without its deep copy: status asks for every loader every second (1,024 sources: ~1 s of CPU a second)."""
        out: dict = {}
        for k in _STAT_FIELDS:
            v = getattr(self, k)
            if isinstance(v, dict):
                out[k] = dict(v)
            elif isinstance(v, (int, float, str, type(None))):
                out[k] = v
        return out


_STAT_FIELDS = tuple(f.name for f in fields(LoaderStats))


def _int_at_least(what: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"loader {what}={value!r} must be an integer >= {low}")


class SourceLoader:
    """One per (source, partition): the source's file-access state, held once per node; a bounded read-ahead
    of transformed samples addressed by ordinal. The caller owns (and closes) the source and the pool.

    Size: the API the node asks of a source (lengths, vision, tokens, release, seek, stop_at, statistics) and the
    scheduling they share state with; what is held, counted, read and owned is in the modules beside it."""

    def __init__(
        self,
        source: Source,
        pool: WorkerPool | None,
        *,
        transform: str | None,
        seed: int,
        readahead: int | None = None,
        batch: int = 64,
        partition: tuple[int, int] = (0, 1),
        readahead_bytes: int | None = None,
        budget: ReadAheadBudget | None = None,
    ):
        _int_at_least("batch", batch, 1)
        if readahead is not None:
            _int_at_least("readahead", readahead, 0)
        if readahead_bytes is not None:
            _int_at_least("readahead_bytes", readahead_bytes, 0)
        k, n = partition
        if not (isinstance(k, int) and isinstance(n, int) and n >= 1 and 0 <= k < n):
            raise ConfigError(f"loader {partition=} must be (k, n) with 0 <= k < n")
        self.source = source
        self.pool = pool
        self.transform = transform
        self.name = source.name
        self.seed = int(seed)
        # None: a share of the node's budget (both, when neither is given); a number: this loader's own bound
        self._own = (readahead, readahead_bytes)
        shared = readahead is None or (readahead_bytes is None and budget is not None)
        self._budget: ReadAheadBudget | None = (budget or node_budget()) if shared else None
        self.batch = batch
        self.partition = (k, n)
        self._part = Partition(k, n, batch)
        self._reader = SampleReader(source, pool, transform, self.seed)
        self._buf = ReadBuffer(self._part)
        self._cursor = 0  # local batch index the read-ahead schedules next
        self._end: int | None = None  # global batch the read-ahead stops before (a new partitioning reads on)
        self._high = -1  # highest local sample index asked for
        self._planned: int | None = None  # highest local sample index planned (None: plans not followed)
        self._warming: int | None = None  # the first batch read for the budget's ``warm``, until it is read
        self._parted = False  # a batch was read in parts (the first one only: module doc)
        self._inflight = 0
        self._tasks: set[asyncio.Task] = set()
        self._started = self._closed = False
        self._counts = ReadCounts(source)
        self._idle = asyncio.Event()  # no batch in flight (set until the first is scheduled)
        self._idle.set()
        if self._budget is not None:  # counted from now: a job's loaders all count before the first starts
            self._budget.join(self)

    @property
    def own_readahead(self) -> tuple[int | None, int | None]:
        """(readahead, readahead_bytes) as given: None for a share of the node's budget."""
        return self._own

    @property
    def readahead(self) -> int:
        """The read-ahead bound in samples of this partition: its own, or its share of the node's budget."""
        own = self._own[0]
        if own is not None:
            return own
        assert self._budget is not None
        return self._budget.share().samples

    @property
    def readahead_bytes(self) -> int:
        own = self._own[1]
        if own is not None:
            return own
        return self._budget.share().bytes if self._budget is not None else READAHEAD_BYTES

    def budget_grew(self) -> None:
        """The node's budget gives each loader more: read on (called by the budget)."""
        self._pump()

    def follow_plans(self) -> None:
        """Keep payloads only up to ``readahead`` samples past what ``planned_to`` says is planned (module doc),
        and read the first batch now whatever the read-ahead: the planner asks every source it draws from for at
        least a batch of lengths at its first step, one source after another (1,024 sources: 1,024 reads in a
        row, unless they are under way together); only ``readahead`` of its payloads are held."""
        if self._planned is None:
            self._planned = -1
            (self._budget or node_budget()).warm(self)

    def warm_read(self) -> bool:
        """Read the first batch now unless something was read already (the budget's ``warm``); whether it did."""
        if not self._started or self._closed or self._inflight or self._buf.batches:
            return False
        b = self._part.global_batch(self._cursor)
        if self._end is not None and b >= self._end:
            return False
        self._cursor += 1
        self._warming = b
        self._schedule(b, self._first_part(HEAD))
        return True

    def planned_to(self, ordinal: int) -> None:
        """Ordinals of this source up to ``ordinal`` are planned (their payloads will be fetched)."""
        if self._planned is not None:
            self._planned = max(self._planned, self._part.first_local(int(ordinal) + 1)[1] - 1)

    def _keep_below(self) -> int | None:
        """The local sample index from which a fill keeps lengths only (None: it keeps every payload)."""
        if self._planned is None or self.readahead >= self.batch:
            return None
        return self._planned + 1 + self.readahead

    def _asked(self, last_ordinal: int) -> None:
        local = self._part.local_index(last_ordinal)
        if local > self._high:
            self._high = local
            self._pump()

    @property
    def _max_inflight(self) -> int:
        return max(2, 2 * self.pool.size) if self.pool is not None and self.transform is not None else 2

    # ---- lifecycle ----
    async def start(self) -> None:
        """Begin reading ahead from the cursor (0, or where ``seek`` put it). Idempotent."""
        if self._closed:
            raise ClosedError(f"loader of source {self.name!r} is closed; make a new one")
        if self._started:
            return
        self._started = True
        self._pump()

    async def wait_idle(self) -> None:
        """Wait until no batch is in flight (the read-ahead is as full as its bound allows)."""
        await self.start()
        await self._idle.wait()

    async def aclose(self) -> None:
        """Stop reading, wake every waiter with ClosedError, drop the buffer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._budget is not None:
            self._budget.leave(self)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel("loader closed")
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._idle.set()
        self._buf.close()

    # ---- scheduling ----
    def _pump(self) -> None:
        """Schedule read-ahead batches in order while within the bound and the in-flight limit."""
        if not self._started or self._closed:
            return
        while self._inflight < self._max_inflight:
            j = self._cursor
            if (j + 1) * self.batch - 1 > self._high + self.readahead:
                return
            if self._end is not None and self._part.global_batch(j) >= self._end:
                return
            if j * self.batch > self._high and self._buf.memory >= self.readahead_bytes:
                return  # the bytes bound: resumed by release()
            self._cursor += 1
            b = self._part.global_batch(j)
            bs = self._buf.get(b)
            if bs is None:
                self._schedule(b)
            elif not bs.reading and bs.filled < self.batch:  # its first part was read: read the rest
                self._read_part(bs, self.batch)

    def _schedule(self, b: int, upto: int | None = None) -> ReadBatch:
        """A new batch of global index b, its samples [0, upto) read now (all by default)."""
        bs = self._buf.add(b)
        self._read_part(bs, self.batch if upto is None else upto)
        return bs

    def _read_part(self, bs: ReadBatch, upto: int) -> None:
        """Read samples [bs.filled, upto) of a batch (none of it is in flight)."""
        self._inflight += 1
        bs.reading = True
        bs.event.clear()
        self._idle.clear()
        task = asyncio.get_running_loop().create_task(
            self._run(bs, bs.filled, upto), name=f"msdata-load-{self.name}-{bs.index}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _first_part(self, upto: int) -> int:
        """How much of a batch nobody read yet to read now when samples [0, upto) of it are needed (it is read
        then): the first such batch of a loader whose first read is in parts (module doc), at least HEAD; any
        other, all of it."""
        if self._parted or self._keep_below() is None:
            return self.batch
        self._parted = True
        return min(self.batch, max(HEAD, upto))

    def _ensure(self, b: int, upto: int | None = None) -> ReadBatch:
        """The batch of global index b, scheduled if absent (its first ``upto`` samples at least; all when None).
        A batch the read-ahead already passed was released (or seeked over): read again (whole) for its lengths
        only, holding none of its payloads."""
        bs = self._buf.get(b)
        if bs is not None:
            return bs
        if self._behind(b):
            bs = self._schedule(b)
            bs.released[:] = True
            return bs
        return self._schedule(b, self._first_part(self.batch if upto is None else upto))

    def _behind(self, b: int) -> bool:
        """Whether the read-ahead has passed global batch b (scheduled it once, or seeked past it)."""
        return self._part.local_batch(b) < self._cursor

    async def _wait(self, bs: ReadBatch, upto: int | None = None) -> ReadBatch:
        """The batch once its samples [0, upto) are read (all when None), reading the rest if need be."""
        need = self.batch if upto is None else upto
        while True:
            if not bs.event.is_set():
                await bs.event.wait()
            if self._closed:
                raise ClosedError(f"loader of source {self.name!r} was closed while waiting for batch {bs.index}")
            if bs.error is not None:
                raise MsdataError(f"source {self.name!r}: reading batch {bs.index} failed: {bs.error!r}") from bs.error
            if bs.filled >= need:
                break
            if not bs.reading:
                self._read_part(bs, self.batch)
        assert bs.lengths is not None, "a batch without error was filled"
        assert bs.payloads is not None, "a batch without error was filled"
        return bs

    # ---- the work of one batch ----
    async def _run(self, bs: ReadBatch, lo: int, hi: int) -> None:
        ords = np.arange(bs.start + lo, bs.start + hi, dtype=np.int64)
        try:
            records, results, nbytes = await self._reader.read(ords)
            self._buf.fill(bs, results, self._keep_below(), lo)
            assert bs.lengths is not None
            self._counts.batch_read(ords, records, results, nbytes, int(bs.lengths[lo:hi].sum()))
        except asyncio.CancelledError:
            bs.error = ClosedError(f"loader of source {self.name!r} closed")
            raise
        except Exception as e:
            self._counts.batch_failed()
            bs.error = e
            log.exception("source %s: batch %d (ordinals %d..) failed", self.name, bs.index, bs.start)
            self._buf.discard(bs)  # asked again later -> read again
        finally:
            self._inflight -= 1
            bs.reading = False
            bs.event.set()
            if self._warming == bs.index:
                self._warming = None
                (self._budget or node_budget()).warm_done()
            self._pump()
            if self._inflight == 0:
                self._idle.set()
                self.source.trim()  # read-ahead full: decode caches would only sit there until the next burst

    # ---- the API the node server uses ----
    async def _filled(self, start: int, count: int) -> list[tuple[ReadBatch, int, int]]:
        """The read batches over ordinals [start, start+count) (count > 0), in order, each with the span
        [lo, hi) of those ordinals it holds; waits until they are read."""
        await self.start()
        ords = np.arange(start, start + count, dtype=np.int64)
        blist = self._part.check(ords)
        self._asked(start + count - 1)
        end = start + count
        out = []
        for b in range(int(blist[0]), int(blist[-1]) + 1):  # ordinals are consecutive: so are batches
            upto = min(end - b * self.batch, self.batch)
            bs = self._ensure(b, upto)
            if bs.filled < upto or bs.error is not None or self._closed:
                bs = await self._wait(bs, upto)
            out.append((bs, max(start, bs.start), min(end, bs.start + self.batch)))
        return out

    async def lengths(self, start: int, count: int) -> np.ndarray:
        """int64 lengths of ordinals [start, start+count), waiting until they are ready; 0 for bad samples."""
        out = np.zeros(max(count, 0), dtype=np.int64)
        if count <= 0:
            return out
        for bs, lo, hi in await self._filled(start, count):
            assert bs.lengths is not None  # _wait checked it
            out[lo - start : hi - start] = bs.lengths[lo - bs.start : hi - bs.start]
        return out

    async def vision(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(images, patches) of ordinals [start, start+count) (planner.lengths.VisionView): int64 images per
        sample (0 for text and bad samples) and int64 patches (t*h*w) of each of their images, in order."""
        images = np.zeros(max(count, 0), dtype=np.int64)
        if count <= 0:
            return images, np.zeros(0, dtype=np.int64)
        patches = []
        for bs, lo, hi in await self._filled(start, count):
            assert bs.images is not None
            assert bs.patches is not None
            a, b = lo - bs.start, hi - bs.start
            at = np.concatenate([[0], np.cumsum(bs.images)])
            images[lo - start : hi - start] = bs.images[a:b]
            patches.append(bs.patches[at[a] : at[b]])
        return images, np.concatenate(patches)

    async def tokens(self, ordinal: int) -> np.ndarray:
        """The transformed sample of an ordinal (waits if needed); BadSampleError for a bad sample."""
        await self.start()
        ordinal = int(ordinal)
        b = ordinal // self.batch
        if ordinal < 0 or not self._part.owns(ordinal):
            self._part.check(np.array([ordinal], dtype=np.int64))  # raises with the explanation
        self._asked(ordinal)
        bs = self._buf.get(b)
        if bs is None and self._behind(b):  # released or seeked over: read it once more, uncached
            return self._good(ordinal, await self._read_once(ordinal))
        i = ordinal - b * self.batch
        bs = bs or self._ensure(b, i + 1)
        if bs.filled <= i or bs.error is not None or self._closed:
            bs = await self._wait(bs, i + 1)
        assert bs.payloads is not None, "a finished batch without error was filled"
        p = bs.payloads[i]
        if p is None and not bs.released[i]:  # kept as a length only (beyond the plans): read it and the next
            p = await self._refill(bs, i)
        if p is None:  # released while others of its batch are held: read it once more, uncached
            p = await self._read_once(ordinal)
        return self._good(ordinal, p)

    async def _read_once(self, ordinal: int) -> Any:
        """One sample read again, uncached, as it would have been held (``compact``: the same dtype)."""
        p = (await self._reader.transform_once(np.array([ordinal], dtype=np.int64)))[0]
        return p if isinstance(p, BadSample) else compact(p)

    async def _refill(self, bs: ReadBatch, i: int) -> Any:
        """Read again sample i of a batch kept as lengths only, with the next ones of the batch in the same state
        up to ``readahead`` (at least one), and hold their payloads; sample i's payload (None if it was released
        meanwhile)."""
        assert bs.payloads is not None
        idx = [i]
        for j in range(i + 1, min(bs.filled, i + max(1, self.readahead))):
            if bs.payloads[j] is not None or bs.released[j]:
                break
            idx.append(j)
        got = await self._reader.transform_once(bs.start + np.array(idx, dtype=np.int64))
        self._buf.refill(bs, idx, got)
        if bs.payloads[i] is not None:
            return bs.payloads[i]
        return got[0] if isinstance(got[0], BadSample) else compact(got[0])

    def _good(self, ordinal: int, p: Any) -> np.ndarray:
        if isinstance(p, BadSample):
            raise BadSampleError(
                f"ordinal {ordinal} is a bad sample ({p.reason}: {p.detail})", source=self.name, location=p.location
            )
        return p

    def sample_ids(self, ordinals) -> np.ndarray:
        """Stable global sample ids (file_index << 32 | row) of ordinals."""
        return self.source.sample_ids(np.asarray(ordinals, dtype=np.int64))

    def release(self, ordinals) -> None:
        """Payloads no longer needed: free them (a batch whose samples are all released is dropped)."""
        ords = np.asarray(ordinals, dtype=np.int64).reshape(-1)
        if len(ords):
            self._buf.release(ords)
            self._pump()  # the bytes bound may let the read-ahead go on

    def seek(self, ordinal: int) -> None:
        """Continue reading at this ordinal (resume): drop batches before it, restart the read-ahead there."""
        if ordinal < 0:
            raise ValueError(f"seek {ordinal=} must be >= 0")
        j, start_local = self._part.first_local(ordinal)
        self._buf.drop_before(j)
        self._cursor = j
        self._high = start_local - 1
        self._pump()

    @property
    def ready(self) -> int:
        """Samples read and not yet released (``statistics().ready``, without the rest of the statistics)."""
        return self._buf.ready

    def statistics(self) -> LoaderStats:
        counts, ready = self._counts, self._buf.ready
        return LoaderStats(
            name=self.name,
            partition=self.partition,
            samples_per_s=counts.samples_per_s(),
            samples_done=counts.done,
            bytes_read=counts.bytes,
            ready=ready,
            buffer_fill=ready / self.readahead if self.readahead else float(ready > 0),
            memory_bytes=self._buf.memory,
            read_s=self._reader.read_s,
            tokens_read=self._counts.tokens,
            bad_samples=counts.bad_counts(),
            errors=counts.errors,
            inflight=self._inflight,
            cursor=self._part.global_batch(self._cursor) * self.batch,
            held_ahead=self._buf.held_ahead(self._high),
            readahead=self.readahead,
            readahead_bytes=self.readahead_bytes,
            memory={"read_ahead": self._buf.memory, **self.source.memory()},
            open_files=self.source.open_files(),
        )

    def asked_from(self, ordinal: int) -> int:
        """How many of this partition's ordinals from ``ordinal`` up to the highest asked for there are: samples
        the planner read the lengths of (its look-ahead) that no plan has taken yet if ordinal is its cursor."""
        return max(0, self._high + 1 - self._part.first_local(max(0, int(ordinal)))[1])

    def owns(self, ordinal: int) -> bool:
        """Whether this partition reads ``ordinal``."""
        return self._part.owns(ordinal)

    def frontier(self) -> int:
        """The first global batch beyond every batch this loader scheduled or holds."""
        return max(self._part.global_batch(self._cursor), max(self._buf.batches, default=-1) + 1)

    def stop_at(self, batch: int) -> None:
        """Read ahead no batch at or past global ``batch`` (another partitioning of the source reads those), and
        drop those already read ahead there (asked for again, they are read again, holding nothing); batches
        asked for explicitly are still read."""
        self._end = int(batch) if self._end is None else min(self._end, int(batch))
        self._buf.drop_from(self._end)

    def __repr__(self) -> str:
        return f"SourceLoader({self.name!r}, partition={self.partition}, cursor={self._cursor})"

    async def __aenter__(self) -> SourceLoader:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
