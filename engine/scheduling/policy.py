"""Which K a request runs each cycle: fixed, or chosen by auto K."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DraftPolicy:
    """Which K to run each cycle: fixed, or automatic (``chooser``: a ``RequestAutoK``).
    ``batched``: whether a batch may choose an automatic row's K together with its neighbours'
    (``BatchK``); a seeded row's K must stay a function of the request alone."""

    fixed: int | None
    chooser: Any = None
    batched: bool = True

    @property
    def batched_auto(self) -> bool:
        """Whether the batch chooses this row's K (``CycleNeed.auto``)."""
        return self.fixed is None and self.batched

    def choose(self, seq: Any, remaining: int) -> int:
        k = self.fixed if self.fixed is not None else self.chooser.choose(seq)
        # Never draft past max_tokens: at most `remaining` tokens can be emitted.
        return max(0, min(k, remaining - 1))
