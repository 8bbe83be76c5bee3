"""The time rules across processes: ``max_count`` and pings at a window's due time.

The rules are the in-process ones (docs/semantics.rst): the ping that brings a window
to ``max_count`` pings makes it due at that instant, and a ping at or after a window's
due time (its deadline, its cap, or that instant) never joins it: the window fires
with its own payload and count, and the ping opens the next window (with its own
leading fire). With a backend they hold for every pinger: the owner, a peer, pings
merged by group commit, a ping into a dead owner's window, and one that meets the
owner's finalize in flight.

Every store here has epoch 0 and every time is on a binary grid, so wall and Trio
times convert exactly and the tests compare times with ``==``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import backend, processes
from trio_debounce import (
    Coordinator,
    Edge,
    JsonSerializer,
    Mode,
    ModeName,
    Outcome,
    open_coordinator,
)
from trio_debounce._protocol import WindowDoc
from trio_debounce._protocol._rules import Identity, Ping, apply_ping
from trio_debounce.testing import MemoryBackend, MemoryStore

DELAY = 4.0
T = 1.0  # the instant of the bursts


def fired(fires: Fires) -> list[tuple[float, str, str, Any, int, float]]:
    """(fired_at, run id, edge, payload, ping count, first ping) of every fire, in
    time order (fires of one instant: by run id, leading edge first)."""
    return sorted(
        (f.fired_at, f.run_id, f.edge.value, f.payload, f.ping_count, f.first_ping_at)
        for _, f in fires.log
    )


def seven_at_once(
    mode: str, order: Sequence[int], times: Sequence[float]
) -> list[tuple[float, str, str, Any, int, float]]:
    """What ``max_count=3`` and seven pings fire, as without a backend: windows of 3, 3
    and 1 pings. ``order``: the payloads (and run ids) in the order the pings arrived;
    ``times``: when each was made (all at T, but a sequential ping can be a little
    late when the one before it lost a compare-and-swap and backed off)."""
    expected = []
    for start, size in ((0, 3), (3, 3), (6, 1)):
        run = f"r{order[start]}"
        t0 = times[start]
        if mode != "trailing":
            expected.append((t0, run, "leading", order[start], 1, t0))
        if mode == "trailing" or (mode == "both" and size > 1):
            due = times[start + 2] if size == 3 else t0 + DELAY
            expected.append((due, run, "trailing", order[start + size - 1], size, t0))
    return sorted(expected)


MODES: list[ModeName] = ["trailing", "leading", "both"]


# ------------------------------------------------------------------------ max_count


@pytest.mark.parametrize("mode", MODES)
async def test_max_count_seven_pings_in_process_make_windows_of_3_3_1(
    autojump_clock: trio.testing.MockClock, mode: ModeName
) -> None:
    # The rule every pinger follows, as the local table applies it (no backend).
    fires = Fires()
    async with open_coordinator(handlers={"wf": fires.handler("local")}) as c:
        await trio.sleep(T)
        results = [
            await c.debounce("wf", "k", i, delay=DELAY, mode=mode, run_id=f"r{i}", max_count=3)
            for i in range(7)
        ]
    assert fired(fires) == seven_at_once(mode, range(7), [T] * 7)
    assert [r.ping_count for r in results] == [1, 2, 3, 1, 2, 3, 1]


@pytest.mark.parametrize("mode", MODES)
async def test_max_count_seven_sequential_pings_of_one_process_make_windows_of_3_3_1(
    autojump_clock: trio.testing.MockClock, mode: ModeName
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    async with processes(store, fires, "A") as (a,):
        await trio.sleep(T)
        results = [
            await a.debounce("wf", "k", i, delay=DELAY, mode=mode, run_id=f"r{i}", max_count=3)
            for i in range(7)
        ]
        assert trio.current_time() == T  # no conflict in one process
    assert fired(fires) == seven_at_once(mode, range(7), [T] * 7)
    assert [r.ping_count for r in results] == [1, 2, 3, 1, 2, 3, 1]
    assert [r.active_run_id for r in results] == ["r0"] * 3 + ["r3"] * 3 + ["r6"]
    opening = Outcome.SCHEDULE_TRAILING if mode == "trailing" else Outcome.FIRE_IMMEDIATE
    assert [r.outcome for r in results[::3]] == [opening] * 3


@pytest.mark.parametrize("mode", MODES)
async def test_max_count_seven_sequential_pings_alternating_two_processes_make_windows_of_3_3_1(
    autojump_clock: trio.testing.MockClock, mode: ModeName
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    async with processes(store, fires, "AB") as (a, b):
        await trio.sleep(T)
        times, results = [], []
        for i in range(7):
            times.append(trio.current_time())
            results.append(
                await (a, b)[i % 2].debounce(
                    "wf", "k", i, delay=DELAY, mode=mode, run_id=f"r{i}", max_count=3
                )
            )
        await trio.sleep(2 * DELAY)
    # A ping made late (after the one before lost a compare-and-swap and backed off)
    # is off the grid, where a time's conversion may cost an ulp.
    assert fired(fires) == [
        (pytest.approx(at, abs=1e-9), *rest[:-1], pytest.approx(rest[-1], abs=1e-9))
        for at, *rest in seven_at_once(mode, range(7), times)
    ]
    assert [r.ping_count for r in results] == [1, 2, 3, 1, 2, 3, 1]


@pytest.mark.parametrize("mode", MODES)
async def test_max_count_seven_concurrent_pings_merged_by_group_commit_make_windows_of_3_3_1(
    autojump_clock: trio.testing.MockClock, mode: ModeName
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    async with processes(store, fires, "A") as (a,):
        backend_a = a._backend
        assert isinstance(backend_a, MemoryBackend)
        await trio.sleep(T)
        arrived: list[int] = []
        puts = store.requests["put"]

        async def ping(i: int) -> None:
            arrived.append(i)  # no checkpoint before the ping joins the key's queue
            await a.debounce("wf", "k", i, delay=DELAY, mode=mode, run_id=f"r{i}", max_count=3)

        async with trio.open_nursery() as nursery:
            for i in range(7):
                nursery.start_soon(ping, i)
        # merged: fewer writes than pings would take alone (each ping's put, and two
        # fire records and tombstones; and under at-least-once, the leading fire's
        # record of each of the three windows, written before its opening)
        leading_records = 0 if mode == "trailing" else 3
        assert store.requests["put"] - puts < 7 + 2 * 2 + leading_records
        assert trio.current_time() == T
    assert fired(fires) == seven_at_once(mode, arrived, [T] * 7)


# ------------------------------------------------------------ a ping at the due time


async def _ping_at(coordinator: Coordinator, at: float, payload: str, **kw: Any) -> Any:
    await trio.sleep_until(at)
    return await coordinator.debounce("wf", "k", payload, run_id=payload, **kw)


@pytest.mark.parametrize("pinger", ["owner", "peer"])
async def test_a_ping_at_exactly_the_owners_deadline_opens_the_next_window(
    autojump_clock: trio.testing.MockClock, pinger: str
) -> None:
    # The owner's timer and the ping run at the same instant, in either order (Trio
    # picks): the tie is decided by time. Several rounds, so both orders happen.
    for n in range(8):
        store, fires = MemoryStore(epoch=0.0), Fires()
        async with processes(store, fires, "AB") as (a, b):
            t0 = trio.current_time()
            await a.debounce("wf", "k", "a", delay=DELAY, run_id="a")
            who = a if pinger == "owner" else b
            r = await _ping_at(who, t0 + DELAY, "b", delay=DELAY)
            assert (r.outcome, r.active_run_id, r.ping_count, r.owner) == (
                Outcome.SCHEDULE_TRAILING,
                "b",
                1,
                True,
            ), n
        assert fired(fires) == [
            (t0 + DELAY, "a", "trailing", "a", 1, t0),
            (t0 + 2 * DELAY, "b", "trailing", "b", 1, t0 + DELAY),
        ], n


@pytest.mark.parametrize("pinger", ["owner", "peer"])
async def test_a_ping_at_exactly_the_cap_opens_the_next_window(
    autojump_clock: trio.testing.MockClock, pinger: str
) -> None:
    # Cap 4 (max_delay), pings every 2 s with delay 3: the window is due at its cap,
    # and the ping at the cap opens the next window, whoever pings.
    for n in range(8):
        store, fires = MemoryStore(epoch=0.0), Fires()
        async with processes(store, fires, "AB") as (a, b):
            t0 = trio.current_time()
            kw: dict[str, Any] = {"delay": 3.0, "max_delay": 4.0}
            await a.debounce("wf", "k", "a1", run_id="a1", **kw)
            r = await _ping_at(b, t0 + 2.0, "b1", **kw)
            assert r.ping_count == 2
            who = a if pinger == "owner" else b
            r = await _ping_at(who, t0 + 4.0, "x", **kw)
            assert (r.active_run_id, r.ping_count, r.owner) == ("x", 1, True), n
        assert fired(fires) == [
            (t0 + 4.0, "a1", "trailing", "b1", 2, t0),
            (t0 + 7.0, "x", "trailing", "x", 1, t0 + 4.0),
        ], n


@pytest.mark.parametrize("pinger", ["owner", "peer"])
async def test_a_ping_at_the_max_count_instant_opens_the_next_window_with_a_leading_fire(
    autojump_clock: trio.testing.MockClock, pinger: str
) -> None:
    # The peer's ping that reaches max_count makes the window due at once (its process
    # takes the fire); a ping at the same instant, from the owner or from the peer,
    # opens the next window and fires its leading edge.
    for n in range(4):
        store, fires = MemoryStore(epoch=0.0), Fires()
        async with processes(store, fires, "AB") as (a, b):
            t0 = trio.current_time()
            kw: dict[str, Any] = {"delay": DELAY, "mode": "both", "max_count": 2}
            await a.debounce("wf", "k", "a", run_id="a", **kw)
            await b.debounce("wf", "k", "b", run_id="b", **kw)
            who = a if pinger == "owner" else b
            r = await who.debounce("wf", "k", "c", run_id="c", **kw)
            assert (r.outcome, r.active_run_id, r.ping_count) == (Outcome.FIRE_IMMEDIATE, "c", 1)
        assert fired(fires) == [
            (t0, "a", "leading", "a", 1, t0),
            (t0, "a", "trailing", "b", 2, t0),
            (t0, "c", "leading", "c", 1, t0),
        ], n


#: What B fires after :func:`_dead_owner_and_b`'s ping at 10 s: D's window at its own
#: time (D's payload and first ping), then B's window opened by that ping.
D_THEN_B = [
    (DELAY, "d", "trailing", "d", 1, 0.0),
    (10.0 + DELAY, "b", "trailing", "b", 1, 10.0),
]


async def _dead_owners_due_window() -> MemoryStore:
    """A store holding the window of D, a process that opened it (due at DELAY, run
    "d", payload "d") and died."""
    store = MemoryStore(epoch=0.0)
    d = backend(store, "D")
    await d.refresh_lease()
    await d.register(
        "wf", "k", mode=Mode.TRAILING, delay=DELAY, max_delay=None, run_id="d", payload="d"
    )
    return store


@contextlib.asynccontextmanager
async def _dead_owner_and_b(fires: Fires) -> AsyncIterator[tuple[Coordinator, MemoryBackend]]:
    """D's due window, and B, an at-most-once process with a 60 s lease, at 10 s less
    a millisecond (the test arms B's store faults, then pings at 10 s)."""
    store = await _dead_owners_due_window()
    async with processes(
        store, fires, "B", backend_options={"process_lease": 60.0}, delivery="at-most-once"
    ) as (b,):
        backend_b = b._backend
        assert isinstance(backend_b, MemoryBackend)
        await trio.sleep_until(10.0 - 0.001)
        yield b, backend_b


async def test_a_ping_into_a_dead_owners_due_window_takes_its_fire_and_opens_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # D opened a window due at 4 and died (its lease lapses at 6, beyond the skew at
    # 7). B's ping at 10, before any heartbeat of B noticed the death, takes the fire
    # (B runs its handler: D's payload and count, fired at the window's own time) and
    # opens the next window, owned by B, instead of taking the due window over.
    store, fires = await _dead_owners_due_window(), Fires()
    # A lease of 60 s: B heartbeats every 20 s.
    async with processes(store, fires, "B", backend_options={"process_lease": 60.0}) as (b,):
        r = await _ping_at(b, 10.0, "b", delay=DELAY)
        assert (r.outcome, r.active_run_id, r.ping_count, r.owner) == (
            Outcome.SCHEDULE_TRAILING,
            "b",
            1,
            True,
        )
        assert b.statistics().takeovers == 0
        await trio.sleep(DELAY)
    assert [(p, f.edge) for p, f in fires.log] == [("B", Edge.TRAILING)] * 2
    assert fired(fires) == D_THEN_B


@pytest.mark.parametrize("slow", [3.0, 30.0])
async def test_at_most_once_a_taken_fire_whose_answer_is_slow_is_proven_and_fires_once(
    autojump_clock: trio.testing.MockClock, slow: float
) -> None:
    # As the previous test, at-most-once, but the tombstone of B's take lands at once
    # and its answer comes after op_timeout (2 s): 3 s, or 30 s (half B's lease). B's
    # ping goes on (it re-reads and opens the next window); B proves the take by
    # re-reading, and runs D's fire once, at the window's own time, attempt 1.
    fires = Fires()
    async with _dead_owner_and_b(fires) as (b, backend_b):
        backend_b.faults.delay_next(slow, ops=("put",))  # the take's tombstone
        r = await _ping_at(b, 10.0, "b", delay=DELAY)
        assert (r.active_run_id, r.ping_count, r.owner) == ("b", 1, True)
        assert trio.current_time() <= 10.0 + 2 * 2.0  # within 2 * op_timeout
        await trio.sleep(DELAY + slow)
        assert b.statistics().dropped_fires == 0
    assert [(p, f.attempt) for p, f in fires.log] == [("B", 1)] * 2
    assert fired(fires) == D_THEN_B


@pytest.mark.parametrize("second", [0.5, 2.0])
async def test_at_most_once_a_taken_fire_whose_first_write_lands_late_is_recognised(
    autojump_clock: trio.testing.MockClock, second: float
) -> None:
    # B's take sends a tombstone that fails at once (0.2 s) and reaches the store 1 s
    # after it was sent (a leader election); B's re-read, stalled 0.5 s, sees the
    # window still open, so the take decides again with a new write id, which
    # conflicts. The proof knows the first write: in the key's turn (the second write
    # answers in 0.5 s) or after it, by re-reads (it answers after op_timeout, 2 s).
    fires = Fires()
    async with _dead_owner_and_b(fires) as (b, backend_b):
        backend_b.faults.stall_next(1.0, ops=("put",), fail_after=0.2)
        backend_b.faults.stall_next(0.5, ops=("get",))
        backend_b.faults.stall_next(second, ops=("put",))
        await _ping_at(b, 10.0, "b", delay=DELAY)
        await trio.sleep(DELAY + 10.0)
        assert b.statistics().dropped_fires == 0
    assert fired(fires) == D_THEN_B


async def test_an_exit_waits_for_the_proof_of_a_taken_fire(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # As above with a 30 s answer, but B's block ends right after its ping: the exit
    # waits for the proof (at most a lease), and the taken fire runs, once.
    fires = Fires()
    async with _dead_owner_and_b(fires) as (b, backend_b):
        backend_b.faults.delay_next(30.0, ops=("put",))
        await _ping_at(b, 10.0, "b", delay=DELAY)
    assert trio.current_time() < 10.0 + 60.0
    assert b.statistics().dropped_fires == 0
    assert [f.run_id for _, f in fires.log] == ["d", "b"]
    assert fires.log[0][1].attempt == 1
    assert fires.log[0][1].fired_at == DELAY


@pytest.mark.parametrize("slow", ["owner", "pinger"])
async def test_a_ping_meeting_a_window_whose_finalize_is_in_flight_opens_the_next_one(
    autojump_clock: trio.testing.MockClock, slow: str
) -> None:
    # A's finalize of its window (due at 4) is in flight when B's ping at or after 4
    # meets the window: B takes the fire by compare-and-swap. The compare-and-swap
    # decides: the slow one (its fire record's put answered late) loses, re-reads and
    # (B) opens the next window at its ping's time, or (A) abandons. The window fires
    # once, with its own ping.
    store, fires = MemoryStore(epoch=0.0), Fires()
    async with processes(store, fires, "AB") as (a, b):
        backend_a, backend_b = a._backend, b._backend
        assert isinstance(backend_a, MemoryBackend)
        assert isinstance(backend_b, MemoryBackend)
        await a.debounce("wf", "k", "a", delay=DELAY, run_id="a")
        if slow == "owner":
            await trio.sleep_until(DELAY - 0.25)
            backend_a.faults.delay_next(0.5, ops=("put",))  # A's record: answered at 4.5
            r = await _ping_at(b, DELAY + 0.25, "b", delay=DELAY)
            ping_at = DELAY + 0.25
        else:
            backend_b.faults.delay_next(0.5, ops=("put",))
            r = await _ping_at(b, DELAY, "b", delay=DELAY)
            ping_at = DELAY
        assert (r.active_run_id, r.ping_count, r.owner) == ("b", 1, True)
        await trio.sleep(2 * DELAY)
        assert a.statistics().unconfirmed_fires == 0
    assert fired(fires) == [
        (DELAY, "a", "trailing", "a", 1, 0.0),
        (ping_at + DELAY, "b", "trailing", "b", 1, ping_at),
    ]
    assert [p for p, f in fires.log if f.run_id == "a"] == ["B" if slow == "owner" else "A"]


async def test_max_count_in_a_tight_loop_of_a_peer_fires_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # B, which does not own the window, pings in a loop at one instant: its ping that
    # reaches max_count makes the window due, and its next ping takes the fire at once
    # (it used to wait for the owner's commit, about half an operation deadline, and
    # then land in the due window).
    store, fires = MemoryStore(epoch=0.0), Fires()
    async with processes(store, fires, "AB") as (a, b):
        await trio.sleep(T)
        await a.debounce("wf", "k", 0, delay=DELAY, run_id="r0", max_count=3)
        for i in range(1, 7):
            await b.debounce("wf", "k", i, delay=DELAY, run_id=f"r{i}", max_count=3)
        assert trio.current_time() == T
        await trio.sleep(2 * DELAY)
    assert fired(fires) == seven_at_once("trailing", range(7), [T] * 7)
    assert [p for p, f in fires.log if f.run_id in ("r0", "r3")] == ["B", "B"]


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_requests_of_a_ping_at_the_due_time(
    autojump_clock: trio.testing.MockClock, delivery: Any
) -> None:
    # docs/protocol.rst, "Requests per operation": the take costs what a taker's
    # finalize does (a fire record and the tombstone under at-least-once, the tombstone
    # under at-most-once, against the revision the ping read or knew), then the ping
    # opens the next window over the tombstone it wrote, unread.
    store = MemoryStore(epoch=0.0)
    a, b = backend(store, "A"), backend(store, "B")
    await a.refresh_lease()
    await b.refresh_lease()  # B's lease table knows A
    a.attach(delivery=delivery)
    b.attach(delivery=delivery)
    record = 1 if delivery == "at-least-once" else 0

    async def cost(pinger: MemoryBackend, run_id: str) -> dict[str, int]:
        before = store.requests.copy()
        r = await pinger.register(
            "wf", "k", mode=Mode.TRAILING, delay=DELAY, max_delay=None, run_id=run_id
        )
        spent = dict(store.requests - before)
        [taken] = r.taken
        assert (r.outcome.value, r.run_id, taken.outcome.value) == ("opened", run_id, "fire")
        if taken.fire_id is not None:
            await pinger.complete(taken.fire_id)
        return spent

    await a.register("wf", "k", mode=Mode.TRAILING, delay=DELAY, max_delay=None, run_id="r1")
    await trio.sleep(DELAY)
    # a peer that does not know the key's revision: 1 get first
    assert await cost(b, "r2") == {"get": 1, "put": 2 + record}
    await trio.sleep(DELAY)
    # the owner of the due window, which knows its revision
    assert await cost(b, "r3") == {"put": 2 + record}


def test_an_older_ping_leaves_the_later_pings_time() -> None:
    # A ping made before the window's latest one but landed after it (docs/protocol.rst,
    # "A ping: register") counts, and leaves at and last as the later ping set them; a
    # max_count it reaches makes the window due at the later ping's time.
    a = backend(MemoryStore(epoch=0.0), "A")
    me = Identity(a.process_id, a.epoch, JsonSerializer(), MemoryStore().max_value_bytes)
    kw: dict[str, Any] = {"mode": Mode.TRAILING, "max_delay": None, "run_id": "r", "own": None}

    def apply(
        doc: WindowDoc | None, now: float, delay: float, write: str, payload: str, **options: Any
    ) -> WindowDoc:
        ping = Ping(delay=delay, text=payload, **kw, **options)
        _, new, _ = apply_ping(doc, ping, me, now, write, owner_live=True, takeover=True)
        return new

    doc = apply(None, 2.0, delay=4.0, write="w0", payload="0")
    new = apply(doc, 1.0, delay=1.0, write="w1", payload="1")
    assert (new.at, new.last, new.count, new.payload) == (6.0, 2.0, 2, "1")
    doc = apply(None, 2.0, delay=4.0, write="w0", payload="0", max_count=2)
    new = apply(doc, 1.0, delay=1.0, write="w1", payload="1", max_count=2)
    assert (new.at, new.last, new.count) == (2.0, 2.0, 2)
