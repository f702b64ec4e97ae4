"""A picture job on two node servers with a real etcd: the leader prices images it asks the partition owners
about (the vision metadata over the peer links), pictures travel between nodes without pickle, and every
rank's batches equal, bit for bit and pixels included, those of the same job on one node."""

from __future__ import annotations

from .cluster_util import run_spread
from .e2e_util import run_ranks
from .polling import wait_for
from .vlm_util import documents, picture_job, pictures, write_parquet


def test_a_picture_job_on_two_nodes_equals_one_node(etcd_server, cluster_factory, server_factory, tmp_path):
    write_parquet(tmp_path / "pq", [pictures("a", 40, "PNG", 7), pictures("b", 40, "JPEG", 8)])
    spec = picture_job("vlm-cluster", [("pq", "parquet", tmp_path / "pq", ["image", "caption"])], dp=2, micro=2)
    n = 3 * spec.micro_batches
    single = server_factory(workers=1).start()
    want, kept = run_ranks(spec, single.socket, n, keep=True)
    assert sum(len(documents(b)) for b in kept[0]) > 0
    assert any(len(b["image_grid_thw"]) for b in kept[0])

    c = cluster_factory(etcd_server.url, n=2).start()
    wait_for(lambda: c.settled(set(c.nodes)), 30, "one leader that every node agrees on")
    got = run_spread(c, spec, n, {0: [0], 1: [1]})
    for r in range(spec.mesh.world_size):
        assert got[r] == want[r], f"rank {r} got other batches on two nodes than on one"
