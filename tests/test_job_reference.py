"""docs/JOB.md, the job file's key reference (issue 26, item 8), is generated from the spec and cannot drift: it
equals what the generator writes, and its keys are exactly those each table accepts (read from the spec's own
'allowed keys' refusal)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from msdata_client._reference import MEANINGS, TABLES, render, table_keys
from msdata_client.errors import ConfigError
from msdata_client.spec import JobSpec

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "job": {"name": "ref"},
    "mesh": {"dp": 1},
    "source": [{"name": "a", "format": "synthetic"}],
    "mix": {"weights": {"a": 1.0}},
    "balance": {"method": "greedy"},
}
WHERE = {"[job]": "job", "[mesh]": "mesh", "[[source]]": "source", "[mix]": "mix", "[balance]": "balance"}


def test_docs_job_md_is_the_generated_reference():
    got = (ROOT / "docs" / "JOB.md").read_text()
    assert got == render(), "docs/JOB.md is stale: regenerate with `python -m msdata_client._reference > docs/JOB.md`"


def documented(table: str) -> list[str]:
    text = (ROOT / "docs" / "JOB.md").read_text()
    section = text.split(f"## {table}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, re.M)


@pytest.mark.parametrize("table", [t for t, _ in TABLES])
def test_the_reference_lists_exactly_the_keys_the_spec_accepts(table):
    d = copy.deepcopy(BASE)
    target = d[WHERE[table]]
    (target[0] if isinstance(target, list) else target)["no_such_key"] = 1
    with pytest.raises(ConfigError, match="allowed keys: ") as e:
        JobSpec.from_dict(d)
    accepted = str(e.value).split("allowed keys: ", 1)[1].split(";")[0].strip().split(", ")
    assert sorted(documented(table)) == sorted(accepted)


def test_every_meaning_belongs_to_a_key():
    keys = {(t, f.name) for t, cls in TABLES for f in table_keys(t, cls)}
    assert set(MEANINGS) == keys


def test_documented_defaults_are_the_spec_defaults():
    spec = JobSpec.from_dict(copy.deepcopy(BASE))
    text = (ROOT / "docs" / "JOB.md").read_text()
    assert f"| `seq_len` | integer | `{spec.seq_len}` |" in text
    assert f"| `pad_id` | integer | `{spec.pad_id}`, or the tokenizer's pad token |" in text
    assert f'| `long_docs` | string | `"{spec.long_docs}"` |' in text
