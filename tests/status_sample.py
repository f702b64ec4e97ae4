"""A node's status as the server reports it, for the tests of what reads it (the Prometheus exporter, the
watch view, the CLI)."""

from __future__ import annotations


def _source(samples: int, bad: dict) -> dict:
    return {
        "name": "x",
        "samples_per_s": 812.5,
        "samples_done": samples,
        "bytes_read": 7 * samples,
        "tokens_read": 90 * samples,
        "ready": 40,
        "buffer_fill": 0.625,
        "memory_bytes": 1 << 20,
        "bad_samples": bad,
        "errors": 1,
        "inflight": 2,
        "cursor": samples + 40,
        "held_ahead": 12,
        "readahead": 64,
        "held": 40,
        "held_bound": 96,
        "held_pinned": 32,
        "workers": 3,
        "memory": {"read_ahead": 1 << 20, "order": 60_000, "metadata": 4_200, "handles": 48_000, "decoded": 0},
        "open_files": 2,
    }


# What NodeServer.status() returns (node.py, job/job.py status(), loader statistics, cluster status), plus the
# ranks_detail and autoscale keys the node will add.
SAMPLE = {
    "node": "node-0",
    "role": "leader",
    "pid": 4242,
    "socket": "/run/msdata/msdata.sock",
    "uptime_s": 3725.5,
    "workers": 4,
    "memory": {
        "server_pss": 210 << 20,
        "total_pss": 812 << 20,
        "total_uss": 600 << 20,
        "sources": {
            "read_ahead": 2 << 20,
            "order": 120_000,
            "metadata": 8_400,
            "handles": 96_000,
            "decoded": 0,
            "total": (2 << 20) + 224_400,
        },
        "read_ahead_budget": {
            "samples": 4096,
            "bytes": 1 << 30,
            "loaders": 2,
            "per_loader_samples": 64,
            "per_loader_bytes": 256 << 20,
        },
        "open_files": {"open": 4, "limit": 256, "evictions": 0},
    },
    "storage": {
        "requests": 5120,
        "bytes": 3 << 30,
        "retries": 41,
        "throttled": 37,
        "errors": 0,
        "latency_ms_p50": 21.5,
        "latency_ms_p99": 88.0,
        "cache_hits": 900,
        "cache_misses": 100,
    },
    "autoscale": {
        "enabled": True,
        "sources": {
            "web": {
                "workers": 3,
                "partitions": 2,
                "demand_samples_s": 800.0,
                "supply_samples_s": 950.0,
                "cpu_s_per_sample": 0.004,
            }
        },
    },
    "jobs": [
        {
            "name": "pretrain",
            "digest": "0123456789abcdef",
            "state": "running",
            "error": None,
            "world_size": 4,
            "mesh": {"dp": 4},
            "ranks": [0, 1, 2, 3],
            "steps_planned": 1200,
            "micro_batches_published": 4800,
            "micro_batches_per_s": 38.1,
            "bytes_per_s": 1.3e8,
            "imbalance": 1.031,
            "padding_fraction": 0.02,
            "plan_ms": 2.5,
            "last_step": {"imbalance": 1.05, "padding_fraction": 0.01, "tokens": {"web": 100}},
            "tokens_per_source": {"web": 9_000_000, "code": 3_000_000},
            "tokens_planned": {"web": 9_000_000, "code": 3_000_000},
            "accounting": {
                name: {
                    "tokens_delivered": tokens,
                    "docs_delivered": tokens // 1000,
                    "docs_skipped": 2,
                    "tokens_skipped": 2000,
                    "bad_samples": 4,
                    "epochs_completed": 1,
                }
                for name, tokens in (("web", 8_998_000), ("code", 2_998_000))
            },
            "mixture": {
                "web": {"target": 0.75, "delivered": 0.7501, "epochs_completed": 1, "epoch_progress": 0.25},
                "code": {"target": 0.25, "delivered": 0.2499, "epochs_completed": 1, "epoch_progress": 0.5},
            },
            "rings": [
                {"group": 0, "ring": 0, "slots": 8, "in_use": 3, "slot_size": 1 << 20},
                {"group": 0, "ring": 1, "slots": 8, "in_use": 2, "slot_size": 1 << 20},
                {"group": 1, "ring": 2, "slots": 8, "in_use": 1, "slot_size": 1 << 20},
            ],
            "sources": {"web": _source(50_000, {"decode": 3, "oversize": 1}), "code": _source(20_000, {})},
            "ranks_detail": {
                str(r): {
                    "delivered": 1200,
                    "micro_batches_delivered": 1200,
                    "wait_s": 3.25 + r,
                    "wait_p50_s": 0.0011,
                    "wait_p99_s": 0.015,
                    "wait_frac": 0.012,
                    "step": 299,
                }
                for r in range(4)
            },
        }
    ],
    "cluster": {
        "leader": "node-0",
        "token": 42,
        "leader_token": 42,
        "listen": "127.0.0.1:7460",
        "members": ["node-0", "node-1"],
        "links": ["node-1"],
        "incoming": ["node-1"],
        "lease_alive": True,
        "traffic": {"bytes_in": 123456, "bytes_out": 654321},
        "runs": [],
    },
}
