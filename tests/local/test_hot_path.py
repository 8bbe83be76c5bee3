"""The in-memory fast paths: lazy due times and debounce_nowait's inlined coalescing ping.

A ping that moves a window's due time later only writes it on the window; the window's
task wakes at the deadline it armed, finds the due time moved and sleeps again. Only a
ping that moves it earlier touches the task's cancel scope. These tests pin the fires
to the exact instant on a MockClock, through both the inlined path and the full one.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Recorder
from trio_debounce import DebounceResult, Edge, Mode, Outcome, open_coordinator

WF = "wf"


def _armed(c: Any, key: str) -> float:
    """The deadline the window's task sleeps on (white box: its cancel scope's)."""
    scope = c._windows[(WF, key)].scope
    assert scope is not None
    return float(scope.deadline)


async def test_a_later_due_time_leaves_the_armed_deadline_and_fires_at_the_new_one(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.debounce_nowait(WF, "k", 0, delay=10.0)
        await trio.testing.wait_all_tasks_blocked()
        assert _armed(c, "k") == t0 + 10.0
        await trio.sleep(5.0)
        r = c.debounce_nowait(WF, "k", 1, delay=10.0)
        assert r == DebounceResult(Outcome.COALESCE, r.active_run_id, t0 + 15.0, 2)
        # Lazy: the ping wrote the due time only; the task still sleeps on t0 + 10.
        assert _armed(c, "k") == t0 + 10.0
        await trio.sleep(5.0)  # t0 + 10: the task wakes, finds t0 + 15, sleeps again
        await trio.testing.wait_all_tasks_blocked()
        assert recorder.fires == []
        assert c.has(WF, "k")
        assert _armed(c, "k") == t0 + 15.0
    assert recorder.summary() == [(t0 + 15.0, "k", 1, 2, "trailing")]
    assert trio.current_time() == t0 + 15.0


async def test_an_earlier_due_time_moves_the_armed_deadline(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.debounce_nowait(WF, "k", 0, delay=10.0)
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(1.0)
        r = c.debounce_nowait(WF, "k", 1, delay=2.0)
        assert r.scheduled_at == t0 + 3.0
        assert _armed(c, "k") == t0 + 3.0
    assert recorder.summary() == [(t0 + 3.0, "k", 1, 2, "trailing")]
    assert trio.current_time() == t0 + 3.0


async def test_an_earlier_due_time_before_the_task_first_runs(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    # The task has not armed yet (no scope): it arms on the due time it finds.
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.debounce_nowait(WF, "k", 0, delay=10.0)
        c.debounce_nowait(WF, "k", 1, delay=2.0)
        c.debounce_nowait(WF, "k", 2, delay=4.0)  # later again: 4 s from now
    assert recorder.summary() == [(t0 + 4.0, "k", 2, 3, "trailing")]


@pytest.mark.parametrize("nowait", [True, False])
async def test_max_delay_caps_a_window_pinged_faster_than_its_delay(
    autojump_clock: trio.testing.MockClock, recorder: Recorder, nowait: bool
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(20):
            if nowait:
                r = c.debounce_nowait(WF, "k", i, delay=2.0, max_delay=5.0)
            else:
                r = await c.debounce(WF, "k", i, delay=2.0, max_delay=5.0)
            opened = t0 + (0.0 if i < 10 else 5.0)
            assert r.scheduled_at == min(t0 + i * 0.5 + 2.0, opened + 5.0)
            await trio.sleep(0.5)
            if i == 9:  # t0 + 5: the window is due; the next ping opens another
                assert not c.has(WF, "k")
    assert recorder.summary() == [
        (t0 + 5.0, "k", 9, 10, "trailing"),
        (t0 + 5.0 + 5.0, "k", 19, 10, "trailing"),
    ]


async def test_many_pings_fire_once_at_the_instant_after_the_last(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        first = c.debounce_nowait(WF, "k", -1, delay=3.0, run_id="first")
        for step in range(100):
            for i in range(100):
                r = c.debounce_nowait(WF, "k", (step, i), delay=3.0, run_id=f"ignored{i}")
                assert r.active_run_id == "first"
            await trio.sleep(1 / 64)  # exact in binary: the sums are exact
        last_ping = t0 + 99 / 64
        assert r == DebounceResult(Outcome.COALESCE, "first", last_ping + 3.0, 10_001)
        assert first.outcome is Outcome.SCHEDULE_TRAILING
        stats = c.statistics()
        assert (stats.pings, stats.coalesced, stats.pending_trailing_fires) == (10_001, 10_000, 1)
        await trio.sleep_until(last_ping + 3.0 - 1e-6)
        assert recorder.fires == []
    [fire] = recorder.fires
    assert (fire.fired_at, fire.payload, fire.ping_count, fire.run_id) == (
        last_ping + 3.0,
        (99, 99),
        10_001,
        "first",
    )
    assert fire.first_ping_at == t0
    assert c.statistics().fires == 1


async def test_a_ping_exactly_at_the_due_time_opens_a_new_window(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.debounce_nowait(WF, "k", 0, delay=2.0, run_id="a")
        c.debounce_nowait(WF, "k", 1, delay=2.0)  # due t0 + 2
        # Jump to the due time without letting the window's task run first.
        autojump_clock.jump(2.0)
        r = c.debounce_nowait(WF, "k", 2, delay=2.0, run_id="b")
        assert (r.outcome, r.active_run_id, r.ping_count) == (Outcome.SCHEDULE_TRAILING, "b", 1)
    assert recorder.summary() == [
        (t0 + 2.0, "k", 1, 2, "trailing"),
        (t0 + 4.0, "k", 2, 1, "trailing"),
    ]


async def test_pings_the_inlined_path_does_not_take_still_follow_the_rules(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    # on_fire, an int delay, a str mode, and both mode's first coalescing ping take
    # the full path; each does what the rules say.
    t0 = trio.current_time()
    other = Recorder()
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.debounce_nowait(WF, "t", 0, delay=2.0)
        c.debounce_nowait(WF, "t", 1, delay=3)  # int delay
        c.debounce_nowait(WF, "t", 2, delay=3.0, mode="trailing")
        r = c.debounce_nowait(WF, "t", 3, delay=3.0, on_fire=other)
        assert (r.outcome, r.ping_count, r.scheduled_at) == (Outcome.COALESCE, 4, t0 + 3.0)
        lead = c.debounce_nowait(WF, "b", "x", delay=2.0, mode=Mode.BOTH)
        assert (lead.outcome, lead.scheduled_at) == (Outcome.FIRE_IMMEDIATE, None)
        assert c.statistics().pending_trailing_fires == 1
        r = c.debounce_nowait(WF, "b", "y", delay=2.0, mode=Mode.BOTH)
        assert (r.outcome, r.scheduled_at, r.ping_count) == (Outcome.COALESCE, t0 + 2.0, 2)
        assert c.statistics().pending_trailing_fires == 2
        r = c.debounce_nowait(WF, "b", "z", delay=2.0, mode=Mode.BOTH)  # inlined now
        assert (r.outcome, r.scheduled_at, r.ping_count) == (Outcome.COALESCE, t0 + 2.0, 3)
    assert [(f.key, f.payload, f.edge) for f in recorder.fires] == [
        ("b", "x", Edge.LEADING),
        ("b", "z", Edge.TRAILING),
    ]
    assert other.summary() == [(t0 + 3.0, "t", 3, 4, "trailing")]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"delay": -1.0}, ValueError),
        ({"delay": 1.0, "max_delay": 0.5}, ValueError),
        ({"delay": 1.0, "run_id": ""}, ValueError),
        ({"delay": 1.0, "mode": "leading"}, ValueError),
    ],
)
async def test_a_bad_ping_into_an_open_window_raises_and_changes_nothing(
    autojump_clock: trio.testing.MockClock,
    recorder: Recorder,
    kwargs: dict[str, Any],
    error: type[Exception],
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.debounce_nowait(WF, "k", "ok", delay=1.0)
        before = c.statistics()
        with pytest.raises(error):
            c.debounce_nowait(WF, "k", "bad", **kwargs)
        assert c.statistics() == before
    assert [f.payload for f in recorder.fires] == ["ok"]


async def test_a_removed_handler_is_still_a_lookup_error_in_an_open_window(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.debounce_nowait(WF, "k", 0, delay=1.0)
        c.set_handler(WF, None)
        with pytest.raises(LookupError, match="'wf'"):
            c.debounce_nowait(WF, "k", 1, delay=1.0)
        c.set_handler(WF, recorder)
        assert c.debounce_nowait(WF, "k", 2, delay=1.0).ping_count == 2


async def test_window_options_still_apply_to_later_pings(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.debounce_nowait(WF, "k", 0, delay=5.0, max_count=3, payload_policy="collect")
        # Pings without options into a window with options take the full path: they
        # must repeat the window's options.
        with pytest.raises(ValueError, match="max_count None differs from the max_count 3"):
            c.debounce_nowait(WF, "k", 1, delay=5.0)
        c.debounce_nowait(WF, "k", 1, delay=5.0, max_count=3, payload_policy="collect")
        r = c.debounce_nowait(WF, "k", 2, delay=5.0, max_count=3, payload_policy="collect")
        assert r.scheduled_at == t0  # the third ping makes it due now
    assert recorder.summary() == [(t0, "k", [0, 1, 2], 3, "trailing")]
