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


def wall_to_trio(wall_at: float, *, wall_now: float, trio_now: float) -> float:
    """A wall-clock time (epoch seconds, shared between processes) as a Trio deadline.

    Both clocks are read by the caller at the same moment; the conversion keeps the
    distance from now, so a step of the wall clock between two conversions is
    followed (shared times are compared on the wall clock, as the peers do).
    """
    return trio_now + (wall_at - wall_now)


def trio_to_wall(trio_at: float, *, wall_now: float, trio_now: float) -> float:
    """The inverse of :func:`wall_to_trio`."""
    return wall_now + (trio_at - trio_now)
