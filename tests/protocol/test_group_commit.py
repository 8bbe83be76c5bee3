"""Group commit: pings of one key that arrive while a write of it is in flight go out
together in the next compare-and-swap (see docs/protocol.rst, "Group commit").

Protocol logic on MemoryStore under MockClock, with StoreFaults.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any
from unittest import mock

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness.fires import Fires
from trio_debounce import (
    BackendUnavailableError,
    Finalized,
    JsonSerializer,
    Mode,
    Registered,
    open_coordinator,
)
from trio_debounce._backend import Registration
from trio_debounce._flow import Flow, FlowSpec, stored_as
from trio_debounce._protocol import RunMarker, WindowDoc, _rules
from trio_debounce._protocol._rules import Identity, Ping
from trio_debounce.testing import MemoryBackend, MemoryStore

KEY = "w.d2Y.aw"  # window ("wf", "k")


def stored(store: MemoryStore) -> WindowDoc:
    entry = store.raw_get(KEY)
    assert entry is not None
    assert entry.value is not None
    return WindowDoc.decode(entry.value)


async def ping(backend: MemoryBackend, payload: Any, results: dict[Any, Any], **kw: Any) -> None:
    """Register one ping; its Registration (or the exception it raised) goes to
    ``results[payload]``, with the Trio time it returned at."""
    kw.setdefault("mode", Mode.TRAILING)
    try:
        r: Any = await backend.register(
            "wf", "k", delay=5.0, max_delay=None, run_id=f"r{payload}", payload=payload, **kw
        )
    except BackendUnavailableError as exc:
        r = exc
    results[payload] = (r, trio.current_time())


async def burst(backend: MemoryBackend, n: int, **kw: Any) -> dict[Any, Any]:
    """Ping 0 writes first (its answer 1 s late); pings 1..n-1 arrive while it is in
    flight, 0.01 s apart, in that order."""
    results: dict[Any, Any] = {}
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(partial(ping, backend, i, results, **kw))
            await trio.sleep(0.01)
    return results


async def test_pings_in_flight_are_merged_into_one_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    a.faults.delay_next(1.0, ops=("put",))
    before = store.requests.copy()
    results = await burst(a, 10)
    assert store.requests["put"] - before["put"] == 2  # ping 0, then pings 1..9 at once
    first: Registration = results[0][0]
    assert (first.outcome, first.ping_count) == (Registered.OPENED, 1)
    merged: list[Registration] = [results[i][0] for i in range(1, 10)]
    # each returns once the write that carries it is acknowledged, and reports the
    # window as that write left it
    assert {r.outcome for r in merged} == {Registered.EXTENDED}
    assert {(r.ping_count, r.payload, r.fencing_token) for r in merged} == {
        (10, 9, merged[0].fencing_token)
    }
    assert merged[0].fencing_token > first.fencing_token
    doc = stored(store)
    assert (doc.count, doc.payload, doc.run_id) == (10, "9", "r0")


async def test_merged_pings_keep_their_arrival_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    a.faults.delay_next(1.0, ops=("put",))
    await burst(a, 20, payload_policy="collect", max_items=100)
    assert store.requests["put"] == 3  # the lease, ping 0, pings 1..19
    assert _rules.load_payload(a._me.serializer, stored(store).payload) == list(range(20))


async def test_a_leading_opening_ping_is_written_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Its leading fire carries its own payload: it is never merged with later pings.
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    a.faults.delay_next(1.0, ops=("get",))  # the first read is slow: all 5 queue up
    results = await burst(a, 5, mode=Mode.LEADING)
    outcomes = [(results[i][0].outcome, results[i][0].payload) for i in range(5)]
    assert outcomes[0] == (Registered.OPENED, 0)
    assert {o for o, _ in outcomes[1:]} == {Registered.EXTENDED}
    # the lease, the leading fire's record (at-least-once), ping 0 alone, pings 1..4
    assert store.requests["put"] == 4
    assert stored(store).count == 5


async def test_a_merged_ping_cannot_be_withdrawn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The caller of a merged ping is cancelled while the ping waits: the ping is still
    # written, and the call returns its result instead of raising Cancelled.
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    a.faults.delay_next(1.0, ops=("put",))
    results: dict[Any, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ping, a, 0, results)
        await trio.sleep(0.1)
        with trio.CancelScope() as scope:

            async def cancel_soon() -> None:
                await trio.sleep(0.1)  # the ping is merged by then
                scope.cancel()

            nursery.start_soon(cancel_soon)
            r = await a.register(
                "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id="r1", payload=1
            )
        assert scope.cancel_called
        assert not scope.cancelled_caught
    assert (r.outcome, r.ping_count, r.payload) == (Registered.EXTENDED, 2, 1)
    assert stored(store).count == 2


async def test_a_batch_is_governed_by_its_oldest_pings_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Pings 1 and 2 arrive while ping 0's write is in flight (answered at t0+1.5); their
    # batch loses every compare-and-swap, so it fails at ping 1's deadline (t0+0.5+2):
    # ping 2, which arrived at t0+1.4, fails then too, well within its own deadline.
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A", op_timeout=2.0)
    await a.refresh_lease()
    a.faults.delay_next(1.5, ops=("put",))
    results: dict[Any, Any] = {}
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ping, a, 0, results)
        await trio.sleep(0.5)
        nursery.start_soon(ping, a, 1, results)
        await trio.sleep(0.1)
        a.faults.conflict_next(10_000)
        await trio.sleep(0.8)
        nursery.start_soon(ping, a, 2, results)
    assert isinstance(results[0][0], Registration)
    for i in (1, 2):
        error, returned_at = results[i]
        assert isinstance(error, BackendUnavailableError)
        assert returned_at == pytest.approx(t0 + 2.5)
    assert stored(store).count == 1


async def test_an_ambiguous_batch_is_resolved_by_rereading_its_write_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The batch of pings 1..4 lands, but its answer is lost past the batch's deadline:
    # a re-read finds its write id, and every ping of it is answered as stored.
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A", op_timeout=2.0)
    await a.refresh_lease()
    a.faults.delay_next(1.0, ops=("put",))
    a.faults.delay_next(10.0, ops=("put",))
    results = await burst(a, 5)
    for i in range(1, 5):
        r = results[i][0]
        assert isinstance(r, Registration)
        assert (r.outcome, r.ping_count, r.stored) == (Registered.EXTENDED, 5, True)
    assert stored(store).count == 5  # written once


async def test_a_batch_that_did_not_land_is_written_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The batch's write fails without being applied (the error is ambiguous): the
    # re-read does not find its write id, so it is written again, counted once.
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    a.faults.delay_next(1.0, ops=("put",))
    a.faults.fail_next(1, ops=("put",))
    results = await burst(a, 5)
    assert {results[i][0].ping_count for i in range(1, 5)} == {5}
    assert stored(store).count == 5


async def test_a_batch_whose_write_is_lost_and_unreadable_fails_open_after_the_reread(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The write lands, its answer is lost, and the store stays out of reach for the
    # re-read: only then (one op_timeout after the batch's deadline) do the pings fail.
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A", op_timeout=2.0)
    await a.refresh_lease()
    a.faults.delay_next(1.0, ops=("put",))
    a.faults.delay_next(10.0, ops=("put",))
    t0 = trio.current_time()

    async def cut_off() -> None:
        await trio.sleep(2.0)
        a.faults.partitioned = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cut_off)
        results = await burst(a, 5)
    for i in range(1, 5):
        error, returned_at = results[i]
        assert isinstance(error, BackendUnavailableError)
        # the batch's deadline (ping 1's: t0+0.01+2), then the re-read's op_timeout
        assert returned_at == pytest.approx(t0 + 4.01, abs=0.02)


async def test_hot_key_through_the_coordinator_fires_once_with_every_ping(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    backend = MemoryBackend(store, process_id="A")
    async with open_coordinator(handlers={"wf": fires.handler("A")}, backend=backend) as a:
        payloads: list[int] = []

        async def pinger(task: int) -> None:
            for i in range(50):
                payloads.append(task * 100 + i)
                await a.debounce("wf", "k", task * 100 + i, delay=1.0)

        puts = store.requests["put"]
        async with trio.open_nursery() as nursery:
            for task in range(20):
                nursery.start_soon(pinger, task)
        assert store.requests["put"] - puts < 1000  # merged
    [(_, fire)] = fires.log
    assert fire.ping_count == 1000
    # the stored payload is that of the last ping to arrive
    assert fire.payload == payloads[-1]


async def test_a_finalize_waits_for_its_keys_write_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The owner's ping is being written when its finalize comes: the finalize takes the
    # key's next turn, so it sees that write (which moved the fire time) instead of
    # committing against the revision before it and losing the compare-and-swap. (The
    # ping comes before the due time: one at it would take the fire itself.)
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    kw: dict[str, Any] = {"mode": Mode.TRAILING, "delay": 1.0, "max_delay": None}
    await a.register("wf", "k", run_id="r", payload=0, **kw)
    await trio.sleep(0.875)
    a.faults.delay_next(0.5, ops=("put",))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(a.register, "wf", "k", run_id="s", payload=1, **kw))
        await trio.sleep(0.1)
        result = await a.finalize("wf", "k", "r")
    assert result.outcome is Finalized.RESCHEDULE
    assert a.conflicts == 0


async def test_a_peers_ping_races_the_owners_commit_of_a_window_due_at_its_cap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # B's ping after a window's cap never joins it: it takes the window's fire by
    # compare-and-swap while A's commit is in flight (slow), and opens the next window.
    # The compare-and-swap decides: the window fires once, with its own ping and
    # payload (here B wins: A's record put is slow), and the loser re-reads.
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    b = MemoryBackend(store, process_id="B")
    await a.refresh_lease()
    await b.refresh_lease()
    kw: dict[str, Any] = {"mode": Mode.TRAILING, "delay": 1.0, "max_delay": 1.0}
    await a.register("wf", "k", run_id="r", payload="a", **kw)
    await trio.sleep(1.0)
    a.faults.delay_next(0.5, ops=("put",))  # A's commit is slow: B's ping comes during it
    results: dict[Any, Any] = {}

    async def owner() -> None:
        results["a"] = await a.finalize("wf", "k", "r")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(owner)
        await trio.sleep(0.1)
        results["b"] = await b.register("wf", "k", run_id="s", payload="b", **kw)
    fires = [f for f in (results["a"], *results["b"].taken) if f.outcome is Finalized.FIRE]
    assert [(f.ping_count, f.payload, f.scheduled_at) for f in fires] == [
        (1, "a", 1.0 + store.epoch)
    ]
    assert (results["b"].outcome, results["b"].run_id) == (Registered.OPENED, "s")
    assert results["b"].ping_count == 1


# ------------------------------------------------------ the window options, merged


async def register_any(
    backend: MemoryBackend, payload: Any, results: dict[Any, Any], **kw: Any
) -> None:
    """Like ``ping``, keeping whatever the call raised."""
    kw.setdefault("mode", Mode.TRAILING)
    kw.setdefault("delay", 5.0)
    try:
        r: Any = await backend.register(
            "wf", "k", max_delay=None, run_id=f"r{payload}", payload=payload, **kw
        )
    except Exception as exc:
        r = exc
    results[payload] = r


async def burst_each(backend: MemoryBackend, kws: list[dict[str, Any]]) -> dict[Any, Any]:
    """Ping i (payload i, options ``kws[i]``) 0.01 s after ping i-1: ping 0 writes
    first, the others wait for its write (delayed by the caller) and go out together."""
    results: dict[Any, Any] = {}
    async with trio.open_nursery() as nursery:
        for i, kw in enumerate(kws):
            nursery.start_soon(partial(register_any, backend, i, results, **kw))
            await trio.sleep(0.01)
    return results


def _append(acc: Any, value: Any) -> Any:
    if value == "boom":
        raise RuntimeError("the reducer refuses boom")
    return [*acc, value]


APPEND = {
    "payload_policy": "append",
    "reducer": (_append, list),
    "max_items": 100,
    "overflow": "fire-early",
}


async def test_merged_reducer_pings_fold_in_arrival_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    a.faults.delay_next(1.0, ops=("put",))
    before = store.requests.copy()
    results = await burst_each(a, [APPEND] * 10)
    assert store.requests["put"] - before["put"] == 2  # ping 0, then pings 1..9 at once
    assert store.requests["get"] - before["get"] == 1  # ping 0's: the batch needs none
    merged: list[Registration] = [results[i] for i in range(1, 10)]
    assert {(r.outcome, r.ping_count) for r in merged} == {(Registered.EXTENDED, 10)}
    assert all(r.payload == list(range(10)) for r in merged)  # the window's value
    doc = stored(store)
    assert (doc.count, doc.held, _rules.load_payload(a._me.serializer, doc.payload)) == (
        10,
        10,
        list(range(10)),
    )


async def test_a_raising_reducer_fails_only_its_own_merged_ping(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    a.faults.delay_next(1.0, ops=("put",))
    results: dict[Any, Any] = {}
    async with trio.open_nursery() as nursery:
        for i, payload in enumerate([0, 1, "boom", 3]):
            nursery.start_soon(partial(register_any, a, payload, results, **APPEND))
            await trio.sleep(0.01 * (i + 1))
    assert isinstance(results["boom"], RuntimeError)
    assert (results[3].outcome, results[3].ping_count) == (Registered.EXTENDED, 3)
    assert (results[1].outcome, results[1].ping_count) == (Registered.EXTENDED, 3)
    assert _rules.load_payload(a._me.serializer, stored(store).payload) == [0, 1, 3]


async def test_a_stale_merged_ping_is_dropped_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The key's last fired order key is 10 (kept in the tombstone): merged pings with
    # keys 5 and 3 are stale, the others are written by one compare-and-swap.
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    opts = {"drop_stale": True}
    r = await a.register(
        "wf", "k", mode=Mode.TRAILING, delay=1.0, max_delay=None, run_id="r",
        payload="x", order_key=10, drop_stale=True,
    )  # fmt: skip
    f = await a.finalize("wf", "k", r.run_id, force=True)
    assert f.outcome is Finalized.FIRE
    assert stored(store).fired_order == 10
    a.faults.delay_next(1.0, ops=("put",))
    before = store.requests.copy()
    keys = [11, 12, 5, 13, 3, 14]
    results = await burst_each(a, [{**opts, "order_key": k} for k in keys])
    outcomes = [results[i].outcome for i in range(len(keys))]
    assert outcomes == [
        Registered.OPENED,
        Registered.EXTENDED,
        Registered.STALE,
        Registered.EXTENDED,
        Registered.STALE,
        Registered.EXTENDED,
    ]
    assert {results[i].run_id for i in (2, 4)} == {"r0"}  # the open window's
    assert {results[i].ping_count for i in (1, 3, 5)} == {4}
    # ping 0, then the batch; its stale pings are decided on a fresh read (1 get)
    assert store.requests["put"] - before["put"] == 2
    assert store.requests["get"] - before["get"] == 1
    doc = stored(store)
    assert (doc.count, doc.max_order, doc.fired_order) == (4, 14, 10)


async def test_a_full_fire_early_window_overflows_after_the_merged_pings_land(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # max_items=3: pings 1 and 2 fill the window in one write with ping 0's; pings 3
    # and 4 then find it full and answer overflowed, nothing written.
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    a.faults.delay_next(1.0, ops=("put",))
    opts = {**APPEND, "max_items": 3, "overflow": "fire-early"}
    results = await burst_each(a, [opts] * 5)
    assert [results[i].outcome for i in range(3)] == [
        Registered.OPENED,
        Registered.EXTENDED,
        Registered.EXTENDED,
    ]
    assert results[2].ping_count == 3
    for i in (3, 4):
        r = results[i]
        assert (r.overflowed, r.stored, r.run_id, r.ping_count) == (True, False, "r0", 3)
    doc = stored(store)
    assert (doc.count, _rules.load_payload(a._me.serializer, doc.payload)) == (3, [0, 1, 2])


async def test_merged_pings_of_a_queue_latest_window_that_waits_report_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    a = MemoryBackend(store, process_id="A")
    await a.refresh_lease()
    opts = {"overlap": "queue-latest", "delay": 0.5}
    r = await a.register("wf", "k", max_delay=None, run_id="r", payload="x", mode=Mode.TRAILING,
                         delay=0.0, overlap="queue-latest")  # fmt: skip
    f = await a.finalize("wf", "k", r.run_id)
    assert (f.outcome, f.blocks) == (Finalized.FIRE, True)  # its run blocks the key
    a.faults.delay_next(1.0, ops=("put",))
    results = await burst_each(a, [opts] * 4)
    assert results[0].outcome is Registered.OPENED
    assert not results[0].waiting
    # the batch lands 1 s later: the window (due at 0.5 s) waits for the run
    merged: list[Registration] = [results[i] for i in (1, 2, 3)]
    assert {(r.outcome, r.waiting, r.ping_count) for r in merged} == {
        (Registered.EXTENDED, True, 4)
    }
    doc = stored(store)
    assert doc.running is not None
    assert doc.count == 4
    # when the owner looks again (the run's process's lease), not the due time
    assert len({r.scheduled_at for r in merged}) == 1
    assert merged[0].scheduled_at is not None
    assert merged[0].scheduled_at > doc.at
    assert await a.end_run("wf", "k", r.run_id) == doc.run_id  # it fires now


# ------------------------------------------- folding runs of plain pings (_fold_plain)

_MODES = (Mode.TRAILING, Mode.TRAILING, Mode.TRAILING, Mode.LEADING, Mode.BOTH)
#: The flow windows whose pings fold (a both-edges throttle, an audit), by name.
_FLOWS = {
    "throttle": FlowSpec(Flow.THROTTLE, 4.0),
    "audit": FlowSpec(Flow.AUDIT, 4.0, leading=False),
}


@st.composite
def _batches(draw: st.DrawFn) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A window as read (or none), how it was found, and a batch of pings for it:
    mostly plain ones (any mode, delays that move the time either way), some with
    options that the window refuses or that open a window of their own."""
    window = draw(
        st.fixed_dictionaries(
            {
                "kind": st.sampled_from(["open", "open", "open", "fired", "none", "options"]),
                "mine": st.booleans(),
                "live": st.booleans(),
                "takeover": st.booleans(),
                "mode": st.sampled_from(_MODES),
                "max_delay": st.sampled_from([None, 3.0, 30.0]),
                "armed_in": st.sampled_from([0.5, 2.0, 10.0]),
                "running": st.booleans(),
                "blocked": st.sampled_from([None, 1_000.0]),
                # A flow window (its mode and times then its flow's): its pings fold too.
                "flow": st.sampled_from([None, None, None, "throttle", "audit"]),
                # 1: a both-edges window before its first ping after the leading fire.
                "count": st.sampled_from([1, 3, 3]),
            }
        )
    )
    ping = st.fixed_dictionaries(
        {
            "mode": st.sampled_from(_MODES),
            "delay": st.sampled_from([0.0, 1.0, 2.0, 4.0, 8.0]),
            "option": st.sampled_from([None] * 6 + ["max_count", "order_key", "first", "alone"]),
            # The window's flow (most often), none, or another.
            "flow": st.sampled_from(["window", "window", "window", None, "throttle", "audit"]),
        }
    )
    return window, draw(st.lists(ping, min_size=1, max_size=12))


def _apply(window: dict[str, Any], pings: list[dict[str, Any]], fold: bool) -> tuple[Any, ...]:
    me = Identity("A", "E", JsonSerializer(), MemoryStore().max_value_bytes)  # both runs
    takeover: bool = window["takeover"]
    now = 1_700_000_100.0
    doc: WindowDoc | None = None
    if window["kind"] != "none":
        options: dict[str, Any] = {"max_count": 50} if window["kind"] == "options" else {}
        spec = _FLOWS.get(window["flow"])
        if spec is None:
            first = Ping(window["mode"], 4.0, window["max_delay"], "r0", "0", None, **options)
        else:
            first = Ping(stored_as(spec), spec.span, spec.span, "r0", "0", None, flow=spec)
        _, doc, _ = _rules.apply_ping(
            None, first, me, now - 2.0, "w0", owner_live=True, takeover=takeover
        )
        assert doc is not None
        doc = replace(doc, armed=now + window["armed_in"], count=window["count"])
        if not window["mine"]:
            doc = replace(doc, owner="B", epoch="e")
        if window["running"]:
            doc = replace(doc, running=RunMarker("B", "e", "q", None))
        if window["kind"] == "fired":
            doc = replace(doc, fired=True)
    batch: list[Ping] = []
    for i, p in enumerate(pings):
        option = p["option"]
        flow = _FLOWS.get(window["flow"] if p["flow"] == "window" else p["flow"])
        if flow is not None:
            batch.append(
                Ping(
                    stored_as(flow), flow.span, flow.span, f"r{i + 1}", str(i + 1), i + 1, flow=flow
                )
            )
            batch[-1].alone = option == "alone"
            continue
        batch.append(
            Ping(
                mode=p["mode"],
                delay=p["delay"],
                max_delay=None,
                run_id=f"r{i + 1}",
                text=str(i + 1),
                own=i + 1,
                max_count=50 if option == "max_count" else None,
                payload_policy="first" if option == "first" else "last",
                order_key=float(i) if option == "order_key" else None,
                max_items=None,
            )
        )
        batch[-1].alone = option == "alone"
    folds: list[bool] = []
    real_fold = _rules.fold_plain

    def spy(*args: Any, **kwargs: Any) -> Any:
        # Without fold, the batch sees every run as one it cannot fold (as for a run
        # that would take the window over): each ping goes through apply_ping.
        result = real_fold(*args, **kwargs) if fold else None
        folds.append(result is not None)
        return result

    with mock.patch.object(_rules, "fold_plain", spy):
        got = _rules.apply_batch(
            doc, window["live"], now, batch, "w1", False, window["blocked"], me, takeover=takeover
        )
    assert got is not None
    applied, new, take_at, rest = got.pings, got.doc, got.take_at, got.rest
    answered: dict[Ping, Any] = dict(got.answers)
    results = [
        r if r is None or isinstance(r, Registration) else (type(r), str(r))
        for r in (answered.get(ping) for ping in batch)
    ]
    return (
        [(batch.index(ping), outcome) for ping, outcome in applied],
        new,
        take_at,
        [batch.index(ping) for ping in rest],
        results,
        any(folds),
    )


@settings(max_examples=250, deadline=None)
@given(_batches())
def test_a_run_of_plain_pings_folds_into_what_applying_them_one_by_one_gives(
    case: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    window, pings = case
    folded = _apply(window, pings, fold=True)
    one_by_one = _apply(window, pings, fold=False)
    assert folded[:5] == one_by_one[:5]
    assert not one_by_one[5]
    # it does fold the common case: plain pings into an open plain window of their mode
    # (or of their flow)
    if (
        window["kind"] == "open"
        and (window["mine"] or window["live"] or not window["takeover"])
        and pings[0]["option"] is None
        and (
            (
                (window["flow"] is None and pings[0]["flow"] in ("window", None))
                and pings[0]["mode"] is window["mode"]
            )
            or (window["flow"] is not None and pings[0]["flow"] in ("window", window["flow"]))
        )
    ):
        assert folded[5]


@pytest.mark.parametrize("which", ["leader", "merged"])
async def test_a_cancelled_debounce_still_returns_its_stored_ping(
    autojump_clock: trio.testing.MockClock, which: str
) -> None:
    # debounce() opens no cancel scope of its own with this backend: the leader's
    # write is shielded and a merged ping's wait refuses cancellation. Either way the
    # call returns its result; the cancellation comes at the caller's next checkpoint.
    store = MemoryStore()
    backend = MemoryBackend(store, process_id="A")
    async with open_coordinator(handlers={"wf": Fires().handler("A")}, backend=backend) as a:
        await a.debounce("wf", "k", 0, delay=60.0)
        backend.faults.delay_next(1.0, ops=("put",))
        results: list[Any] = []

        async def pinger(payload: int, scope: trio.CancelScope) -> None:
            with scope:
                results.append(await a.debounce("wf", "k", payload, delay=60.0))
                await trio.lowlevel.checkpoint()
                results.append("not cancelled")

        scopes = {"leader": trio.CancelScope(), "merged": trio.CancelScope()}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pinger, 1, scopes["leader"])
            await trio.sleep(0.1)  # ping 1's write is in flight
            nursery.start_soon(pinger, 2, scopes["merged"])
            await trio.sleep(0.1)  # ping 2 waits to be merged into the next write
            scopes[which].cancel()
        assert scopes[which].cancelled_caught
        assert sorted(r.ping_count for r in results if r != "not cancelled") == [2, 3]
        assert results.count("not cancelled") == 1
        assert stored(store).count == 3


async def test_the_merged_pings_of_one_write_get_one_result_and_are_all_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The coordinator applies the first merged ping's registration and hands the
    # others (the same Registration object) the same result; each is still counted,
    # and a ping with its own on_fire is applied in full (its handler is the window's).
    store, fires = MemoryStore(), Fires()
    peer_fires = Fires()
    backend = MemoryBackend(store, process_id="A")
    peer = MemoryBackend(store, process_id="B")
    async with (
        open_coordinator(handlers={"wf": fires.handler("A")}, backend=backend) as a,
        open_coordinator(handlers={"wf": peer_fires.handler("B")}, backend=peer) as b,
    ):
        for coordinator, backend_ in ((a, backend), (b, peer)):
            await coordinator.debounce("wf", "k", 0, delay=60.0)
            backend_.faults.delay_next(1.0, ops=("put",))
            results: dict[int, Any] = {}

            async def pinger(i: int, on_fire: Any = None) -> None:
                results[i] = await coordinator.debounce(  # noqa: B023
                    "wf", "k", i, delay=60.0, on_fire=on_fire
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pinger, 1)  # its write is in flight for 1 s
                await trio.sleep(0.1)
                for i in range(2, 8):
                    on_fire = fires.handler(f"{coordinator is a} 5") if i == 5 else None
                    nursery.start_soon(pinger, i, on_fire)
                    await trio.sleep(0.01)
            merged = [results[i] for i in range(2, 8)]
            assert len(set(merged)) == 1
            assert merged[0].outcome.value == "coalesce"
            assert merged[0].owner == (coordinator is a)
        # A: 1 + 1 + 6 pings, B: 1 + 1 + 6; B's coalesce into A's window
        assert a.statistics().pings == 8
        assert b.statistics().pings == 8
        assert (a.statistics().coalesced, b.statistics().coalesced) == (7, 8)
        assert stored(store).count == 16
        # A's window, and its merged pings, are still armed: it fires with the last payload
        await trio.sleep(61.0)
    # by the handler of its latest ping with one: A's ping 5 (B's is not A's to use)
    [(handler, fire)] = fires.log
    assert (handler, fire.ping_count, fire.payload) == ("True 5", 16, 7)
    assert not peer_fires.log


async def test_the_pings_a_write_answered_join_the_next_write_when_they_ping_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Tasks pinging one key in a loop: once they are in step, each write carries one
    # ping of every task (a write answers its pings; they ping again before the next
    # write takes its batch), not alternately half of them.
    store = MemoryStore()
    backend = MemoryBackend(store, process_id="A")
    await backend.refresh_lease()
    counts: list[int] = []

    async def pinger() -> None:
        for i in range(20):
            r = await backend.register(
                "wf", "k", mode=Mode.TRAILING, delay=60.0, max_delay=None, run_id="r", payload=i
            )
            counts.append(r.ping_count)

    backend.faults.delay_next(0.01, n=1000, ops=("put",))
    puts = store.requests["put"]
    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(pinger)
    writes = store.requests["put"] - puts
    assert stored(store).count == len(counts) == 200
    # the first write brings the tasks in step (one ahead), then about 20 of 10 pings
    # (alternate halves would take 40)
    assert writes <= 22
    assert len(set(counts)) == writes  # each write's pings report the count it left
