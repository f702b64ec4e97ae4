"""Package hygiene: public names, no torch in the server, the console script, the README's commands."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULES = [
    "msdata_client",
    "msdata_client.graph",
    "msdata_client.mesh",
    "msdata_client.ring",
    "msdata_client.wire",
    "msdata_client.errors",
    "msdata_client.client",
    "msdata_server.shm",
    "msdata_server.batch",
    "msdata_server.node",
    "msdata_server.job",
    "msdata_server.endpoint",
    "msdata_server.config",
    "msdata_server.planner",
    "msdata_server.sources",
    "msdata_server.loader",
    "msdata_server.pool",
    "msdata_client.choices",
    "msdata_client.spec",
    "msdata_server.checkpoint",
    "msdata_server.job.pieces",
    "msdata_server.job.seams",
]


@pytest.mark.parametrize("name", MODULES)
def test_all_is_sorted_and_importable(name):
    mod = importlib.import_module(name)
    names = list(mod.__all__)
    assert names == sorted(names), f"{name}.__all__ is not sorted"
    for n in names:
        assert hasattr(mod, n), f"{name}.__all__ names {n!r}, which is missing"


def test_server_never_imports_torch():
    code = (
        "import sys; import msdata_server.cli, msdata_server.node, msdata_server.job, msdata_server.pool, "
        "msdata_server.demo, msdata_client; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_help_and_readme_commands():
    out = subprocess.run([sys.executable, "-m", "msdata_server", "--help"], capture_output=True, text=True, check=True)
    for cmd in ("serve", "demo", "status", "validate", "cleanup"):
        assert cmd in out.stdout
    head = (ROOT / "README.md").read_text().splitlines()[:10]
    assert any("make demo" in line for line in head)
    assert any("make test" in line for line in head)


def test_one_version_everywhere():
    """msdata_client.__version__ (a fixed name), the server's and `msdata-server --version` are pyproject's."""
    import tomllib

    import msdata_client
    import msdata_server

    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert msdata_client.__version__ == msdata_server.__version__ == want
    out = subprocess.run([sys.executable, "-m", "msdata_server", "--version"], capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.strip() == f"msdata-server {want}"


def test_setuptools_reads_pyproject_without_a_deprecation_warning():
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert not [str(w.message) for w in got if "license" in str(w.message)]
    assert dist.metadata.license_expression == "Apache-2.0"


def test_make_test_quick_names_existing_fast_test_files():
    """`make test-quick` runs a subset without server processes (seconds, not the full suite's minutes)."""
    import re

    mk = (ROOT / "Makefile").read_text()
    assert re.search(r"^test-quick:", mk, re.M), "Makefile has no test-quick target"
    files = re.search(r"^QUICK_TESTS\s*:?=(.*?)(?<!\\)$", mk, re.M | re.S)
    assert files is not None
    names = files.group(1).replace("\\", " ").split()
    assert len(names) >= 5
    for n in names:
        p = ROOT / n
        assert p.is_file(), f"make test-quick names {n}, which does not exist"
        needle = "server_" + "factory"  # the fixture that starts servers (split: this file is on the list)
        assert needle not in p.read_text(), f"{n} starts servers: too slow for test-quick"
