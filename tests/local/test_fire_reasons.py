"""Why an in-process fire fired (:class:`~trio_debounce.FireReason`), for the causes that
time alone cannot tell apart: a user's flush, the exit's flush, ``overflow="fire-early"``
and the end of a ``queue-latest`` run (MockClock, exact times)."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

import trio_debounce
from trio_debounce import Fire, FireReason

WF = "wf"


class Log:
    def __init__(self, hold: float = 0.0) -> None:
        self.fires: list[Fire] = []
        self.hold = hold

    async def __call__(self, fire: Fire) -> None:
        self.fires.append(fire)
        if self.hold:
            await trio.sleep(self.hold)

    def of(self, key: str) -> list[tuple[Any, float, FireReason]]:
        return [(f.payload, f.fired_at, f.reason) for f in self.fires if f.key == key]


async def test_a_fire_early_overflow_says_overflow(autojump_clock: trio.testing.MockClock) -> None:
    log = Log()
    opts: dict[str, Any] = {"payload_policy": "collect", "max_items": 2, "overflow": "fire-early"}
    async with trio_debounce.open_coordinator(handlers={WF: log}) as c:
        c.set_reducer("sum", lambda a, b: a + b, initial=int)
        t0 = trio.current_time()
        for n in (1, 2, 3):
            await c.debounce(WF, "k", n, delay=10.0, **opts)
            await c.debounce(WF, "s", n, delay=10.0, payload_policy="sum", max_items=2)
            await c.debounce(WF, "q", n, delay=10.0, overlap="queue-latest", **opts)
            await trio.sleep(1.0)
    for key, first in (("k", [1, 2]), ("s", 3), ("q", [1, 2])):
        assert log.of(key) == [
            (first, t0 + 2.0, FireReason.OVERFLOW),  # the third ping found it full
            ([3] if key != "s" else 3, t0 + 12.0, FireReason.DELAY),
        ]


async def test_the_exit_flush_says_exit_and_a_users_flush_says_flush(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with trio_debounce.open_coordinator(handlers={WF: log}, on_exit="flush") as c:
        t0 = trio.current_time()
        await c.debounce(WF, "user", 1, delay=10.0)
        await c.debounce(WF, "exit", 2, delay=10.0)
        await c.debounce(WF, "queue", 3, delay=10.0, overlap="queue-latest")
        await c.debounce(WF, "due", 4, delay=1.0)
        await c.throttle(WF, "throttle", 5, interval=10.0)
        await c.throttle(WF, "throttle", 6, interval=10.0)
        await c.batch(WF, "batch", 7, max_wait=10.0)
        await trio.sleep(1.0)
        assert await c.flush(WF, "user")
    assert log.of("user") == [(1, t0 + 1.0, FireReason.FLUSH)]
    assert log.of("exit") == [(2, t0 + 1.0, FireReason.EXIT)]
    assert log.of("queue") == [(3, t0 + 1.0, FireReason.EXIT)]
    assert log.of("due") == [(4, t0 + 1.0, FireReason.DELAY)]  # due before the exit
    assert log.of("throttle") == [
        (5, t0, FireReason.LEADING),
        (6, t0 + 1.0, FireReason.EXIT),
    ]
    assert log.of("batch") == [([7], t0 + 1.0, FireReason.EXIT)]


async def test_a_queue_latest_window_that_waited_for_its_run_says_run_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log(hold=5.0)
    queue: dict[str, Any] = {"overlap": "queue-latest"}
    async with trio_debounce.open_coordinator(handlers={WF: log}) as c:
        t0 = trio.current_time()
        await c.debounce(WF, "k", 1, delay=1.0, **queue)  # fires at 1, runs until 6
        await trio.sleep(2.0)
        await c.debounce(WF, "k", 2, delay=1.0, **queue)  # due at 3: waits for the run
        await trio.sleep(2.0)
        assert await c.flush(WF, "k")  # flushed while it waits: still the run's end
        await trio.sleep_until(t0 + 20.0)
        await c.debounce(WF, "k", 3, delay=1.0, **queue)  # no run blocks it
        # run_timeout: the run stops blocking at 30 + 2; the window due at 31.5 fires then.
        await trio.sleep_until(t0 + 29.0)
        await c.debounce(WF, "t", 4, delay=1.0, run_timeout=2.0, **queue)
        await trio.sleep(1.5)
        await c.debounce(WF, "t", 5, delay=1.0, run_timeout=2.0, **queue)
    assert log.of("k") == [
        (1, t0 + 1.0, FireReason.DELAY),
        (2, t0 + 6.0, FireReason.RUN_END),
        (3, t0 + 21.0, FireReason.DELAY),
    ]
    assert log.of("t") == [
        (4, t0 + 30.0, FireReason.DELAY),
        (5, t0 + 32.0, FireReason.RUN_END),
    ]
