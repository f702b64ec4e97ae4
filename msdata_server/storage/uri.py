"""Source paths that are URIs (``s3://bucket/prefix/*.parquet``, ``gs://``, ``hdfs://``, ``file://``): telling
them from local paths, refusing credentials in them, and the fixed part of a glob that orders a listing."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

from ..errors import ConfigError

__all__ = ["GLOB_CHARS", "check_uri", "fixed_part", "glob_regex", "is_uri", "local_path", "split_uri"]

GLOB_CHARS = frozenset("*?[")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SECRET_QUERY = re.compile(r"(secret|token|password|passwd|key|signature|credential)", re.IGNORECASE)


def is_uri(path: str) -> bool:
    """Whether a path entry is a URI (``scheme://...``) rather than a local path."""
    return bool(_SCHEME.match(str(path)))


def local_path(path: str) -> str | None:
    """The local path of a ``file://`` URI (None for any other URI)."""
    if str(path).startswith("file://"):
        return urlsplit(path).path or "/"
    return None


def check_uri(uri: str, *, where: str) -> None:
    """ConfigError when a URI carries credentials (``user:secret@host``, a secret-looking query key): they go in
    the store's environment variables or credential files, never in a job or node file. The message never
    repeats the secret."""
    parts = urlsplit(uri)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{where}: a URI with credentials in it ({parts.scheme}://<credentials>@...) is refused; give credentials "
            f"in the store's environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) or credential "
            f"files, never in a path"
        )
    for k, _ in parse_qsl(parts.query, keep_blank_values=True):
        if _SECRET_QUERY.search(k):
            raise ConfigError(
                f"{where}: a URI with a credential-like query parameter ({k}=...) is refused; give credentials in "
                f"the store's environment variables or credential files, never in a path"
            )


def split_uri(uri: str) -> tuple[str, str]:
    """(scheme, the rest after ``scheme://``)."""
    scheme, _, rest = uri.partition("://")
    return scheme.lower(), rest


def fixed_part(rest: str) -> str:
    """The part of a path before the component holding its first glob character (ending in '/'), or the
    whole path when it has none."""
    parts = rest.split("/")
    for i, p in enumerate(parts):
        if GLOB_CHARS & set(p):
            return "/".join(parts[:i]) + "/"
    return rest


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A regex matching what ``glob.glob(pattern, recursive=True)`` matches: ``*``/``?``/``[...]`` within one
    component (never a leading dot), ``**`` as a whole component across any number of them."""
    out: list[str] = []
    comps = pattern.split("/")
    for n, comp in enumerate(comps):
        last = n == len(comps) - 1
        if comp == "**":
            out.append(r"(?:[^/.][^/]*/)*" if not last else r"(?:[^/.][^/]*/)*[^/.][^/]*")
            continue
        piece: list[str] = []
        i = 0
        while i < len(comp):
            c = comp[i]
            if c == "*":
                piece.append(r"[^/]*")
            elif c == "?":
                piece.append(r"[^/]")
            elif c == "[":
                j = comp.find("]", i + 1)
                if j < 0:
                    piece.append(re.escape(c))
                else:
                    body = comp[i + 1 : j]
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    piece.append(f"[{body}]")
                    i = j
            else:
                piece.append(re.escape(c))
            i += 1
        text = "".join(piece)
        if GLOB_CHARS & set(comp) and not comp.startswith("."):
            text = r"(?!\.)" + text
        out.append(text + ("" if last else "/"))
    return re.compile("".join(out) + r"\Z")
