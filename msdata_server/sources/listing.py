"""A source's file listing and its fingerprint: what a saved position is a position *in*.

A listing is each file's name relative to the fixed part of the ``paths`` entry that found it (the directory
given, or a glob's directories before its first wildcard), its size and mtime_ns, in the source's file order.
Relative names make the digest survive moving the data under another prefix. A resume compares digests
(``datachange.py``); the manifest (``to_manifest``) lets an error name the files that changed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..storage.listing import ListedFile
from ..storage.uri import fixed_part, is_uri, local_path, split_uri
from .paths import expand_files

__all__ = ["FileEntry", "Listing", "describe_change", "list_files", "listing_of"]

MANIFEST_VERSION = 1
_WILDCARDS = frozenset("*?[")  # as in paths.py: an entry part with one of these is a glob
_SHOWN = 5  # file names an error message lists per kind of change


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file as a listing sees it: the ``paths`` entry that found it, its relative name, size, mtime_ns."""

    entry: int
    name: str
    size: int
    mtime_ns: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Listing:
    """A source's files (absolute paths, for reading) and what identifies them (``entries``, ``digest``)."""

    paths: tuple[str, ...]
    entries: tuple[FileEntry, ...]

    @property
    def digest(self) -> str:
        """blake2b-128 hex over (entry, name, size, mtime_ns) of every file in order."""
        h = hashlib.blake2b(digest_size=16)
        for e in self.entries:
            h.update(
                b"%d\x1f%s\x1f%d\x1f%d\x1e" % (e.entry, e.name.encode("utf-8", "surrogatepass"), e.size, e.mtime_ns)
            )
        return h.hexdigest()

    @property
    def files(self) -> int:
        return len(self.entries)

    def to_manifest(self) -> dict:
        """The JSON-able listing kept in the state_dir (keyed by its digest)."""
        return {
            "version": MANIFEST_VERSION,
            "digest": self.digest,
            "files": [[e.entry, e.name, e.size, e.mtime_ns] for e in self.entries],
        }

    @classmethod
    def from_manifest(cls, raw: Mapping) -> Listing:
        """Back from ``to_manifest`` (no absolute paths: only for comparing); ValueError when malformed."""
        if raw.get("version") != MANIFEST_VERSION or not isinstance(raw.get("files"), list):
            raise ValueError(f"not a version {MANIFEST_VERSION} listing manifest")
        entries = tuple(FileEntry(int(i), str(n), int(s), int(m)) for i, n, s, m in raw["files"])
        return cls(paths=(), entries=entries)


def _root(entry: str) -> str:
    """The fixed part of a ``paths`` entry that names are relative to (for a URI: its fixed part, with the
    scheme and bucket, so the same objects under another prefix keep their names)."""
    if is_uri(entry) and local_path(entry) is None:
        scheme, rest = split_uri(entry)
        fixed = fixed_part(rest)  # before the first glob, or the whole path
        if not fixed.endswith("/"):  # one object: names are relative to its "directory"
            fixed = fixed.rpartition("/")[0] + "/"
        return f"{scheme}://{fixed}"
    entry = local_path(entry) or entry
    if os.path.isdir(entry):
        return os.path.abspath(entry)
    parts = entry.split(os.sep)
    for i, part in enumerate(parts):
        if _WILDCARDS & set(part):
            return os.path.abspath(os.sep.join(parts[:i]) or os.curdir)
    return os.path.dirname(os.path.abspath(entry))


def _relative(path: str, root: str) -> str:
    if is_uri(root):
        return path[len(root) :].lstrip("/") if path.startswith(root) else path
    if path.startswith(root.rstrip(os.sep) + os.sep) and os.path.isabs(root) and os.path.normpath(root) == root:
        return path[len(root.rstrip(os.sep)) + 1 :]  # the common case, without relpath's two abspaths per file
    return os.path.relpath(path, root)


def listing_of(paths: Iterable[str] | str, files: Iterable[ListedFile]) -> Listing:
    """The listing of files already listed (a remote source's listing kept in the state_dir): each file named
    relative to the first ``paths`` entry whose fixed part holds it."""
    entries = (paths,) if isinstance(paths, str) else tuple(paths)
    roots = [_root(os.path.expanduser(str(e))) for e in entries]
    found, out = [], []
    for lf in files:
        i = next((k for k, r in enumerate(roots) if lf.path.startswith(r)), 0)
        out.append(lf.path)
        found.append(FileEntry(i, _relative(lf.path, roots[i]), lf.size, lf.mtime_ns))
    return Listing(paths=tuple(out), entries=tuple(found))


def list_files(source: str, fmt: str, paths: Iterable[str] | str, extensions: tuple[str, ...]) -> Listing:
    """The listing of a source's ``paths``: the files ``expand_files`` gives (local paths or URIs, with the
    size and mtime the filesystem or the object store's listing reports), in its order. ConfigError as
    ``expand_files`` raises it."""
    entries = (paths,) if isinstance(paths, str) else tuple(paths)
    files: list[str] = []
    found: list[FileEntry] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        root = _root(os.path.expanduser(str(entry)))
        for lf in expand_files(source, fmt, (entry,), extensions):
            if lf.path in seen:  # a file two entries match belongs to the first (as in expand_files)
                continue
            seen.add(lf.path)
            files.append(lf.path)
            found.append(FileEntry(i, _relative(lf.path, root), lf.size, lf.mtime_ns))
    return Listing(paths=tuple(files), entries=tuple(found))


def _names(entries: list[FileEntry]) -> str:
    shown = ", ".join(e.name for e in entries[:_SHOWN])
    return f" ({shown}{', ...' if len(entries) > _SHOWN else ''})" if entries else ""


def describe_change(source: str, old: Listing | None, new: Listing, *, old_digest: str, old_files: int) -> str:
    """What changed in a source's files, for an error or a log line: the files added, removed and changed
    (size or mtime) when the old manifest is at hand, else the counts and digests."""
    if old is None:
        return (
            f"source {source!r}: its file list changed (saved: {old_files} files, digest {old_digest[:12]}; now: "
            f"{new.files} files, digest {new.digest[:12]}; the saved listing is not in this node's state_dir)"
        )
    before = {(e.entry, e.name): e for e in old.entries}
    after = {(e.entry, e.name): e for e in new.entries}
    added = [e for k, e in after.items() if k not in before]
    removed = [e for k, e in before.items() if k not in after]
    changed = [e for k, e in after.items() if k in before and before[k] != e]
    return (
        f"source {source!r}: {len(added)} file(s) added{_names(added)}, {len(removed)} removed{_names(removed)}, "
        f"{len(changed)} changed (size or mtime){_names(changed)}"
    )
