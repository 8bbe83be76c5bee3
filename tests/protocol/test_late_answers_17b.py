"""Issue 17, what the late-answer fixes of test_late_answers_17.py left (found by the
fault fuzz of tests/chaos/FAULT_FUZZ.md, FTYPES=delay): a lost commit of this process,
proven at its next heartbeat, runs as its first fire with its window's reason (it said
"re-run" and counted as a refire)."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import BEAT, WF, backend
from trio_debounce import BackendUnavailableError, FireReason, FireStarted, open_coordinator
from trio_debounce.testing import MemoryStore


async def test_a_lost_commit_proven_by_the_heartbeat_runs_as_its_first_fire_not_a_rerun(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's ping at the due time of B's window (due at its max_delay) takes its fire: A's
    # fire record and tombstone land, the tombstone's answer comes after op_timeout, so
    # the ping raises. A's next heartbeat proves the commit (its record, its tombstone)
    # and runs it: attempt 1, the first run of the burst. Before, it said "re-run" and
    # counted as a refire, as if a process had died in it.
    store, fires = MemoryStore(), Fires()
    events: list[Any] = []
    a, b = backend(store, "A", op_timeout=1.0), backend(store, "B")
    async with AsyncExitStack() as stack:
        ca, cb = [
            await stack.enter_async_context(
                open_coordinator(
                    handlers={WF: fires.handler(name)},
                    backend=x,
                    on_backend_error="raise",
                    on_event=events.append if name == "A" else None,
                )
            )
            for name, x in (("A", a), ("B", b))
        ]
        start = trio.current_time()
        await trio.sleep_until(start + BEAT + 0.5)
        await cb.debounce(WF, "k", "b0", delay=1.0, max_delay=1.0)  # due at BEAT + 1.5
        b.faults.stall_next(0.5, ops=("put",))  # B's record lands at BEAT + 2.0
        await trio.sleep_until(start + BEAT + 1.6)
        a.faults.delay_next(0.0, ops=("put",))  # A's fire record lands at once
        a.faults.delay_next(3.0, ops=("put",))  # its tombstone lands; its answer is late
        with pytest.raises(BackendUnavailableError):
            await ca.debounce(WF, "k", "a0", delay=1.0)  # at the due time: takes the fire
        await trio.sleep_until(start + 4 * BEAT)
        stats = ca.statistics()
        assert (stats.fires, stats.refires) == (1, 0)
    [(process, fire)] = fires.log
    assert (process, fire.payload, fire.attempt) == ("A", "b0", 1)
    assert fire.reason is FireReason.MAX_DELAY
    [started] = [e for e in events if isinstance(e, FireStarted)]
    assert started.reason is FireReason.MAX_DELAY
