"""The transform worker process and its forkserver (``python -m msdata_server.pool.worker``): numpy/pyarrow only.

Workers are started as fresh interpreters (spawn) or forked from a per-pool zygote that preloaded the
imports (forkserver); never from the server's own process image, and the server's ``__main__`` is never
re-imported (a trainer's or benchmark's main module may import torch).

Protocol on a worker's private socket (multiprocessing Connection frames, pickle: our own child only):
parent -> worker: ``(task_id, transform, seed, sample_ids, records)`` per task, or ``None`` to stop.
worker -> parent: ``("ready", pid)``, then ``(task_id, items, cpu_s, wall_s)`` per task (the process CPU time
and the wall time the task took in the worker, for the source's profile), where an item is
``("s", offset, dtype, shape)`` (the array lies in the output segment at offset), ``("a", array)`` (small,
inline), ``("b", reason, location, detail)`` (a bad sample) or ``("v", [(key, item), ...])`` (a picture
document, ``transforms.VlmSample``: each of its arrays as an "s" or "a" item, so pixels never get pickled).
The parent copies the arrays out of the segment before it sends the next task, so one segment per worker
suffices.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

__all__ = ["ALIGN", "INLINE_BYTES", "main", "pack_results", "worker_main", "zygote_main"]

INLINE_BYTES = 4096  # results at most this big travel inline in the pickle
ALIGN = 64


def pack_results(results: list, mm: mmap.mmap | None, start: int) -> list[tuple]:
    """Encode results: big numeric arrays are copied into mm from ``start`` on, the rest go inline."""
    from ..document import VlmSample
    from ..sources.base import BadSample

    items: list[tuple] = []
    off = [start]
    for r in results:
        if isinstance(r, BadSample):
            items.append(("b", r.reason, r.location, r.detail))
        elif isinstance(r, VlmSample):
            items.append(("v", [(k, _pack_array(a, mm, off)) for k, a in r.arrays().items()]))
        else:
            items.append(_pack_array(r, mm, off))
    return items


def _pack_array(r: np.ndarray, mm: mmap.mmap | None, off: list[int]) -> tuple:
    """One array as an item: into the segment at ``off[0]`` (advanced) when big and it fits, else inline."""
    nb = r.nbytes
    size = len(mm) if mm is not None else 0
    if mm is not None and nb > INLINE_BYTES and r.dtype.kind in "biuf" and off[0] + nb <= size:
        dst = np.frombuffer(mm, dtype=r.dtype, count=r.size, offset=off[0]).reshape(r.shape)
        dst[...] = r
        del dst
        item = ("s", off[0], r.dtype.str, r.shape)
        off[0] = (off[0] + nb + ALIGN - 1) // ALIGN * ALIGN
        return item
    return ("a", r)


def worker_main(conn, seg_fd: int, seg_size: int, data_start: int) -> None:
    """Serve tasks until told to stop or until the parent goes away."""
    from ..transforms import load_transform, run_transform

    # a worker is one core of the pool, which is the parallelism: a transform library's own thread pool
    # (tokenizers' encode_batch) would only oversubscribe the cores the other workers use (an explicit setting wins)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    mm = None
    if seg_fd >= 0:
        try:
            mm = mmap.mmap(seg_fd, seg_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(seg_fd)
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        msg = pickle.loads(data)
        if msg is None:
            break
        tid, name, seed, ids, records = msg
        try:
            fn = load_transform(name)
        except Exception as e:  # the parent validated the name; report rather than die
            conn.send_bytes(pickle.dumps((tid, ("error", f"{type(e).__name__}: {e}"), 0.0, 0.0)))
            continue
        cpu0, wall0 = time.process_time(), time.perf_counter()  # the samples' cost (not the first import)
        results = run_transform(fn, records, seed=seed, sample_ids=ids)
        items = pack_results(results, mm, data_start)
        del results
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        try:
            conn.send_bytes(pickle.dumps((tid, items, cpu, wall), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # the pool closed while this task ran (a long clip): nobody waits for it
            break
    if mm is not None:
        mm.close()
    conn.close()


def zygote_main(sock_fd: int) -> None:
    """A forkserver: with numpy, pyarrow and the transforms imported once, fork a worker per request.

    Request: ``b"F <seg_size> <data_start>"`` with the worker's socket and segment descriptors (SCM_RIGHTS);
    reply: ``b"P <pid>"``. Exits when the pool closes its end.
    """
    from .. import transforms  # noqa: F401  (preload: forked workers start warm)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our children
    sock = socket.socket(fileno=sock_fd)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 256, 2)
        except OSError:
            break
        if not msg:
            break
        _, seg_size, data_start = msg.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                worker_main(Connection(fds[0]), fds[1] if len(fds) > 1 else -1, int(seg_size), int(data_start))
            except BaseException:
                code = 1
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        sock.sendall(b"P %d" % pid)


def main(argv: list[str]) -> None:
    """``worker SOCK_FD SEG_FD SEG_SIZE DATA_START`` or ``zygote SOCK_FD`` (descriptors inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server shuts its pool down itself
    if argv[0] == "worker":
        sock_fd, seg_fd, seg_size, data_start = (int(a) for a in argv[1:5])
        worker_main(Connection(sock_fd), seg_fd, seg_size, data_start)
    elif argv[0] == "zygote":
        zygote_main(int(argv[1]))
    else:
        raise SystemExit(f"usage: python -m msdata_server.pool.worker worker|zygote ...; got {argv!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
