"""The shape of the code, checked on every run (ARCHITECTURE §8): no import cycle between modules or packages
(imports under TYPE_CHECKING count: they tie the code all the same), the client never imports the server, the
planner does no I/O, nobody sniffs which mode a seam object is in, size is argued where it is large, and
docs/ARCHITECTURE.md names every module by its path."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("msdata_server", "msdata_client")
MAX_CLASS = 400  # lines; more needs a "Size: <why it is one piece>" line in the class docstring
MAX_PLAIN_FUNC = 60  # lines; more needs a docstring
MAX_FUNC = 120  # lines; none longer
MAX_PROTOCOL = 8  # members; more needs a "Size:" line too
# Modules whose import means I/O or an event loop: the planner is a pure function of data.
IO_MODULES = ("asyncio", "socket", "selectors", "ssl", "subprocess", "shutil", "http", "urllib", "pyarrow", "uvloop")
# Names of the objects behind the seams (plan feed, payload source, starter, the node): asking one of them
# whether it has an attribute is telling the modes apart where neither imports nor mypy see it.
SEAM_NAMES = frozenset({"feed", "payloads", "starter", "node", "jobs", "job", "run", "shard", "cluster"})


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: set[str] = field(default_factory=set)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Module]:
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            m = Module(_module_name(f), f, ast.parse(f.read_text(), str(f)))
            mods[m.name] = m
    for m in mods.values():
        package = m.name.split(".") if m.path.name == "__init__.py" else m.name.split(".")[:-1]
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    m.imports.add(sub if sub in mods else base)
            elif isinstance(node, ast.Import):
                m.imports.update(a.name for a in node.names)
    return mods


def package_of(mod: Module) -> str:
    """The package a module belongs to: its directory's package (``msdata_server.cluster.net`` for
    ``cluster/net/etcd.py``); a module at a package root is a package of its own (``msdata_server.node``)."""
    if mod.path.name == "__init__.py":
        return mod.name
    parent = mod.name.rpartition(".")[0]
    return mod.name if parent in PACKAGES else parent


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    mods = modules()
    edges = {n: {d for d in m.imports if d in mods and d != n} for n, m in mods.items()}
    assert _cycles(edges) == []


def test_no_import_cycle_between_packages():
    mods = modules()
    edges: dict[str, set[str]] = {}
    for m in mods.values():
        p = package_of(m)
        edges.setdefault(p, set()).update(package_of(mods[d]) for d in m.imports if d in mods)
        edges[p].discard(p)
    assert _cycles(edges) == []


def test_the_client_never_imports_the_server():
    found = {
        f"{m.name} imports {d}"
        for m in modules().values()
        if m.name.startswith("msdata_client")
        for d in m.imports
        if d.split(".")[0] == "msdata_server"
    }
    assert not found


def test_the_planner_does_no_io():
    found = {
        f"{m.name} imports {d}"
        for m in modules().values()
        if m.name.startswith("msdata_server.planner")
        for d in m.imports
        if d.split(".")[0] in IO_MODULES
    }
    assert not found


def _sniffs(tree: ast.AST) -> list[str]:
    """``getattr(x, "name"[, default])`` or ``hasattr(x, "name")`` where ``x`` names a seam object."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
            continue
        if not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            continue
        words = set(re.findall(r"[a-z_]+", ast.unparse(node.args[0])))
        if words & SEAM_NAMES:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_sniff_check_catches_a_sniff():
    assert _sniffs(ast.parse('split = getattr(job.payloads, "set_partitions", None)'))
    assert not _sniffs(ast.parse('getattr(fn, "needs_rng", True)'))


def test_no_mode_is_sniffed_on_a_seam_object():
    found = {f"{m.path.relative_to(ROOT)} {s}" for m in modules().values() for s in _sniffs(m.tree)}
    assert not found, "ask the seam (a method of the PlanFeed/PayloadSource protocol), not getattr"


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined,operator]


def _sized(node: ast.ClassDef) -> bool:
    return any(line.strip().startswith("Size:") for line in (ast.get_docstring(node) or "").splitlines())


def _is_protocol(node: ast.ClassDef) -> bool:
    return any(ast.unparse(b).split(".")[-1].startswith("Protocol") for b in node.bases)


def test_size_is_argued_where_it_is_large():
    unargued, long_plain, too_long = [], [], []
    for m in modules().values():
        where = m.path.relative_to(ROOT)
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ClassDef):
                members = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef, ast.AnnAssign)) for b in node.body)
                big = _lines(node) > MAX_CLASS or (_is_protocol(node) and members > MAX_PROTOCOL)
                if big and not _sized(node):
                    unargued.append(f"{where}:{node.lineno} {node.name}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _lines(node) > MAX_FUNC:
                    too_long.append(f"{where}:{node.lineno} {node.name} ({_lines(node)} lines)")
                elif _lines(node) > MAX_PLAIN_FUNC and ast.get_docstring(node) is None:
                    long_plain.append(f"{where}:{node.lineno} {node.name} ({_lines(node)} lines)")
    assert not unargued, f"classes over {MAX_CLASS} lines (or protocols over {MAX_PROTOCOL} members) need 'Size:'"
    assert not too_long
    assert not long_plain


def test_large_classes_are_reported(capsys):
    """Not a gate: the largest classes of both packages, printed with ``-s`` (a prompt to look, never a cap)."""
    sizes = sorted(
        (
            (_lines(n), f"{m.path.relative_to(ROOT)}:{n.lineno} {n.name}")
            for m in modules().values()
            for n in ast.walk(m.tree)
            if isinstance(n, ast.ClassDef)
        ),
        reverse=True,
    )
    print("largest classes:", "; ".join(f"{n} {w}" for n, w in sizes[:5]))
    assert sizes


def test_architecture_names_every_module():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`([\w/]+\.py)`", doc))
    missing = []
    for m in modules().values():
        if m.path.name in ("__init__.py", "__main__.py"):
            continue
        rel = m.path.relative_to(ROOT / m.name.split(".")[0]).as_posix()
        if rel not in named:
            missing.append(f"{m.name.split('.')[0]}: {rel}")
    assert not missing, "docs/ARCHITECTURE.md names every module by its path in its package, in backticks"
    stale = {p for p in named if not any((ROOT / pkg / p).exists() for pkg in PACKAGES)}
    stale -= {p for p in named if (ROOT / p).exists() or p.startswith(("bench/", "tests/", "examples/"))}
    assert not stale, "docs/ARCHITECTURE.md names modules that do not exist"
