"""The frames a local client may send, checked at the endpoint: one table of field shapes per frame type.

Whatever passes here has the types the node's handlers read (ints are ints, lists hold pairs), so a malformed
frame is a ProtocolError naming the field, never a TypeError deep in a handler. Values (a rank outside the
mesh, a job that does not parse) are the handlers' to judge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ProtocolError

__all__ = ["FRAME_TYPES", "check_frame"]

Check = Callable[[Any], bool]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return _int(v) and v >= 0


def _number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and v == v  # not NaN


def _pairs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and _int(p[0]) and _int(p[1]) for p in v)


def _optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _position(v: Any) -> bool:
    return isinstance(v, dict) and all(_count(v.get(k, 0)) for k in ("step", "micro"))


def _numbers(v: Any) -> bool:
    return isinstance(v, list) and all(_number(x) and x >= 0 for x in v)


# frame type -> {field: (required, check, what it must be)}
FRAME_TYPES: dict[str, dict[str, tuple[bool, Check, str]]] = {
    "hello": {
        "job": (True, lambda v: isinstance(v, dict), "an object (the job spec)"),
        "digest": (False, _optional(lambda v: isinstance(v, str)), "a string"),
        "rank": (True, _count, "an integer >= 0"),
        "world_size": (True, _count, "an integer >= 0"),
        "pid": (False, _optional(_int), "an integer"),
        "position": (False, _optional(_position), 'an object {"step": int >= 0, "micro": int >= 0}'),
        "state": (False, _optional(lambda v: isinstance(v, dict)), "an object (a state_dict)"),
        "resume": (False, lambda v: isinstance(v, bool), "true or false"),
        "client": (False, _optional(lambda v: isinstance(v, str) and len(v) <= 64), "a string of at most 64"),
        "held": (False, _pairs, "a list of [ring, slot] pairs"),
        "latest": (False, _optional(lambda v: isinstance(v, dict)), "an object (the newest state_dict it knows)"),
    },
    "release": {
        "s": (False, _pairs, "a list of [ring, slot] pairs"),
        "w": (False, _numbers, "a list of seconds >= 0"),
        "step": (False, _optional(_int), "an integer"),
    },
    "state": {"step": (True, _count, "an integer >= 0")},
    "mixture": {"weights": (True, lambda v: isinstance(v, dict), "an object of source -> weight")},
    "status": {},
    "lineage": {  # msdata-server lineage, loader.lineage(): steps [start, stop) of a job, replayed
        "job": (True, lambda v: isinstance(v, str), "a job name"),
        "start": (True, _count, "an integer >= 0"),
        "stop": (True, _count, "an integer >= 0"),
        "rank": (False, _optional(_count), "an integer >= 0"),
        "sample": (False, _optional(_count), "an integer >= 0 (a sample id)"),
    },
    "replay": {  # DataClient(job, replay=(A, B)): one rank's micro-batches of steps [start, stop), rebuilt
        "job": (True, lambda v: isinstance(v, str), "a job name"),
        "start": (True, _count, "an integer >= 0"),
        "stop": (True, _count, "an integer >= 0"),
        "rank": (True, _count, "an integer >= 0"),
    },
    "ping": {},
    "bye": {},
}


def check_frame(frame: dict) -> None:
    """ProtocolError unless ``frame`` is a known client frame whose fields have the right types."""
    t = frame["t"]
    fields = FRAME_TYPES.get(t)
    if fields is None:
        raise ProtocolError(f"unknown frame type {t[:40]!r}; a client sends one of {sorted(FRAME_TYPES)}")
    for name, (required, check, what) in fields.items():
        if name not in frame:
            if required:
                raise ProtocolError(f"a {t!r} frame lacks {name!r} ({what})")
            continue
        if not check(frame[name]):
            raise ProtocolError(f"field {name!r} of a {t!r} frame must be {what}, got {_short(frame[name])}")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."
