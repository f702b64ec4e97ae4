"""The tokenizer file a transform names (``hf_tokenizer(path)``, ``vlm(tokenizer=path)``): where it resolves,
and what it says about padding. Reads the tokenizer.json as JSON (no ``tokenizers`` import in the client).

A relative tokenizer path resolves like a source's paths: against the job file's directory (or the working
directory of the process that builds the job), never against the server's. The job's ``pad_id`` defaults to
the tokenizer's pad token when it has one (``padding.pad_id``, else an added special token named like a pad
token), else 257: a real token of any vocabulary of more than 257 entries, which ``pad_warning`` names.
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterable
from typing import Any

from msdata_client._validate import resolve_path
from msdata_client.choices import TRANSFORM_NAME

__all__ = ["DEFAULT_PAD_ID", "default_pad", "pad_warning", "resolve_tokenizer", "tokenizer_pad", "tokenizer_path"]

DEFAULT_PAD_ID = 257  # the byte tokens' padding (0..255 bytes, 256 EOS)
_MODULE = "msdata_server.transforms"
# factory -> (its tokenizer argument's name, its position or None when keyword-only)
_TOKENIZER_ARGS = {"hf_tokenizer": ("path", 0), "vlm": ("tokenizer", None)}
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<PAD>", "[pad]")


def _path_node(transform: str) -> tuple[ast.Constant, str] | None:
    """The string literal naming the tokenizer file in a transform name, and the argument text it sits in."""
    m = TRANSFORM_NAME.match(transform)
    if m is None or m.group(1) != _MODULE or m.group(2) not in _TOKENIZER_ARGS or not m.group(3):
        return None
    text = m.group(3)
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError:
        return None  # the server names the bad argument list
    if not isinstance(call, ast.Call):
        return None
    key, pos = _TOKENIZER_ARGS[m.group(2)]
    nodes = [k.value for k in call.keywords if k.arg == key]
    if pos is not None and len(call.args) > pos:
        nodes.append(call.args[pos])
    if len(nodes) != 1 or not isinstance(nodes[0], ast.Constant) or not isinstance(nodes[0].value, str):
        return None
    return nodes[0], text


def tokenizer_path(transform: str | None) -> str | None:
    """The tokenizer file a transform names (as written), or None."""
    found = _path_node(transform) if isinstance(transform, str) else None
    return None if found is None else str(found[0].value)


def resolve_tokenizer(transform: str, base_dir: str | None) -> str:
    """``transform`` with a relative tokenizer path made absolute against ``base_dir`` (default: the working
    directory); any other transform name comes back unchanged, character for character."""
    found = _path_node(transform)
    if found is None:
        return transform
    node, text = found
    path = str(node.value)
    if os.path.isabs(os.path.expanduser(path)):
        return transform
    # the literal's span within the argument text (ast offsets are in the parsed "f(" + text + ")", line 1)
    lines = f"f({text})".split("\n")
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line.encode()) + 1)
    raw = f"f({text})".encode()
    lo = starts[node.lineno - 1] + node.col_offset
    hi = starts[(node.end_lineno or node.lineno) - 1] + (node.end_col_offset or 0)
    new_text = (raw[:lo] + repr(resolve_path(path, base_dir)).encode() + raw[hi:]).decode()[2:-1]
    head = transform[: transform.index("(")]
    return f"{head}({new_text})"


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # validate and the server name a missing or broken tokenizer file
    return data if isinstance(data, dict) else None


def tokenizer_pad(path: str) -> tuple[int | None, int]:
    """(the tokenizer's pad token id or None, its vocabulary size) from a tokenizer.json; (None, 0) when the
    file does not read."""
    data = _read(path)
    if data is None:
        return None, 0
    ids: list[int] = []
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids.append(len(vocab) - 1)
    added = [t for t in data.get("added_tokens") or () if isinstance(t, dict) and isinstance(t.get("id"), int)]
    ids += [t["id"] for t in added]
    size = max(ids) + 1 if ids else 0
    padding = data.get("padding")
    if isinstance(padding, dict) and isinstance(padding.get("pad_id"), int):
        return padding["pad_id"], size
    for t in added:
        if t.get("content") in _PAD_NAMES:
            return int(t["id"]), size
    return None, size


def default_pad(transforms: Iterable[str | None]) -> int:
    """The job's pad_id when it sets none: the pad token of the first tokenizer that has one, else 257."""
    for t in transforms:
        path = tokenizer_path(t)
        if path is not None:
            pad, _ = tokenizer_pad(path)
            if pad is not None:
                return pad
    return DEFAULT_PAD_ID


def pad_warning(pad_id: int, transforms: Iterable[str | None]) -> str | None:
    """A warning when ``pad_id`` is a real token of a tokenizer the job uses (padding then looks like text to
    anything that reads tokens without loss_mask), else None."""
    for t in transforms:
        path = tokenizer_path(t)
        if path is None:
            continue
        pad, size = tokenizer_pad(path)
        if pad is None and pad_id < size:
            return (
                f"pad_id={pad_id} is a token of the tokenizer {path!r} (vocabulary of {size}), which has no pad "
                f"token; set [job] pad_id to an id outside it (e.g. {size}) or give the tokenizer a pad token"
            )
    return None
