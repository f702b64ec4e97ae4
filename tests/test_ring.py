"""Ring slots, headers, private mappings, and segment creation/cleanup in /dev/shm."""

import os
import subprocess
import sys

import numpy as np
import pytest

from msdata_client.ring import HEADER_SIZE, RingMap, SlotTable, layout_fields, read_header
from msdata_server import shm

from .server_util import can_unshare


def test_slot_table_frees_after_last_reader():
    t = SlotTable(2)
    a = t.acquire()
    b = t.acquire()
    assert t.acquire() is None  # bounded: a full ring gives nothing, it never overwrites
    t.publish(a, {0, 1})
    assert not t.release(a, 0)
    assert not t.release(a, 0)  # idempotent
    assert t.release(a, 1)
    assert t.acquire() == a
    t.publish(b, {0, 1})
    assert t.drop_reader(1) == []
    assert t.drop_reader(0) == [b]


def test_layout_aligns_fields():
    lay, end = layout_fields([("a", "<i8", (3,)), ("b", "<i4", (5,)), ("c", "<f4", (2, 2))])
    assert [f.offset % 64 for f in lay] == [0, 0, 0]
    assert end == lay[-1].offset + 16


def test_segment_is_private_unlinked_and_views_are_copy_on_write():
    seg = shm.create_segment("tring", "ring", 1 << 20)
    try:
        assert not seg.linked  # rings are unlinked at once: nothing to leak even on SIGKILL
        assert read_header(seg.mm)["kind"] == "ring"
        lay, _ = layout_fields([("x", "<i8", (16,))])
        view = np.frombuffer(seg.mm, dtype=np.uint8)[HEADER_SIZE : HEADER_SIZE + 128].view("<i8")
        view[:] = np.arange(16)
        r1, r2 = RingMap(seg.fd, seg.size), RingMap(seg.fd, seg.size)
        wire = [f.to_wire() for f in lay]
        o1, a1, s1, e1 = r1.batch(HEADER_SIZE, wire)
        o2, a2, _, _ = r2.batch(HEADER_SIZE, wire)
        assert a1["x"].tolist() == list(range(16))
        a1["x"][0] = 999  # a reader's write stays private
        assert a2["x"][0] == 0
        assert view[0] == 0
        del o1, a1, o2, a2
        view[:] = 7  # the producer reuses the slot
        assert r1.scrub(s1, e1)  # the written page is dropped at release ...
        o1, a1, _, _ = r1.batch(HEADER_SIZE, wire)
        assert a1["x"].tolist() == [7] * 16  # ... so the next batch shows the producer's bytes
        assert not r1.scrub(s1, e1)  # nothing written: nothing to drop
        with pytest.raises(ValueError, match="outside the ring"):
            r1.batch(seg.size, wire)
        del o1, a1, view, r1, r2
    finally:
        seg.close()


def test_named_segment_mode_and_cleanup():
    seg = shm.create_segment("tring", "pool", 4096, unlink=False)
    try:
        path = "/dev/shm" + seg.name
        assert os.stat(path).st_mode & 0o777 == 0o600
        names = {n for n, _ in shm.list_segments()}
        assert seg.name[1:] in names
        _removed, kept = shm.cleanup()
        assert seg.name[1:] in kept  # its owner (us) is alive
    finally:
        seg.close()


def test_cleanup_removes_segments_of_dead_owners():
    code = "from msdata_server import shm; s = shm.create_segment('tdead', 'pool', 4096, unlink=False); print(s.name)"
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.exists("/dev/shm" + name)  # the child exited without unlinking
    out = subprocess.run([sys.executable, "-m", "msdata_server", "cleanup"], capture_output=True, text=True, check=True)
    assert name[1:] in out.stdout
    assert not os.path.exists("/dev/shm" + name)


needs_unshare = pytest.mark.skipif(not can_unshare(), reason="needs `unshare -m` (root) to mount a small /dev/shm")


@needs_unshare
def test_too_small_shm_fails_at_creation_clearly():
    """A real 2 MiB /dev/shm (a private mount namespace): an 8 MiB ring fails at once, saying the fix."""
    code = (
        "from msdata_server import shm\n"
        "try:\n    shm.create_segment('tsmall', 'ring', 8 << 20)\n"
        "except shm.ShmError as e:\n    print('ShmError:', e)\n"
    )
    out = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f'mount -t tmpfs -o size=2M tmpfs /dev/shm && exec {sys.executable} -c "$0"',
            code,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "ShmError:" in out.stdout, out.stderr
    assert "shm-size" in out.stdout
    assert "2.0 MiB free" in out.stdout
