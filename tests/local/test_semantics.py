"""Named tests, one or more per rule of the foundation issue, to the float on MockClock."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.harness.fires import Recorder
from trio_debounce import DebounceResult, Edge, Fire, Mode, Outcome, open_coordinator

WF = "wf"


# ----------------------------------------------------------------------- trailing


async def test_trailing_single_ping_fires_after_delay(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        r = await c.debounce(WF, "k", "p", delay=5.0, run_id="r1")
        assert r == DebounceResult(Outcome.SCHEDULE_TRAILING, "r1", t0 + 5.0, 1)
    [fire] = recorder.fires
    assert (fire.fired_at, fire.payload, fire.ping_count, fire.edge) == (
        t0 + 5.0,
        "p",
        1,
        Edge.TRAILING,
    )
    assert (fire.workflow, fire.key, fire.run_id, fire.first_ping_at) == (WF, "k", "r1", t0)
    assert trio.current_time() - t0 == 5.0


async def test_trailing_latest_payload_wins_and_silence_is_from_last_ping(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(4):
            r = await c.debounce(WF, "k", i, delay=2.0, run_id=f"r{i}")
            assert r.active_run_id == "r0"
            assert r.ping_count == i + 1
            assert r.outcome is (Outcome.SCHEDULE_TRAILING if i == 0 else Outcome.COALESCE)
            assert r.scheduled_at == trio.current_time() + 2.0
            await trio.sleep(1.5)
    assert recorder.summary() == [(t0 + 4.5 + 2.0, "k", 3, 4, "trailing")]
    assert recorder.fires[0].run_id == "r0"


async def test_trailing_max_delay_caps_latency_from_first_ping(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        results = []
        for i in range(10):
            results.append(await c.debounce(WF, "k", i, delay=2.0, max_delay=5.0))
            await trio.sleep(1.0)
    # pings at t0..t0+4 land in the window (deadline capped at t0+5); the ping at
    # t0+5 opens the next window, which then runs to t0+9 + 2 = t0+11 (< t0+5+5).
    assert [r.scheduled_at for r in results[:5]] == [t0 + 2, t0 + 3, t0 + 4, t0 + 5, t0 + 5]
    assert results[5].outcome is Outcome.SCHEDULE_TRAILING
    assert recorder.summary() == [(t0 + 5, "k", 4, 5, "trailing"), (t0 + 10, "k", 9, 5, "trailing")]


async def test_max_delay_equal_to_delay_is_a_fixed_window(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(7):
            await c.debounce(WF, "k", i, delay=3.0, max_delay=3.0)
            await trio.sleep(1.0)
    assert recorder.summary() == [
        (t0 + 3, "k", 2, 3, "trailing"),
        (t0 + 6, "k", 5, 3, "trailing"),
        (t0 + 9, "k", 6, 1, "trailing"),
    ]


async def test_shorter_delay_moves_the_deadline_earlier(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", "long", delay=100.0)
        await trio.sleep(1.0)
        r = await c.debounce(WF, "k", "short", delay=2.0)
        assert r.scheduled_at == t0 + 3.0
    assert recorder.summary() == [(t0 + 3.0, "k", "short", 2, "trailing")]


async def test_later_max_delay_is_ignored(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", 1, delay=2.0, max_delay=3.0)
        await trio.sleep(1.0)
        r = await c.debounce(WF, "k", 2, delay=2.0, max_delay=100.0)
        await trio.sleep(1.0)
        r = await c.debounce(WF, "k", 3, delay=2.0)
        assert r.scheduled_at == t0 + 3.0
    assert recorder.summary() == [(t0 + 3.0, "k", 3, 3, "trailing")]


# ------------------------------------------------------------------------ leading


async def test_leading_fires_at_once_drops_the_rest_and_closes_silently(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        r = await c.debounce(WF, "k", 0, delay=2.0, mode="leading", run_id="a")
        assert r == DebounceResult(Outcome.FIRE_IMMEDIATE, "a", None, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert recorder.summary() == [(t0, "k", 0, 1, "leading")]
        for i in (1, 2, 3):
            await trio.sleep(1.5)  # silence is measured from the last ping
            r = await c.debounce(WF, "k", i, delay=2.0, mode=Mode.LEADING, run_id="b")
            assert r == DebounceResult(Outcome.COALESCE, "a", None, i + 1)
        assert c.has(WF, "k")
        await trio.sleep(2.0)  # the window closes at t0 + 4.5 + 2 without firing
        assert not c.has(WF, "k")
        await trio.testing.wait_all_tasks_blocked()
        assert len(c) == 0
        r = await c.debounce(WF, "k", 4, delay=2.0, mode="leading", run_id="c")
        assert r.outcome is Outcome.FIRE_IMMEDIATE
    assert recorder.summary() == [(t0, "k", 0, 1, "leading"), (t0 + 6.5, "k", 4, 1, "leading")]
    assert [f.run_id for f in recorder.fires] == ["a", "c"]


async def test_leading_window_closes_at_max_delay(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(6):
            await c.debounce(WF, "k", i, delay=2.0, max_delay=3.0, mode="leading")
            await trio.sleep(1.0)
    assert recorder.summary() == [(t0, "k", 0, 1, "leading"), (t0 + 3, "k", 3, 1, "leading")]


# --------------------------------------------------------------------------- both


async def test_both_fires_leading_and_trailing_sharing_the_run_id(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        r = await c.debounce(WF, "k", 0, delay=2.0, mode="both", run_id="a")
        assert r == DebounceResult(Outcome.FIRE_IMMEDIATE, "a", None, 1)
        await trio.sleep(1.0)
        r = await c.debounce(WF, "k", 1, delay=2.0, mode="both", run_id="b")
        assert r == DebounceResult(Outcome.COALESCE, "a", t0 + 3.0, 2)
    assert recorder.summary() == [(t0, "k", 0, 1, "leading"), (t0 + 3.0, "k", 1, 2, "trailing")]
    assert {f.run_id for f in recorder.fires} == {"a"}


async def test_both_with_a_single_ping_fires_only_the_leading_edge(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", 0, delay=2.0, mode="both")
        assert c.statistics().pending_trailing_fires == 0
        await trio.sleep(5.0)
        assert not c.has(WF, "k")
    assert recorder.summary() == [(t0, "k", 0, 1, "leading")]


# -------------------------------------------------------------------- time rules


async def test_ping_at_the_deadline_opens_a_new_window_even_before_the_old_task_runs(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", "old", delay=2.0, max_delay=10.0, run_id="old")
        await c.debounce(WF, "k", "old2", delay=2.0, run_id="x")
        # Jump the clock to the deadline by hand: no task runs in between, so the old
        # window's task has not run when the ping lands.
        autojump_clock.jump(2.0)
        assert not c.has(WF, "k")
        assert len(c) == 1  # due, but its task has not run yet
        r = c.debounce_nowait(WF, "k", "new", delay=2.0, run_id="new")
        assert r == DebounceResult(Outcome.SCHEDULE_TRAILING, "new", t0 + 4.0, 1)
    assert sorted(recorder.summary()) == [
        (t0 + 2.0, "k", "old2", 2, "trailing"),
        (t0 + 4.0, "k", "new", 1, "trailing"),
    ]
    new = next(f for f in recorder.fires if f.run_id == "new")
    assert new.first_ping_at == t0 + 2.0  # nothing of the old window leaks


async def test_ping_during_a_running_handler_opens_a_new_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(duration=10.0)
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", 1, delay=1.0)
        await trio.sleep(2.0)
        assert recorder.running == 1
        r = await c.debounce(WF, "k", 2, delay=1.0)
        assert (r.outcome, r.ping_count) == (Outcome.SCHEDULE_TRAILING, 1)
    # The second run starts while the first still runs: runs of one key may overlap.
    assert recorder.summary() == [(t0 + 1, "k", 1, 1, "trailing"), (t0 + 3, "k", 2, 1, "trailing")]
    assert recorder.max_running == 2


async def test_zero_delay_makes_every_ping_its_own_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    for mode in Mode:
        recorder = Recorder()
        t0 = trio.current_time()
        async with open_coordinator(handlers={WF: recorder}) as c:
            for i in range(3):
                r = await c.debounce(WF, "k", i, delay=0.0, mode=mode)
                assert r.ping_count == 1
                assert r.outcome is not Outcome.COALESCE
        edge = "trailing" if mode is Mode.TRAILING else "leading"
        assert sorted(recorder.summary(), key=lambda s: str(s[2])) == [
            (t0, "k", i, 1, edge) for i in range(3)
        ]


async def test_keys_and_workflows_are_independent(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={"a": recorder, "b": recorder}) as c:
        await c.debounce("a", "k", 1, delay=1.0)
        await c.debounce("b", "k", 2, delay=2.0)
        await c.debounce("a", "j", 3, delay=3.0)
        assert len(c) == 3
    assert sorted((f.fired_at, f.workflow, f.key) for f in recorder.fires) == [
        (t0 + 1, "a", "k"),
        (t0 + 2, "b", "k"),
        (t0 + 3, "a", "j"),
    ]


async def test_wall_clock_jumps_change_nothing(
    autojump_clock: trio.testing.MockClock, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    real_time = time.time
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", 1, delay=5.0)
        monkeypatch.setattr(time, "time", lambda: real_time() + 86400.0)
        await trio.sleep(1.0)
        await c.debounce(WF, "k", 2, delay=5.0)
        monkeypatch.setattr(time, "time", lambda: real_time() - 86400.0)
    assert recorder.summary() == [(t0 + 6.0, "k", 2, 2, "trailing")]


# ---------------------------------------------------------------- cancel / flush


async def test_cancel_closes_without_firing(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", 1, delay=5.0)
        assert await c.cancel(WF, "k") is True
        assert await c.cancel(WF, "k") is False
        assert await c.cancel(WF, "never") is False
        assert not c.has(WF, "k")
        assert c.statistics().cancelled == 1
    assert recorder.fires == []


async def test_cancel_of_a_leading_window_lets_the_next_ping_fire_at_once(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", 1, delay=5.0, mode="leading")
        await c.debounce(WF, "k", 2, delay=5.0, mode="leading")
        assert await c.cancel(WF, "k") is True
        r = await c.debounce(WF, "k", 3, delay=5.0, mode="leading")
        assert r.outcome is Outcome.FIRE_IMMEDIATE
    assert [f.payload for f in recorder.fires] == [1, 3]  # the leading fire is not undone


async def test_flush_fires_now_with_the_latest_payload(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", 1, delay=5.0, run_id="r")
        await trio.sleep(1.0)
        await c.debounce(WF, "k", 2, delay=5.0)
        await trio.sleep(1.0)
        assert await c.flush(WF, "k") is True
        assert not c.has(WF, "k")
        assert await c.flush(WF, "k") is False
        await trio.testing.wait_all_tasks_blocked()
        assert recorder.summary() == [(t0 + 2.0, "k", 2, 2, "trailing")]
    assert len(recorder.fires) == 1
    assert recorder.fires[0].run_id == "r"


async def test_flush_without_a_pending_trailing_fire_closes_and_returns_false(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "lead", 1, delay=5.0, mode="leading")
        await c.debounce(WF, "lead", 2, delay=5.0, mode="leading")
        await c.debounce(WF, "both", 3, delay=5.0, mode="both")
        assert await c.flush(WF, "lead") is False
        assert await c.flush(WF, "both") is False
        assert len(c) == 0
        r = await c.debounce(WF, "lead", 4, delay=5.0, mode="leading")
        assert r.outcome is Outcome.FIRE_IMMEDIATE
    assert sorted(f.payload for f in recorder.fires) == [1, 3, 4]


async def test_cancel_and_flush_at_the_deadline_return_false_and_the_fire_happens(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "a", "a", delay=2.0)
        await c.debounce(WF, "b", "b", delay=2.0)
        autojump_clock.jump(2.0)  # at the deadline, before the windows' tasks run
        assert await c.cancel(WF, "a") is False
        assert await c.flush(WF, "b") is False
    assert sorted(recorder.summary()) == [
        (t0 + 2.0, "a", "a", 1, "trailing"),
        (t0 + 2.0, "b", "b", 1, "trailing"),
    ]


async def test_cancel_or_flush_against_a_pending_fire_gives_exactly_one_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Sweep the call time across the deadline in quarter steps.
    for offset in (1.5, 1.75, 2.0, 2.25):
        for op in ("cancel", "flush"):
            recorder = Recorder()
            async with open_coordinator(handlers={WF: recorder}) as c:
                await c.debounce(WF, "k", 1, delay=2.0)
                await trio.sleep(offset)
                took = await getattr(c, op)(WF, "k")
            stats = c.statistics()
            fired = len(recorder.fires)
            if op == "cancel":
                assert fired + stats.cancelled == 1
                assert took == (stats.cancelled == 1)
            else:
                assert fired == 1
            assert took == (offset < 2.0)


async def test_a_handler_that_pings_during_exit_is_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fired: list[tuple[float, str]] = []
    t0 = trio.current_time()

    async def chain(fire: Fire) -> None:
        fired.append((fire.fired_at, fire.key))
        if fire.key == "first":
            c.debounce_nowait(WF, "second", None, delay=3.0)

    async with open_coordinator(handlers={WF: chain}) as c:
        await c.debounce(WF, "first", None, delay=1.0)
    assert fired == [(t0 + 1.0, "first"), (t0 + 4.0, "second")]
