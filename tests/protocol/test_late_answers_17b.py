"""Issue 17, what the late-answer fixes of test_late_answers_17.py left (found by the
fault fuzz of tests/chaos/FAULT_FUZZ.md, FTYPES=delay): a lost commit of this process,
proven at its next heartbeat, runs as its first fire with its window's reason (it said
"re-run" and counted as a refire); a register whose re-read cannot tell whether its
join landed says it joined the window (it said "the window its write opened"). The last
two tests show two documented points the fuzz found (docs/reliability.rst): an
unconfirmed fire that a live peer's ping fires again, and a join that cannot be proven
and fires twice once failed open."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import BEAT, WF, backend
from trio_debounce import (
    BackendUnavailableError,
    FireReason,
    FireStarted,
    Mode,
    open_coordinator,
)
from trio_debounce._protocol._documents import WRITES_KEEP
from trio_debounce.testing import MemoryBackend, MemoryStore


async def _ping(b: MemoryBackend, run_id: str, payload: str) -> None:
    await b.register(
        "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id=run_id, payload=payload
    )


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


async def test_a_join_that_a_reread_cannot_tell_says_it_joined_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's ping joins B's open window r1: the write lands, its answer comes after
    # op_timeout, and meanwhile B's pings push its id out of the key's "writes". The
    # re-read cannot tell whether it landed: the error names the window it joined (it
    # said "the window its write opened").
    store = MemoryStore()
    a, b = backend(store, "A", op_timeout=1.0), backend(store, "B")
    for x in (a, b):
        await x.refresh_lease()
    await _ping(b, "r1", "b0")
    a.faults.delay_next(3.0, ops=("put",))  # lands at once, answered late
    failed: list[BaseException] = []

    async def join() -> None:
        with pytest.raises(BackendUnavailableError) as raised:
            await _ping(a, "r2", "a0")
        failed.append(raised.value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(join)
        await trio.sleep(0.1)  # A's write has landed
        for n in range(WRITES_KEEP + 1):
            await _ping(b, "r3", f"b{n + 1}")
    [error] = failed
    message = str(error)
    assert "'wf'/'k'" in message
    assert "could not tell whether its write into the window it joined (run r1) landed" in message
    assert "opened" not in message


async def test_an_unconfirmed_fire_of_a_late_record_can_be_fired_again_by_a_live_peers_ping(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A documented run-twice point of at-least-once (docs/reliability.rst): the owner A's
    # fire record lands, its answer comes after op_timeout, so A fires unconfirmed (token
    # 0) and queues the window's close for its next heartbeat. Meanwhile the window is
    # still open and due in the store, and a ping of B, whose lease is live (as is A's),
    # takes its fire and fires it again, confirmed.
    store, fires = MemoryStore(), Fires()
    a, b = backend(store, "A", op_timeout=0.5), backend(store, "B")
    async with AsyncExitStack() as stack:
        ca, cb = [
            await stack.enter_async_context(
                open_coordinator(handlers={WF: fires.handler(name)}, backend=x)
            )
            for name, x in (("A", a), ("B", b))
        ]
        start = trio.current_time()
        await trio.sleep_until(start + BEAT + 0.5)
        await ca.debounce(WF, "k", "a0", delay=0.5)  # A's window, due at BEAT + 1.0
        a.faults.delay_next(2.0, ops=("put",))  # A's fire record: answered late
        await trio.sleep_until(start + BEAT + 1.7)  # A fired unconfirmed at BEAT + 1.5
        assert [(p, f.fencing_token) for p, f in fires.log] == [("A", 0)]
        await cb.debounce(WF, "k", "b0", delay=0.5)  # due: B takes the fire
        await trio.sleep_until(start + 4 * BEAT)
        assert ca.statistics().unconfirmed_fires == 1
    (pa, first), (pb, second), (_, after) = fires.log  # after: b0's own window
    assert (pa, pb) == ("A", "B")
    assert first.run_id == second.run_id != after.run_id
    assert (first.payload, second.payload, after.payload) == ("a0", "a0", "b0")
    assert second.fencing_token > 0
    assert (first.attempt, second.attempt) == (1, 1)


async def test_a_join_a_reread_cannot_tell_fails_open_and_fires_twice(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A documented ping duplication point (docs/protocol.rst): A's ping joins B's window
    # and lands, its answer comes after op_timeout (the store reachable all along), and
    # more than six newer writes of the key follow it before A's re-read: it cannot
    # tell whether the ping landed. Failing open (the default), A fires it in a local
    # window, and B's window fires it too.
    store, fires = MemoryStore(), Fires()
    a, b = backend(store, "A", op_timeout=1.0), backend(store, "B")
    options: dict[str, Any] = {"delay": 5.0, "payload_policy": "collect", "max_items": 20}
    async with AsyncExitStack() as stack:
        ca, cb = [
            await stack.enter_async_context(
                open_coordinator(handlers={WF: fires.handler(name)}, backend=x)
            )
            for name, x in (("A", a), ("B", b))
        ]
        await cb.debounce(WF, "k", "b0", **options)
        a.faults.delay_next(3.0, ops=("put",))  # A's join lands; its answer is late

        async def bs() -> None:
            await trio.sleep(0.1)
            for n in range(WRITES_KEEP + 1):
                await cb.debounce(WF, "k", f"b{n + 1}", **options)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(bs)
            r = await ca.debounce(WF, "k", "a0", **options)
        assert r.owner  # a local window (fail-open)
        assert ca.statistics().fail_open_windows == 1
        await trio.sleep(20.0)
    by = {p: f.payload for p, f in fires.log}
    assert sorted(by) == ["A", "B"]
    assert by["A"] == ["a0"]
    assert "a0" in by["B"]
