"""The one place where Trio's clock and the wall clock meet.

Local timers run on Trio's clock (:func:`trio.current_time`), which MockClock drives in
tests; wall-clock time (epoch seconds) is only for what leaves the process: CLI output
now, shared and persisted times in later backends.
"""

from __future__ import annotations

import time

import trio


def trio_to_wall(trio_time: float) -> float:
    """Convert an absolute time on Trio's clock to wall-clock epoch seconds.

    Both clocks are read now, so the result is as good as ``time.time()`` is at this
    moment; must be called inside a Trio run.
    """
    return time.time() - (trio.current_time() - trio_time)
