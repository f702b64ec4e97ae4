"""Planner checkpoints on the node's disk (``[node] state_dir``): the small state at each step boundary, so a
server killed with SIGKILL continues a job where its ranks were (large buffers are rebuilt by deterministic
replay, never snapshotted).

One file per step, written atomically (tmp + rename): a base (the whole state) every ``every`` steps, deltas
(what changed since that base) between them (``planner/delta.py``); files of version 1 (``.json``, the whole
state) still load. A state_dir that cannot be written (permissions, a full disk) is an error that names the
directory and the fix; ``persist`` waits and retries until the write succeeds, so no state is lost and the job
goes on by itself once the cause is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re

import orjson

from . import faults
from .errors import CheckpointError
from .planner.delta import DeltaWriter, expired, newest

__all__ = ["ListingManifests", "StateStore", "atomic_write", "probe"]

log = logging.getLogger(__name__)

_STEP_FILE = re.compile(r"^step-(\d{12})\.(json|msds)$")
_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
_IN_THE_WAY = (errno.ENOTDIR, errno.EEXIST)


def atomic_write(path: str, data: bytes) -> None:
    """``data`` at ``path`` or nothing there (tmp + rename; the tmp file goes on failure)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def explain(directory: str, e: OSError) -> str:
    """What went wrong writing the state_dir and what the user does about it."""
    what = f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
    if e.errno in _FULL:
        fix = "free space on that disk (or point [node] state_dir at another one)"
        cause = "the disk is full"
    elif e.errno in _DENIED:
        fix = "make it writable by the server's user (chown/chmod), or point [node] state_dir at a writable directory"
        cause = "it is not writable"
    elif e.errno in _IN_THE_WAY:
        fix = "remove that file, or point [node] state_dir at a writable directory"
        cause = "a file is in the way"
    else:
        fix = "check the disk and the path, or point [node] state_dir elsewhere"
        cause = "writing failed"
    return (
        f"cannot save the planner state in state_dir {directory}: {cause}: {what}; {fix}. "
        "Planning waits (no step leaves before its state is saved) and goes on by itself once it can write"
    )


def probe(directory: str) -> str | None:
    """Why the planner state could not be saved in ``directory`` now (``explain``), or None when a file can be
    written there (made and removed: what ``status`` and ``health`` report, issue 25 item 11)."""
    path = os.path.join(directory, f".probe-{os.getpid()}")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        with open(path, "wb"):
            pass
        os.unlink(path)
    except OSError as e:
        return explain(directory, e)
    return None


class StateStore:
    """Per-job directory ``{state_dir}/{job}/{digest16}`` of ``step-NNNNNNNNNNNN.msds`` records (version 1:
    ``.json`` states). Keeps the newest ``keep`` steps and the bases their deltas need."""

    def __init__(self, state_dir: str, job: str, digest: str, keep: int = 64, every: int = 16):
        self.dir = os.path.join(state_dir, job, digest[:16])
        self.keep = keep
        self.every = every
        self.write = atomic_write  # the one write path (tests' disk faults wrap it: faults.py)
        self.failing: str | None = None  # the error while the state_dir cannot be written, for status and logs
        self.bytes_written = 0
        self._writer = DeltaWriter(every)
        self._files: dict[int, str] | None = None  # step -> file name
        self._clear_pending = False
        faults.arm_disk(self)  # tests only: a no-op unless their fault switch is on (faults.py)

    def _list(self) -> dict[int, str]:
        if self._files is None:
            try:
                names = os.listdir(self.dir)
            except OSError:
                names = []
            found: dict[int, str] = {}
            for n in sorted(names):  # .json before .msds: the record wins when both exist
                if m := _STEP_FILE.match(n):
                    found[int(m.group(1))] = n
            self._files = found
        return self._files

    def _path(self, step: int, ext: str = "msds") -> str:
        return os.path.join(self.dir, f"step-{step:012d}.{ext}")

    def _name(self, step: int) -> str:
        return os.path.join(self.dir, self._list().get(step, f"step-{step:012d}"))

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, name))

    def save(self, step: int, state: dict) -> None:
        """Write the state at the start of ``step`` (a base or a delta); forget what left the window.
        CheckpointError (naming the directory and the fix) when the state_dir cannot be written."""
        data, _ = self._writer.encode(step, state)
        try:
            if self._clear_pending:
                self._clear_files()
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            self.write(self._path(step), data)
        except OSError as e:
            self._writer.reset()  # the next record is a base: this one may be missing
            raise CheckpointError(explain(self.dir, e)) from e
        self.bytes_written += len(data)
        files = self._list()
        old = files.get(step)
        files[step] = os.path.basename(self._path(step))
        if old is not None and old != files[step]:
            self._unlink(old)
        cutoff = expired(step, self.keep, self.every)
        for s in [s for s in files if s <= cutoff]:
            try:
                self._unlink(files[s])
            except OSError as e:  # a later save tries again
                log.debug("could not drop %s: %s", files[s], e)
                continue
            del files[s]

    async def persist(self, step: int, state: dict) -> None:
        """``save`` in a thread; while the state_dir cannot be written, log the cause once and retry with
        back-off (the step's plan waits, so nothing is lost); log when it works again."""
        delay = 0.05
        while True:
            try:
                await asyncio.to_thread(self.save, step, state)
            except CheckpointError as e:
                if self.failing is None:
                    log.error("%s", e)
                self.failing = str(e)
                await asyncio.sleep(delay)  # no event tells us the disk has room again: back off, retry
                delay = min(2 * delay, 1.0)
                continue
            if self.failing is not None:
                log.warning("state_dir %s: the planner state saves again (step %d); planning goes on", self.dir, step)
                self.failing = None
            return

    def _read(self, step: int) -> bytes | None:
        name = self._list().get(step)
        if name is None:
            return None
        with open(os.path.join(self.dir, name), "rb") as f:
            return f.read()

    def load_at_or_before(self, step: int) -> tuple[int, dict] | None:
        """The newest state at a step <= ``step`` that loads (a torn or corrupt file, or a delta whose base is
        gone, is skipped with a warning)."""
        found, skipped = newest([s for s in self._list() if s <= step], self._read, self._name)
        for why in skipped:
            log.warning("skipping a planner checkpoint: %s", why)
        return found

    def _clear_files(self) -> None:
        files = self._list()
        for s in list(files):
            self._unlink(files[s])
            del files[s]
        self._clear_pending = False

    def clear(self) -> None:
        """Forget every checkpoint of this job (a new run that brought no state starts from the beginning); if
        the directory cannot be written now, the next save clears it first."""
        self._writer.reset()
        try:
            self._clear_files()
        except OSError as e:
            self._clear_pending = True
            log.error("%s", explain(self.dir, e))


class ListingManifests:
    """Sources' file listings (``sources.listing``) in ``{state_dir}/.listings/{digest}.json``, each written once:
    when a resume finds the files changed, the saved listing names the files that did. Best effort: a manifest
    that cannot be written is logged and the error then names counts and digests only."""

    def __init__(self, state_dir: str):
        self.dir = os.path.join(state_dir, ".listings")

    def _path(self, digest: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{32}", digest):
            raise ValueError(f"not a listing digest: {digest!r}")
        return os.path.join(self.dir, f"{digest}.json")

    def save(self, manifest: dict) -> None:
        path = self._path(manifest["digest"])
        if os.path.exists(path):
            return
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            atomic_write(path, orjson.dumps(manifest))
        except OSError as e:
            log.warning("could not keep the file listing %s: %s", path, e)

    def load(self, digest: str) -> dict | None:
        """The manifest of ``digest``, or None when this node does not hold it (or it does not read)."""
        try:
            with open(self._path(digest), "rb") as f:
                raw = orjson.loads(f.read())
        except (OSError, ValueError):
            return None
        return raw if isinstance(raw, dict) else None
