"""A job mixing captions, pages and clips on a 3-node cluster with a real etcd: the leader prices clips per
temporal patch from the partition owners' metadata, clips travel between nodes as raw bytes (never pickled),
and every rank's batches equal, bit for bit and pixels included, those of the same job on one node."""

from __future__ import annotations

from .cluster_util import run_spread
from .e2e_util import run_ranks
from .polling import wait_for
from .video_util import mixed_job, video_documents, write_mixed


def test_a_video_job_on_three_nodes_equals_one_node(etcd_server, cluster_factory, server_factory, tmp_path):
    write_mixed(tmp_path)
    spec = mixed_job(tmp_path, "video-cluster", dp=3, micro=2)
    n = 3 * spec.micro_batches
    single = server_factory(workers=1).start()
    want, kept = run_ranks(spec, single.socket, n, keep=True)
    clips = sum(len(b["video_grid_thw"]) for r in kept for b in kept[r])
    assert clips > 0, "the job delivered no clip"
    for r in kept:
        for b in kept[r]:
            video_documents({k: v.numpy() for k, v in b.items()})

    c = cluster_factory(etcd_server.url, n=3).start()
    wait_for(lambda: c.settled(set(c.nodes)), 30, "one leader that every node agrees on")
    got = run_spread(c, spec, n, {0: [0], 1: [1], 2: [2]})
    for r in range(spec.mesh.world_size):
        assert got[r] == want[r], f"rank {r} got other batches on three nodes than on one"
