"""A tiny TOML writer: enough for the job's shape (tables, arrays of tables, inline values); tomllib reads it back."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from msdata_client.errors import ConfigError

__all__ = ["dumps"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+", re.ASCII)
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, Mapping) for x in v)


def _string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _string(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"cannot write {v!r} to TOML; use a finite number")
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, Mapping):
        if not v:
            return "{}"
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {type(v).__name__} {v!r} to TOML")


def _entries(table: Mapping[str, Any]) -> list[str]:
    lines = []
    for k, v in table.items():
        if _is_table_array(v):
            lines.append(f"{_key(k)} = [")
            lines.extend(f"    {_value(x)}," for x in v)
            lines.append("]")
        else:
            lines.append(f"{_key(k)} = {_value(v)}")
    return lines


def dumps(doc: Mapping[str, Any]) -> str:
    """Write a dict of tables / arrays of tables (values: scalars, lists, inline tables) as TOML."""
    lines = _entries({k: v for k, v in doc.items() if not isinstance(v, Mapping) and not _is_table_array(v)})
    for k, v in doc.items():
        if isinstance(v, Mapping):
            lines += ["", f"[{_key(k)}]", *_entries(v)]
        elif _is_table_array(v):
            for x in v:
                lines += ["", f"[[{_key(k)}]]", *_entries(x)]
    return "\n".join(lines).lstrip("\n") + "\n"
