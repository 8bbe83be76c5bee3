"""The one place where Trio's clock and the wall clock meet.

Local timers run on Trio's clock (:func:`trio.current_time`), which MockClock drives in
tests; wall-clock time (epoch seconds) is only for what leaves the process: CLI output
now, shared and persisted times in later backends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import trio


@dataclass(frozen=True, slots=True)
class WallClock:
    """A fixed offset between Trio's clock and wall-clock epoch seconds.

    The offset is read once (:meth:`now`), so converting two Trio times keeps their
    difference exact; the price is that a later step of the wall clock (NTP, a manual
    change) is not followed, which is what local timing wants.
    """

    offset: float

    @classmethod
    def now(cls, wall_time: Callable[[], float] = time.time) -> WallClock:
        """Measure the offset now; must be called inside a Trio run."""
        return cls(wall_time() - trio.current_time())

    def from_trio(self, trio_time: float) -> float:
        """An absolute time on Trio's clock as wall-clock epoch seconds."""
        return trio_time + self.offset
