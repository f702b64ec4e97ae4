"""Layout: the shape one step fills (dp ranks x micro-batches x rows of seq_len tokens)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """The shape one step fills: dp ranks x micro-batches x rows of seq_len tokens."""

    dp: int
    micro: int
    rows: int
    seq_len: int

    @property
    def slots(self) -> int:
        """Rows per rank."""
        return self.micro * self.rows

    @property
    def capacity(self) -> int:
        """Tokens per step."""
        return self.dp * self.slots * self.seq_len
