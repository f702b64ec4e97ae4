"""Progress for the benchmarks: a tqdm bar on a terminal, nothing extra when stdout is a log or a pipe.

Result lines go through `say`, which prints them above a live bar (and plainly without one), so a bench's
output reads the same in a terminal and in `bench/suite.py`'s captured logs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

__all__ = ["bar", "say", "track"]

T = TypeVar("T")


def bar(total: float | None = None, desc: str = "", unit: str = "it") -> tqdm:
    """A progress bar, disabled (a no-op) unless stdout is a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, disable=not sys.stdout.isatty())


def track(items: Iterable[T], desc: str = "", total: int | None = None, unit: str = "it") -> Iterator[T]:
    """Iterate ``items`` with a bar (see `bar`)."""
    with bar(total if total is not None else _len(items), desc, unit) as b:
        for x in items:
            yield x
            b.update(1)


def say(line: str) -> None:
    """Print one result line (above the bar when there is one) and flush."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def _len(items: Iterable) -> int | None:
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None
