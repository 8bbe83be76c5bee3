"""Throttle, audit, batch and rate limit in one process: the named rules of
docs/semantics.rst ("Throttle, batch and rate limit") on MockClock. The fire-by-fire
comparison with the reference model is tests/local/test_flow_properties.py."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import trio
import trio.testing

from trio_debounce import (
    CoordinatorEvent,
    Fire,
    FireReason,
    Outcome,
    PingAnswered,
    PingRejected,
    open_coordinator,
)

WF = "wf"


class Log:
    def __init__(self) -> None:
        self.fires: list[Fire] = []

    async def __call__(self, fire: Fire) -> None:
        self.fires.append(fire)

    def rows(self) -> list[tuple[float, str, Any, int, str, str]]:
        return [
            (f.fired_at, f.key, f.payload, f.ping_count, f.edge.value, f.reason.value)
            for f in self.fires
        ]


async def test_throttle_fires_both_edges_at_least_an_interval_apart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(handlers={WF: log}) as c:
        for n in range(13):  # a ping every 0.25 s for 3 s
            c.throttle_nowait(WF, "k", n, interval=1.0)
            await trio.sleep(0.25)
    assert log.rows() == [
        (0.0, "k", 0, 1, "leading", "leading"),
        (1.0, "k", 3, 3, "trailing", "interval"),  # 1, 2, 3 (the ping at 1.0 is next)
        (2.0, "k", 7, 4, "trailing", "interval"),
        (3.0, "k", 11, 4, "trailing", "interval"),
        (4.0, "k", 12, 1, "trailing", "interval"),
    ]
    times = [f.fired_at for f in log.fires]
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(times))


async def test_a_throttle_window_without_a_later_ping_never_fires_empty(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(handlers={WF: log}) as c:
        c.throttle_nowait(WF, "k", 1, interval=1.0)
        await trio.sleep(1.0)  # its end: nothing absorbed, no trailing fire, closed
        assert not c.has(WF, "k")
        r = c.throttle_nowait(WF, "k", 2, interval=1.0)  # a new window, a leading fire
    assert r.outcome is Outcome.FIRE_IMMEDIATE
    assert log.rows() == [
        (0.0, "k", 1, 1, "leading", "leading"),
        (1.0, "k", 2, 1, "leading", "leading"),
    ]


async def test_throttle_without_a_trailing_edge_drops_and_counts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(handlers={WF: log}) as c:
        outcomes = []
        for n in range(6):
            outcomes.append(c.throttle_nowait(WF, "k", n, interval=1.0, trailing=False).outcome)
            await trio.sleep(0.5)
        stats = c.statistics()
    assert [o.value for o in outcomes] == ["fire-immediate", "dropped"] * 3
    assert (stats.dropped_pings, stats.pings, stats.fires) == (3, 3, 3)
    assert [row[2] for row in log.rows()] == [0, 2, 4]


async def test_audit_fires_the_latest_at_the_end_of_its_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(handlers={WF: log}) as c:
        first = c.throttle_nowait(WF, "k", 1, interval=2.0, leading=False)
        await trio.sleep(1.5)
        c.throttle_nowait(WF, "k", 2, interval=2.0, leading=False)  # no restart
    assert (first.outcome, first.scheduled_at) == (Outcome.SCHEDULE_TRAILING, 2.0)
    assert log.rows() == [(2.0, "k", 2, 2, "trailing", "interval")]


async def test_a_batch_fires_at_its_nth_item_inside_that_call_as_a_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(handlers={WF: log}) as c:
        c.batch_nowait(WF, "k", "a", max_items=3, max_wait=10.0)
        c.batch_nowait(WF, "k", "b", max_items=3, max_wait=10.0)
        r = c.batch_nowait(WF, "k", "c", max_items=3, max_wait=10.0)
        assert log.fires == []  # committed, but the handler runs as a task
        assert (r.outcome, r.ping_count) == (Outcome.COALESCE, 3)
        assert not c.has(WF, "k")
        await trio.testing.wait_all_tasks_blocked()
        assert log.rows() == [(0.0, "k", ["a", "b", "c"], 3, "trailing", "max-items")]


async def test_a_batch_fires_before_an_item_that_would_pass_max_bytes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(handlers={WF: log}) as c:
        assert c.batch_nowait(WF, "k", "aaaa", max_wait=5.0, max_bytes=10).ping_count == 1
        c.batch_nowait(WF, "k", "bb", max_wait=5.0, max_bytes=10)  # 6 + 4 bytes: 10
        r = c.batch_nowait(WF, "k", "c", max_wait=5.0, max_bytes=10)  # 13: fires first
        assert (r.outcome, r.ping_count) == (Outcome.SCHEDULE_TRAILING, 1)
        with pytest.raises(ValueError, match="13 bytes as JSON, more than max_bytes=10"):
            c.batch_nowait(WF, "k", "x" * 11, max_wait=5.0, max_bytes=10)
        assert c.statistics().pings == 3  # the refused item changed nothing
    assert log.rows() == [
        (0.0, "k", ["aaaa", "bb"], 2, "trailing", "max-bytes"),
        (5.0, "k", ["c"], 1, "trailing", "max-wait"),
    ]


async def test_an_item_at_exactly_max_wait_belongs_to_the_next_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(handlers={WF: log}) as c:
        c.batch_nowait(WF, "k", 1, max_wait=1.0)
        await trio.sleep(1.0)
        r = c.batch_nowait(WF, "k", 2, max_wait=1.0)
    assert r.outcome is Outcome.SCHEDULE_TRAILING
    assert log.rows() == [
        (1.0, "k", [1], 1, "trailing", "max-wait"),
        (2.0, "k", [2], 1, "trailing", "max-wait"),
    ]


async def test_rate_limit_fires_the_first_k_of_a_fixed_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(handlers={WF: log}) as c:
        results = []
        for n in range(8):  # every 0.5 s: windows [0, 2), [2, 4)
            results.append(c.rate_limit_nowait(WF, "k", n, limit=2, period=2.0))
            await trio.sleep(0.5)
        stats = c.statistics()
    assert [r.outcome.value for r in results] == ["fire-immediate"] * 2 + ["dropped"] * 2 + [
        "fire-immediate"
    ] * 2 + ["dropped"] * 2
    fired = [r.active_run_id for r in results if r.outcome is Outcome.FIRE_IMMEDIATE]
    assert len(set(fired)) == 4  # each fire its own run
    assert [f.run_id for f in log.fires] == fired
    assert [row[2] for row in log.rows()] == [0, 1, 4, 5]
    assert stats.dropped_pings == 4


async def test_cool_down_and_rate_windows_hold_nothing_pending(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # has() and len() show them open (as a leading window), wait_idle() and the exit
    # do not wait for them.
    async with open_coordinator(handlers={WF: Log()}) as c:
        c.rate_limit_nowait(WF, "r", 1, limit=1, period=100.0)
        c.throttle_nowait(WF, "t", 1, interval=100.0)
        assert c.has(WF, "r")
        assert c.has(WF, "t")
        assert len(c) == 2
        assert c.statistics().pending_trailing_fires == 0
        with trio.fail_after(1):
            await c.wait_idle()
        c.throttle_nowait(WF, "t", 2, interval=100.0)  # now a trailing fire is pending
        assert c.statistics().pending_trailing_fires == 1
        start = trio.current_time()
    assert trio.current_time() - start == 100.0  # the exit waited for it alone


async def test_flush_fires_now_and_a_throttle_then_cools_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(handlers={WF: log}) as c:
        c.throttle_nowait(WF, "t", 1, interval=10.0)
        assert not await c.flush(WF, "t")  # nothing pending after the leading fire
        c.throttle_nowait(WF, "t", 2, interval=10.0)
        await trio.sleep(3.0)
        assert await c.flush(WF, "t")
        r = c.throttle_nowait(WF, "t", 3, interval=10.0)  # in the cool-down [3, 13)
        assert (r.outcome, r.scheduled_at) == (Outcome.COALESCE, 13.0)
        c.batch_nowait(WF, "b", 1, max_wait=10.0)
        assert await c.flush(WF, "b")
        assert await c.cancel(WF, "t")  # drops 3; no cool-down: the next fires at once
        assert c.throttle_nowait(WF, "t", 4, interval=10.0).outcome is Outcome.FIRE_IMMEDIATE
    assert log.rows() == [
        (0.0, "t", 1, 1, "leading", "leading"),
        (3.0, "t", 2, 1, "trailing", "flush"),
        (3.0, "b", [1], 1, "trailing", "flush"),
        (3.0, "t", 4, 1, "leading", "leading"),
    ]
    assert log.fires[1].reason is FireReason.FLUSH


async def test_a_key_has_one_kind_of_window_at_a_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={WF: Log()}) as c:
        c.debounce_nowait(WF, "d", 1, delay=5.0)
        with pytest.raises(ValueError, match="open debounce window"):
            c.throttle_nowait(WF, "d", 1, interval=1.0)
        c.batch_nowait(WF, "b", 1, max_wait=5.0)
        with pytest.raises(ValueError, match="open throttle, batch or rate-limit window"):
            c.debounce_nowait(WF, "b", 1, delay=5.0)
        with pytest.raises(ValueError, match=r"throttle\(interval=1.0.*differs from batch"):
            c.throttle_nowait(WF, "b", 1, interval=1.0)
        with pytest.raises(ValueError, match=r"max_wait=6\.0.*differs"):
            c.batch_nowait(WF, "b", 2, max_wait=6.0)
        assert c.statistics().pings == 2  # the refused pings changed nothing
        await trio.sleep(5.0)
        c.throttle_nowait(WF, "b", 1, interval=1.0)  # the batch is over: free again


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        ("throttle_nowait(WF, 'k', interval=0.0)", ValueError, "interval must be > 0, got 0.0"),
        ("throttle_nowait(WF, 'k', interval=math.nan)", ValueError, "interval must not be NaN"),
        (
            "throttle_nowait(WF, 'k', interval=1.0, leading=False, trailing=False)",
            ValueError,
            "leading and trailing cannot both be False",
        ),
        ("throttle_nowait(WF, 'k', interval=1.0, leading=1)", TypeError, "must be bools"),
        ("batch_nowait(WF, 'k', 1, max_wait=1.0, max_items=0)", ValueError, "max_items must"),
        ("batch_nowait(WF, 'k', 1, max_wait=1.0, max_bytes=True)", TypeError, "max_bytes"),
        ("batch_nowait(WF, 'k', 1, max_wait=-1.0)", ValueError, "max_wait must be > 0"),
        ("rate_limit_nowait(WF, 'k', limit=0, period=1.0)", ValueError, "limit must be >= 1"),
        ("rate_limit_nowait(WF, 'k', limit=1, period=math.inf)", ValueError, "period must"),
        ("rate_limit_nowait('', 'k', limit=1, period=1.0)", ValueError, "workflow"),
        ("throttle_nowait(WF, 'k', interval=1.0, run_id='')", ValueError, "run_id"),
        ("throttle_nowait('nobody', 'k', interval=1.0)", LookupError, "nobody"),
    ],
)
async def test_bad_input_is_refused_naming_it(
    autojump_clock: trio.testing.MockClock, call: str, error: type[Exception], message: str
) -> None:
    async with open_coordinator(handlers={WF: Log()}) as c:
        with pytest.raises(error, match=message):
            eval(f"c.{call}", {"c": c, "WF": WF, "math": math})
        assert len(c) == 0
        assert c.statistics().pings == 0


async def test_an_abort_fires_what_was_due_and_cancels_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    coordinators = []

    async def body() -> None:
        async with open_coordinator(handlers={WF: log}) as c:
            coordinators.append(c)
            c.batch_nowait(WF, "b", 1, max_wait=5.0)
            c.throttle_nowait(WF, "t", 1, interval=1.0, leading=False)
            await trio.sleep(0.5)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await body()
    assert log.fires == []  # neither was due at the abort
    assert coordinators[0].statistics().cancelled == 2


async def test_flow_pings_reach_the_event_hook(autojump_clock: trio.testing.MockClock) -> None:
    events: list[CoordinatorEvent] = []
    async with open_coordinator(handlers={WF: Log()}, on_event=events.append) as c:
        c.rate_limit_nowait(WF, "k", 1, limit=1, period=1.0)
        c.rate_limit_nowait(WF, "k", 2, limit=1, period=1.0)
        with pytest.raises(ValueError, match="differs"):
            c.rate_limit_nowait(WF, "k", 3, limit=2, period=1.0)
    answered = [e.result.outcome.value for e in events if isinstance(e, PingAnswered)]
    assert answered == ["fire-immediate", "dropped"]
    assert [type(e.error) for e in events if isinstance(e, PingRejected)] == [ValueError]
