"""The Coordinator's API contract: validation, checkpoints, statistics, exit and errors."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import pytest
import trio
import trio.testing

import trio_debounce
from tests.harness.fires import Recorder
from trio_debounce import Coordinator, Fire, Outcome, open_coordinator
from trio_debounce._firing import Ledger

WF = "wf"


async def noop(fire: Fire) -> None:
    pass


# -------------------------------------------------------------------- validation

BAD_PINGS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"delay": -1.0}, ValueError, "-1.0"),
    ({"delay": math.nan}, ValueError, "nan"),
    ({"delay": math.inf}, ValueError, "inf"),
    ({"delay": "1"}, TypeError, "'1'"),
    ({"delay": None}, TypeError, "None"),
    ({"delay": True}, TypeError, "True"),
    ({"delay": 10**400}, ValueError, "finite"),
    ({"delay": 1.0, "max_delay": -2.0}, ValueError, "-2.0"),
    ({"delay": 1.0, "max_delay": math.inf}, ValueError, "inf"),
    ({"delay": 1.0, "max_delay": math.nan}, ValueError, "nan"),
    ({"delay": 1.0, "max_delay": "x"}, TypeError, "'x'"),
    ({"delay": 2.0, "max_delay": 1.0}, ValueError, "max_delay=1.0"),
    ({"delay": 1.0, "mode": "sideways"}, ValueError, "'sideways'"),
    ({"delay": 1.0, "mode": 3}, ValueError, "3"),
    ({"delay": 1.0, "run_id": ""}, ValueError, "''"),
    ({"delay": 1.0, "run_id": 7}, TypeError, "7"),
    ({"delay": 1.0, "on_fire": "not callable"}, TypeError, "'not callable'"),
    ({"delay": 1.0, "on_fire": print}, TypeError, "built-in function print"),
    ({"workflow": ""}, ValueError, "workflow"),
    ({"workflow": 5}, TypeError, "5"),
    ({"key": ""}, ValueError, "key"),
    ({"key": b"k"}, TypeError, "b'k'"),
    ({"key": None}, TypeError, "None"),
    ({"key": ["k"]}, TypeError, "['k']"),
    ({"workflow": {}}, TypeError, "{}"),
]


@pytest.mark.parametrize(("kwargs", "error", "named"), BAD_PINGS)
@pytest.mark.parametrize("existing_window", [False, True])
async def test_bad_input_raises_naming_the_value_and_changes_nothing(
    autojump_clock: trio.testing.MockClock,
    kwargs: dict[str, Any],
    error: type[Exception],
    named: str,
    existing_window: bool,
) -> None:
    recorder = Recorder()
    args: dict[str, Any] = {"workflow": WF, "key": "k", "delay": 1.0}
    args.update(kwargs)
    workflow, key = args.pop("workflow"), args.pop("key")
    async with open_coordinator(handlers={WF: recorder}) as c:
        if existing_window and (workflow, key) == (WF, "k"):
            await c.debounce(workflow, key, "first", delay=5.0)
        before = c.statistics()
        with pytest.raises(error, match=re.escape(named)):
            await c.debounce(workflow, key, "bad", **args)
        with pytest.raises(error, match=re.escape(named)):
            c.debounce_nowait(workflow, key, "bad", **args)
        assert c.statistics() == before
    assert all(f.payload == "first" for f in recorder.fires)


async def test_a_different_mode_on_an_open_window_raises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={WF: noop}) as c:
        await c.debounce(WF, "k", delay=5.0, mode="trailing")
        with pytest.raises(ValueError, match="'leading' differs from the mode 'trailing'"):
            await c.debounce(WF, "k", delay=5.0, mode="leading")
        r = await c.debounce(WF, "k", delay=5.0, mode=trio_debounce.Mode.TRAILING)
        assert r.ping_count == 2


async def test_no_handler_is_a_lookup_error_at_ping_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator() as c:
        with pytest.raises(LookupError, match="'wf'"):
            await c.debounce(WF, "k", delay=1.0)
        assert len(c) == 0
        await c.debounce(WF, "k", delay=1.0, on_fire=noop)
        # The window has a handler from its first ping; later pings need none.
        r = await c.debounce(WF, "k", delay=1.0)
        assert r.ping_count == 2


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"on_exit": "later"}, ValueError),
        ({"handlers": {"": noop}}, ValueError),
        ({"handlers": {WF: 42}}, TypeError),
        ({"handlers": {WF: None}}, TypeError),
        ({"on_error": "log"}, TypeError),
        ({"on_error": noop}, TypeError),  # async: it would never be awaited
        ({"handlers": 5}, TypeError),
    ],
)
async def test_open_coordinator_rejects_bad_options(
    kwargs: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        async with open_coordinator(**kwargs):
            pass  # pragma: no cover


async def test_set_handler_validates(autojump_clock: trio.testing.MockClock) -> None:
    async with open_coordinator() as c:
        with pytest.raises(TypeError, match="42"):
            c.set_handler(WF, 42)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="workflow"):
            c.set_handler("", noop)


def test_coordinator_has_no_public_constructor() -> None:
    with pytest.raises(TypeError, match="open_coordinator"):
        Coordinator()  # type: ignore[call-arg]
    assert Coordinator.__module__ == "trio_debounce"
    assert repr(trio_debounce.Mode.BOTH) == "<Mode.BOTH: 'both'>"
    assert str(trio_debounce.Outcome.COALESCE) == "coalesce"


async def test_results_and_fires_are_immutable(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        r = await c.debounce(WF, "k", delay=0.0)
        with pytest.raises(AttributeError):
            r.ping_count = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        recorder.fires[0].payload = 1  # type: ignore[misc]


# ------------------------------------------------------------------- handlers


async def test_latest_on_fire_wins_then_the_workflow_handler_at_fire_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[str] = []

    def named(name: str) -> trio_debounce.Handler:
        async def handler(fire: Fire) -> None:
            seen.append(f"{name}:{fire.key}")

        return handler

    async with open_coordinator(handlers={WF: named("registered")}) as c:
        await c.debounce(WF, "a", delay=1.0, on_fire=named("first"))
        await c.debounce(WF, "a", delay=1.0, on_fire=named("second"))
        await c.debounce(WF, "a", delay=1.0)  # None does not reset it
        await c.debounce(WF, "b", delay=1.0)
        c.set_handler(WF, named("replaced"))  # applies to open windows at fire time
    assert sorted(seen) == ["replaced:b", "second:a"]


async def test_handler_removed_before_fire_is_reported_not_silent(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[tuple[Fire, Exception]] = []
    async with open_coordinator(
        handlers={WF: noop}, on_error=lambda f, e: errors.append((f, e))
    ) as c:
        await c.debounce(WF, "k", "p", delay=1.0)
        c.set_handler(WF, None)
    assert c.statistics().handler_errors == 1
    [(fire, exc)] = errors
    assert isinstance(exc, LookupError)
    assert fire.payload == "p"
    assert "no handler" in caplog.text


async def test_handler_errors_are_logged_counted_and_reported(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    reported: list[tuple[str, str]] = []

    async def boom(fire: Fire) -> None:
        raise RuntimeError(f"boom {fire.key}")

    def on_error(fire: Fire, exc: Exception) -> None:
        reported.append((fire.key, str(exc)))
        if fire.key == "b":
            raise KeyError("the callback fails too")

    caplog.set_level(logging.ERROR, logger="trio_debounce")
    async with open_coordinator(handlers={"bad": boom, WF: recorder}, on_error=on_error) as c:
        await c.debounce("bad", "a", delay=1.0)
        await c.debounce("bad", "b", delay=1.0, mode="leading")
        await c.debounce(WF, "ok", delay=2.0)
    assert sorted(reported) == [("a", "boom a"), ("b", "boom b")]
    assert [f.key for f in recorder.fires] == ["ok"]  # other windows unaffected
    assert c.statistics().handler_errors == 2
    records = [r for r in caplog.records if r.name == "trio_debounce"]
    assert any(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in records)
    assert any("on_error callback raised" in r.getMessage() for r in records)


async def test_base_exceptions_from_handlers_propagate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Fatal(BaseException):
        pass

    async def fatal(fire: Fire) -> None:
        raise Fatal

    with pytest.raises(BaseExceptionGroup) as info:  # noqa: PT012
        async with open_coordinator(handlers={WF: fatal}) as c:
            await c.debounce(WF, "k", delay=1.0)
            await trio.sleep(5.0)
    assert info.group_contains(Fatal)


# ------------------------------------------------------------------ checkpoints


async def test_debounce_cancel_flush_are_checkpoints(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={WF: noop}) as c:
        with trio.testing.assert_checkpoints():
            await c.debounce(WF, "k", delay=1.0)
        with trio.testing.assert_checkpoints():
            await c.debounce(WF, "k", delay=1.0)
        with trio.testing.assert_checkpoints():
            await c.flush(WF, "k")
        with trio.testing.assert_checkpoints():
            await c.cancel(WF, "k")
        with trio.testing.assert_checkpoints():
            await c.wait_idle()
        with trio.testing.assert_no_checkpoints():
            c.debounce_nowait(WF, "j", delay=1.0)
            c.debounce_nowait(WF, "j", delay=1.0)


async def test_a_cancelled_caller_changes_no_state(autojump_clock: trio.testing.MockClock) -> None:
    async with open_coordinator(handlers={WF: noop}) as c:
        await c.debounce(WF, "open", delay=5.0)
        with trio.CancelScope() as scope:
            scope.cancel()
            await c.debounce(WF, "k", delay=1.0)
        assert scope.cancelled_caught
        assert not c.has(WF, "k")
        for method in (c.cancel, c.flush):
            with trio.CancelScope() as scope:
                scope.cancel()
                await method(WF, "open")
            assert c.has(WF, "open")
        assert c.statistics().pings == 1


async def test_once_taken_a_ping_returns_even_if_cancelled_meanwhile(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={WF: noop}) as c:
        with trio.CancelScope() as scope:
            # Cancel between the ping being taken and the trailing checkpoint: the
            # handler-free path must still return the result.
            original = c._local.ping

            def cancel_then_ping(*args: Any, **kwargs: Any) -> trio_debounce.DebounceResult:
                result = original(*args, **kwargs)
                scope.cancel()
                return result

            c._local.ping = cancel_then_ping  # type: ignore[method-assign]
            r = await c.debounce(WF, "k", delay=1.0)
            assert r.outcome is Outcome.SCHEDULE_TRAILING
            await trio.lowlevel.checkpoint()
            pytest.fail("not reached")  # pragma: no cover
        assert c.has(WF, "k")


# ---------------------------------------------------------- O(1) coalescing ping


async def test_a_coalescing_ping_spawns_nothing_and_leaves_the_scope_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={WF: noop}) as c:
        await c.debounce(WF, "k", delay=5.0)
        await trio.testing.wait_all_tasks_blocked()
        window = c._windows[(WF, "k")]
        scope = window.scope
        assert scope is not None
        deadline = scope.deadline
        tasks = len(c._nursery.child_tasks)
        for _ in range(100):  # 100 pings within the first deadline
            await trio.sleep(1 / 32)
            c.debounce_nowait(WF, "k", delay=5.0)
        # Only a move to an earlier time touches the scope.
        assert window.scope is scope
        assert scope.deadline == deadline
        assert len(c._nursery.child_tasks) == tasks
        c.debounce_nowait(WF, "k", delay=1.0)
        assert scope.deadline == trio.current_time() + 1.0


async def test_run_ids_are_generated_only_when_a_window_opens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={WF: noop}) as c:
        first = await c.debounce(WF, "k", delay=5.0)
        second = await c.debounce(WF, "k", delay=5.0, run_id="ignored")
        assert re.fullmatch(r"[0-9a-f]{32}", first.active_run_id)
        assert second.active_run_id == first.active_run_id
        other = await c.debounce(WF, "j", delay=5.0)
        assert other.active_run_id != first.active_run_id


# ----------------------------------------------------- inspection and statistics


async def test_has_len_statistics_and_wait_idle(autojump_clock: trio.testing.MockClock) -> None:
    recorder = Recorder(duration=3.0)
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "t", delay=2.0)
        await c.debounce(WF, "t", delay=2.0)
        await c.debounce(WF, "l", delay=10.0, mode="leading")
        await c.debounce(WF, "b", delay=2.0, mode="both")
        await c.debounce(WF, "b", delay=2.0, mode="both")
        await c.debounce(WF, "x", delay=2.0)
        assert await c.cancel(WF, "x")
        assert (c.has(WF, "t"), c.has(WF, "l"), c.has(WF, "x")) == (True, True, False)
        assert len(c) == 3
        await trio.testing.wait_all_tasks_blocked()
        assert c.statistics() == trio_debounce.CoordinatorStatistics(
            open_windows=3,
            pending_trailing_fires=2,
            running_handlers=2,  # the leading fires of "l" and "b"
            pings=6,
            coalesced=2,
            fires=2,
            cancelled=1,
            handler_errors=0,
        )
        await c.wait_idle()
        # t and b fire at t0+2 and run 3 s; the leading window l stays open.
        assert trio.current_time() == t0 + 5.0
        stats = c.statistics()
        assert (stats.open_windows, stats.pending_trailing_fires, stats.running_handlers) == (
            1,
            0,
            0,
        )
        assert stats.fires == 4
        assert c.has(WF, "l")
    # leading-only windows are closed at exit, not waited for
    assert trio.current_time() == t0 + 5.0
    assert c.statistics().open_windows == 0


# ------------------------------------------------------------------------ exit


async def test_exit_waits_for_pending_trailing_fires_at_their_times(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(duration=1.0)
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", 1, delay=7.0)
        await c.debounce(WF, "l", 2, delay=100.0, mode="leading")
    assert recorder.summary() == [(t0, "l", 2, 1, "leading"), (t0 + 7.0, "k", 1, 1, "trailing")]
    assert trio.current_time() == t0 + 8.0  # the fire at +7, then its 1 s handler


async def test_exit_with_on_exit_flush_fires_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}, on_exit="flush") as c:
        await c.debounce(WF, "k", 1, delay=7.0)
        await c.debounce(WF, "b", 2, delay=7.0, mode="both")
        await trio.sleep(1.0)
    assert sorted(recorder.summary()) == [
        (t0, "b", 2, 1, "leading"),
        (t0 + 1.0, "k", 1, 1, "trailing"),
    ]
    assert trio.current_time() == t0 + 1.0


async def test_exit_with_on_exit_cancel_drops_pending_fires_but_finishes_handlers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(duration=2.0)
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}, on_exit="cancel") as c:
        await c.debounce(WF, "k", 1, delay=7.0)
        await c.debounce(WF, "l", 2, delay=7.0, mode="leading")
    assert recorder.summary() == [(t0, "l", 2, 1, "leading")]
    assert trio.current_time() == t0 + 2.0
    assert c.statistics().cancelled == 1


async def test_body_exception_propagates_as_itself_and_drops_pending(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(duration=10.0)
    t0 = trio.current_time()
    with pytest.raises(KeyError) as info:  # noqa: PT012
        async with open_coordinator(handlers={WF: recorder}) as c:
            await c.debounce(WF, "k", delay=1.0)
            await c.debounce(WF, "l", delay=1.0, mode="leading")
            raise KeyError("from the body")
    assert type(info.value) is KeyError
    assert trio.current_time() == t0  # nothing waited for; the running handler is cancelled
    assert [f.key for f in recorder.fires] == ["l"]
    assert c.statistics().cancelled == 1


async def test_cancelled_from_outside_drops_pending(autojump_clock: trio.testing.MockClock) -> None:
    recorder = Recorder()
    t0 = trio.current_time()
    with trio.move_on_after(3.0) as scope:
        async with open_coordinator(handlers={WF: recorder}) as c:
            await c.debounce(WF, "k", delay=10.0)
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert trio.current_time() == t0 + 3.0
    assert recorder.fires == []
    # also while the exit is waiting for a pending fire
    with trio.move_on_after(3.0) as scope:
        async with open_coordinator(handlers={WF: recorder}) as c:
            await c.debounce(WF, "k", delay=10.0)
    assert scope.cancelled_caught
    assert recorder.fires == []


async def test_methods_after_exit(autojump_clock: trio.testing.MockClock) -> None:
    async with open_coordinator(handlers={WF: noop}) as c:
        await c.debounce(WF, "k", delay=1.0)
    with pytest.raises(trio.ClosedResourceError):
        await c.debounce(WF, "k", delay=1.0)
    with pytest.raises(trio.ClosedResourceError):
        c.debounce_nowait(WF, "k", delay=1.0)
    with pytest.raises(trio.ClosedResourceError):
        await c.cancel(WF, "k")
    with pytest.raises(trio.ClosedResourceError):
        await c.flush(WF, "k")
    assert not c.has(WF, "k")
    assert len(c) == 0
    assert c.statistics().fires == 1
    await c.wait_idle()
    assert "closed" in repr(c)


async def test_wait_idle_outside_the_block_returns_when_the_body_raises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    woke: list[float] = []

    async def waiter(c: Coordinator) -> None:
        await c.wait_idle()
        woke.append(trio.current_time())

    t0 = trio.current_time()
    with trio.fail_after(100):  # a lost wake-up would hang the waiter
        async with trio.open_nursery() as outer:
            with pytest.raises(KeyError):  # noqa: PT012
                async with open_coordinator(handlers={WF: noop}) as c:
                    await c.debounce(WF, "k", delay=10.0)
                    outer.start_soon(waiter, c)
                    await trio.testing.wait_all_tasks_blocked()
                    raise KeyError("boom")
    assert woke == [t0]


@pytest.mark.parametrize("method", ["cancel", "flush"])
@pytest.mark.parametrize(
    ("workflow", "key", "error"), [("", "k", ValueError), (WF, ["k"], TypeError)]
)
async def test_cancel_and_flush_validate_names(
    autojump_clock: trio.testing.MockClock, method: str, workflow: Any, key: Any, error: type
) -> None:
    async with open_coordinator(handlers={WF: noop}) as c:
        with pytest.raises(error):
            await getattr(c, method)(workflow, key)


async def test_at_abort_due_and_flushed_fires_start_and_future_ones_are_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Decided by time, whatever order the scheduler runs the tasks in: repeat to give
    # the randomised scheduler its chances.
    for _ in range(20):
        started: list[str] = []

        async def handler(fire: Fire, started: list[str] = started) -> None:
            started.append(fire.key)
            await trio.sleep(1.0)

        with pytest.raises(RuntimeError):  # noqa: PT012
            async with open_coordinator(handlers={WF: handler}) as c:
                c.debounce_nowait(WF, "flushed", delay=10.0)
                assert await c.flush(WF, "flushed")
                r = c.debounce_nowait(WF, "due", delay=1.0)
                c.debounce_nowait(WF, "future", delay=5.0)
                assert r.scheduled_at is not None
                await trio.sleep_until(r.scheduled_at)  # "due" is due now
                raise RuntimeError
        assert sorted(started) == ["due", "flushed"]
        stats = c.statistics()
        assert (stats.fires, stats.cancelled) == (2, 1)
        assert (stats.pending_trailing_fires, stats.running_handlers) == (0, 0)
        with trio.fail_after(1):
            await c.wait_idle()


@pytest.mark.parametrize("on_exit", ["flush", "cancel"])
async def test_pings_made_by_handlers_during_exit_follow_on_exit(
    autojump_clock: trio.testing.MockClock, on_exit: trio_debounce.OnExit
) -> None:
    fired: list[tuple[str, float]] = []
    t0 = trio.current_time()

    async def chain(fire: Fire) -> None:
        fired.append((fire.key, fire.fired_at))
        if fire.key == "first":
            c.debounce_nowait(WF, "second", delay=3600.0)
            c.debounce_nowait(WF, "both", delay=3600.0, mode="both")
            c.debounce_nowait(WF, "both", delay=3600.0, mode="both")

    async with open_coordinator(handlers={WF: chain}, on_exit=on_exit) as c:
        await c.debounce(WF, "first", delay=3600.0, mode="leading")
    assert trio.current_time() == t0
    if on_exit == "flush":
        assert sorted(fired) == [("both", t0), ("both", t0), ("first", t0), ("second", t0)]
    else:
        assert sorted(fired) == [("both", t0), ("first", t0)]  # leading fires only
        assert c.statistics().cancelled == 2


async def test_an_exception_during_the_exit_wait_propagates_as_itself(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def interrupted_drain(self: Coordinator, on_exit: str) -> None:
        await trio.sleep(1.0)
        raise KeyboardInterrupt

    monkeypatch.setattr(Coordinator, "_drain", interrupted_drain)
    recorder = Recorder()
    with pytest.raises(KeyboardInterrupt):
        async with open_coordinator(handlers={WF: recorder}) as c:
            await c.debounce(WF, "k", delay=10.0)
    assert recorder.fires == []
    assert c.statistics().cancelled == 1


async def test_has_is_false_for_anything_but_an_open_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={WF: noop}) as c:
        await c.debounce(WF, "k", delay=1.0)
        assert c.has(WF, "k")
        assert not c.has(1, 2)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=re.escape("['k']")):
            c.has(WF, ["k"])  # type: ignore[arg-type]


async def test_the_block_error_is_kept_when_a_task_raises_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Fatal(BaseException):
        pass

    async def fatal_on_cancel(fire: Fire) -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise Fatal  # a BaseException escaping a handler's cleanup

    with pytest.raises(BaseExceptionGroup) as info:  # noqa: PT012
        async with open_coordinator(handlers={WF: fatal_on_cancel}) as c:
            await c.debounce(WF, "k", delay=1.0, mode="leading")
            await trio.testing.wait_all_tasks_blocked()
            raise ValueError("from the body")
    assert info.group_contains(ValueError, depth=1)
    assert info.group_contains(Fatal)


async def test_bookkeeping_is_ki_protected_and_user_code_is_not(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, list[bool]] = {"handler": [], "on_error": [], "bookkeeping": []}
    original = Ledger.check_idle

    def spy(self: Ledger) -> None:
        seen["bookkeeping"].append(trio.lowlevel.currently_ki_protected())
        original(self)

    monkeypatch.setattr(Ledger, "check_idle", spy)

    async def handler(fire: Fire) -> None:
        seen["handler"].append(trio.lowlevel.currently_ki_protected())
        raise RuntimeError

    def on_error(fire: Fire, exc: Exception) -> None:
        seen["on_error"].append(trio.lowlevel.currently_ki_protected())

    async with open_coordinator(handlers={WF: handler}, on_error=on_error) as c:
        await c.debounce(WF, "t", delay=1.0)
        await c.debounce(WF, "l", delay=1.0, mode="leading")
        await c.debounce(WF, "x", delay=1.0)
        await c.cancel(WF, "x")
    assert seen["handler"] == [False, False]
    assert seen["on_error"] == [False, False]
    assert seen["bookkeeping"]
    assert all(seen["bookkeeping"])


async def test_a_sync_handler_is_reported_when_it_fires(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[Exception] = []

    def sync_handler(fire: Fire) -> None:
        pass

    async def real(fire: Fire) -> None:
        pass

    async with open_coordinator(on_error=lambda f, e: errors.append(e)) as c:
        await c.debounce(WF, "sync", delay=1.0, on_fire=sync_handler)  # type: ignore[arg-type]
        # a sync lambda that returns a coroutine is a valid async callable
        await c.debounce(WF, "wrapped", delay=1.0, on_fire=lambda fire: real(fire))
    [exc] = errors
    assert isinstance(exc, TypeError)
    assert "async def" in str(exc)
    assert c.statistics().handler_errors == 1


@pytest.mark.parametrize("on_exit", ["wait", "flush", "cancel"])
async def test_an_outside_cancel_during_the_exit_settles_every_pending_fire(
    autojump_clock: trio.testing.MockClock, on_exit: trio_debounce.OnExit
) -> None:
    # The outer cancellation reaches the windows' tasks directly, possibly before the
    # block's own abort runs: every pending fire must still be settled exactly once.
    for _ in range(20):
        recorder = Recorder()
        with trio.CancelScope() as outer:
            async with open_coordinator(handlers={WF: recorder}, on_exit=on_exit) as c:
                await c.debounce(WF, "b", delay=2.0, mode="both")
                await c.debounce(WF, "b", delay=2.0, mode="both")
                await c.debounce(WF, "t", delay=2.0)
                outer.cancel()
        stats = c.statistics()
        assert (stats.pending_trailing_fires, stats.running_handlers) == (0, 0)
        trailing = [f for f in recorder.fires if f.edge is trio_debounce.Edge.TRAILING]
        assert len(trailing) + stats.cancelled == 2  # each: started or dropped, once
        with trio.fail_after(1):
            await c.wait_idle()


def test_the_kv_contract_is_public_in_abc() -> None:
    # The store a custom backend implements is a contract: its home is the abc
    # module; trio_debounce.testing, where it was first exported, still has it.
    import trio_debounce.abc
    import trio_debounce.testing

    for name in ("KvStore", "KvEntry"):
        cls = getattr(trio_debounce.abc, name)
        assert cls.__module__ == "trio_debounce.abc"
        assert getattr(trio_debounce.testing, name) is cls
