"""SourceLoader: one per (source, partition); a bounded read-ahead of transformed samples, addressed by ordinal.

Partition (k, n) owns the ordinals whose batch index ``ordinal // batch`` is congruent to k modulo n, so n
loaders (on one node or several) split a source's work by whole batches without changing its order.

Bound: the loader schedules a batch only when its last ordinal is at most ``readahead`` of this partition's
samples beyond the highest ordinal asked for so far (by ``lengths``/``tokens``; ``seek`` resets it), with a
few batches in flight; payloads stay until ``release``d. Batches asked for explicitly are always read, and a
released batch asked for again is read again (reads are deterministic).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .errors import BadSampleError, ClosedError, ConfigError, MsdataError
from .sources.base import BadDataLog, BadSample, Source
from .sources.order import stable_seed
from .transforms import load_transform, parse_transform_name, run_transform

if TYPE_CHECKING:
    from .pool import WorkerPool

__all__ = ["LoaderStats", "SourceLoader"]

log = logging.getLogger(__name__)

_RATE_WINDOW = 64  # completed batches the throughput is measured over


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
    bad_samples: Mapping[str, int]
    errors: int
    inflight: int
    cursor: int  # the next ordinal the read-ahead will schedule
    held_ahead: int  # of ``ready``: payloads beyond the highest ordinal asked for; at most ``readahead``
    readahead: int  # the read-ahead bound, in samples of this partition


def _compact(a: np.ndarray) -> np.ndarray:
    """Token ids held in the read-ahead as uint16 when they fit (byte tokens and vocabularies up to 65536):
    half the memory of int32 for every sample waiting to be built; constructors widen them anyway."""
    if a.dtype.kind in "iu" and a.dtype.itemsize > 2 and a.size and int(a.min()) >= 0 and int(a.max()) <= 0xFFFF:
        return a.astype(np.uint16)
    return a


class _Batch:
    """One batch of ``batch`` consecutive ordinals: filled once by its task, then released sample by sample."""

    __slots__ = ("index", "start", "event", "lengths", "payloads", "released", "held", "nbytes", "error")

    def __init__(self, index: int, start: int, size: int):
        self.index = index
        self.start = start
        self.event = asyncio.Event()
        self.lengths: np.ndarray | None = None
        self.payloads: list | None = None
        self.released = np.zeros(size, dtype=bool)
        self.held = 0  # payloads present and not released
        self.nbytes = 0
        self.error: BaseException | None = None


class SourceLoader:
    """One per (source, partition): the source's file-access state, held once per node; a bounded read-ahead
    of transformed samples addressed by ordinal. The caller owns (and closes) the source and the pool."""

    def __init__(
        self,
        source: Source,
        pool: WorkerPool | None,
        *,
        transform: str | None,
        seed: int,
        readahead: int = 64,
        batch: int = 64,
        partition: tuple[int, int] = (0, 1),
    ):
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigError(f"loader {batch=} must be an integer >= 1")
        if isinstance(readahead, bool) or not isinstance(readahead, int) or readahead < 0:
            raise ConfigError(f"loader {readahead=} must be an integer >= 0")
        k, n = partition
        if not (isinstance(k, int) and isinstance(n, int) and n >= 1 and 0 <= k < n):
            raise ConfigError(f"loader {partition=} must be (k, n) with 0 <= k < n")
        self.source = source
        self.pool = pool
        self.transform = transform
        self.name = source.name
        self.seed = int(seed)
        self.readahead = readahead
        self.batch = batch
        self.partition = (k, n)
        # With a pool the transform is imported only in the workers (it may import heavy libraries the server
        # must not load, such as torch); without one it runs here, so import it now for a clear error.
        self._fn = load_transform(transform) if pool is None or transform is None else None
        if transform is not None:
            parse_transform_name(transform)
        self._tseed = stable_seed(self.seed, self.name, "transform")
        self._batches: dict[int, _Batch] = {}
        self._cursor = 0  # local batch index the read-ahead schedules next
        self._high = -1  # highest local sample index asked for
        self._inflight = 0
        self._tasks: set[asyncio.Task] = set()
        self._read_lock: asyncio.Lock | None = None
        self._started = False
        self._closed = False
        self._bad: Counter[str] = Counter()
        self._badlog = BadDataLog(self.name)
        self._errors = 0
        self._done = 0
        self._bytes = 0
        self._ready = 0
        self._memory = 0
        self._rate: deque[tuple[float, int]] = deque(maxlen=_RATE_WINDOW)
        self._idle: asyncio.Event | None = None

    # ---- ordinal <-> batch arithmetic ----
    def _local_batch(self, b: int) -> int:
        return b // self.partition[1]

    def _global_batch(self, j: int) -> int:
        return j * self.partition[1] + self.partition[0]

    def _check(self, ordinals: np.ndarray) -> np.ndarray:
        """Batch indices of ordinals, which must belong to this partition."""
        if len(ordinals) and int(ordinals.min()) < 0:
            raise ValueError(f"ordinals must be >= 0, got {int(ordinals.min())}")
        b = ordinals // self.batch
        k, n = self.partition
        if n > 1 and not np.all(b % n == k):
            bad = int(ordinals[np.flatnonzero(b % n != k)[0]])
            raise ValueError(
                f"ordinal {bad} belongs to partition {(bad // self.batch) % n} of {n}, not {k}: "
                f"partition k handles ordinals with (ordinal // {self.batch}) % {n} == k"
            )
        return b

    def _asked(self, last_ordinal: int) -> None:
        b = last_ordinal // self.batch
        local = self._local_batch(b) * self.batch + last_ordinal % self.batch
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
        self._read_lock = asyncio.Lock()
        self._idle = asyncio.Event()
        self._idle.set()
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
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel("loader closed")
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for bs in self._batches.values():
            bs.event.set()
        if self._idle is not None:
            self._idle.set()
        self._batches.clear()
        self._ready = self._memory = 0

    # ---- scheduling ----
    def _pump(self) -> None:
        """Schedule read-ahead batches in order while within the bound and the in-flight limit."""
        if not self._started or self._closed:
            return
        while self._inflight < self._max_inflight:
            j = self._cursor
            if (j + 1) * self.batch - 1 > self._high + self.readahead:
                return
            self._cursor += 1
            b = self._global_batch(j)
            if b not in self._batches:
                self._schedule(b)

    def _schedule(self, b: int) -> _Batch:
        bs = _Batch(b, b * self.batch, self.batch)
        self._batches[b] = bs
        self._inflight += 1
        self._idle.clear()
        task = asyncio.get_running_loop().create_task(self._run(bs), name=f"msdata-load-{self.name}-{b}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return bs

    def _ensure(self, b: int) -> _Batch:
        """The batch of global index b, scheduled if absent. A batch the read-ahead already passed was
        released (or seeked over): read again for its lengths only, holding none of its payloads."""
        bs = self._batches.get(b)
        if bs is not None:
            return bs
        bs = self._schedule(b)
        if self._behind(b):
            bs.released[:] = True
        return bs

    def _behind(self, b: int) -> bool:
        """Whether the read-ahead has passed global batch b (scheduled it once, or seeked past it)."""
        return self._local_batch(b) < self._cursor

    async def _wait(self, bs: _Batch) -> _Batch:
        if not bs.event.is_set():
            await bs.event.wait()
        if self._closed:
            raise ClosedError(f"loader of source {self.name!r} was closed while waiting for batch {bs.index}")
        if bs.error is not None:
            raise MsdataError(f"source {self.name!r}: reading batch {bs.index} failed: {bs.error!r}") from bs.error
        return bs

    # ---- the work of one batch ----
    def _read(self, ords: np.ndarray) -> tuple[list, int, np.ndarray]:
        rr = self.source.read_batch(ords)
        return rr.records, rr.nbytes, self.source.sample_ids(ords)

    def _read_transform(self, ords: np.ndarray) -> tuple[list, list, int]:
        records, nbytes, ids = self._read(ords)
        fn = self._fn if self._fn is not None else load_transform(self.transform)  # the pool has no workers
        return records, run_transform(fn, records, seed=self._tseed, sample_ids=ids), nbytes

    async def _run(self, bs: _Batch) -> None:
        ords = np.arange(bs.start, bs.start + self.batch, dtype=np.int64)
        try:
            if self.pool is None or self.transform is None:
                async with self._read_lock:
                    records, results, nbytes = await asyncio.to_thread(self._read_transform, ords)
            else:
                async with self._read_lock:
                    records, nbytes, ids = await asyncio.to_thread(self._read, ords)
                results = await self.pool.transform(self.transform, records, seed=self._tseed, sample_ids=ids)
            self._fill(bs, ords, records, results, nbytes)
        except asyncio.CancelledError:
            bs.error = ClosedError(f"loader of source {self.name!r} closed")
            raise
        except Exception as e:
            self._errors += 1
            bs.error = e
            log.exception("source %s: batch %d (ordinals %d..) failed", self.name, bs.index, bs.start)
            if self._batches.get(bs.index) is bs:
                del self._batches[bs.index]  # asked again later -> read again
        finally:
            self._inflight -= 1
            bs.event.set()
            self._pump()
            if self._inflight == 0:
                self._idle.set()
                self.source.trim()  # read-ahead full: decode caches would only sit there until the next burst

    def _fill(self, bs: _Batch, ords: np.ndarray, records: list, results: list, nbytes: int) -> None:
        lengths = np.zeros(len(results), dtype=np.int64)
        payloads: list = [None] * len(results)
        held = mem = 0
        for i, r in enumerate(results):
            if isinstance(r, BadSample):
                self._bad[r.reason] += 1
                if r is not records[i]:  # found by the transform: the source has not logged it
                    loc = self.source.location(int(ords[i]))
                    self._badlog.record(BadSample(r.reason, loc, r.detail))
                payloads[i] = r  # kept so tokens() can say why; needs no release
                bs.released[i] = True
                continue
            lengths[i] = len(r)
            if not bs.released[i]:
                payloads[i] = r = _compact(r)
                held += 1
                mem += r.nbytes
        bs.lengths, bs.payloads, bs.held, bs.nbytes = lengths, payloads, held, mem
        self._done += len(results)
        self._bytes += nbytes
        self._rate.append((time.monotonic(), len(results)))
        if self._batches.get(bs.index) is bs:
            self._ready += held
            self._memory += mem
            if held == 0 and bs.released.all():
                del self._batches[bs.index]

    # ---- the API the node server uses ----
    async def lengths(self, start: int, count: int) -> np.ndarray:
        """int64 lengths of ordinals [start, start+count), waiting until they are ready; 0 for bad samples."""
        if count <= 0:
            return np.zeros(0, dtype=np.int64)
        await self.start()
        ords = np.arange(start, start + count, dtype=np.int64)
        blist = self._check(ords)
        self._asked(start + count - 1)
        out = np.empty(count, dtype=np.int64)
        end = start + count
        for b in range(int(blist[0]), int(blist[-1]) + 1):  # ordinals are consecutive: so are batches
            bs = await self._wait(self._ensure(b))
            lo, hi = max(start, bs.start), min(end, bs.start + self.batch)
            out[lo - start : hi - start] = bs.lengths[lo - bs.start : hi - bs.start]
        return out

    async def tokens(self, ordinal: int) -> np.ndarray:
        """The transformed sample of an ordinal (waits if needed); BadSampleError for a bad sample."""
        await self.start()
        ordinal = int(ordinal)
        b = ordinal // self.batch
        if ordinal < 0 or b % self.partition[1] != self.partition[0]:
            self._check(np.array([ordinal], dtype=np.int64))  # raises with the explanation
        self._asked(ordinal)
        bs = self._batches.get(b)
        if bs is None and self._behind(b):  # released or seeked over: read it once more, uncached
            return self._good(ordinal, (await self._transform_once(np.array([ordinal], dtype=np.int64)))[0])
        bs = bs or self._ensure(b)
        if not bs.event.is_set() or bs.error is not None or self._closed:
            bs = await self._wait(bs)
        i = ordinal - bs.start
        p = bs.payloads[i]
        if p is None:  # released while others of its batch are held: read it once more, uncached
            p = (await self._transform_once(np.array([ordinal], dtype=np.int64)))[0]
        return self._good(ordinal, p)

    def _good(self, ordinal: int, p: Any) -> np.ndarray:
        if isinstance(p, BadSample):
            raise BadSampleError(
                f"ordinal {ordinal} is a bad sample ({p.reason}: {p.detail})", source=self.name, location=p.location
            )
        return p

    async def _transform_once(self, ords: np.ndarray) -> list:
        if self.pool is None or self.transform is None:
            async with self._read_lock:
                return (await asyncio.to_thread(self._read_transform, ords))[1]
        async with self._read_lock:
            records, _, ids = await asyncio.to_thread(self._read, ords)
        return await self.pool.transform(self.transform, records, seed=self._tseed, sample_ids=ids)

    def sample_ids(self, ordinals) -> np.ndarray:
        """Stable global sample ids (file_index << 32 | row) of ordinals."""
        return self.source.sample_ids(np.asarray(ordinals, dtype=np.int64))

    def release(self, ordinals) -> None:
        """Payloads no longer needed: free them (a batch whose samples are all released is dropped)."""
        ords = np.asarray(ordinals, dtype=np.int64).reshape(-1)
        if len(ords) == 0:
            return
        blist = ords // self.batch
        for b in np.unique(blist).tolist():
            bs = self._batches.get(b)
            if bs is None:
                continue
            idx = ords[blist == b] - bs.start
            idx = idx[~bs.released[idx]]
            if len(idx) == 0:
                continue
            bs.released[idx] = True
            if bs.payloads is not None:
                for i in idx.tolist():
                    p = bs.payloads[i]
                    if isinstance(p, np.ndarray):
                        bs.held -= 1
                        bs.nbytes -= p.nbytes
                        self._ready -= 1
                        self._memory -= p.nbytes
                    bs.payloads[i] = None
                if bs.held == 0 and bs.released.all():
                    del self._batches[b]

    def seek(self, ordinal: int) -> None:
        """Continue reading at this ordinal (resume): drop batches before it, restart the read-ahead there."""
        if ordinal < 0:
            raise ValueError(f"seek {ordinal=} must be >= 0")
        j, start_local = self._first_local(ordinal)
        for gb in [gb for gb in self._batches if self._local_batch(gb) < j]:
            bs = self._batches.pop(gb)
            self._ready -= bs.held
            self._memory -= bs.nbytes
        self._cursor = j
        self._high = start_local - 1
        self._pump()

    def statistics(self) -> LoaderStats:
        rate = 0.0
        if len(self._rate) >= 2:
            dt = self._rate[-1][0] - self._rate[0][0]
            if dt > 0:
                rate = sum(n for _, n in list(self._rate)[1:]) / dt
        return LoaderStats(
            name=self.name,
            partition=self.partition,
            samples_per_s=rate,
            samples_done=self._done,
            bytes_read=self._bytes,
            ready=self._ready,
            buffer_fill=self._ready / self.readahead if self.readahead else float(self._ready > 0),
            memory_bytes=self._memory,
            bad_samples=self._bad_counts(),
            errors=self._errors,
            inflight=self._inflight,
            cursor=self._global_batch(self._cursor) * self.batch,
            held_ahead=self._held_ahead(),
            readahead=self.readahead,
        )

    def _held_ahead(self) -> int:
        """Payloads held beyond the highest ordinal asked for (what the read-ahead bound limits)."""
        n = 0
        for bs in self._batches.values():
            if bs.payloads is None or bs.held == 0:
                continue
            first = self._local_batch(bs.index) * self.batch
            i0 = max(0, self._high + 1 - first)
            n += sum(1 for p in bs.payloads[i0:] if isinstance(p, np.ndarray))
        return n

    def asked_from(self, ordinal: int) -> int:
        """How many of this partition's ordinals from ``ordinal`` up to the highest asked for there are: samples
        the planner read the lengths of (its look-ahead) that no plan has taken yet if ordinal is its cursor."""
        return max(0, self._high + 1 - self._first_local(max(0, int(ordinal)))[1])

    def owns(self, ordinal: int) -> bool:
        """Whether this partition reads ``ordinal``."""
        return (int(ordinal) // self.batch) % self.partition[1] == self.partition[0]

    def _first_local(self, ordinal: int) -> tuple[int, int]:
        """(local batch, local index) of this partition's first ordinal at or after ``ordinal``."""
        k, n = self.partition
        b = ordinal // self.batch
        j = b // n + (1 if b % n > k else 0)
        return j, j * self.batch + (ordinal % self.batch if self._global_batch(j) == b else 0)

    def _bad_counts(self) -> dict[str, int]:
        """Bad samples by reason; files the source skipped at open never reach the loader, so add those."""
        skipped = self.source.bad.snapshot().get("corrupt_file", 0)
        return {**self._bad, "corrupt_file": skipped} if skipped else dict(self._bad)

    def __repr__(self) -> str:
        return f"SourceLoader({self.name!r}, partition={self.partition}, cursor={self._cursor})"

    async def __aenter__(self) -> SourceLoader:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
