"""Which jobs this node admits: the functions a job may make the server import and call, and the data it may
make the server read, as the node's operator set them in node.toml (``[node] allow_transforms``, ``[node]
data_roots``). Checked when a job registers, before anything of it is imported or opened (issue 25, item 1):
a client that may connect to the socket must not be able to run code as the server or read its files."""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import Iterable

from msdata_client.choices import is_import_path
from msdata_client.spec import JobSpec
from msdata_client.tokenizer import tokenizer_path

from .config import NodeConfig
from .errors import ConfigError
from .sources.paths import expand_paths
from .transforms import parse_transform_name

__all__ = [
    "BUILTIN_FUNCTIONS",
    "Admission",
    "check_bounds",
    "check_files",
    "check_functions",
    "check_job",
    "check_paths",
]

# msdata_server's own transforms and cost functions: always allowed ([node] allow_transforms extends them)
BUILTIN_FUNCTIONS = frozenset(
    {
        *(f"msdata_server.transforms:{n}" for n in ("byte_tokens", "identity", "hf_tokenizer", "image_patches", "vlm")),
        "msdata_server.planner.cost:attention_cost",
    }
)


def _allowed(module: str, name: str, allow: Iterable[str]) -> bool:
    """Whether ``module:name`` is a built-in or lies under an allow_transforms entry ("pkg" allows pkg and
    pkg.sub, never pkgevil; "pkg.mod:fn" allows that one function)."""
    if f"{module}:{name}" in BUILTIN_FUNCTIONS:
        return True
    for a in allow:
        if ":" in a:
            if a == f"{module}:{name}":
                return True
        elif module == a or module.startswith(a + "."):
            return True
    return False


def _refuse(what: str, path: str, module: str, allow: tuple[str, ...]) -> ConfigError:
    return ConfigError(
        f"{what} {path!r} is not allowed on this node: a job may name msdata_server's own transforms and cost "
        f"functions and functions under [node] allow_transforms = {list(allow)!r}; the node's operator must add "
        f"{module!r} (or a package above it) to allow_transforms in node.toml for this job to run here"
    )


def check_functions(spec: JobSpec, allow: tuple[str, ...]) -> None:
    """ConfigError naming [node] allow_transforms unless every transform and the cost function of ``spec`` are
    allowed; imports nothing."""
    for s in spec.sources:
        if s.transform is not None:
            module, name, _args = parse_transform_name(s.transform)
            if not _allowed(module, name, allow):
                raise _refuse(f"source {s.name!r} transform", s.transform, module, allow)
    cost = spec.balance.cost
    if is_import_path(cost):
        module, name = cost.split(":")
        if not _allowed(module, name, allow):
            raise _refuse("[balance] cost", cost, module, allow)


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    """Whether ``path`` (a URI, or a local path with symlinks and '..' resolved) lies under one of ``roots``."""
    if "://" in path:
        return any("://" in r and path.startswith(r) for r in roots)
    real = os.path.realpath(path)
    for r in roots:
        if "://" in r:
            continue
        root = os.path.realpath(r)
        if os.path.commonpath([real, root]) == root:
            return True
    return False


def _fixed_part(entry: str) -> str:
    """The part of a path entry before its first glob character (the directory a glob starts from)."""
    parts = entry.split(os.sep)
    for i, p in enumerate(parts):
        if glob.has_magic(p):
            return os.sep.join(parts[:i]) or os.sep
    return entry


def _outside(source: str, path: str, roots: tuple[str, ...]) -> ConfigError:
    return ConfigError(
        f"source {source!r}: path {path!r} lies outside [node] data_roots = {list(roots)!r} (symlinks and '..' "
        f"resolved); this node serves data from those only. Move the data under a data root, or ask the node's "
        f"operator to add its directory to data_roots in node.toml"
    )


def check_paths(spec: JobSpec, roots: tuple[str, ...]) -> None:
    """ConfigError naming [node] data_roots unless every path entry (and tokenizer file) of ``spec`` lies under
    one (a glob: where it starts, and no '..' after); nothing is read. No roots: every path is allowed."""
    if not roots:
        return
    for s in spec.sources:
        tokenizer = tokenizer_path(s.transform)
        if tokenizer is not None and not _inside(os.path.expanduser(tokenizer), roots):
            raise ConfigError(
                f"source {s.name!r}: tokenizer file {tokenizer!r} lies outside [node] data_roots = {list(roots)!r} "
                f"(symlinks and '..' resolved); this node reads files from those only. Move the tokenizer under a "
                f"data root, or ask the node's operator to add its directory to data_roots in node.toml"
            )
        for entry in s.paths:
            entry = os.path.expanduser(entry)
            fixed = _fixed_part(entry)
            if not _inside(fixed, roots) or (fixed != entry and ".." in entry[len(fixed) :].split(os.sep)):
                raise _outside(s.name, entry, roots)


def check_files(spec: JobSpec, roots: tuple[str, ...]) -> None:
    """Like check_paths, for every file the entries expand to (a symlink in a data root may point out of it).
    Reads directories: call it off the event loop, after check_paths."""
    if not roots:
        return
    for s in spec.sources:
        if s.paths:
            for f in expand_paths(s.name, s.format, s.paths, ("",)):
                if not _inside(f, roots):
                    raise _outside(s.name, f, roots)


def check_bounds(spec: JobSpec, node: NodeConfig) -> None:
    """ConfigError unless the job keeps within this node's bounds on what one job may hold ([node]
    max_prefetch_steps: each step planned ahead holds its plan and payloads in the server)."""
    if spec.prefetch_steps > node.max_prefetch_steps:
        raise ConfigError(
            f"job {spec.name!r}: prefetch_steps = {spec.prefetch_steps} is over this node's [node] "
            f"max_prefetch_steps = {node.max_prefetch_steps}; plan fewer steps ahead (2 is the default; a few "
            f"cover any stall) or ask the node's operator to raise max_prefetch_steps in node.toml"
        )


def check_job(spec: JobSpec, node: NodeConfig) -> None:
    """Every check of a job against this node's [node] allow_transforms, data_roots and bounds (the CLI's
    validate)."""
    check_bounds(spec, node)
    check_functions(spec, node.allow_transforms)
    check_paths(spec, node.data_roots)
    check_files(spec, node.data_roots)


class Admission:
    """The node's check of each registering job, once per job digest (its ranks register one by one)."""

    def __init__(self, node: NodeConfig):
        self.node = node
        self._admitted: set[str] = set()

    async def check(self, spec: JobSpec, digest: str) -> None:
        """ConfigError (that rank is refused; the server goes on) unless this node admits the job; the
        file-level check runs in a thread (it walks directories)."""
        if digest in self._admitted:
            return
        check_bounds(spec, self.node)
        check_functions(spec, self.node.allow_transforms)
        check_paths(spec, self.node.data_roots)
        if self.node.data_roots:
            await asyncio.to_thread(check_files, spec, self.node.data_roots)
        self._admitted.add(digest)
