"""The file listings a planner state was planned over (``state.K_LISTING``): per source the listing digest and
file count, and the changes a resume with ``[job] on_data_change = "continue"`` went on across.

Pure values; the starters compare them with the files now (``datachange.py``). A state saved before listings
were kept has none: its file list is unknown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from msdata_server.errors import CheckpointError

__all__ = ["Listings", "ListingChange"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ListingChange:
    """From ``step`` on, source ``source`` is read over the files of digest ``now`` (it was ``was``): the rows of
    earlier steps refer to the old file list."""

    step: int
    source: str
    was: str
    now: str

    def to_dict(self) -> dict:
        return {"step": self.step, "source": self.source, "was": self.was, "now": self.now}


@dataclass(frozen=True, slots=True, kw_only=True)
class Listings:
    """Per source (in the job's order) its listing digest ("" for a source without files) and file count."""

    digests: tuple[str, ...]
    files: tuple[int, ...]
    changes: tuple[ListingChange, ...] = ()  # oldest first

    def to_dict(self) -> dict:
        return {
            "digest": list(self.digests),
            "files": list(self.files),
            **({"changes": [c.to_dict() for c in self.changes]} if self.changes else {}),
        }

    @classmethod
    def from_dict(cls, raw: object, n: int) -> Listings:
        """Strictly, for a job of ``n`` sources; CheckpointError says what does not fit."""
        ok = (
            isinstance(raw, Mapping)
            and set(raw) <= {"digest", "files", "changes"}
            and isinstance(raw.get("digest"), list)
            and len(raw["digest"]) == n
            and all(isinstance(d, str) for d in raw["digest"])
            and isinstance(raw.get("files"), list)
            and len(raw["files"]) == n
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in raw["files"])
        )
        if not ok:
            raise CheckpointError(
                f"planner state 'listing' must be {{'digest': {n} strings, 'files': {n} ints >= 0}}, got {raw!r}"
            )
        assert isinstance(raw, Mapping)
        changes = []
        for c in raw.get("changes", []):
            if not (
                isinstance(c, Mapping)
                and set(c) == {"step", "source", "was", "now"}
                and isinstance(c["step"], int)
                and all(isinstance(c[k], str) for k in ("source", "was", "now"))
            ):
                raise CheckpointError(f"planner state listing change {c!r} must be {{step, source, was, now}}")
            changes.append(ListingChange(step=c["step"], source=c["source"], was=c["was"], now=c["now"]))
        return cls(digests=tuple(raw["digest"]), files=tuple(raw["files"]), changes=tuple(changes))

    def differing(self, now: Listings) -> list[int]:
        """Indices of the sources whose files differ in ``now``."""
        return [i for i, (a, b) in enumerate(zip(self.digests, now.digests)) if a != b]

    def went_on(self, now: Listings, step: int, names: Sequence[str]) -> Listings:
        """``now``, with this listing's changes and one more per source that differs, taking effect at ``step``."""
        new = tuple(
            ListingChange(step=step, source=names[i], was=self.digests[i], now=now.digests[i])
            for i in self.differing(now)
        )
        return Listings(digests=now.digests, files=now.files, changes=self.changes + new)

    def changes_after(self, step: int) -> tuple[ListingChange, ...]:
        """The changes that took effect after ``step``: that step's rows refer to an older file list."""
        return tuple(c for c in self.changes if c.step > step)
