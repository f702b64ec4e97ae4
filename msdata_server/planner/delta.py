"""Differential planner checkpoints: a stored step is a *base* (the whole state) or a *delta* (the keys that
differ from its base), with a base every ``every`` steps. Pure: bytes in, bytes out, no I/O.

Record bytes: ``MAGIC`` + a version byte + zlib(orjson(body)). A body is ``{"k": "base", "step", "state"}`` or
``{"k": "delta", "step", "base", "crc", "set"}``: ``crc`` is the CRC-32 of the base record's bytes, so a delta
never composes with a base that another run wrote at the same step. Bytes that start with ``{`` are a state
written before records existed (version 1: the planner state as JSON) and still load.

Why the carry is coded by columns: at dp 4096 the carried pieces (about a thousand) are all new every step,
so "what changed" is mostly the carry; its ordinals are stored as gaps within their source (small numbers
that compress well) instead of six-digit ordinals.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from msdata_server.errors import CheckpointError

__all__ = [
    "MAGIC",
    "RECORD_VERSION",
    "DeltaWriter",
    "Record",
    "compose",
    "decode",
    "encode_base",
    "encode_delta",
    "expired",
    "newest",
]

MAGIC = b"MSDS"
RECORD_VERSION = 2
_K_CARRY = "carry"
_GAPS = "ordinal_gaps"  # the compact carry's ordinal column


def _int_list(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _pack_carry(carry: object) -> object:
    """The carry with its ordinals as gaps within each source; any other shape unchanged (tagged)."""
    if not isinstance(carry, dict) or _GAPS in carry:
        return {"raw": carry}
    src, ords = carry.get("source"), carry.get("ordinal")
    if not isinstance(src, list) or not isinstance(ords, list) or not (_int_list(src) and _int_list(ords)):
        return {"raw": carry}
    if len(src) != len(ords):
        return {"raw": carry}
    last: dict[int, int] = {}
    gaps = []
    for s, o in zip(src, ords):
        gaps.append(o - last.get(s, 0))
        last[s] = o
    out = {k: v for k, v in carry.items() if k != "ordinal"}
    out[_GAPS] = gaps
    return {"cols": out, "order": list(carry)}


def _unpack_carry(packed: dict) -> object:
    if "raw" in packed:
        return packed["raw"]
    cols = dict(packed["cols"])
    last: dict[int, int] = {}
    ords = []
    for s, g in zip(cols["source"], cols.pop(_GAPS)):
        last[s] = last.get(s, 0) + g
        ords.append(last[s])
    cols["ordinal"] = ords
    return {k: cols[k] for k in packed["order"]}


def _pack(state: dict) -> dict:
    return {k: _pack_carry(v) if k == _K_CARRY else v for k, v in state.items()}


def _unpack(packed: dict) -> dict:
    return {k: _unpack_carry(v) if k == _K_CARRY else v for k, v in packed.items()}


def _seal(body: dict) -> bytes:
    return MAGIC + bytes([RECORD_VERSION]) + zlib.compress(orjson.dumps(body), 6)


def encode_base(step: int, state: dict) -> bytes:
    """The whole state of ``step``."""
    return _seal({"k": "base", "step": step, "state": _pack(state)})


def encode_delta(step: int, state: dict, base_step: int, base_state: dict, base_bytes: bytes) -> bytes:
    """The keys of ``state`` that differ from ``base_state`` (and the keys it lacks), against that base."""
    changed = {k: v for k, v in state.items() if k not in base_state or orjson.dumps(base_state[k]) != orjson.dumps(v)}
    gone = [k for k in base_state if k not in state]
    body = {
        "k": "delta",
        "step": step,
        "base": base_step,
        "crc": zlib.crc32(base_bytes),
        "set": _pack(changed),
        "del": gone,
    }
    return _seal(body)


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """A stored step, decoded: ``state`` for a base (or a version-1 state); for a delta, its ``base`` step,
    the base record's ``crc`` and what it changes (``compose`` gives the whole state)."""

    step: int
    state: dict | None = None
    base: int | None = None
    crc: int = 0
    changed: dict | None = None
    removed: tuple[str, ...] = ()

    @property
    def is_delta(self) -> bool:
        return self.base is not None


def decode(data: bytes, where: str) -> Record:
    """One stored record (``where`` names it in errors). CheckpointError for bytes that are not one."""
    try:
        if data[:1] == b"{":  # version 1: the planner state as JSON
            state = orjson.loads(data)
            if not isinstance(state, dict) or not isinstance(state.get("step"), int):
                raise ValueError("not a planner state")
            return Record(step=state["step"], state=state)
        if data[: len(MAGIC)] != MAGIC:
            raise ValueError("unknown format (neither a JSON state nor an msdata state record)")
        version = data[len(MAGIC)]
        if version != RECORD_VERSION:
            raise CheckpointError(
                f"{where}: state record version {version} is newer than this msdata ({RECORD_VERSION}); upgrade it"
            )
        body = orjson.loads(zlib.decompress(data[len(MAGIC) + 1 :]))
        if body["k"] == "base":
            return Record(step=int(body["step"]), state=_unpack(body["state"]))
        if body["k"] == "delta":
            return Record(
                step=int(body["step"]),
                base=int(body["base"]),
                crc=int(body["crc"]),
                changed=_unpack(body["set"]),
                removed=tuple(body["del"]),
            )
        raise ValueError(f"unknown record kind {body['k']!r}")
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, zlib.error) as e:  # orjson's errors are ValueErrors
        raise CheckpointError(f"{where}: corrupt planner state record: {e}") from None


def compose(delta: Record, base: Record, base_bytes: bytes, where: str) -> dict:
    """The whole state of a delta record from its base record (CheckpointError if they do not belong together)."""
    if base.state is None or base.step != delta.base or zlib.crc32(base_bytes) != delta.crc:
        raise CheckpointError(f"{where}: its base (step {delta.base}) is missing or was rewritten")
    assert delta.changed is not None
    state = {k: v for k, v in base.state.items() if k not in delta.removed}
    state.update(delta.changed)
    return state


class DeltaWriter:
    """Chooses base or delta for each saved step: a base at steps divisible by ``every``, at the first save,
    after ``reset()`` (a failed write, a mixture cut); else a delta against the newest base written."""

    def __init__(self, every: int):
        if every < 1:
            raise CheckpointError(f"{every=} must be >= 1")
        self.every = every
        self._base: tuple[int, dict, bytes] | None = None  # step, state, record bytes

    def encode(self, step: int, state: dict) -> tuple[bytes, bool]:
        """The record of ``step`` and whether it is a base."""
        base = self._base
        if base is None or step % self.every == 0 or step <= base[0] or step - base[0] >= self.every:
            data = encode_base(step, state)
            self._base = (step, state, data)
            return data, True
        return encode_delta(step, state, base[0], base[1], base[2]), False

    def reset(self) -> None:
        """The next record is a base (what was written last may not have reached the store)."""
        self._base = None


def expired(step: int, keep: int, every: int) -> int:
    """The step whose record a store deletes when it writes ``step``: keeping ``keep + every - 1`` steps keeps
    the base of every delta among the newest ``keep`` (bases come at least every ``every`` steps)."""
    return step - keep - every + 1


def newest(
    steps: list[int], read: Callable[[int], bytes | None], where: Callable[[int], str]
) -> tuple[tuple[int, dict] | None, list[str]]:
    """The newest state among ``steps`` that loads (a delta composed with its base), and why newer ones did not
    (a torn or corrupt record, a delta whose base is gone): the caller logs those."""
    skipped: list[str] = []
    cache: dict[int, tuple[bytes, Record] | None] = {}

    def load(s: int) -> tuple[bytes, Record] | None:
        if s not in cache:
            data = read(s)
            cache[s] = None if data is None else (data, decode(data, where(s)))
        return cache[s]

    for s in sorted(steps, reverse=True):
        try:
            got = load(s)
            if got is None:
                continue
            rec = got[1]
            if rec.base is None:
                assert rec.state is not None
                return (s, rec.state), skipped
            base = load(rec.base)
            if base is None:
                raise CheckpointError(f"{where(s)}: its base (step {rec.base}) is gone")
            return (s, compose(rec, base[1], base[0], where(s))), skipped
        except (CheckpointError, OSError) as e:
            skipped.append(str(e))
    return None, skipped
