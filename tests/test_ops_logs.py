"""configure_logging: JSON lines that parse one by one (exceptions included), the text format, bad formats."""

from __future__ import annotations

import io
import logging
import re

import orjson
import pytest

from msdata_server.ops.logs import Once, configure_logging


@pytest.fixture
def restore_logging():
    """configure_logging replaces the root handlers (pytest's too): put them back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            h.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_logs_are_one_object_per_line(restore_logging):
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    log = logging.getLogger("msdata_server.test")
    log.debug("not shown")
    log.info("job %s registered\nwith a newline", "pretrain")
    try:
        {}["missing"]
    except KeyError:
        log.exception("planning failed")
    log.warning("done", stack_info=True)
    lines = out.getvalue().splitlines()
    docs = [orjson.loads(line) for line in lines]
    assert len(lines) == 3
    assert docs[0]["message"] == "job pretrain registered\nwith a newline"
    assert docs[0]["level"] == "INFO"
    assert docs[0]["logger"] == "msdata_server.test"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", docs[0]["time"])
    assert "exc_info" not in docs[0]
    assert docs[1]["level"] == "ERROR"
    assert "KeyError: 'missing'" in docs[1]["exc_info"]
    assert "Traceback" in docs[1]["exc_info"]
    assert "stack_info" in docs[2]


def test_text_logs_and_levels(restore_logging):
    out = io.StringIO()
    configure_logging("WARNING", "text", stream=out)
    logging.getLogger("msdata_server.x").info("quiet")
    logging.getLogger("msdata_server.x").warning("loud %d", 3)
    assert re.fullmatch(r"\S+ \S+ WARNING msdata_server\.x: loud 3\n", out.getvalue())


@pytest.mark.parametrize(
    ("level", "fmt", "match"),
    [("INFO", "xml", r"'xml' must be one of \['text', 'json'\]"), ("LOUD", "text", "log level 'LOUD'")],
)
def test_bad_format_or_level(level, fmt, match, restore_logging):
    with pytest.raises(ValueError, match=match):
        configure_logging(level, fmt)


def test_once_names_each_offender_once_and_stays_bounded():
    once = Once(limit=3)
    assert once("bad-frame", "peer-a")
    assert not once("bad-frame", "peer-a")
    assert not once("bad-frame", "peer-a")
    assert once("bad-frame", "peer-b")
    assert once("stale-token", "peer-a")
    assert once.suppressed == 2
    assert once("x", 1)  # a fourth key: the oldest ("bad-frame", "peer-a") is forgotten ...
    assert once("bad-frame", "peer-a")  # ... and would be logged again
    assert len(once) == 3
    with pytest.raises(ValueError, match="limit=0"):
        Once(limit=0)
