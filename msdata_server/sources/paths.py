"""Expanding a source's ``paths`` (files, directories, globs; local or URIs) into a sorted, de-duplicated file
list. Each entry's files are ordered by their path relative to its fixed part (the directory given, or a glob's
part before its first wildcard), so the same entries under another prefix (local disk vs a bucket) give the
same order."""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Iterable

from ..errors import ConfigError
from ..storage import ListedFile, get_store, is_uri, local_path

__all__ = ["expand_files", "expand_paths"]

_GLOB_CHARS = frozenset("*?[")


def _hidden(name: str) -> bool:
    # Spark/Hadoop markers (_SUCCESS, _metadata) and dot files are never data
    return name.startswith((".", "_"))


def _walk(directory: str, extensions: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    for root, dirs, files in os.walk(directory, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not _hidden(d))
        found.extend(os.path.join(root, f) for f in files if not _hidden(f) and f.lower().endswith(extensions))
    return sorted(found)


def expand_paths(source: str, fmt: str, paths: Iterable[str], extensions: tuple[str, ...]) -> list[str]:
    """The paths (local paths or URIs) of expand_files."""
    return [f.path for f in expand_files(source, fmt, paths, extensions)]


def expand_files(source: str, fmt: str, paths: Iterable[str], extensions: tuple[str, ...]) -> list[ListedFile]:
    """Files of a source in a stable order: each entry expanded in turn (directories recursively and
    sorted, keeping files whose name ends with one of ``extensions``; globs sorted), duplicates dropped.

    ConfigError names the source, the entry and the fix when an entry matches nothing.
    """
    if isinstance(paths, str):
        paths = (paths,)
    paths = tuple(paths)
    if not paths:
        raise ConfigError(f"source {source!r} ({fmt}) has no paths; give files, directories or globs in paths = [...]")
    out: list[ListedFile] = []
    seen: set[str] = set()
    for entry in paths:
        entry = str(entry)
        if is_uri(entry) and local_path(entry) is None:  # object storage: listed with sizes and mtimes at once
            for lf in get_store().list_entry(source, entry, extensions):
                if lf.path not in seen:
                    seen.add(lf.path)
                    out.append(lf)
            continue
        entry = os.path.expanduser(local_path(entry) or entry)
        st = _stat(entry)  # one stat per entry (1,024 sources of 16 files named one by one: 16,384 entries)
        if st is not None and stat.S_ISDIR(st.st_mode):
            matched = _walk(entry, extensions)
            hint = f"a directory with no {'/'.join(extensions)} files"
        elif _GLOB_CHARS & set(entry):
            matched = sorted(glob.glob(entry, recursive=True))  # directories among them are passed over below
            hint = "a glob that matched no files"
        elif st is not None and stat.S_ISREG(st.st_mode):
            one = _file(entry, seen, st)
            if one is not None:
                out.append(one)
            continue
        else:
            raise ConfigError(
                f"source {source!r}: path {entry!r} does not exist; fix the path (relative paths resolve "
                f"against the job file's directory)"
            )
        got = [lf for lf in (_file(p, seen) for p in matched) if lf is not None]
        if not got and not any(os.path.isfile(p) for p in matched):
            raise ConfigError(f"source {source!r}: no files matched {entry!r} ({hint}); fix the path or the format")
        out.extend(got)
    return out


def _stat(path: str) -> os.stat_result | None:
    """os.stat (following links), or None where there is nothing (or nothing reachable) at the path."""
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def _file(p: str, seen: set[str], st: os.stat_result | None = None) -> ListedFile | None:
    """The listed file at a matched path (absolute), with one stat (``st``: made already); None for a directory
    or a duplicate."""
    if not (p.startswith(os.sep) and os.sep + "." not in p and os.sep * 2 not in p):
        p = os.path.abspath(p)  # 100,000 files: abspath on each took seconds; an absolute, normal path needs none
    if p in seen:
        return None
    if st is None:
        st = os.stat(p)
    if not stat.S_ISREG(st.st_mode):
        return None
    seen.add(p)
    return ListedFile(p, int(st.st_size), int(st.st_mtime_ns))
