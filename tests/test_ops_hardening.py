"""Operations hardening (issue 25, item 11): non-finite durations are refused in the config, an unreachable
NOTIFY_SOCKET is warned about once (not on every watchdog ping), and Python warnings go through logging (one
JSON object a line with log_format = "json")."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import orjson
import pytest

from msdata_server.config import parse_config
from msdata_server.errors import ConfigError
from msdata_server.ops.sdnotify import Notifier

from .server_util import ROOT


@pytest.mark.parametrize("key", ["reconnect_grace", "drain_timeout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_durations_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"{key} = {value!r} must be a finite number >= 0"):
        parse_config({"node": {key: value}})


def test_an_unreachable_notify_socket_is_warned_about_once(sockdir, caplog):
    caplog.set_level(logging.DEBUG, logger="msdata_server.ops.sdnotify")
    with Notifier({"NOTIFY_SOCKET": os.path.join(sockdir, "nobody.sock"), "WATCHDOG_USEC": "1000000"}) as n:
        for _ in range(5):
            assert n.watchdog() is False
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]  # the failure, and that repeats go to debug
    assert "nobody.sock" in warnings[0].getMessage()
    assert "debug level" in warnings[1].getMessage()
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 4


def test_python_warnings_are_json_log_lines():
    code = (
        "import warnings\n"
        "from msdata_server.ops.logs import configure_logging\n"
        "configure_logging('INFO', 'json')\n"
        "warnings.warn('Image size exceeds limit', UserWarning)\n"
    )
    res = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=60, cwd=str(ROOT)
    )
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines, "the warning was not logged"
    records = [orjson.loads(line) for line in lines]  # every line one JSON object
    assert any("Image size exceeds limit" in r["message"] for r in records)
