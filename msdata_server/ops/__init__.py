"""Operations building blocks the node server wires in: systemd notify, the Prometheus exporter, rank data-wait
statistics, log formats and the `status --watch` screen. Each module is self-contained (no node or job imports).
The watch loop is ``msdata_server.ops.watch.watch`` (not re-exported: the name is its module's).

Names load on first use (PEP 562): a `msdata-server health` probe does not pay for importing prometheus_client.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "LOG_FORMATS",
    "Notifier",
    "StatusCollector",
    "WaitStats",
    "configure_logging",
    "notify",
    "render",
    "start_metrics_server",
]

_WHERE = {
    "LOG_FORMATS": "logs",
    "Notifier": "sdnotify",
    "StatusCollector": "prometheus",
    "WaitStats": "waits",
    "configure_logging": "logs",
    "notify": "sdnotify",
    "render": "watch",
    "start_metrics_server": "prometheus",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
