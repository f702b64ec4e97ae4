"""[node] metrics and log_format: defaults, good values, and errors that name the key and the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from msdata_server.config import load_config, parse_config
from msdata_server.errors import ConfigError

from .server_util import ROOT


def test_defaults_are_off_and_text():
    node = parse_config({}).node
    assert node.metrics == ""
    assert node.metrics_addr is None
    assert node.log_format == "text"


def test_good_values():
    node = parse_config({"node": {"metrics": "0.0.0.0:9460", "log_format": "json"}}).node
    assert node.metrics_addr == ("0.0.0.0", 9460)
    assert node.log_format == "json"
    assert parse_config({"node": {"metrics": "[::1]:0"}}).node.metrics_addr == ("::1", 0)
    assert parse_config({"node": {"metrics": "localhost:9460"}}).node.metrics_addr == ("localhost", 9460)


@pytest.mark.parametrize(
    ("node", "match"),
    [
        ({"metrics": "9460"}, r'\[node\] metrics = \'9460\' must be "HOST:PORT", e\.g\. "127\.0\.0\.1:9460"'),
        ({"metrics": "127.0.0.1:65536"}, r"\[node\] metrics = .* must be \"HOST:PORT\""),
        ({"metrics": "metrics.example.com:9460"}, r"\[node\] metrics host 'metrics\.example\.com' must be an IP"),
        ({"metrics": 9460}, r"\[node\] metrics = 9460 must be a string"),
        ({"log_format": "xml"}, r"\[node\] log_format = 'xml' must be one of 'text', 'json'"),
        ({"log_format": 1}, r"\[node\] log_format = 1 must be a string"),
        ({"listen": "nowhere"}, r"\[node\] listen = 'nowhere' must be \"HOST:PORT\", e\.g\. \"127\.0\.0\.1:7460\""),
    ],
)
def test_bad_values_name_the_key_and_the_fix(node, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({"node": node})


def test_the_deploy_example_enables_metrics():
    assert load_config(str(ROOT / "deploy" / "node.toml")).node.metrics == "127.0.0.1:9460"


def test_validate_reports_a_bad_metrics_address(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('[node]\nmetrics = "127.0.0.1"\n')
    out = subprocess.run(
        [sys.executable, "-m", "msdata_server", "validate", "--config", str(cfg)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 2
    assert "[node] metrics = '127.0.0.1' must be \"HOST:PORT\"" in out.stderr
