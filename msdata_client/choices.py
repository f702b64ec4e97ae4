"""The allowed values of a job's settings, each table defined once as a str-valued enum.

The job specs (client) and the planner (server) both parse settings with `Choice.parse`, so the choices
and the error messages that list them come from these tables and never drift apart.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, Self

from msdata_client.errors import ConfigError

__all__ = [
    "ATTENTION_COST",
    "BroadcastAxis",
    "Choice",
    "CostKind",
    "DEFAULT_TRANSFORM",
    "Distribute",
    "Interpolate",
    "LongDocs",
    "Method",
    "OnDataChange",
    "SHUFFLE_SPREAD",
    "SHUFFLE_WINDOW",
    "ShuffleMode",
    "SourceFormat",
    "TRANSFORM_NAME",
    "is_import_path",
    "is_transform_name",
]

_IMPORT_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
# a transform: "module:function", or "module:factory(args)" that builds one (groups: module, name, arguments)
TRANSFORM_NAME = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*:\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$", re.S)


class Choice(str, Enum):  # noqa: UP042 (StrEnum would change str() and format() of every member)
    """Base of the tables below: a member is its value (a str), and `parse` refuses anything else."""

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every allowed value, in declaration order."""
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value: Any, where: str, *, brief: bool = False) -> Self:
        """The member equal to `value`; ConfigError naming `where`, the value and every choice otherwise.

        `brief`: list the choices only (the planner's message), not the tuple and how to write them.
        """
        allowed = cls.values()
        if value in allowed:  # (a tuple test: any value, hashable or not)
            return cls(value)
        if brief:
            raise ConfigError(f"{where}={value!r} is not one of {', '.join(map(repr, allowed))}")
        raise ConfigError(f"{where}={value!r} is not one of {allowed}; use one of: {', '.join(allowed)}")


class SourceFormat(Choice):
    """How a source's samples are stored ([[source]] format)."""

    PARQUET = "parquet"
    ARROW = "arrow"
    JSONL = "jsonl"
    WEBDATASET = "webdataset"  # tar shards; files sharing a key are one sample (a dict by extension)
    SYNTHETIC = "synthetic"  # generated token ids: reads no files


class ShuffleMode(Choice):
    """A source's read order ([[source]] shuffle = { mode = ... }; README "The order of a source")."""

    MIX = "mix"  # the default: rows of `spread` files interleaved, files, windows and rows permuted per epoch
    FILE = "file"  # file-local: files permuted, then one file at a time (windows and rows permuted inside it)
    NONE = "none"  # fixed: files in path order, rows in file order (shuffle = false)


SHUFFLE_SPREAD = 32  # files read at once by the mixed order: any 32 consecutive samples come from 32 files
SHUFFLE_WINDOW = 4096  # rows shuffled together inside a file (aligned with row groups or record batches)


class Method(Choice):
    """How pieces are balanced across DP ranks and micro-batches ([balance] method)."""

    KARMARKAR_KARP = "karmarkar_karp"
    GREEDY = "greedy"
    NONE = "none"  # arrival order, rank by rank: the baseline


class CostKind(Choice):
    """Built-in per-document costs ([balance] cost); any other cost is a 'module:function' path."""

    ATTENTION = "attention"  # alpha * len**2 + beta * len
    # two stages balanced at once: backbone alpha * len**2 + beta * len, vision encoder
    # alpha_v * p**2 + beta_v * p per image of p patches
    VLM = "vlm"


class LongDocs(Choice):
    """What happens to a document longer than seq_len ([job] long_docs)."""

    SPLIT = "split"  # pieces of seq_len tokens, then the remainder; each piece is its own document
    TRUNCATE = "truncate"  # keep the first seq_len tokens only


class OnDataChange(Choice):
    """What a resume does when a source's files changed since the state was saved ([job] on_data_change)."""

    ERROR = "error"  # refuse, naming what changed
    CONTINUE = "continue"  # go on from the saved position over the new files (the state records the change)


class Distribute(Choice):
    """Which mesh axis receives distinct data ([job] distribute)."""

    DP = "dp"
    CP = "cp"  # CP ranks slice one build
    WORLD = "world"  # every rank its own data


class OnReadError(Choice):
    """What an object-store read that failed for good does ([job] on_read_error)."""

    FAIL = "fail"  # the job stops with an error naming the object and the last status code
    SKIP = "skip"  # the unit's samples are bad samples (reason storage_error) and the job goes on


class BroadcastAxis(Choice):
    """Axes whose ranks may receive identical copies of one build ([job] broadcast_at)."""

    TP = "tp"
    PP = "pp"
    CP = "cp"


class Interpolate(Choice):
    """How weights between two schedule points are chosen ([mix] interpolate)."""

    STEP = "step"  # piecewise constant: the last point at or before the step
    LINEAR = "linear"  # linear between the surrounding points (each point normalised first)


ATTENTION_COST = CostKind.ATTENTION.value
DEFAULT_TRANSFORM = "msdata_server.transforms:byte_tokens"


def is_import_path(value: Any) -> bool:
    """Whether `value` names a function as 'package.module:function' (transforms, cost functions)."""
    return isinstance(value, str) and _IMPORT_RE.fullmatch(value) is not None


def is_transform_name(value: Any) -> bool:
    """Whether `value` names a transform: 'module:function' or 'module:factory(arguments)'."""
    return isinstance(value, str) and TRANSFORM_NAME.match(value) is not None
