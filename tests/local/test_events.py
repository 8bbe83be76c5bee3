"""The ``on_event`` hook of a coordinator without a backend, on MockClock: what each
ping and fire reports, and that a hook never breaks the coordinator."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
import trio.testing

from trio_debounce import (
    CoordinatorEvent,
    DebounceResult,
    Edge,
    Fire,
    FireFinished,
    FireStarted,
    Outcome,
    PingAnswered,
    PingRejected,
    open_coordinator,
)

WF = "wf"


async def noop(fire: Fire) -> None:
    pass


def summary(events: list[CoordinatorEvent]) -> list[tuple[Any, ...]]:
    """Each event as a short tuple (its type's name and the fields a test checks)."""
    out: list[tuple[Any, ...]] = []
    for event in events:
        if isinstance(event, PingAnswered):
            out.append(("ping", event.key, event.result.outcome.value, event.at))
        elif isinstance(event, PingRejected):
            out.append(("rejected", event.key, type(event.error).__name__, event.at))
        elif isinstance(event, FireStarted):
            out.append(("started", event.fire.key, event.fire.edge.value, event.at, event.lateness))
        elif isinstance(event, FireFinished):
            out.append(("finished", event.fire.key, event.outcome, event.at, event.duration))
        else:  # pragma: no cover - no other event without a backend
            out.append((type(event).__name__,))
    return out


async def test_pings_and_fires_are_reported_in_order_with_their_times(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[CoordinatorEvent] = []

    async def handler(fire: Fire) -> None:
        await trio.sleep(0.5)

    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: handler}, on_event=events.append) as c:
        await c.debounce(WF, "k", 1, delay=2.0)  # opens
        await trio.sleep(1.0)
        r = c.debounce_nowait(WF, "k", 2, delay=2.0)  # the inlined hot path's ping
        await c.debounce(WF, "j", 3, delay=1.0, mode="leading")  # fires at once
        with pytest.raises(ValueError, match="max_count"):
            await c.debounce(WF, "k", 4, delay=2.0, max_count=5)  # an options ping
    assert r == DebounceResult(Outcome.COALESCE, r.active_run_id, t0 + 3.0, 2)
    # The pings, in the caller's order (the handlers' tasks interleave with them).
    assert [s for s in summary(events) if s[0] in ("ping", "rejected")] == [
        ("ping", "k", "schedule-trailing", t0),
        ("ping", "k", "coalesce", t0 + 1.0),
        ("ping", "j", "fire-immediate", t0 + 1.0),
        ("rejected", "k", "ValueError", t0 + 1.0),  # max_count differs from the window's
    ]
    # Each fire: started at its time, finished after the handler's 0.5 s.
    for key, edge, at in (("j", "leading", t0 + 1.0), ("k", "trailing", t0 + 3.0)):
        started, finished = [
            e for e in events if isinstance(e, (FireStarted, FireFinished)) and e.fire.key == key
        ]
        assert isinstance(started, FireStarted)
        assert isinstance(finished, FireFinished)
        assert (started.fire.edge.value, started.at) == (edge, at)
        assert started.lateness == pytest.approx(0.0, abs=1e-9)
        assert (finished.outcome, finished.error, finished.at) == ("returned", None, at + 0.5)
        assert finished.duration == pytest.approx(0.5)
        assert finished.fire is started.fire
    [answered] = [e for e in events if isinstance(e, PingAnswered) and e.key == "j"]
    assert answered.result.outcome is Outcome.FIRE_IMMEDIATE
    assert c.statistics().pings == 3  # the hook does not change what is counted
    assert c.statistics().hook_errors == 0


async def test_a_hot_key_reports_every_ping(autojump_clock: trio.testing.MockClock) -> None:
    # With a hook, no ping takes the inlined hot path unseen.
    events: list[CoordinatorEvent] = []
    async with open_coordinator(handlers={WF: noop}, on_event=events.append) as c:
        for i in range(100):
            c.debounce_nowait(WF, "k", i, delay=1.0)
    pings = [e for e in events if isinstance(e, PingAnswered)]
    assert [e.result.ping_count for e in pings] == list(range(1, 101))
    [finished] = [e for e in events if isinstance(e, FireFinished)]
    assert (finished.fire.payload, finished.fire.ping_count) == (99, 100)
    assert (c.statistics().pings, c.statistics().coalesced) == (100, 99)


async def test_a_raising_handler_and_a_cancelled_one_are_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[CoordinatorEvent] = []
    boom = RuntimeError("boom")

    async def handler(fire: Fire) -> None:
        if fire.key == "raises":
            raise boom
        await trio.sleep(10.0)  # cancelled by the block's cancellation

    with trio.move_on_after(5.0):
        async with open_coordinator(handlers={WF: handler}, on_event=events.append) as c:
            await c.debounce(WF, "raises", delay=1.0)
            await c.debounce(WF, "slow", delay=1.0)
            await trio.sleep_forever()
    finished = {e.fire.key: e for e in events if isinstance(e, FireFinished)}
    assert (finished["raises"].outcome, finished["raises"].error) == ("raised", boom)
    assert finished["slow"].outcome == "cancelled"
    assert isinstance(finished["slow"].error, trio.Cancelled)
    assert finished["slow"].duration == 4.0
    assert c.statistics().handler_errors == 1


async def test_a_fire_with_no_handler_is_reported_as_raised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[CoordinatorEvent] = []
    async with open_coordinator(handlers={WF: noop}, on_event=events.append) as c:
        await c.debounce(WF, "k", delay=1.0)
        c.set_handler(WF, None)
    [finished] = [e for e in events if isinstance(e, FireFinished)]
    assert finished.outcome == "raised"
    assert isinstance(finished.error, LookupError)
    assert finished.fire.edge is Edge.TRAILING


async def test_a_raising_hook_is_logged_once_counted_and_never_breaks_the_coordinator(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    fired: list[Fire] = []
    calls = 0

    def hook(event: CoordinatorEvent) -> None:
        nonlocal calls
        calls += 1
        raise ValueError(f"hook failure {calls}")

    async def handler(fire: Fire) -> None:
        fired.append(fire)

    with caplog.at_level(logging.ERROR, logger="trio_debounce"):
        async with open_coordinator(handlers={WF: handler}, on_event=hook) as c:
            r1 = await c.debounce(WF, "k", 1, delay=1.0)
            r2 = c.debounce_nowait(WF, "k", 2, delay=1.0)
            with pytest.raises(ValueError, match="delay"):  # the ping's own error
                c.debounce_nowait(WF, "k", 3, delay=-1.0)
    assert (r1.ping_count, r2.ping_count) == (1, 2)
    assert [(f.payload, f.ping_count) for f in fired] == [(2, 2)]
    # Three pings, a fire started and finished: five calls, each raised.
    assert calls == c.statistics().hook_errors == 5
    logged = [r for r in caplog.records if "on_event hook raised" in r.getMessage()]
    assert len(logged) == 1
    assert logged[0].exc_info is not None
    assert str(logged[0].exc_info[1]) == "hook failure 1"


async def test_without_a_hook_nothing_is_reported_and_pings_take_the_hot_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={WF: noop}) as c:
        assert not c._not_plain
        await c.debounce(WF, "k", delay=1.0)
        c.debounce_nowait(WF, "k", delay=1.0)
        assert c._hot_pings == 1  # the second ping took the inlined path
    assert c.statistics().hook_errors == 0


@pytest.mark.parametrize(
    ("on_event", "message"),
    [
        ("log", "on_event must be callable, not 'log'"),
        (trio.sleep, "on_event is called synchronously"),
    ],
)
async def test_a_bad_hook_is_refused_naming_it(on_event: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        async with open_coordinator(on_event=on_event):
            pass  # pragma: no cover


async def test_a_fire_says_why_it_fired(autojump_clock: trio.testing.MockClock) -> None:
    events: list[CoordinatorEvent] = []
    async with open_coordinator(handlers={WF: noop}, on_event=events.append) as c:
        c.debounce_nowait(WF, "silence", 1, delay=1.0)
        for _ in range(3):  # at 0, 0.9 and 1.8: the silence would come at 2.8
            c.debounce_nowait(WF, "capped", 1, delay=1.0, max_delay=2.5)
            await trio.sleep(0.9)
        c.debounce_nowait(WF, "flushed", 1, delay=10.0)
        c.debounce_nowait(WF, "counted", 1, delay=10.0, max_count=2)
        c.debounce_nowait(WF, "counted", 2, delay=10.0, max_count=2)
        c.debounce_nowait(WF, "led", 1, delay=1.0, mode="leading")
        await c.flush(WF, "flushed")
        await trio.sleep(5.0)
    started = {e.fire.key: e.reason for e in events if isinstance(e, FireStarted)}
    finished = {e.fire.key: e.reason for e in events if isinstance(e, FireFinished)}
    carried = {e.fire.key: e.fire.reason for e in events if isinstance(e, FireStarted)}
    assert (
        started
        == finished
        == carried
        == {
            "silence": "delay",
            "capped": "max-delay",
            "flushed": "flush",
            "counted": "max-count",
            "led": "leading",
        }
    )
