"""``overlap="queue-latest"`` for audit and batch in one process (issue 20, rule 6): a
window due while its key's run executes waits for it, taking pings, and fires at the
run's end (reason ``run-end``) or at its ``run_timeout``; throttles with a leading
edge and rate limits refuse it. The fire-by-fire comparison with the reference model
is tests/local/test_flow_properties.py."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Recorder
from trio_debounce import Coordinator, Outcome, open_coordinator

WF = "wf"
QUEUE: Any = "queue-latest"


class SlowLog(Recorder):
    """A handler that takes ``duration`` seconds; records fires and overlaps."""

    def rows(self) -> list[tuple[float, Any, int, str]]:
        return [(f.fired_at, f.payload, f.ping_count, f.reason.value) for f in self.fires]


async def audit(c: Coordinator, payload: Any, **kw: Any) -> Any:
    return await c.throttle(WF, "k", payload, interval=1.0, leading=False, overlap=QUEUE, **kw)


async def test_an_audit_due_during_its_keys_run_waits_and_fires_at_the_runs_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = SlowLog(3.0)
    async with open_coordinator(handlers={WF: log}) as c:
        await audit(c, 0)  # fires at 1.0; its run takes until 4.0
        await trio.sleep(1.5)
        r = await audit(c, 1)  # t=1.5: a window due at 2.5, while the run executes
        assert r.outcome is Outcome.SCHEDULE_TRAILING
        assert r.scheduled_at == 2.5
        await trio.sleep(1.5)
        r = await audit(c, 2)  # t=3.0: the window waits; the ping joins it
        assert (r.outcome, r.scheduled_at, r.ping_count) == (Outcome.COALESCE, None, 2)
        assert c.has(WF, "k")
    assert log.rows() == [(1.0, 0, 1, "interval"), (4.0, 2, 2, "run-end")]
    assert log.max_running == 1


async def test_without_queue_latest_the_same_audit_overlaps_its_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The control of the test above: the second fire is at its interval, not held.
    log = SlowLog(3.0)
    async with open_coordinator(handlers={WF: log}) as c:
        await c.throttle(WF, "k", 0, interval=1.0, leading=False)
        await trio.sleep(1.5)
        await c.throttle(WF, "k", 1, interval=1.0, leading=False)
    assert log.rows() == [(1.0, 0, 1, "interval"), (2.5, 1, 1, "interval")]
    assert log.max_running == 2


async def test_a_run_timeout_ends_the_wait_and_the_next_run_overlaps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = SlowLog(3.0)
    async with open_coordinator(handlers={WF: log}) as c:
        await audit(c, 0, run_timeout=2.0)  # fires at 1.0; blocks until 3.0
        await trio.sleep(1.5)
        await audit(c, 1, run_timeout=2.0)  # due at 2.5, waits until 3.0
    assert log.rows() == [(1.0, 0, 1, "interval"), (3.0, 1, 1, "run-end")]
    assert log.max_running == 2


async def test_audit_fires_stay_an_interval_apart_on_their_logical_times(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Rule 6: spacing is measured on fire times, not on handler ends. Pings every
    # 0.25 s for 6 s; each run takes 0.6 s, less than the interval, so nothing waits.
    log = SlowLog(0.6)
    async with open_coordinator(handlers={WF: log}) as c:
        for n in range(25):
            await audit(c, n)
            await trio.sleep(0.25)
    times = [f.fired_at for f in log.fires]
    assert times == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert all(f.reason.value == "interval" for f in log.fires)
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(times))


async def test_a_batch_waits_for_its_keys_run_taking_items_and_stays_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = SlowLog(10.0)
    async with open_coordinator(handlers={WF: log}) as c:

        async def item(n: int) -> Any:
            return await c.batch(WF, "k", n, max_wait=1.0, max_items=3, overlap=QUEUE)

        await item(0)
        await trio.sleep(1.0)  # max_wait: fires [0] at 1.0; its run takes until 11.0
        await item(1)  # t=1.0: the next batch, due at 2.0, waits
        await trio.sleep(1.5)
        await item(2)
        r = await item(3)  # the 3rd item: full, still held back by the run
        assert (r.outcome, r.scheduled_at, r.ping_count) == (Outcome.COALESCE, None, 3)
        assert len(log.fires) == 1
        r = await item(4)  # it cannot hold a 4th: it fires now, and 4 opens the next
        assert r.outcome is Outcome.SCHEDULE_TRAILING
        assert r.ping_count == 1
        await trio.testing.wait_all_tasks_blocked()
        assert log.rows()[-1] == (2.5, [1, 2, 3], 3, "max-items")
    assert log.rows() == [
        (1.0, [0], 1, "max-wait"),
        (2.5, [1, 2, 3], 3, "max-items"),
        (12.5, [4], 1, "run-end"),  # due at 3.5, held by the run of [1, 2, 3]
    ]
    assert all(len(f.payload) <= 3 for f in log.fires)


async def test_a_waiting_batch_fires_before_an_item_past_max_bytes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = SlowLog(10.0)
    async with open_coordinator(handlers={WF: log}) as c:

        async def item(n: str) -> Any:
            return await c.batch(WF, "k", n, max_wait=1.0, max_bytes=12, overlap=QUEUE)

        await item("a")  # 3 bytes as JSON; fires at 1.0, runs until 11.0
        await trio.sleep(1.0)
        await item("bbb")  # 5 bytes; due at 2.0, waits
        await trio.sleep(1.5)
        await item("cccc")  # 6 bytes: 11 in all
        await item("d")  # 3 more would be 14: the batch fires now, "d" opens the next
    assert [row[1:] for row in log.rows()] == [
        (["a"], 1, "max-wait"),
        (["bbb", "cccc"], 2, "max-bytes"),
        (["d"], 1, "run-end"),
    ]
    assert log.rows()[1][0] == 2.5


async def test_a_flush_of_a_waiting_window_waits_and_a_cancel_drops_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = SlowLog(3.0)
    async with open_coordinator(handlers={WF: log}) as c:
        await audit(c, 0)  # fires at 1.0, runs until 4.0
        await trio.sleep(1.5)
        await audit(c, 1)
        assert await c.flush(WF, "k")  # due now, but the run blocks it: it waits
        assert len(log.fires) == 1
        await trio.sleep(1.0)
        await audit(c, 2)
        await trio.sleep(10.0)  # fires at 4.0 with both pings
        await audit(c, 3)  # t=12.5: no run executes; due at 13.5
        await trio.sleep(1.0)  # fires at 13.5, runs until 16.5
        await audit(c, 4)
        await trio.sleep(1.5)  # due at 14.5: waits
        assert await c.cancel(WF, "k")  # dropped: the run's end fires nothing
        assert not c.has(WF, "k")
    assert log.rows() == [
        (1.0, 0, 1, "interval"),
        (4.0, 2, 2, "run-end"),
        (13.5, 3, 1, "interval"),
    ]
    assert c.statistics().cancelled == 1


@pytest.mark.parametrize("on_exit", ["wait", "flush"])
async def test_the_exit_waits_for_the_run_then_fires_the_waiting_window(
    autojump_clock: trio.testing.MockClock, on_exit: Any
) -> None:
    log = SlowLog(3.0)
    async with open_coordinator(handlers={WF: log}, on_exit=on_exit) as c:
        await audit(c, 0)
        await trio.sleep(1.5)
        await audit(c, 1)  # due at 2.5 (or at the exit's flush, 1.5): waits
    assert log.rows() == [(1.0, 0, 1, "interval"), (4.0, 1, 1, "run-end")]
    assert log.max_running == 1


async def test_an_abort_drops_a_waiting_window(autojump_clock: trio.testing.MockClock) -> None:
    log = SlowLog(3.0)
    coordinators = []

    async def body() -> None:
        async with open_coordinator(handlers={WF: log}) as c:
            coordinators.append(c)
            await audit(c, 0)  # fires at 1.0, runs until 4.0
            await trio.sleep(3.25)
            await audit(c, 1)  # t=3.25: due at 4.25, after the run: fires, until 7.25
            await trio.sleep(1.5)
            await audit(c, 2)  # t=4.75: due at 5.75, waits for the run
            await trio.sleep(1.25)
            raise KeyError("body failed")  # t=6.0: the waiting fire is dropped

    with pytest.raises(KeyError):
        await body()
    [c] = coordinators
    assert log.rows() == [(1.0, 0, 1, "interval"), (4.25, 1, 1, "interval")]
    assert c.statistics().cancelled == 1


@pytest.mark.parametrize(
    ("call", "match"),
    [
        ({"method": "throttle"}, "throttle\\(leading=False\\)"),
        ({"method": "throttle", "trailing": False}, "throttle\\(leading=False\\)"),
        ({"method": "rate_limit"}, "rate_limit"),
        ({"method": "throttle", "leading": False, "overlap": "queue"}, "'queue'"),
        ({"method": "batch", "overlap": "allow", "run_timeout": 1.0}, "run_timeout"),
        ({"method": "batch", "run_timeout": -1.0}, "run_timeout"),
    ],
)
async def test_queue_latest_is_refused_where_a_fire_is_leading_and_bad_values_are_named(
    autojump_clock: trio.testing.MockClock, call: dict[str, Any], match: str
) -> None:
    kw = dict(call)
    method = kw.pop("method")
    kw.setdefault("overlap", QUEUE)
    if method == "throttle":
        kw["interval"] = 1.0
    elif method == "rate_limit":
        kw.update(limit=2, period=1.0)
    else:
        kw["max_wait"] = 1.0
    async with open_coordinator(handlers={WF: SlowLog(0.0)}) as c:
        with pytest.raises(ValueError, match=match):
            await getattr(c, method)(WF, "k", 0, **kw)
        assert not c.has(WF, "k")
        assert c.statistics().pings == 0


async def test_a_ping_with_another_overlap_clashes_with_the_open_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={WF: SlowLog(0.0)}) as c:
        await audit(c, 0)
        with pytest.raises(ValueError, match="queue-latest"):
            await c.throttle(WF, "k", 1, interval=1.0, leading=False)
        with pytest.raises(ValueError, match=r"run_timeout=2\.0"):
            await audit(c, 1, run_timeout=2.0)
        with pytest.raises(ValueError, match="queue-latest"):
            c.throttle_nowait(WF, "k", 1, interval=1.0, leading=False)
        assert c.statistics().pings == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"run_timeout": True},
        {"leading": 0},
        {"trailing": 1},
    ],
)
async def test_an_ill_typed_argument_equal_to_the_open_windows_is_refused(
    autojump_clock: trio.testing.MockClock, bad: dict[str, Any]
) -> None:
    # True == 1 == 1.0: the fast path into an open window, which compares the raw
    # arguments with the window's, must not take an ill-typed value that compares equal.
    kw: dict[str, Any] = {"interval": 1.0, "leading": False, "trailing": True}
    if "run_timeout" in bad:
        kw.update(overlap=QUEUE, run_timeout=1.0)
    else:
        kw["leading"] = True
    async with open_coordinator(handlers={WF: SlowLog(0.0)}) as c:
        c.throttle_nowait(WF, "k", 0, **kw)
        with pytest.raises(TypeError, match=repr(next(iter(bad.values())))):
            c.throttle_nowait(WF, "k", 1, **{**kw, **bad})
        with pytest.raises(TypeError):
            await c.throttle(WF, "k", 1, **{**kw, **bad})
        if "run_timeout" in bad:
            c.batch_nowait(WF, "b", 0, max_wait=1.0, overlap=QUEUE, run_timeout=1.0)
            with pytest.raises(TypeError, match="True"):
                c.batch_nowait(WF, "b", 1, max_wait=1.0, overlap=QUEUE, run_timeout=True)
        assert c.statistics().pings == 1 + ("run_timeout" in bad)


async def test_a_negative_run_timeout_is_refused_as_not_above_zero(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={WF: SlowLog(0.0)}) as c:
        with pytest.raises(ValueError, match="run_timeout must be > 0, got -1"):
            await audit(c, 0, run_timeout=-1)
