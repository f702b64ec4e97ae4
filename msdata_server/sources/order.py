"""A source's deterministic read order: a pure function of (seed, source name, epoch), O(files) memory.

Per epoch the files are permuted; inside a file the windows (runs of consecutive rows, aligned with row
groups or record batches where the format has them) are permuted, and the rows of each window are permuted.
Every permutation is seeded by a blake2b hash of its coordinates, so any ordinal is located directly
(seek) and partitions split the work without changing the order. No full permutation of all rows exists.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np

from msdata_client.choices import SHUFFLE_SPREAD, SHUFFLE_WINDOW, ShuffleMode

__all__ = [
    "DEFAULT_SPREAD",
    "DEFAULT_WINDOW",
    "MODES",
    "Order",
    "lanes_for",
    "make_rng",
    "stable_seed",
    "window_starts",
]

DEFAULT_WINDOW = SHUFFLE_WINDOW  # rows shuffled together: big enough to mix, small enough to keep reads local
DEFAULT_SPREAD = SHUFFLE_SPREAD  # lanes of the mixed order: files read at once
MODES = ShuffleMode.values()
_EPOCH_CACHE = 4
_FILE_CACHE = 64  # (epoch, file) window orders kept; the mixed order keeps lanes more
_WINDOW_CACHE = 32  # row permutations kept (int32); the mixed order keeps lanes more: one per lane in reading


def stable_seed(*parts: object) -> int:
    """A 128-bit seed from a tuple of ints/strings, stable across processes (never Python's hash())."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, (int, np.integer)):
            h.update(b"i%d\x1f" % int(p))
        else:
            h.update(b"s" + str(p).encode("utf-8", "surrogatepass") + b"\x1f")
    return int.from_bytes(h.digest(), "little")


def make_rng(*parts: object) -> np.random.Generator:
    """A PCG64 generator seeded by stable_seed(*parts)."""
    return np.random.Generator(np.random.PCG64(stable_seed(*parts)))


def window_starts(unit_rows: np.ndarray, target: int = DEFAULT_WINDOW) -> np.ndarray:
    """Window start rows of one file from its unit sizes (row groups, record batches).

    Consecutive small units merge until a window holds >= target rows; a unit larger than target is cut into
    pieces of target rows. A window never straddles a unit boundary, so reading it touches few units.
    """
    unit_rows = np.asarray(unit_rows, dtype=np.int64)
    if len(unit_rows) == 1:  # one unit (a JSON Lines file): the loop below, without its per-file overhead
        n = int(unit_rows[0])
        return np.arange(0, n, target, dtype=np.int64) if n else np.zeros(0, np.int64)
    starts: list[int] = []  # Python ints, one array at the end (1,024 sources x 16 files: no array per window)
    acc = 0  # rows in the window being merged
    s = 0  # the unit's first row
    for n in unit_rows.tolist():
        if n >= target:
            starts.extend(range(s, s + n, target))
            acc = 0
        elif n:
            if acc == 0 or acc >= target:
                starts.append(s)
                acc = 0
            acc += n
        s += n
    return np.array(starts, dtype=np.int64)


def lanes_for(files: int, spread: int) -> int:
    """Lanes of the mixed order for a source of `files` non-empty files: 1 for one file (nothing to mix);
    `spread` for 2 * spread files or more; else up to 2 * spread (2 * files, at least spread), so that each
    file holding at least half the average rows is read in every round of lanes ordinals (module docstring)."""
    if files <= 1:
        return 1
    if files >= 2 * spread:
        return spread
    return min(2 * spread, max(spread, 2 * files))


class Order:
    """Maps ordinals (epoch * num_samples + pos) to (epoch, file, row) for files of known row counts.

    ``counts[f]`` rows in file f (0 for a skipped file); ``starts[f]`` the window start rows of file f,
    flattened into one array with ``offsets`` (CSR layout, no per-file Python objects on the hot path).
    ``mode`` one of MODES and ``spread`` the lanes of the mixed order (module docstring).
    Memory: the index (O(files + windows)) and bounded caches: 4 epochs' file orders, max(64, 2 * lanes)
    files' window orders and max(32, lanes + 8) row permutations (int32: 16 KiB per 4096-row window).
    """

    def __init__(
        self,
        *,
        seed: int,
        name: str,
        counts: np.ndarray,
        starts: np.ndarray,
        offsets: np.ndarray,
        mode: str = ShuffleMode.MIX.value,
        spread: int = DEFAULT_SPREAD,
    ):
        if mode not in MODES:
            raise ValueError(f"{mode=} is not one of {MODES}")
        if not 1 <= spread <= 1 << 20:
            raise ValueError(f"{spread=} must be in 1..2**20 (files read at once)")
        self.seed = int(seed)
        self.name = name
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.num_samples = int(self.counts.sum())
        self.mode = ShuffleMode(mode)
        self.lanes = lanes_for(int(np.count_nonzero(self.counts)), int(spread)) if self.mode == ShuffleMode.MIX else 1
        self._file_cache = max(_FILE_CACHE, 2 * self.lanes)
        self._window_cache = _WINDOW_CACHE if self.lanes == 1 else max(_WINDOW_CACHE, self.lanes + 8)
        self._fixed_cum = np.cumsum(self.counts)
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._files: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # the caches are shared by the loop thread and reader threads
        self._last: tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None  # last locate

    @classmethod
    def from_units(
        cls,
        *,
        seed: int,
        name: str,
        units: list[np.ndarray],
        window: int = DEFAULT_WINDOW,
        mode: str = ShuffleMode.MIX.value,
        spread: int = DEFAULT_SPREAD,
    ) -> Order:
        """Build from each file's unit sizes (an empty array for a skipped file)."""
        counts = np.fromiter((u.sum() for u in units), dtype=np.int64, count=len(units))
        per_file = [window_starts(u, window) for u in units]
        offsets = np.zeros(len(units) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(s) for s in per_file])
        starts = np.concatenate(per_file) if per_file else np.zeros(0, np.int64)
        return cls(seed=seed, name=name, counts=counts, starts=starts, offsets=offsets, mode=mode, spread=spread)

    def fixed_starts(self) -> np.ndarray:
        """The first row of each file in the fixed order (files in path order): source-wide row numbers."""
        return self._fixed_cum - self.counts

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes + self.starts.nbytes + self.offsets.nbytes + self._fixed_cum.nbytes

    def trim(self) -> None:
        """Drop the cached window and row orders (recomputed when read again: ~10 us a window); a source read
        rarely, one of 1,024 on a node, would keep ~60 KiB of them for nothing."""
        with self._lock:
            self._files.clear()
            self._windows.clear()
            self._last = None

    def cache_bytes(self) -> int:
        """Bytes of the cached permutations (epochs' file orders, files' window orders, windows' row orders)."""
        with self._lock:
            arrays = [a for v in self._epochs.values() for a in v] + [a for v in self._files.values() for a in v]
            return sum(a.nbytes for a in arrays) + sum(a.nbytes for a in self._windows.values())

    def lane_position(self, pos: np.ndarray) -> np.ndarray:
        """Where positions of an epoch (0 <= pos < num_samples) of the mixed order sit in the file-local
        sequence: ordinal p reads lane p mod lanes at its p div lanes-th row; the first N mod lanes lanes hold
        one row more (their last rows are the last, partial round). A bijection of 0..N-1."""
        lanes = self.lanes
        q, r = divmod(self.num_samples, lanes)
        full = q * lanes
        head = pos < full
        lane = np.where(head, pos % lanes, pos - full)
        idx = np.where(head, pos // lanes, q)
        return lane * q + np.minimum(lane, r) + idx

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._epochs.get(epoch)
        if got is None:
            perm = make_rng(self.seed, self.name, epoch, "files").permutation(len(self.counts))
            got = (perm, np.cumsum(self.counts[perm]))
            self._epochs[epoch] = got
            if len(self._epochs) > _EPOCH_CACHE:
                self._epochs.popitem(last=False)
        else:
            self._epochs.move_to_end(epoch)
        return got

    def _file(self, epoch: int, f: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(window order, cumulative sizes in that order, window sizes) of file f in an epoch."""
        key = (epoch, f)
        got = self._files.get(key)
        if got is None:
            lo, hi = int(self.offsets[f]), int(self.offsets[f + 1])
            ws = self.starts[lo:hi]
            sizes = np.diff(np.append(ws, self.counts[f]))
            # one window (a file smaller than the window, the usual small file) has one order: no generator (its
            # seeding is most of the cost of locating a read batch across 16 such files)
            n = hi - lo
            perm = (
                make_rng(self.seed, self.name, epoch, f, "windows").permutation(n) if n > 1 else np.zeros(n, np.int64)
            )
            got = (perm, np.cumsum(sizes[perm]), sizes)
            self._files[key] = got
            if len(self._files) > self._file_cache:
                self._files.popitem(last=False)
        else:
            self._files.move_to_end(key)
        return got

    def _rows(self, epoch: int, f: int, w: int, size: int) -> np.ndarray:
        key = (epoch, f, w)
        got = self._windows.get(key)
        if got is None:
            # int32 halves the cache (16 KiB, not 32, per 4096-row window; up to _WINDOW_CACHE per source)
            got = make_rng(self.seed, self.name, epoch, f, w).permutation(size).astype(np.int32)
            self._windows[key] = got
            if len(self._windows) > self._window_cache:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        return got

    def locate(self, ordinals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, file, row) int64 arrays for an array of ordinals; vectorised per (epoch, file, window)."""
        o = np.asarray(ordinals, dtype=np.int64).reshape(-1)
        if self.num_samples == 0:
            raise ValueError(f"source {self.name!r} has no samples to locate")
        if len(o) and int(o.min()) < 0:
            raise ValueError(f"ordinals must be >= 0, got {int(o.min())}")
        with self._lock:
            last = self._last
            if last is not None and len(last[0]) == len(o) and np.array_equal(last[0], o):
                got = last[1]  # a loader locates each read batch twice: to read it, then for its sample ids
            else:
                got = self._locate(o)
                self._last = (o.copy(), got)
        return got[0].copy(), got[1].copy(), got[2].copy()

    def _locate(self, o: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        epoch, pos = np.divmod(o, self.num_samples)
        if self.mode == ShuffleMode.NONE:
            files = np.searchsorted(self._fixed_cum, pos, side="right")
            return epoch, files, pos - (self._fixed_cum[files] - self.counts[files])
        if self.lanes > 1:
            pos = self.lane_position(pos)
        if len(o) == 0 or (epoch[0] == epoch[-1] and bool((epoch == epoch[0]).all())):  # one epoch: the usual
            files, rows = self._locate_epoch(int(epoch[0]) if len(o) else 0, pos)
            return epoch, files, rows
        files = np.empty_like(o)
        rows = np.empty_like(o)
        for e in np.unique(epoch).tolist():
            sel = np.flatnonzero(epoch == e)
            files[sel], rows[sel] = self._locate_epoch(e, pos[sel])
        return epoch, files, rows

    def _locate_epoch(self, e: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file, row) of positions of the file-local sequence of epoch e, in a constant number of numpy calls:
        the window orders of the files touched and the row permutations of the windows touched (cached) are
        concatenated, so the Python work is one cache lookup per file and per window (the mixed order touches
        lanes of each), not a pass of numpy calls per file and per window."""
        perm, cum = self._epoch(e)
        if len(pos) == 0:
            return pos.copy(), pos.copy()
        k = np.searchsorted(cum, pos, side="right")  # the file's place in the epoch's file order
        uk, ik = np.unique(k, return_inverse=True)
        uf = perm[uk]
        first = cum[uk] - self.counts[uf]  # each touched file's first position in the sequence
        info = [self._file(e, fi) for fi in uf.tolist()]
        nwin = np.fromiter((len(w[0]) for w in info), dtype=np.int64, count=len(info))
        wbase = np.zeros(len(info) + 1, dtype=np.int64)
        np.cumsum(nwin, out=wbase[1:])
        # the touched files' window ends in the sequence: increasing, as the files are taken in epoch order
        ends = np.concatenate([w[1] for w in info]) + np.repeat(first, nwin)
        kw = np.searchsorted(ends, pos, side="right")  # the window's place among the touched files' windows
        win = np.concatenate([w[0] for w in info])[kw]  # window index in its file
        sizes = np.concatenate([w[2] for w in info])[wbase[ik] + win]
        j = pos - (ends[kw] - sizes)  # place in the window's row permutation
        f = uf[ik]
        wstart = self.starts[self.offsets[f] + win]
        uw, iw = np.unique(kw, return_inverse=True)
        rep = np.zeros(len(uw), dtype=np.int64)
        rep[iw] = np.arange(len(pos))  # one position in each touched window
        perms = [
            self._rows(e, fi, wi, si) for fi, wi, si in zip(f[rep].tolist(), win[rep].tolist(), sizes[rep].tolist())
        ]
        at = np.zeros(len(perms), dtype=np.int64)  # where each permutation starts in their concatenation
        np.cumsum(np.fromiter((len(p) for p in perms[:-1]), dtype=np.int64, count=len(perms) - 1), out=at[1:])
        rows = wstart + np.concatenate(perms)[at[iw] + j]
        return f, rows
