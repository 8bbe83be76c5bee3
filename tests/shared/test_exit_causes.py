"""What leaving a coordinator's block does with its pending windows: every cell of the
table in ``docs/protocol.rst`` ("Leaving the block"), exit cause x ``on_exit`` x
delivery, and without a backend, on the in-memory fake under MockClock.

Process A has two pending trailing windows when it leaves: ``own`` holds A's pings
alone, ``mixed`` a ping of the live peer B as well. Each cell says who fires each
window, and when: ``A@due`` (A, at its due time: the exit waits), ``A@exit`` (A, at
once), ``B@due`` (B adopts it and fires it on time) or ``-`` (never: it is dropped).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import backend
from trio_debounce import open_coordinator
from trio_debounce._keys import window_key
from trio_debounce.testing import MemoryStore

CAUSES = ("clean", "error", "outer-cancel")
ON_EXIT = ("wait", "flush", "cancel", "handoff")
DELIVERIES = ("at-least-once", "at-most-once")

#: A's pings at 0 (delay 10: due at 10), B's ping of ``mixed`` at 1 (due at 11),
#: A's block left at 2.
DUE = {"own": 10.0, "mixed": 11.0}
EXIT_AT = 2.0


def expected(cause: str, on_exit: str, delivery: str) -> tuple[str, str]:
    """(what becomes of ``own``, of ``mixed``): the table of the docs."""
    if on_exit == "handoff":
        return ("B@due", "B@due")
    if cause != "clean":
        # Not the user's choice: at-least-once keeps every stored ping (hand-off);
        # at-most-once drops what had not come due.
        return ("B@due", "B@due") if delivery == "at-least-once" else ("-", "-")
    if on_exit == "wait":
        return ("A@due", "A@due")
    if on_exit == "flush":
        return ("A@exit", "A@exit")
    # An explicit cancel drops A's own window; under at-least-once a window that holds
    # a peer's ping goes to that peer instead of losing the ping.
    return ("-", "B@due") if delivery == "at-least-once" else ("-", "-")


TABLE = [
    pytest.param(cause, on_exit, delivery, id=f"{cause}-{on_exit}-{delivery}")
    for cause in CAUSES
    for on_exit in ON_EXIT
    for delivery in DELIVERIES
]


@contextmanager
def leaving(cause: str) -> Iterator[trio.CancelScope]:
    """The block, left by ``cause``: the body calls ``scope.cancel()`` for an outer
    cancellation or raises RuntimeError for an error."""
    with trio.CancelScope() as scope:
        if cause == "error":
            with pytest.raises(RuntimeError, match="the body failed"):
                yield scope
        else:
            yield scope
    assert scope.cancelled_caught is (cause == "outer-cancel")


async def end_block(cause: str, scope: trio.CancelScope) -> None:
    if cause == "error":
        raise RuntimeError("the body failed")
    if cause == "outer-cancel":
        scope.cancel()
        await trio.lowlevel.checkpoint()


def outcomes(fires: Fires, t0: float) -> tuple[str, str]:
    seen: dict[str, str] = {"own": "-", "mixed": "-"}
    for process, fire in fires.log:
        assert seen[fire.key] == "-", f"{fire.key} fired twice: {fires.log}"
        when = fire.fired_at - t0
        if when == pytest.approx(DUE[fire.key], abs=0.05):
            seen[fire.key] = f"{process}@due"
        elif when == pytest.approx(EXIT_AT, abs=0.05):
            seen[fire.key] = f"{process}@exit"
        else:  # pragma: no cover - a failure's message
            seen[fire.key] = f"{process}@{when:.3f}"
    return seen["own"], seen["mixed"]


@pytest.mark.parametrize(("cause", "on_exit", "delivery"), TABLE)
async def test_exit_cause_on_exit_and_delivery(
    autojump_clock: trio.testing.MockClock, cause: str, on_exit: Any, delivery: Any
) -> None:
    store, fires = MemoryStore(), Fires()
    b_backend = backend(store, "B")
    async with open_coordinator(
        handlers={"wf": fires.handler("B")}, backend=b_backend, delivery=delivery
    ) as b:
        t0 = trio.current_time()
        a_backend = backend(store, "A")
        with leaving(cause) as scope:
            async with open_coordinator(
                handlers={"wf": fires.handler("A")},
                backend=a_backend,
                delivery=delivery,
                on_exit=on_exit,
            ) as a:
                await a.debounce("wf", "own", "a", delay=10.0)
                await a.debounce("wf", "mixed", "a", delay=10.0)
                await trio.sleep(1.0)
                r = await b.debounce("wf", "mixed", "b", delay=10.0)
                assert not r.owner
                await trio.sleep_until(t0 + EXIT_AT)
                await end_block(cause, scope)
        await trio.sleep(60.0)  # long past every due time and any lease
    got = outcomes(fires, t0)
    assert got == expected(cause, on_exit, delivery)
    # A fire of the mixed window carries both pings, whoever fires it.
    assert all(f.ping_count == 2 for _, f in fires.log if f.key == "mixed")
    # cancelled: an explicit cancel counts the windows it deleted; an exit by error or
    # cancellation every pending fire it dropped here (handed off or not).
    if cause != "clean":
        assert a.statistics().cancelled == 2
    elif on_exit == "cancel":
        assert a.statistics().cancelled == got.count("-")
    else:
        assert a.statistics().cancelled == 0
    if cause == "clean" and on_exit == "cancel":
        # Deleted (revision-checked), not left to lapse: nothing of it is in the store.
        entry = await store.get(window_key("wf", "own"))
        assert entry is None or entry.value is None


@pytest.mark.parametrize("cause", CAUSES)
@pytest.mark.parametrize("on_exit", ["wait", "flush", "cancel"])
async def test_exit_without_a_backend(
    autojump_clock: trio.testing.MockClock, cause: str, on_exit: Any
) -> None:
    fires = Fires()
    t0 = trio.current_time()
    with leaving(cause) as scope:
        async with open_coordinator(handlers={"wf": fires.handler("A")}, on_exit=on_exit) as a:
            await a.debounce("wf", "own", "a", delay=10.0)
            await trio.sleep_until(t0 + EXIT_AT)
            await end_block(cause, scope)
    await trio.sleep(60.0)
    # A process's windows die with it: only a clean wait or flush fires them.
    want = {"wait": "A@due", "flush": "A@exit", "cancel": "-"}[on_exit] if cause == "clean" else "-"
    assert outcomes(fires, t0) == (want, "-")
    assert a.statistics().cancelled == (on_exit == "cancel" or cause != "clean")
