"""A closed run gives its memory back at once (issue 14, the soak): nothing keeps its Job alive once its ranks
left, and the reference cycles of its object graph are collected by the server itself, not at some later
full collection. Automatic collection is off during the test, so only the server's own collection can free
the run: without it (or with a reference left behind, such as the accept loop holding the last client)
the Job stays and the test fails."""

from __future__ import annotations

import gc
import os
import secrets
import warnings
import weakref

import msdata_client as msd
from msdata_server.config import NodeConfig, ServerConfig
from msdata_server.demo import serve_in_thread, stop_server

from .e2e_util import small_job
from .polling import wait_for


def test_closed_run_is_freed_without_automatic_gc(tmp_path):
    cfg = ServerConfig(
        node=NodeConfig(
            id="reclaim",
            socket=os.path.join(str(tmp_path), "msdata.sock"),
            workers=0,
            shm_prefix="rc" + secrets.token_hex(3),
            log_level="WARNING",
        )
    )
    spec = small_job("reclaim", dp=1, samples=200)
    was_enabled = gc.isenabled()
    with warnings.catch_warnings():  # what earlier tests left behind is not this test's subject
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    gc.disable()
    server, loop, thread = serve_in_thread(cfg)
    try:
        refs = []
        for run in range(2):  # two runs one after another, as a restarted trainer
            with msd.DataClient(spec, endpoint=cfg.node.socket, rank=0, world_size=1) as dc:
                for _ in range(6):
                    next(dc)
                job = server.jobs.get("reclaim")
                assert job is not None, f"run {run}: the job did not start"
                assert job.state == "running", f"run {run}: the job did not start"
                refs.append(weakref.ref(job))
                del job
            wait_for(lambda: refs[-1]() is None, 30, f"run {run}'s closed Job to be freed (gc is off)")
        assert not server.jobs, "no job is left registered once every rank left"
    finally:
        stop_server(server, loop, thread)
        if was_enabled:
            gc.enable()


def test_collect_hands_freed_heap_pages_back_to_the_system():
    """Freed blocks in the middle of the heap stay resident until ``malloc_trim``: a closed run's megabytes
    would otherwise count in the server's memory until later allocations reuse them. In a fresh interpreter
    (a heap no other test shaped): 48 MiB of blocks freed below one live block leave the resident set as
    they were, and ``reclaim.collect()`` gives them back."""
    import subprocess
    import sys

    code = """
import os
from msdata_server import reclaim
assert reclaim._TRIM is not None, "glibc's malloc_trim was not found"
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blocks = [bytes([i % 251]) * (64 * 1024) for i in range(768)]  # under the mmap threshold: on the heap
pin = bytes(64 * 1024)  # a live block above them keeps the heap's top from shrinking on its own
del blocks
before = rss()
reclaim.collect()
print(before - rss())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    given_back = int(out)
    assert given_back > 32 * 2**20, f"collect() gave back only {given_back / 2**20:.1f} MiB of 48 MiB freed"


def test_tune_allocator_maps_big_buffers_and_keeps_planner_temporaries_on_the_heap():
    """glibc raises its mmap threshold each time a mapped block is freed, so later buffers of that size are
    carved from the heap (where the holes they leave fragment it). After ``tune_allocator()`` a freed 16 MiB
    block leaves the threshold at 4 MiB: 8 MiB blocks are still mapped on their own, while 1 MiB blocks (a
    planner step's temporaries) come from the heap, not from a fresh mapping faulted in page by page. The same
    code without the call is the control, in a fresh interpreter each."""
    import subprocess
    import sys

    code = """
import ctypes, sys
from msdata_server import reclaim
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert reclaim.tune_allocator(), "mallopt refused the threshold"
big = bytearray(16 << 20)  # mapped, then freed: glibc would raise its threshold past 16 MiB
del big
before = libc.mallinfo2().hblkhd
blocks = [bytearray(8 << 20) for _ in range(4)]  # 32 MiB
after_big = libc.mallinfo2().hblkhd
small = [bytearray(1 << 20) for _ in range(8)]  # 8 MiB
print(after_big - before, libc.mallinfo2().hblkhd - after_big)
"""

    def mapped(mode: str) -> tuple[int, int]:
        run = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
        big, small = run.stdout.split()
        return int(big), int(small)

    big, small = mapped("tuned")
    assert big >= 32 * 2**20, "after tune_allocator() 8 MiB blocks should be mapped on their own"
    assert small < 2**20, "after tune_allocator() 1 MiB blocks should come from the heap (16 KiB mapped them)"
    assert mapped("default")[0] < 2**20, "control: glibc's dynamic threshold should have put 8 MiB blocks on the heap"
