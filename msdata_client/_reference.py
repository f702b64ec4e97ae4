"""The job file's key reference (docs/JOB.md), generated from the spec classes: every table's keys with their
types and defaults as the dataclasses declare them, the allowed values from the choice enums, and one meaning
per key written here. tests/test_job_reference.py checks that docs/JOB.md equals ``render()`` and that every
key the spec accepts has a meaning, so the reference cannot drift from the code.

Regenerate: ``python -m msdata_client._reference > docs/JOB.md``.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, fields
from typing import Any

from .choices import (
    BroadcastAxis,
    Choice,
    CostKind,
    Distribute,
    Interpolate,
    LongDocs,
    Method,
    OnDataChange,
    OnReadError,
    SourceFormat,
)
from .mesh import ClientPlaceTree
from .mix import MixSpec
from .source import SourceSpec
from .spec import PAD_FROM_TOKENIZER, BalanceSpec, JobSpec

__all__ = ["MEANINGS", "TABLES", "render", "table_keys"]

_NESTED = ("sources", "mix", "balance", "mesh")  # JobSpec fields that are tables of their own

TABLES: tuple[tuple[str, type], ...] = (
    ("[job]", JobSpec),
    ("[mesh]", ClientPlaceTree),
    ("[[source]]", SourceSpec),
    ("[mix]", MixSpec),
    ("[balance]", BalanceSpec),
)

_CHOICES: dict[tuple[str, str], type[Choice]] = {
    ("[job]", "long_docs"): LongDocs,
    ("[job]", "distribute"): Distribute,
    ("[job]", "broadcast_at"): BroadcastAxis,
    ("[job]", "on_data_change"): OnDataChange,
    ("[job]", "on_read_error"): OnReadError,
    ("[[source]]", "format"): SourceFormat,
    ("[mix]", "interpolate"): Interpolate,
    ("[balance]", "method"): Method,
    ("[balance]", "cost"): CostKind,
}

MEANINGS: dict[tuple[str, str], str] = {
    ("[job]", "name"): "the job's name; part of its data identity (a state restores only into the same identity)",
    ("[job]", "seed"): "seeds every source's order and the transforms' randomness; part of the data identity",
    ("[job]", "seq_len"): "tokens per packed row; with cp > 1 it must divide by 2·cp",
    ("[job]", "micro_batches"): "micro-batches per DP rank per step",
    ("[job]", "rows"): "packed rows per micro-batch",
    ("[job]", "pad_id"): "token id of the padding after the last document of a row",
    ("[job]", "long_docs"): "a document longer than seq_len: split into pieces, or keep its first piece only",
    ("[job]", "distribute"): "which mesh axis receives distinct data",
    ("[job]", "broadcast_at"): "axes whose ranks read identical copies of one build",
    ("[job]", "prefetch_steps"): "steps planned and built ahead of the slowest rank",
    ("[job]", "on_read_error"): "an object-store read that failed for good (after [storage] give_up_s): stop the "
    "job naming the object, or count its samples as bad (storage_error) and go on",
    ("[job]", "on_data_change"): "a resume over a source whose files changed (added, removed, another size or "
    "mtime): refused naming what changed, or continued from the saved position over the new files (README)",
    ("[job]", "pp_fields"): "per pipeline stage (first, middle, last), the batch fields it receives",
    ("[job]", "video_token_id"): "id of the video placeholder tokens of clips (one per merge x merge patches of a "
    "temporal patch); not pad_id or image_token_id",
    ("[job]", "image_token_id"): "id of the image placeholder tokens of picture documents; not pad_id",
    ("[job]", "shadow_loaders"): "hot standbys per source partition on other nodes (cluster only; data unchanged)",
    ("[mesh]", "dp"): "data-parallel ranks: disjoint micro-batches",
    ("[mesh]", "pp"): "pipeline stages: each gets the fields its stage needs",
    ("[mesh]", "cp"): "context-parallel ranks: each gets its zig-zag slice of every row",
    ("[mesh]", "tp"): "tensor-parallel ranks: read the same ring slot (one build, no copy)",
    ("[mesh]", "order"): "the axes outermost first (how global ranks map to coordinates)",
    ("[[source]]", "name"): "the source's name, used by [mix] weights and in status",
    ("[[source]]", "format"): "how its samples are stored",
    ("[[source]]", "paths"): "files, directories or globs (relative to the job file); none for synthetic",
    ("[[source]]", "column"): "the column (field) whose value is a record",
    ("[[source]]", "shuffle"): "the source's order: true (rows mixed across files, the default), false (files "
    "in path order, rows in file order) or a table {mode = 'mix'|'file'|'none', spread, window} (README: the order "
    "of a source)",
    ("[[source]]", "transform"): "'module:function' turning a record into token ids ('' or none: ids already)",
    ("[[source]]", "max_sample_bytes"): "a record larger than this is counted as bad and skipped",
    ("[[source]]", "columns"): "several columns: the transform gets a dict keyed by their names",
    ("[[source]]", "samples"): "synthetic only: number of documents",
    ("[[source]]", "median"): "synthetic only: median document length in tokens (log-normal)",
    ("[[source]]", "sigma"): "synthetic only: spread of the log-normal lengths",
    ("[[source]]", "min_len"): "synthetic only: shortest document",
    ("[[source]]", "max_len"): "synthetic only: longest document",
    ("[mix]", "weights"): "share of tokens per source, { name = share, ... } (normalised)",
    ("[mix]", "schedule"): "instead of weights: [{ step = s, weights = {...} }, ...] starting at step 0",
    ("[mix]", "interpolate"): "between schedule points: the last point, or linear (schedule only)",
    ("[balance]", "cost"): "per-document cost: alpha·len² + beta·len, the two-stage vlm cost, or 'module:function'",
    ("[balance]", "alpha"): "the cost's quadratic coefficient",
    ("[balance]", "beta"): "the cost's linear coefficient",
    ("[balance]", "method"): "how documents are balanced across DP ranks and micro-batches",
    ("[balance]", "alpha_v"): 'cost = "vlm" only: the vision encoder\'s quadratic coefficient per image',
    ("[balance]", "beta_v"): 'cost = "vlm" only: the vision encoder\'s linear coefficient per image',
    ("[balance]", "pad_cost"): "what a padded token costs a rank: beta when unset (fixed shapes run the padding "
    "through the linear layers; 0 with a 'module:function' cost), 0 for an unpadded (varlen) trainer",
}

_REQUIRED = "required"


def table_keys(table: str, cls: type) -> list[Field[Any]]:
    """The keys a table accepts: its class's fields (a job's nested tables are tables of their own)."""
    return [f for f in fields(cls) if not (cls is JobSpec and f.name in _NESTED)]


def _default(table: str, f: Field[Any]) -> str:
    if f.default is not MISSING:
        value = f.default
    elif f.default_factory is not MISSING:
        value = f.default_factory()
    elif (table, f.name) in {("[job]", "name"), ("[[source]]", "name"), ("[[source]]", "format")}:
        return _REQUIRED
    else:
        return "—"
    if value is None:
        return "none"
    if value is PAD_FROM_TOKENIZER:
        return "`257`, or the tokenizer's pad token"
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`".replace("'", '"')


# the dataclasses' annotations as a TOML writer sees them
_TOML_TYPES = {
    "str": "string",
    "int": "integer",
    "float": "float",
    "float | None": "float",
    "str | None": "string",
    "tuple[str, ...]": "array of strings",
    "tuple[str, ...] | None": "array of strings",
    "Mapping[str, tuple[str, ...]] | None": "table of arrays of strings",
    "Mapping[str, float] | None": "table of floats",
    "tuple[tuple[int, Mapping[str, float]], ...]": "array of tables",
}


def _type(f: Field[Any]) -> str:
    return _TOML_TYPES.get(str(f.type), f"`{f.type}`".replace("|", "\\|"))


def render() -> str:
    """docs/JOB.md: one section per table, one row per key."""
    out = [
        "# Job file reference",
        "",
        "Generated from the spec classes by `python -m msdata_client._reference > docs/JOB.md`; "
        "`tests/test_job_reference.py` fails when this file and the code disagree. A job file has the tables "
        "below (`[[source]]` once per source); an unknown key is refused with the list of allowed ones. "
        "`msdata-server validate --job job.toml` checks a file, its paths and its transforms.",
        "",
    ]
    for table, cls in TABLES:
        out += [f"## {table}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in table_keys(table, cls):
            meaning = MEANINGS[(table, f.name)]
            choice = _CHOICES.get((table, f.name))
            if choice is not None:
                meaning += "; one of " + ", ".join(f"`{v}`" for v in choice.values())
            out.append(f"| `{f.name}` | {_type(f)} | {_default(table, f)} | {meaning} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
