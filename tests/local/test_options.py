"""Named tests, one or more per rule of the window options (docs/semantics.rst), on MockClock.

max_count, payload policies (first, collect, reducers, bounds), one run at a time per
key (overlap="queue-latest", run_timeout) and caller ordering (order_key, drop_stale).
"""

from __future__ import annotations

import json
import math
import re
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness.fires import Fires, Recorder
from tests.harness.memory import near, processes
from tests.harness.model import Model, Options
from trio_debounce import (
    BackendUnavailableError,
    DebounceResult,
    Edge,
    Fire,
    Mode,
    Outcome,
    open_coordinator,
)
from trio_debounce._keys import window_key
from trio_debounce._protocol import _AFTER_KEEP, RunMarker, WindowDoc
from trio_debounce.testing import MemoryBackend, MemoryStore

WF = "wf"


# ---------------------------------------------------------------------- max_count


async def test_max_count_fires_at_the_ping_that_reaches_it(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        results = []
        for i in range(5):
            results.append(await c.debounce(WF, "k", i, delay=10.0, max_count=3, run_id=f"r{i}"))
            assert c.has(WF, "k") is (i not in (2,))
            await trio.sleep(1.0)
    # pings at t0, t0+1, t0+2 fill the first window, which is due at the third ping;
    # the pings at t0+3 and t0+4 open the next one, which fires after its delay.
    assert [r.scheduled_at for r in results] == [t0 + 10, t0 + 11, t0 + 2, t0 + 13, t0 + 14]
    assert [r.outcome for r in results] == [
        Outcome.SCHEDULE_TRAILING,
        Outcome.COALESCE,
        Outcome.COALESCE,
        Outcome.SCHEDULE_TRAILING,
        Outcome.COALESCE,
    ]
    assert recorder.summary() == [(t0 + 2, "k", 2, 3, "trailing"), (t0 + 14, "k", 4, 2, "trailing")]
    assert [f.run_id for f in recorder.fires] == ["r0", "r3"]


async def test_max_count_closes_a_leading_window_and_fires_both_trailing(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(4):
            await c.debounce(WF, "lead", i, delay=10.0, mode="leading", max_count=2)
            await c.debounce(WF, "both", i, delay=10.0, mode="both", max_count=2)
            await trio.sleep(1.0)
    lead = [s for s in recorder.summary() if s[1] == "lead"]
    both = [s for s in recorder.summary() if s[1] == "both"]
    # leading: the second ping closes the window, the third opens (and fires) the next
    assert lead == [(t0, "lead", 0, 1, "leading"), (t0 + 2, "lead", 2, 1, "leading")]
    assert both == [
        (t0, "both", 0, 1, "leading"),
        (t0 + 1, "both", 1, 2, "trailing"),
        (t0 + 2, "both", 2, 1, "leading"),
        (t0 + 3, "both", 3, 2, "trailing"),
    ]


async def test_max_count_one_fires_every_ping_at_once(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(3):
            r = await c.debounce(WF, "k", i, delay=5.0, max_count=1)
            assert (r.outcome, r.scheduled_at, r.ping_count) == (Outcome.SCHEDULE_TRAILING, t0, 1)
            assert not c.has(WF, "k")
    assert recorder.summary() == [(t0, "k", i, 1, "trailing") for i in range(3)]


# ------------------------------------------------------- options belong to the window


@pytest.mark.parametrize(
    ("first", "later", "named"),
    [
        ({"max_count": 3}, {"max_count": 4}, "max_count 4 differs from the max_count 3"),
        ({"max_count": 3}, {}, "max_count None differs from the max_count 3"),
        ({}, {"max_count": 3}, "max_count 3 differs from the max_count None"),
        ({"payload_policy": "collect"}, {"payload_policy": "first"}, "payload_policy 'first'"),
        (
            {"payload_policy": "collect"},
            {"payload_policy": "collect", "max_items": 5},
            "max_items 5",
        ),
        ({"overlap": "queue-latest"}, {}, "overlap 'allow' differs"),
        (
            {"overlap": "queue-latest", "run_timeout": 2.0},
            {"overlap": "queue-latest"},
            "run_timeout None differs from the run_timeout 2.0",
        ),
        ({"order_key": 1}, {}, "opened with an order_key: every ping of it needs one"),
        ({}, {"order_key": 1}, "opened without an order_key"),
    ],
)
async def test_options_are_fixed_by_the_first_ping(
    autojump_clock: trio.testing.MockClock,
    recorder: Recorder,
    first: dict[str, Any],
    later: dict[str, Any],
    named: str,
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", "a", delay=5.0, **first)
        before = c.statistics()
        with pytest.raises(ValueError, match=re.escape(named)):
            await c.debounce(WF, "k", "b", delay=5.0, **later)
        with pytest.raises(ValueError, match=re.escape(named)):
            c.debounce_nowait(WF, "k", "b", delay=5.0, **later)
        assert c.statistics() == before
        # the same options are accepted (max_items given as the default it had)
        same = dict(first)
        if same.get("payload_policy") == "collect":
            same["max_items"] = 1000
        r = await c.debounce(WF, "k", "c", delay=5.0, **same)
        assert r.ping_count == 2
    assert [f.payload for f in recorder.fires] in (["c"], [["a", "c"]])


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"max_count": 0}, ValueError, "max_count must be >= 1, got 0"),
        ({"max_count": True}, TypeError, "max_count must be an int, not True"),
        ({"max_count": 2.0}, TypeError, "max_count must be an int, not 2.0"),
        ({"payload_policy": "sum"}, ValueError, "got 'sum'"),
        ({"payload_policy": 3}, TypeError, "payload_policy must be a str, not 3"),
        ({"max_items": 5}, ValueError, "max_items bounds payload_policy 'collect'"),
        ({"payload_policy": "collect", "max_items": 0}, ValueError, "max_items must be >= 1"),
        ({"payload_policy": "collect", "overflow": "spill"}, ValueError, "got 'spill'"),
        ({"overflow": "drop-oldest"}, ValueError, "overflow applies to payload_policy"),
        ({"overlap": "serial"}, ValueError, "got 'serial'"),
        ({"overlap": "queue-latest", "mode": "both"}, ValueError, "needs mode='trailing'"),
        ({"run_timeout": 1.0}, ValueError, "run_timeout bounds overlap='queue-latest'"),
        ({"overlap": "queue-latest", "run_timeout": 0}, ValueError, "run_timeout must be > 0"),
        ({"overlap": "queue-latest", "run_timeout": math.nan}, ValueError, "run_timeout"),
        ({"order_key": math.nan}, ValueError, "order_key must be finite, got nan"),
        ({"order_key": math.inf}, ValueError, "order_key must be finite, got inf"),
        ({"order_key": "3"}, TypeError, "order_key must be a number"),
        ({"order_key": False}, TypeError, "order_key must be a number (int or float), not False"),
        ({"drop_stale": True}, ValueError, "drop_stale=True needs an order_key"),
        ({"drop_stale": 1, "order_key": 1}, TypeError, "drop_stale must be a bool, not 1"),
    ],
)
async def test_bad_options_raise_naming_the_value_and_change_nothing(
    autojump_clock: trio.testing.MockClock,
    recorder: Recorder,
    kwargs: dict[str, Any],
    error: type[Exception],
    named: str,
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        before = c.statistics()
        with pytest.raises(error, match=re.escape(named)):
            await c.debounce(WF, "k", "p", delay=1.0, **kwargs)
        assert c.statistics() == before
        assert len(c) == 0


async def test_an_unknown_keyword_is_a_type_error(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        bad: dict[str, Any] = {"max_cout": 3}
        with pytest.raises(TypeError, match="unexpected keyword argument 'max_cout'"):
            await c.debounce(WF, "k", 1, delay=1.0, **bad)
        with pytest.raises(TypeError, match="unexpected keyword argument 'max_cout'"):
            c.debounce_nowait(WF, "k", 1, delay=1.0, **bad)
        assert len(c) == 0


async def test_a_reducer_with_order_key_or_drop_oldest_is_refused(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.set_reducer("sum", lambda a, b: a + b, initial=int)
        with pytest.raises(ValueError, match="order_key cannot be combined with the reducer 'sum'"):
            await c.debounce(WF, "k", 1, delay=1.0, payload_policy="sum", order_key=1)
        with pytest.raises(ValueError, match="'drop-oldest' needs payload_policy='collect'"):
            await c.debounce(WF, "k", 1, delay=1.0, payload_policy="sum", overflow="drop-oldest")


async def test_set_reducer_validates(autojump_clock: trio.testing.MockClock) -> None:
    async with open_coordinator() as c:
        with pytest.raises(ValueError, match="'collect' is a built-in payload policy"):
            c.set_reducer("collect", lambda a, b: b)
        with pytest.raises(ValueError, match="reducer name"):
            c.set_reducer("", lambda a, b: b)
        with pytest.raises(TypeError, match="the reducer must be callable, not 3"):
            c.set_reducer("x", 3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="for a list, pass initial=list"):
            c.set_reducer("x", lambda a, b: b, initial=[])  # type: ignore[arg-type]


async def test_options_with_a_backend_are_checked_as_in_process(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(
        handlers={WF: recorder}, backend=MemoryBackend(MemoryStore(), process_id="p1")
    ) as c:
        cases: list[tuple[dict[str, Any], type[Exception], str]] = [
            # a reducer this process lacks (every process must register the same one)
            ({"payload_policy": "sum"}, ValueError, "payload_policy must be one of"),
            ({"overlap": "queue-latest", "mode": "both"}, ValueError, "needs mode='trailing'"),
            ({"drop_stale": True}, ValueError, "drop_stale=True needs an order_key"),
            ({"order_key": 1, "drop_stale": 1}, TypeError, "drop_stale must be a bool"),
            ({"run_timeout": 1.0}, ValueError, "run_timeout bounds"),
            ({"overflow": "drop-oldest", "payload_policy": "first"}, ValueError, "overflow"),
            ({"order_key": math.nan}, ValueError, "order_key must be finite"),
            ({"max_itemz": 3}, TypeError, "unexpected keyword argument 'max_itemz'"),
        ]
        for kwargs, error, message in cases:
            with pytest.raises(error, match=message):
                await c.debounce(WF, "k", 1, delay=1.0, **kwargs)
        assert not c.has(WF, "k")
        c.set_reducer("sum", lambda a, b: a + b, initial=int)
        with pytest.raises(ValueError, match="order_key cannot be combined with the reducer"):
            await c.debounce(WF, "k", 1, delay=1.0, payload_policy="sum", order_key=1)
        # the defaults spelled out (an equal string built at run time) are the defaults
        r = await c.debounce(WF, "k", 1, delay=1.0, payload_policy="".join("last"), overlap="allow")
        assert r.ping_count == 1
    assert len(recorder.fires) == 1


# ---------------------------------------------------------------- payload policies


async def test_payload_first_keeps_the_first_payload_including_the_leading_ping(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(3):
            await c.debounce(WF, "t", f"t{i}", delay=2.0, payload_policy="first")
            await c.debounce(WF, "b", f"b{i}", delay=2.0, mode="both", payload_policy="first")
            await trio.sleep(1.0)
    assert sorted(recorder.summary()) == [
        (t0, "b", "b0", 1, "leading"),
        (t0 + 4, "b", "b0", 3, "trailing"),
        (t0 + 4, "t", "t0", 3, "trailing"),
    ]


async def test_collect_gives_every_payload_in_order_including_the_leading_ping(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(3):
            await c.debounce(WF, "b", i, delay=2.0, mode="both", payload_policy="collect")
            await c.debounce(WF, "l", i, delay=2.0, mode="leading", payload_policy="collect")
    # A leading fire carries its ping's own payload, under every policy.
    assert [(f.key, f.edge.value, f.payload) for f in recorder.fires] == [
        ("b", "leading", 0),
        ("l", "leading", 0),
        ("b", "trailing", [0, 1, 2]),
    ]


async def test_a_reducer_gets_a_fresh_initial_value_per_window(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    def append(acc: list[str], new: str) -> list[str]:
        acc.append(new)
        return acc

    async with open_coordinator(handlers={WF: recorder}) as c:
        c.set_reducer("tail", append, initial=list)
        c.set_reducer("concat", lambda acc, new: acc + new)  # no initial: the first payload
        for burst in ("ab", "cd"):
            for letter in burst:
                await c.debounce(WF, "k", letter, delay=1.0, payload_policy="tail")
                await c.debounce(WF, "s", letter, delay=1.0, payload_policy="concat")
            await trio.sleep(5.0)
    assert sorted((f.fired_at, f.key, str(f.payload)) for f in recorder.fires) == [
        (1.0, "k", "['a', 'b']"),
        (1.0, "s", "ab"),
        (6.0, "k", "['c', 'd']"),
        (6.0, "s", "cd"),
    ]


async def test_a_reducer_that_raises_leaves_the_ping_untaken(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    def picky(acc: int, new: int) -> int:
        if new < 0:
            raise ArithmeticError(f"negative {new}")
        return acc + new

    async with open_coordinator(handlers={WF: recorder}) as c:
        c.set_reducer("picky", picky, initial=int)
        with pytest.raises(ArithmeticError):
            await c.debounce(WF, "k", -1, delay=1.0, payload_policy="picky")
        assert len(c) == 0
        await c.debounce(WF, "k", 2, delay=1.0, payload_policy="picky")
        with pytest.raises(ArithmeticError):
            await c.debounce(WF, "k", -5, delay=1.0, payload_policy="picky")
        r = await c.debounce(WF, "k", 3, delay=1.0, payload_policy="picky")
        assert r.ping_count == 2
        assert c.statistics().pings == 2
    assert [(f.payload, f.ping_count) for f in recorder.fires] == [(5, 2)]


async def test_an_overflowing_ping_that_raises_leaves_the_full_window_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()

    def picky(acc: int, new: int) -> int:
        if new < 0:
            raise ArithmeticError(f"negative {new}")
        return acc + new

    async with open_coordinator() as c:
        c.set_reducer("picky", picky, initial=int)
        opts: dict[str, Any] = {"payload_policy": "picky", "max_items": 2}
        await c.debounce(WF, "k", 1, delay=5.0, on_fire=recorder, **opts)
        await c.debounce(WF, "k", 2, delay=5.0, **opts)
        with pytest.raises(ArithmeticError):  # it would open the next window
            await c.debounce(WF, "k", -1, delay=5.0, on_fire=recorder, **opts)
        with pytest.raises(LookupError, match="no handler for workflow 'wf'"):
            await c.debounce(WF, "k", 3, delay=5.0, **opts)  # the window's on_fire is its own
        assert c.has(WF, "k")
        assert recorder.fires == []
        await c.debounce(WF, "k", 4, delay=5.0, on_fire=recorder, **opts)
    assert [(f.payload, f.ping_count) for f in recorder.fires] == [(3, 2), (4, 1)]


async def test_replacing_a_reducer_leaves_open_windows_alone(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.set_reducer("r", lambda a, b: a + b, initial=int)
        await c.debounce(WF, "k", 1, delay=1.0, payload_policy="r")
        c.set_reducer("r", lambda a, b: a * b, initial=lambda: 1)
        await c.debounce(WF, "k", 5, delay=1.0, payload_policy="r")
        await trio.sleep(2.0)
        await c.debounce(WF, "k", 2, delay=1.0, payload_policy="r")
        await c.debounce(WF, "k", 5, delay=1.0, payload_policy="r")
        c.set_reducer("r", None)
        with pytest.raises(ValueError, match="got 'r'"):
            await c.debounce(WF, "other", 1, delay=1.0, payload_policy="r")
    assert [f.payload for f in recorder.fires] == [6, 10]


async def test_collect_overflow_fire_early_fires_what_it_holds_and_opens_the_next(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        results = []
        for i in range(5):
            results.append(
                await c.debounce(WF, "k", i, delay=10.0, payload_policy="collect", max_items=2)
            )
            await trio.sleep(1.0)
    assert [r.outcome.value for r in results] == [
        "schedule-trailing",
        "coalesce",
        "schedule-trailing",  # the overflowing ping opened the next window
        "coalesce",
        "schedule-trailing",
    ]
    assert recorder.summary() == [
        (t0 + 2, "k", [0, 1], 2, "trailing"),
        (t0 + 4, "k", [2, 3], 2, "trailing"),
        (t0 + 14, "k", [4], 1, "trailing"),
    ]


async def test_collect_overflow_drop_oldest_keeps_the_newest_items(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(5):
            await c.debounce(
                WF, "k", i, delay=1.0, payload_policy="collect", max_items=2, overflow="drop-oldest"
            )
    assert [(f.payload, f.ping_count) for f in recorder.fires] == [([3, 4], 5)]


async def test_reducer_overflow_fires_early(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        c.set_reducer("sum", lambda a, b: a + b, initial=int)
        for i in range(1, 6):
            await c.debounce(WF, "k", i, delay=1.0, payload_policy="sum", max_items=3)
    assert [(f.payload, f.ping_count) for f in recorder.fires] == [(6, 3), (9, 2)]


async def test_collect_is_bounded_by_default(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(1001):
            c.debounce_nowait(WF, "k", i, delay=1.0, payload_policy="collect")
    assert [len(f.payload) for f in recorder.fires] == [1000, 1]


# ----------------------------------------------------------- one run at a time per key


async def test_queue_latest_waits_for_the_run_and_fires_once_with_the_latest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(duration=10.0)
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", "a", delay=1.0, overlap="queue-latest")
        await trio.sleep(2.0)  # t0+2: the first run executes until t0+11
        r = await c.debounce(WF, "k", "b", delay=1.0, overlap="queue-latest")
        assert r.scheduled_at == t0 + 3
        await trio.sleep(3.0)  # t0+5: the second window is due and waits
        assert c.has(WF, "k")
        assert c.statistics().pending_trailing_fires == 1
        results = []
        for payload in "cde":
            results.append(await c.debounce(WF, "k", payload, delay=1.0, overlap="queue-latest"))
            await trio.sleep(1.0)
        assert [(r.outcome, r.scheduled_at, r.ping_count) for r in results] == [
            (Outcome.COALESCE, None, 2),
            (Outcome.COALESCE, None, 3),
            (Outcome.COALESCE, None, 4),
        ]
        assert c.has(WF, "k")
        await trio.sleep_until(t0 + 11.5)
        assert not c.has(WF, "k")  # fired at the end of the run
    assert recorder.summary() == [
        (t0 + 1, "k", "a", 1, "trailing"),
        (t0 + 11, "k", "e", 4, "trailing"),
    ]
    assert recorder.max_running == 1
    assert trio.current_time() == t0 + 21


async def test_queue_latest_at_most_one_run_follows_and_no_ping_is_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(duration=3.0)
    async with open_coordinator(handlers={WF: recorder}) as c:
        for i in range(40):
            await c.debounce(
                WF, "k", i, delay=0.5, overlap="queue-latest", payload_policy="collect"
            )
            await trio.sleep(0.25)
    assert recorder.max_running == 1
    payloads = [p for f in recorder.fires for p in f.payload]
    assert payloads == list(range(40))
    assert sum(f.ping_count for f in recorder.fires) == 40


async def test_a_ping_at_the_deadline_of_a_blocked_window_joins_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The time rule: the window is due at t0+3, blocked, so it waits from t0+3; a ping
    # at exactly t0+3 finds it waiting, whichever task the scheduler runs first.
    recorder = Recorder(duration=10.0)
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", "a", delay=0.0, overlap="queue-latest")
        await c.debounce(WF, "k", "b", delay=3.0, overlap="queue-latest")
        await trio.sleep_until(t0 + 3)
        r = await c.debounce(WF, "k", "c", delay=3.0, overlap="queue-latest")
        assert (r.outcome, r.scheduled_at, r.ping_count) == (Outcome.COALESCE, None, 2)
    assert recorder.summary() == [(t0, "k", "a", 1, "trailing"), (t0 + 10, "k", "c", 2, "trailing")]


async def test_run_timeout_stops_a_run_from_blocking_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(duration=10.0)
    t0 = trio.current_time()
    opts: dict[str, Any] = {"overlap": "queue-latest", "run_timeout": 4.0}
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", "a", delay=1.0, **opts)  # runs t0+1 .. t0+11
        await trio.sleep(1.5)
        await c.debounce(WF, "k", "b", delay=1.0, **opts)  # due t0+2.5, waits
        await trio.sleep_until(t0 + 5)
        # the block lapses at t0+1+4: this ping opens the next window
        r = await c.debounce(WF, "k", "c", delay=1.0, **opts)
        assert (r.outcome, r.scheduled_at) == (Outcome.SCHEDULE_TRAILING, t0 + 6)
    assert recorder.summary() == [
        (t0 + 1, "k", "a", 1, "trailing"),
        (t0 + 5, "k", "b", 1, "trailing"),  # beside the first run, which is not cancelled
        (t0 + 9, "k", "c", 1, "trailing"),  # t0+5+4: the second run's block lapses
    ]
    assert recorder.max_running == 3


async def test_a_flushed_window_waits_for_a_run_only_until_its_run_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A flush makes the window due now; the run blocks it until its start + run_timeout,
    # earlier than the window's own deadline, and the window fires then: its handler
    # starts at that time, not when the task would have woken at its old deadline
    # (t0+5.25, or the run's end first: found by the property test).
    started: list[tuple[float, float, object]] = []
    t0 = trio.current_time()

    async def handler(fire: Fire) -> None:
        started.append((trio.current_time() - t0, fire.fired_at - t0, fire.payload))
        await trio.sleep(10.0 if fire.payload == "a" else 0.0)

    opts: dict[str, Any] = {"overlap": "queue-latest", "run_timeout": 1.0}
    async with open_coordinator(handlers={WF: handler}) as c:
        await c.debounce(WF, "k", "a", delay=0.0, **opts)  # runs t0 .. t0+10
        await trio.sleep(0.25)
        await c.debounce(WF, "k", "b", delay=5.0, **opts)  # due t0+5.25
        await trio.testing.wait_all_tasks_blocked()  # its task sleeps until t0+5.25
        assert await c.flush(WF, "k")  # due now: waits for the run, blocked until t0+1
    assert started == [(0.0, 0.0, "a"), (1.0, 1.0, "b")]


async def test_fire_early_overflow_overrides_the_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(duration=10.0)
    t0 = trio.current_time()
    opts: dict[str, Any] = {"overlap": "queue-latest", "payload_policy": "collect", "max_items": 2}
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", 0, delay=0.0, **opts)
        for i in (1, 2, 3):
            await trio.sleep(1.0)
            await c.debounce(WF, "k", i, delay=0.0, **opts)
    assert recorder.summary() == [
        (t0, "k", [0], 1, "trailing"),
        (t0 + 3, "k", [1, 2], 2, "trailing"),  # full at the third ping: fires at once
        (t0 + 13, "k", [3], 1, "trailing"),
    ]


async def test_cancel_and_flush_of_a_waiting_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(duration=10.0)
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "a", 1, delay=0.0, overlap="queue-latest")
        await c.debounce(WF, "a", 2, delay=1.0, overlap="queue-latest")
        await c.debounce(WF, "b", 1, delay=0.0, overlap="queue-latest")
        await c.debounce(WF, "b", 2, delay=5.0, overlap="queue-latest")
        await trio.sleep(2.0)
        assert await c.cancel(WF, "a")  # waiting: closed, never fires
        assert not c.has(WF, "a")
        assert await c.flush(WF, "b")  # open: made due now, so it waits for the run
        r = await c.debounce(WF, "b", 3, delay=5.0, overlap="queue-latest")
        assert (r.outcome, r.scheduled_at) == (Outcome.COALESCE, None)
    assert sorted(recorder.summary()) == [
        (t0, "a", 1, 1, "trailing"),
        (t0, "b", 1, 1, "trailing"),
        (t0 + 10, "b", 3, 2, "trailing"),
    ]


@pytest.mark.parametrize("on_exit", ["wait", "flush", "cancel"])
async def test_exit_and_waiting_windows(
    autojump_clock: trio.testing.MockClock, on_exit: Any
) -> None:
    recorder = Recorder(duration=10.0)
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}, on_exit=on_exit) as c:
        await c.debounce(WF, "k", 1, delay=0.0, overlap="queue-latest")
        await c.debounce(WF, "k", 2, delay=1.0, overlap="queue-latest")
        await trio.sleep(2.0)
    expected = [(t0, "k", 1, 1, "trailing")]
    if on_exit != "cancel":
        expected.append((t0 + 10, "k", 2, 1, "trailing"))
    assert recorder.summary() == expected
    assert c.statistics().cancelled == (on_exit == "cancel")


async def test_runs_of_allow_windows_do_not_block(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder(duration=10.0)
    t0 = trio.current_time()
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", 1, delay=0.0)
        await c.debounce(WF, "k", 2, delay=1.0, overlap="queue-latest")
    assert recorder.summary() == [(t0, "k", 1, 1, "trailing"), (t0 + 1, "k", 2, 1, "trailing")]


async def test_an_abort_drops_a_waiting_window(autojump_clock: trio.testing.MockClock) -> None:
    recorder = Recorder(duration=10.0)
    with pytest.raises(KeyError):  # noqa: PT012
        async with open_coordinator(handlers={WF: recorder}) as c:
            await c.debounce(WF, "k", 1, delay=0.0, overlap="queue-latest")
            await c.debounce(WF, "k", 2, delay=1.0, overlap="queue-latest")
            await trio.sleep(2.0)
            raise KeyError("boom")
    assert [f.payload for f in recorder.fires] == [1]
    assert c.statistics().cancelled == 1


# ---------------------------------------------------------------- caller ordering


async def test_order_key_a_late_older_event_never_replaces_a_newer_payload(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        for payload, order in [("e5", 5), ("e9", 9), ("e7", 7), ("e9-again", 9), ("e1", 1)]:
            await c.debounce(WF, "last", payload, delay=1.0, order_key=order)
            await c.debounce(
                WF, "first", payload, delay=1.0, order_key=order, payload_policy="first"
            )
            await c.debounce(
                WF, "all", payload, delay=1.0, order_key=order, payload_policy="collect"
            )
    by_key = {f.key: f.payload for f in recorder.fires}
    assert by_key == {
        "last": "e9-again",  # the highest order key, ties: the later arrival
        "first": "e1",  # the lowest
        "all": ["e1", "e5", "e7", "e9", "e9-again"],  # by order key, then arrival
    }


async def test_order_key_with_drop_oldest_keeps_the_highest(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        for order in (4, 1, 9, 2, 7):
            await c.debounce(
                WF, "k", order, delay=1.0, order_key=order, payload_policy="collect",
                max_items=3, overflow="drop-oldest",
            )  # fmt: skip
    assert [f.payload for f in recorder.fires] == [[4, 7, 9]]


async def test_drop_stale_drops_and_counts_pings_not_above_the_last_fired(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", "t10", delay=1.0, order_key=10, drop_stale=True)
        await c.debounce(WF, "k", "t3", delay=1.0, order_key=3, drop_stale=True)  # in window
        await trio.sleep(2.0)  # fired with order key 10
        r = await c.debounce(WF, "k", "t10b", delay=1.0, order_key=10, drop_stale=True)
        assert r == DebounceResult(Outcome.STALE, "", None, 0)
        r = await c.debounce(WF, "k", "t4", delay=1.0, order_key=4)  # not asked to drop
        assert r.outcome is Outcome.SCHEDULE_TRAILING
        r = await c.debounce(WF, "k", "t8", delay=1.0, order_key=8, drop_stale=True)
        assert (r.outcome, r.active_run_id, r.ping_count) == (Outcome.STALE, r.active_run_id, 1)
        await c.debounce(WF, "k", "t11", delay=1.0, order_key=11, drop_stale=True)
        stats = c.statistics()
        assert (stats.stale_pings, stats.pings) == (2, 4)
    assert [(f.payload, f.ping_count) for f in recorder.fires] == [("t10", 2), ("t11", 2)]


async def test_drop_stale_counts_a_leading_fire(
    autojump_clock: trio.testing.MockClock, recorder: Recorder
) -> None:
    async with open_coordinator(handlers={WF: recorder}) as c:
        await c.debounce(WF, "k", "a", delay=1.0, mode="both", order_key=5)
        r = await c.debounce(WF, "k", "b", delay=1.0, mode="both", order_key=5, drop_stale=True)
        assert r.outcome is Outcome.STALE
        r = await c.debounce(WF, "k", "c", delay=1.0, mode="both", order_key=6, drop_stale=True)
        assert r.outcome is Outcome.COALESCE
    assert [(f.edge.value, f.payload) for f in recorder.fires] == [
        ("leading", "a"),
        ("trailing", "c"),
    ]


# ------------------------------------------------------ max_count across processes


async def test_shared_max_count_the_pinger_that_reaches_it_takes_the_fire(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "ABC") as (a, b, c):
        t0 = trio.current_time()
        r = await a.debounce(WF, "k", "a", delay=10.0, max_count=3)
        assert (r.outcome, r.owner) == (Outcome.SCHEDULE_TRAILING, True)
        await trio.sleep(1.0)
        r = await b.debounce(WF, "k", "b", delay=10.0, max_count=3)
        assert (r.ping_count, r.scheduled_at) == (2, near(t0 + 11.0))
        await trio.sleep(1.0)
        r = await c.debounce(WF, "k", "c", delay=10.0, max_count=3)
        assert (r.outcome, r.ping_count, r.scheduled_at) == (
            Outcome.COALESCE,
            3,
            near(t0 + 2.0),
        )
        await trio.sleep(1.0)
        # The window has fired: the next ping opens a new one.
        r = await b.debounce(WF, "k", "d", delay=10.0, max_count=3)
        assert (r.outcome, r.owner, r.ping_count) == (Outcome.SCHEDULE_TRAILING, True, 1)
    [(p1, f1), (p2, f2)] = fires.of("k")
    assert (p1, f1.payload, f1.ping_count, f1.fired_at) == ("C", "c", 3, near(t0 + 2.0))
    assert (p2, f2.payload, f2.ping_count, f2.fired_at) == ("B", "d", 1, near(t0 + 13.0))


async def test_shared_max_count_reached_by_the_owner_fires_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        t0 = trio.current_time()
        await a.debounce(WF, "k", 1, delay=10.0, max_count=2)
        await trio.sleep(1.0)
        r = await a.debounce(WF, "k", 2, delay=10.0, max_count=2)
        assert r.scheduled_at == near(t0 + 1.0)
        await trio.sleep(0.5)
        assert fires.by_edge() == [("A", "k", 2, 2, Edge.TRAILING)]
        await b.debounce(WF, "j", 1, delay=5.0, max_count=2)
        with pytest.raises(ValueError, match="max_count 3 differs from the max_count 2"):
            await a.debounce(WF, "j", 2, delay=5.0, max_count=3)
        with pytest.raises(ValueError, match="max_count None differs from the max_count 2"):
            await a.debounce(WF, "j", 2, delay=5.0)
        r = await b.debounce(WF, "one", 1, delay=5.0, max_count=1)
        assert r.scheduled_at == near(trio.current_time())
    assert ("B", "one", 1, 1, Edge.TRAILING) in fires.by_edge()
    assert [f.ping_count for _, f in fires.of("j")] == [1]


async def test_shared_collect_gathers_every_process_payload_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    opts: dict[str, Any] = {"payload_policy": "collect", "overflow": "drop-oldest"}
    async with processes(store, fires, "ABC") as (a, b, c):
        for who, payload, order in [(a, "e5", 5), (b, "e9", 9), (c, "e7", 7), (a, "e1", 1)]:
            await who.debounce(WF, "all", payload, delay=5.0, mode="both", **opts)
            await who.debounce(WF, "sorted", payload, delay=5.0, order_key=order, **opts)
            await who.debounce(WF, "two", payload, delay=5.0, max_items=2, **opts)
            await trio.sleep(1.0)
        with pytest.raises(ValueError, match="max_items 3 differs from the max_items 2"):
            await b.debounce(WF, "two", "x", delay=5.0, **{**opts, "max_items": 3})
    payloads = {(f.key, f.edge.value): (f.payload, f.ping_count) for _, f in fires.log}
    assert payloads == {
        ("all", "leading"): ("e5", 1),  # a leading fire carries its own ping's payload
        ("all", "trailing"): (["e5", "e9", "e7", "e1"], 4),
        ("sorted", "trailing"): (["e1", "e5", "e7", "e9"], 4),
        ("two", "trailing"): (["e7", "e1"], 4),
    }


async def test_shared_order_key_and_first_keep_the_right_payload_across_processes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "ABC") as (a, b, c):
        for who, payload, order in [(a, "e5", 5), (b, "e9", 9), (c, "e7", 7), (a, "e9b", 9)]:
            await who.debounce(WF, "last", payload, delay=5.0, order_key=order)
            await who.debounce(
                WF, "first", payload, delay=5.0, order_key=order, payload_policy="first"
            )
            await who.debounce(WF, "plain-first", payload, delay=5.0, payload_policy="first")
            await trio.sleep(1.0)
        with pytest.raises(ValueError, match="opened with an order_key: every ping"):
            await b.debounce(WF, "last", "x", delay=5.0)
        with pytest.raises(ValueError, match="payload_policy 'last' differs from the payload_"):
            await c.debounce(WF, "first", "x", delay=5.0, order_key=1)
        with pytest.raises(ValueError, match="payload_policy 'last' differs"):
            await c.debounce(WF, "first", "x", delay=5.0, order_key=1, drop_stale=True)
    payloads = {f.key: (f.payload, f.ping_count) for _, f in fires.log}
    assert payloads == {
        "last": ("e9b", 4),  # the highest order key; ties: the later arrival
        "first": ("e5", 4),  # the lowest
        "plain-first": ("e5", 4),  # the first to arrive
    }


def test_window_documents_with_max_count_are_version_2_and_version_1_still_reads() -> None:
    doc = WindowDoc("p", "e", "r", Mode.TRAILING, 1.0, None, 0.0, 0.0, 1.0, None, 1.0, 1, "w", "w")
    assert json.loads(doc.encode())["v"] == 1
    assert "max_count" not in json.loads(doc.encode())
    counted = replace(doc, max_count=3)
    assert json.loads(counted.encode())["v"] == 2
    assert WindowDoc.decode(counted.encode()) == counted
    assert WindowDoc.decode(doc.encode()) == doc
    bad = json.loads(counted.encode())
    bad["max_count"] = 0
    with pytest.raises(ValueError, match="bad max_count 0"):
        WindowDoc.decode(json.dumps(bad).encode())
    ordered = replace(doc, payload_policy="first", ordered=True, order=4)
    assert json.loads(ordered.encode())["v"] == 2
    assert WindowDoc.decode(ordered.encode()) == ordered
    collected = replace(
        doc,
        payload_policy="collect",
        max_items=5,
        ranks=((0.0, 0), (2.5, 1)),
        payload="[1,2]",
        overflow="drop-oldest",
    )
    assert json.loads(collected.encode())["v"] == 2
    assert WindowDoc.decode(collected.encode()) == collected


def test_the_proofs_of_the_runs_before_read_back_in_every_version() -> None:
    doc = WindowDoc("p", "e", "r", Mode.TRAILING, 1.0, None, 0.0, 0.0, 1.0, None, 1.0, 1, "w", "w")
    proofs = (("r1", "w1"), ("r0", "w0"))
    for version_doc in (doc, replace(doc, max_count=3), replace(doc, fired_order=2.0)):
        after = replace(version_doc, after=proofs)
        assert json.loads(after.encode())["after"] == [["r1", "w1"], ["r0", "w0"]]
        assert WindowDoc.decode(after.encode()) == after
    assert "after" not in json.loads(doc.encode())
    raw = json.loads(replace(doc, after=proofs).encode())
    too_many = [["r", "w"]] * (_AFTER_KEEP + 1)
    for bad in ([], [["r0"]], [["r0", 1]], "r0", ["r0", "w0"], [["r0", "w0", "x"]], too_many):
        raw["after"] = bad
        with pytest.raises(ValueError, match="bad after"):
            WindowDoc.decode(json.dumps(raw).encode())
    raw["after"] = [["r0", "\ud800"]]
    with pytest.raises(ValueError, match="after holds a lone surrogate"):
        WindowDoc.decode(json.dumps(raw).encode())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(0, 2), st.sampled_from("ab")),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from([None, 1, 2, 3, 5]),
    st.integers(0, 4),
    st.sampled_from(["last", "first", "collect"]),
    st.none() | st.lists(st.integers(0, 4), min_size=25, max_size=25),
    st.sampled_from([None, 1, 2, 3]),
)
def test_shared_options_match_the_model(
    pings: list[tuple[int, int, str]],
    max_count: int | None,
    delay_steps: int,
    policy: str,
    orders: list[int] | None,
    max_items: int | None,
) -> None:
    # Pings at whole seconds from three processes; deadlines at half seconds, so no
    # ping meets a deadline (shared times pass through the wall clock and are only
    # near, not equal).
    delay = delay_steps + 0.5
    model = Model()
    t = 0.0
    collect = policy == "collect"
    opts = Options(
        max_count=max_count,
        payload_policy=policy,
        max_items=max_items if collect else None,
        overflow="drop-oldest" if collect else None,
    )
    for i, (dt, _, key) in enumerate(pings):
        t += dt
        order = None if orders is None else orders[i]
        model.ping(t, (WF, key), i, delay, None, "trailing", f"r{i}", opts, order)
    model.finish(math.inf)
    expected = sorted((f.key[1], f.payload, f.ping_count, f.fired_at) for f in model.fires)

    async def main() -> list[tuple[str, Any, int, float]]:
        store, fires = MemoryStore(), Fires()
        t0 = trio.current_time()
        async with processes(store, fires, "ABC") as coordinators:
            elapsed = 0.0
            for i, (dt, who, key) in enumerate(pings):
                # At the model's instants exactly: a ping whose call took time (a
                # conflict's retry) must not move every later ping.
                elapsed += dt
                await trio.sleep_until(t0 + elapsed)
                kwargs: dict[str, Any] = {"payload_policy": policy}
                if collect:
                    kwargs.update(max_items=max_items, overflow="drop-oldest")
                if max_count is not None:
                    kwargs["max_count"] = max_count
                if orders is not None:
                    kwargs["order_key"] = orders[i]
                await coordinators[who].debounce(WF, key, i, delay=delay, run_id=f"r{i}", **kwargs)
        return sorted((f.key, f.payload, f.ping_count, f.fired_at - t0) for _, f in fires.log)

    got = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [(k, p, n) for k, p, n, _ in got] == [(k, p, n) for k, p, n, _ in expected]
    for (_, _, _, at), (_, _, _, want) in zip(got, expected, strict=True):
        assert at == pytest.approx(want, abs=0.05)


def _sum(acc: int, new: int) -> int:
    return acc + new


def _append(acc: list[int], new: int) -> list[int]:
    acc.append(new)  # mutates: a shared initial list would leak between windows
    return acc


#: Reducers every simulated process registers (JSON values: the accumulated value
#: lives in the shared document).
SHARED_REDUCERS: dict[str, tuple[Any, Any]] = {"sum": (_sum, int), "tail": (_append, list)}


#: Handler times of the shared property test (see shared_timelines).
#: Handler times: off the quarter-second grid by 13/1024 s (12.7 ms), and so are their
#: sums (4 in a row end 51 ms past a whole second): farther from a ping's instant than
#: a conflict's retry moves the ping (its jitter is a few ms), since a queue-latest run
#: that ends between a ping's instant and its retried write is judged at the write.
HOLDS = (0.25 + 13 / 1024, 1.25 + 13 / 1024, 4.25 + 13 / 1024)


@st.composite
def shared_timelines(draw: st.DrawFn) -> dict[str, Any]:
    """Pings at whole seconds from three processes on two keys, with one set of
    options for the whole timeline; deadlines at half seconds, handler times and run
    timeouts off that grid by some 1/1024 s (sums of them too), so no two events meet:
    a run that ends at the instant of a ping is a tie the scheduler decides, and shared
    times pass through the wall clock and are only near, not equal."""
    policy = draw(st.sampled_from(["last", "first", "collect", "sum", "tail"]))
    accumulates = policy not in ("last", "first")
    queue = draw(st.booleans())
    mode = "trailing" if queue else draw(st.sampled_from(["trailing", "trailing", "both"]))
    overflow = None
    if accumulates:
        overflows = [None, "fire-early"] + (["drop-oldest"] if policy == "collect" else [])
        overflow = draw(st.sampled_from(overflows))
    opts = Options(
        max_count=draw(st.sampled_from([None, None, 1, 2, 3, 5])),
        payload_policy=policy,
        max_items=draw(st.sampled_from([None, 1, 2, 3])) if accumulates else None,
        overflow=overflow,
        overlap="queue-latest" if queue else "allow",
        run_timeout=draw(st.sampled_from([None, 1.125 + 5 / 1024, 2.875 + 5 / 1024]))
        if queue
        else None,
    )
    ordered = policy in ("last", "first", "collect") and draw(st.booleans())
    n = draw(st.integers(1, 20))
    return {
        "opts": opts,
        "mode": mode,
        "delay": draw(st.integers(0, 4)) + 0.5,
        "pings": draw(
            st.lists(
                st.tuples(st.integers(1, 3), st.integers(0, 2), st.sampled_from("ab")),
                min_size=n,
                max_size=n,
            )
        ),
        "orders": draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)) if ordered else None,
        "stale": draw(st.lists(st.booleans(), min_size=n, max_size=n)) if ordered else [False] * n,
        "hold": draw(st.lists(st.sampled_from(HOLDS), min_size=n, max_size=n)),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_timelines())
def test_shared_windows_with_every_option_match_the_model(case: dict[str, Any]) -> None:
    # Every result (outcome, run id, scheduled time, count) and every fire (key,
    # payload, count, time) of three MemoryBackend processes, against the model, for
    # max_count, every payload policy with both overflows, queue-latest with run
    # timeouts and handler times, order keys and drop_stale.
    opts, mode, delay = case["opts"], case["mode"], case["delay"]
    pings, orders, stale, hold = case["pings"], case["orders"], case["stale"], case["hold"]
    run_times = {f"r{i}": h for i, h in enumerate(hold)}
    model = Model(reducers=dict(SHARED_REDUCERS), run_times=run_times)
    t = 0.0
    expected_results = []
    for i, (dt, _, key) in enumerate(pings):
        t += dt
        order = None if orders is None else orders[i]
        expected_results.append(
            model.ping(t, (WF, key), i, delay, None, mode, f"r{i}", opts, order, stale[i])
        )
    model.finish(math.inf)
    expected = sorted((f.key[1], f.edge, f.payload, f.ping_count, f.fired_at) for f in model.fires)

    async def main() -> tuple[list[Any], list[tuple[str, str, Any, int, float]], int]:
        store, log = MemoryStore(), []
        t0 = trio.current_time()
        running = 0
        most = 0

        async def handler(fire: Any) -> None:
            nonlocal running, most
            log.append(fire)
            if fire.edge is Edge.TRAILING:
                running += 1
                most = max(most, running)
                await trio.sleep(run_times[fire.run_id])
                running -= 1

        results = []
        # Virtual time: a window that never fires fails the test instead of hanging.
        with trio.fail_after(600):
            async with AsyncExitStack() as stack:
                coordinators = []
                for name in "ABC":
                    c = await stack.enter_async_context(
                        open_coordinator(
                            handlers={WF: handler},
                            backend=MemoryBackend(
                                store, process_id=name, process_lease=6.0, max_clock_skew=1.0
                            ),
                        )
                    )
                    for reducer, (fn, initial) in SHARED_REDUCERS.items():
                        c.set_reducer(reducer, fn, initial=initial)
                    coordinators.append(c)
                elapsed = 0.0
                for i, (dt, who, key) in enumerate(pings):
                    # At the model's instants exactly: a ping whose call took time (a
                    # conflict's retry) must not move every later ping past a run's
                    # end that the model puts after it.
                    elapsed += dt
                    await trio.sleep_until(t0 + elapsed)
                    kwargs: dict[str, Any] = {
                        "max_count": opts.max_count,
                        "payload_policy": opts.payload_policy,
                        "max_items": opts.max_items,
                        "overflow": opts.overflow,
                        "overlap": opts.overlap,
                        "run_timeout": opts.run_timeout,
                        "drop_stale": stale[i],
                    }
                    if orders is not None:
                        kwargs["order_key"] = orders[i]
                    r = await coordinators[who].debounce(
                        WF, key, i, delay=delay, mode=mode, run_id=f"r{i}", **kwargs
                    )
                    at = None if r.scheduled_at is None else r.scheduled_at - t0
                    results.append((r.outcome.value, r.active_run_id, at, r.ping_count))
        fired = sorted((f.key, f.edge.value, f.payload, f.ping_count, f.fired_at - t0) for f in log)
        return results, fired, most

    results, got, most = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    for i, (got_result, want) in enumerate(zip(results, expected_results, strict=True)):
        (outcome, run, at, count), (want_outcome, want_run, want_at, want_count) = got_result, want
        assert (i, outcome, run, count) == (i, want_outcome, want_run, want_count)
        assert (i, at is None) == (i, want_at is None)
        if at is not None:
            assert at == pytest.approx(want_at, abs=0.05)
    assert [f[:4] for f in got] == [f[:4] for f in expected]
    for fire, model_fire in zip(got, expected, strict=True):
        assert fire[4] == pytest.approx(model_fire[4], abs=0.05)
    if (
        opts.overlap == "queue-latest"
        and opts.run_timeout is None
        and (opts.payload_policy in ("last", "first") or opts.overflow == "drop-oldest")
    ):
        assert most <= 2  # one run per key (two keys) at a time


async def test_a_shared_collect_ping_that_cannot_be_stored_raises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # As in the plain case, every write of B loses until its deadline while A, the live
    # owner, has a fire pending; a plain ping would be absorbed unstored, but a collect
    # ping would then be missing from the list: it raises instead.
    store, fires = MemoryStore(), Fires()
    opts: dict[str, Any] = {"payload_policy": "collect", "overflow": "drop-oldest"}
    b_backend = MemoryBackend(store, process_id="B", op_timeout=1.0)
    async with (
        processes(store, fires, "A") as (a,),
        open_coordinator(
            handlers={WF: fires.handler("B")}, backend=b_backend, on_backend_error="raise"
        ) as b,
    ):
        await a.debounce(WF, "k", "a", delay=5.0, **opts)
        b_backend.faults.conflict_next(1000)
        with pytest.raises(BackendUnavailableError, match=r"did not complete within 1\.0 s"):
            await b.debounce(WF, "k", "b", delay=5.0, **opts)
        b_backend.faults.clear()
        assert b.statistics().unstored_pings == 0
        await b.debounce(WF, "k", "c", delay=5.0, **opts)
    assert [(p, f.payload) for p, f in fires.log] == [("A", ["a", "c"])]


# ------------------------------- reducers, fire-early, queue-latest, drop_stale shared


async def test_shared_reducer_folds_every_process_ping_into_the_document(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "ABC") as (a, b, c):
        for who in (a, b, c):
            who.set_reducer("tail", _append, initial=list)
        await a.debounce(WF, "k", 1, delay=5.0, payload_policy="tail")
        await b.debounce(WF, "k", 2, delay=5.0, payload_policy="tail")
        r = await c.debounce(WF, "k", 3, delay=5.0, payload_policy="tail")
        assert (r.outcome, r.ping_count) == (Outcome.COALESCE, 3)
        # The accumulated value lives in the shared document (version 3), by name.
        entry = store.raw_get(window_key(WF, "k"))
        assert entry is not None
        assert entry.value is not None
        doc = json.loads(entry.value)
        assert (doc["v"], doc["policy"], doc["payload"], doc["held"]) == (3, "tail", "[1,2,3]", 3)
        # A process that lacks the reducer cannot ping the window: it raises, by name.
        b.set_reducer("tail", None)
        with pytest.raises(ValueError, match=r"payload_policy must be one of .* got 'tail'"):
            await b.debounce(WF, "k", 4, delay=5.0, payload_policy="tail")
        # A reducer that raises leaves the ping untaken.
        c.set_reducer("tail", lambda acc, new: [*acc, 1 / new], initial=list)
        with pytest.raises(ZeroDivisionError):
            await c.debounce(WF, "k", 0, delay=5.0, payload_policy="tail")
    assert [(p, f.payload, f.ping_count) for p, f in fires.log] == [("A", [1, 2, 3], 3)]


async def test_shared_reducer_value_must_be_storable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A") as (a,):
        a.set_reducer("paths", lambda acc, p: acc | {p}, initial=set)
        with pytest.raises(TypeError, match="cannot be stored as JSON"):
            await a.debounce(WF, "k", "x", delay=5.0, payload_policy="paths")
        assert not a.has(WF, "k")
    assert fires.log == []


async def test_shared_fire_early_the_overflowing_pinger_takes_the_fire(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    opts: dict[str, Any] = {"payload_policy": "collect", "max_items": 2}
    async with processes(store, fires, "ABC") as (a, b, c):
        for who in (a, b, c):
            who.set_reducer("sum", _sum, initial=int)
        t0 = trio.current_time()
        await a.debounce(WF, "k", 1, delay=10.0, **opts)
        await b.debounce(WF, "k", 2, delay=10.0, **opts)
        await b.debounce(WF, "s", 1, delay=10.0, payload_policy="sum", max_items=2)
        await c.debounce(WF, "s", 2, delay=10.0, payload_policy="sum", max_items=2)
        await trio.sleep(1.0)
        # Full: C's ping fires A's window at once (C takes it) and opens the next.
        r = await c.debounce(WF, "k", 3, delay=10.0, **opts)
        assert (r.outcome, r.owner, r.ping_count) == (Outcome.SCHEDULE_TRAILING, True, 1)
        assert r.scheduled_at == near(t0 + 11.0)
        r = await a.debounce(WF, "s", 3, delay=10.0, payload_policy="sum", max_items=2)
        assert (r.outcome, r.owner, r.ping_count) == (Outcome.SCHEDULE_TRAILING, True, 1)
        await trio.sleep(0.5)
        assert sorted((p, f.key, f.payload, f.ping_count) for p, f in fires.log) == [
            ("A", "s", 3, 2),
            ("C", "k", [1, 2], 2),
        ]
        assert all(f.fired_at == near(t0 + 1.0) for _, f in fires.log)
    assert sorted((p, f.key, f.payload) for p, f in fires.log)[-2:] == [
        ("C", "k", [1, 2]),
        ("C", "k", [3]),
    ]
    assert [(p, f.payload) for p, f in fires.of("s")] == [("A", 3), ("A", 3)]


async def test_shared_fire_early_by_the_store_size_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The document's size limit bounds collect too: fire-early fires what it holds,
    # drop-oldest drops more of the oldest; a payload too large alone raises. The
    # limit holds two items and the document's fields (its last write ids included).
    store, fires = MemoryStore(max_value_bytes=1200), Fires()
    big = "x" * 300
    async with processes(store, fires, "AB") as (a, b):
        for i in range(3):
            await (a, b)[i % 2].debounce(
                WF, "early", f"{i}{big}", delay=5.0, payload_policy="collect"
            )
            await (a, b)[i % 2].debounce(
                WF, "drop", f"{i}{big}", delay=5.0, payload_policy="collect", overflow="drop-oldest"
            )
        with pytest.raises(ValueError, match="exceeds 1200"):
            await a.debounce(WF, "alone", "y" * 1000, delay=5.0, payload_policy="collect")
    early = [[p[0] for p in f.payload] for _, f in fires.of("early")]
    drop = [[p[0] for p in f.payload] for _, f in fires.of("drop")]
    assert early == [["0", "1"], ["2"]]
    assert drop == [["1", "2"]]
    assert [f.ping_count for _, f in fires.of("drop")] == [3]


async def test_shared_queue_latest_waits_for_a_run_in_another_process(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    opts: dict[str, Any] = {"overlap": "queue-latest"}
    async with (
        processes(store, fires, "B") as (b,),
        open_coordinator(
            handlers={WF: fires.handler("A", hold=10.0)},
            backend=MemoryBackend(store, process_id="A", process_lease=6.0),
        ) as a,
    ):
        t0 = trio.current_time()
        await a.debounce(WF, "k", "a", delay=1.0, **opts)  # A runs it, t0+1 .. t0+11
        await trio.sleep(2.0)
        r = await b.debounce(WF, "k", "b", delay=1.0, **opts)  # B owns the next window
        assert (r.owner, r.scheduled_at) == (True, near(t0 + 3.0))
        await trio.sleep(3.0)  # t0+5: due, waiting for A's run
        assert b.has(WF, "k")
        status = await b.window_status(WF, "k")
        assert status is not None
        assert status.scheduled_at is None
        r = await a.debounce(WF, "k", "c", delay=1.0, **opts)
        assert (r.outcome, r.scheduled_at, r.ping_count) == (Outcome.COALESCE, None, 2)
        r = await b.debounce(WF, "k", "d", delay=1.0, **opts)
        assert (r.outcome, r.scheduled_at, r.ping_count) == (Outcome.COALESCE, None, 3)
        with pytest.raises(ValueError, match="overlap 'allow' differs"):
            await a.debounce(WF, "k", "x", delay=1.0)
        await trio.sleep_until(t0 + 11.5)
        # A's run returned: A took and fired the window (B notices when it looks again).
        assert await b.window_status(WF, "k") is None
    assert [(p, f.payload, f.ping_count) for p, f in fires.log] == [("A", "a", 1), ("A", "d", 3)]
    assert fires.log[1][1].fired_at == near(t0 + 11.0)


async def test_shared_queue_latest_run_timeout_and_a_dead_runner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    dead = MemoryBackend(store, process_id="A", process_lease=6.0, max_clock_skew=1.0)
    async with processes(store, fires, "B") as (b,):
        t0 = trio.current_time()
        with trio.CancelScope() as a_scope:
            async with open_coordinator(
                handlers={WF: fires.handler("A", hold=1000.0)}, backend=dead
            ) as a:
                await a.debounce(WF, "t", "a", delay=0.0, overlap="queue-latest", run_timeout=4.0)
                await a.debounce(WF, "d", "a", delay=0.0, overlap="queue-latest")
                await trio.sleep(1.0)
                r = await b.debounce(
                    WF, "t", "b", delay=0.5, overlap="queue-latest", run_timeout=4.0
                )
                assert r.scheduled_at == near(t0 + 1.5)
                r = await b.debounce(WF, "d", "b", delay=0.5, overlap="queue-latest")
                assert r.scheduled_at == near(t0 + 1.5)
                await trio.sleep(1.0)
                # A's runs hang; A "dies" (its lease is no longer renewed).
                dead.faults.partitioned = True
                a_scope.cancel()
        await trio.sleep(20.0)
    fired = {(p, f.key, f.payload): f.fired_at - t0 for p, f in fires.log}
    assert fired[("B", "t", "b")] == near(4.0)  # the run timed out at t0 + 4
    # The run blocked until A's lease (renewed every 2 s, 6 s long) lapsed, plus skew.
    assert 6.0 < fired[("B", "d", "b")] < 11.0


async def test_shared_drop_stale_knows_the_last_fired_order_key_after_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "ABC") as (a, b, c):
        await a.debounce(WF, "k", "e5", delay=1.0, order_key=5)
        await b.debounce(WF, "k", "e7", delay=1.0, order_key=7)
        await trio.sleep(2.0)  # fired; the tombstone keeps order key 7
        r = await c.debounce(WF, "k", "e6", delay=1.0, order_key=6, drop_stale=True)
        assert (r.outcome, r.active_run_id, r.scheduled_at, r.ping_count) == (
            Outcome.STALE,
            "",
            None,
            0,
        )
        assert c.statistics().stale_pings == 1
        assert c.statistics().pings == 0
        r = await c.debounce(WF, "k", "e8", delay=1.0, order_key=8, drop_stale=True)
        assert r.outcome is Outcome.SCHEDULE_TRAILING
        r = await a.debounce(WF, "k", "e7b", delay=1.0, order_key=7, drop_stale=True)
        assert (r.outcome, r.ping_count) == (Outcome.STALE, 1)
        await trio.sleep(2.0)
        # Kept ten process leases after the key's last ping, then swept.
        await trio.sleep(10 * 6.0 + 20.0)
        assert store.raw_get(window_key(WF, "k")) is None
        r = await b.debounce(WF, "k", "e1", delay=1.0, order_key=1, drop_stale=True)
        assert r.outcome is Outcome.SCHEDULE_TRAILING
    assert [f.payload for _, f in fires.log] == ["e7", "e8", "e1"]


def test_version_3_documents_round_trip() -> None:
    doc = WindowDoc("p", "e", "r", Mode.TRAILING, 1.0, None, 0.0, 0.0, 1.0, None, 1.0, 1, "w", "w")
    reduced = replace(
        doc, payload_policy="sum", max_items=9, overflow="fire-early", held=2, payload="3"
    )
    queued = replace(
        doc,
        queue=True,
        run_timeout=2.5,
        running=RunMarker("q", "e2", "r0", 5.0),
        ordered=True,
        order=3,
        max_order=4,
        fired_order=2,
    )
    early = replace(
        doc, payload_policy="collect", max_items=2, overflow="fire-early", ranks=((0.0, 0),)
    )
    for d in (reduced, queued, early):
        assert json.loads(d.encode())["v"] == 3
        assert WindowDoc.decode(d.encode()) == d
    bad = json.loads(reduced.encode())
    bad["overflow"] = "drop-oldest"
    with pytest.raises(ValueError, match="bad overflow"):
        WindowDoc.decode(json.dumps(bad).encode())
    # a version-2 reader's view: a reducer name is only valid in version 3
    bad["v"] = 2
    with pytest.raises(ValueError, match="bad payload policy 'sum'"):
        WindowDoc.decode(json.dumps(bad).encode())


async def test_shared_flush_and_cancel_while_a_run_blocks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # flush makes the window due now, so it waits for the run; cancel closes a window
    # but keeps the run's state, so the next window still waits for it.
    store, fires = MemoryStore(), Fires()
    opts: dict[str, Any] = {"overlap": "queue-latest"}
    async with (
        processes(store, fires, "B") as (b,),
        open_coordinator(
            handlers={WF: fires.handler("A", hold=10.0)},
            backend=MemoryBackend(store, process_id="A", process_lease=6.0),
        ) as a,
    ):
        t0 = trio.current_time()
        await a.debounce(WF, "f", 1, delay=0.0, **opts)  # runs t0 .. t0+10
        await a.debounce(WF, "c", 1, delay=0.0, **opts)  # runs t0 .. t0+10
        await trio.sleep(1.0)
        await b.debounce(WF, "f", 2, delay=5.0, **opts)
        await b.debounce(WF, "c", 2, delay=5.0, **opts)
        assert await b.flush(WF, "f")
        await trio.sleep(1.0)
        r = await b.debounce(WF, "f", 3, delay=5.0, **opts)
        assert (r.outcome, r.scheduled_at, r.ping_count) == (Outcome.COALESCE, None, 2)
        assert await b.cancel(WF, "c")
        r = await b.debounce(WF, "c", 4, delay=0.5, **opts)
        assert (r.outcome, r.ping_count) == (Outcome.SCHEDULE_TRAILING, 1)
        await trio.sleep(1.0)
        status = await a.window_status(WF, "c")
        assert status is not None
        assert status.scheduled_at is None  # waiting for the run
    fired = sorted(
        (f.key, f.payload, f.ping_count, round(f.fired_at - t0, 1)) for _, f in fires.log
    )
    assert fired == [
        ("c", 1, 1, 0.0),
        ("c", 4, 1, 10.0),
        ("f", 1, 1, 0.0),
        ("f", 3, 2, 10.0),
    ]


async def test_shared_end_of_run_that_cannot_be_recorded_is_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's handler returns while A cannot reach the store: the run's end is queued and
    # written by a later heartbeat; B's waiting window fires when B looks again (at
    # A's lease-based look), not never.
    store, fires = MemoryStore(), Fires()
    a_backend = MemoryBackend(store, process_id="A", process_lease=6.0, max_clock_skew=1.0)
    opts: dict[str, Any] = {"overlap": "queue-latest"}
    async with (
        processes(store, fires, "B") as (b,),
        open_coordinator(handlers={WF: fires.handler("A", hold=3.0)}, backend=a_backend) as a,
    ):
        t0 = trio.current_time()
        await a.debounce(WF, "k", 1, delay=0.0, **opts)  # runs t0 .. t0+3
        await trio.sleep(1.0)
        await b.debounce(WF, "k", 2, delay=0.5, **opts)  # due t0+1.5, waits
        await trio.sleep(1.5)
        # Partitioned t0+2.5 .. t0+6: the end at t0+3 fails for its whole deadline (2 s).
        a_backend.faults.partitioned = True
        await trio.sleep(3.5)
        a_backend.faults.partitioned = False
        await trio.sleep(20.0)
        entry = store.raw_get(window_key(WF, "k"))
        assert entry is None or entry.value is None or b"running" not in entry.value
    [(_, _), (who, second)] = fires.log
    assert (who, second.payload) == ("B", 2)
    # Due when the run's end was recorded (the first heartbeat after the partition, at
    # t0+6): its fire time, whenever B looks.
    assert 6.0 <= second.fired_at - t0 < 18.0
