"""A receiving group and its bounded queue of step plans (between the plan feed and its constructor)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..planner import StepPlan
from .rings import RingSet

__all__ = ["Group", "StepQueue"]


class StepQueue:
    """Bounded FIFO of step plans for one group: at most ``maxsize`` plans wait; a mixture change can drop
    the plans of steps it re-plans. One producer (the job's distribution loop) and one consumer (the
    group's constructor)."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.items: deque[StepPlan] = deque()
        self._space = asyncio.Event()
        self._data = asyncio.Event()

    async def put(self, plan: StepPlan, wanted: Callable[[], bool]) -> bool:
        """Append when there is room; False (nothing appended) once ``wanted()`` says the plan was dropped."""
        while len(self.items) >= self.maxsize and wanted():
            self._space.clear()
            await self._space.wait()
        if not wanted():
            return False
        self.items.append(plan)
        self._data.set()
        return True

    async def get(self) -> StepPlan:
        while not self.items:
            self._data.clear()
            await self._data.wait()
        plan = self.items.popleft()
        self._space.set()
        return plan

    def backfill(self, plans: list[StepPlan]) -> None:
        """Queue plans handed out before this group was read here, ahead of any later one (past the bound: they
        are the past; the producer waits for room as before)."""
        self.items.extendleft(reversed(plans))
        if self.items:
            self._data.set()

    def drop_from(self, step: int) -> list[StepPlan]:
        dropped = [p for p in self.items if p.step >= step]
        self.items = deque(p for p in self.items if p.step < step)
        self._space.set()  # also wakes a producer whose plan was dropped
        return dropped


@dataclass
class Group:
    """A receiving rank group: one distinct data stream, its bounded queue of steps and, where its ranks read
    on this node, its rings (``None``: no reader here, so no constructor either)."""

    index: int
    readers: tuple[int, ...]
    queue: StepQueue
    committed: int  # the newest step this group's constructor has taken up (never re-planned)
    rings: RingSet | None = None
    published: int = 0
    bytes_published: int = 0
