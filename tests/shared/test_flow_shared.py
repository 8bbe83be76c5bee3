"""Throttle, audit, batch and rate limit across processes: coordinators that share a
``MemoryBackend`` store (MockClock), one window per key whoever pings it (see
docs/protocol.rst, "Flow-control windows"). ``test_flow_shared_properties.py`` checks
random timelines against the reference model; these are the cases by name."""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import LEASE, WF, near, process, processes
from trio_debounce import Outcome
from trio_debounce._keys import window_key
from trio_debounce.testing import MemoryStore


def fired(fires: Fires, key: str = "k") -> list[tuple[str, Any, int, str, str]]:
    """(process, payload, ping count, edge, reason) of the key's fires."""
    return [(p, f.payload, f.ping_count, f.edge.value, f.reason.value) for p, f in fires.of(key)]


async def test_a_throttle_fires_the_leading_edge_where_it_opened_and_the_trailing_at_its_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A", "B"]) as (a, b):
        t0 = trio.current_time()
        first = await a.throttle(WF, "k", 1, interval=10.0)
        assert first.outcome is Outcome.FIRE_IMMEDIATE
        await trio.sleep(1.0)
        second = await b.throttle(WF, "k", 2, interval=10.0)
        await trio.sleep(1.0)
        third = await b.throttle(WF, "k", 3, interval=10.0)
        assert (second.outcome, third.outcome) == (Outcome.COALESCE, Outcome.COALESCE)
        assert third.scheduled_at == near(t0 + 10.0)
        await trio.sleep(9.0)  # t=11
        assert fired(fires) == [
            ("A", 1, 1, "leading", "leading"),
            ("A", 3, 2, "trailing", "interval"),
        ]
        [_, (_, trailing)] = fires.of("k")
        assert trailing.first_ping_at == near(t0 + 1.0)  # the first ping after the leading fire
        assert trailing.fired_at == near(t0 + 10.0)
        # The cool-down [10, 20): a ping in it fires no leading edge, but the next
        # trailing one at its end.
        fourth = await b.throttle(WF, "k", 4, interval=10.0)
        assert fourth.outcome is Outcome.COALESCE
        await trio.sleep(10.0)  # t=21
        assert fired(fires)[2:] == [("B", 4, 1, "trailing", "interval")]
        assert fires.of("k")[2][1].fired_at == near(t0 + 20.0)
        # Nothing in [20, 30): the cool-down ends with no fire; a ping after it fires
        # at once.
        await trio.sleep(10.0)  # t=31
        assert len(fires.of("k")) == 3
        fifth = await a.throttle(WF, "k", 5, interval=10.0)
        assert fifth.outcome is Outcome.FIRE_IMMEDIATE
        await trio.sleep(0.1)
        assert fired(fires)[3:] == [("A", 5, 1, "leading", "leading")]


async def test_a_cool_down_longer_than_a_lease_outlives_the_sweeper(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    interval = 20 * LEASE
    async with processes(store, fires, ["A", "B"]) as (a, b):
        t0 = trio.current_time()
        await a.throttle(WF, "k", 1, interval=interval)
        await b.throttle(WF, "k", 2, interval=interval)
        await trio.sleep(interval + 1.0)
        assert len(fires.of("k")) == 2
        await trio.sleep(interval / 2)  # many sweeps later, inside the cool-down
        late = await b.throttle(WF, "k", 3, interval=interval)
        assert late.outcome is Outcome.COALESCE  # no leading fire: cooling down
        await trio.sleep(interval)
        assert fired(fires)[2:] == [("B", 3, 1, "trailing", "interval")]
        assert fires.of("k")[2][1].fired_at == near(t0 + 2 * interval)


async def test_a_leading_only_throttle_drops_the_pings_of_its_window_in_every_process(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A", "B"]) as (a, b):
        t0 = trio.current_time()
        assert (await a.throttle(WF, "k", 1, interval=5.0, trailing=False)).outcome is (
            Outcome.FIRE_IMMEDIATE
        )
        await trio.sleep(1.0)
        dropped = await b.throttle(WF, "k", 2, interval=5.0, trailing=False)
        assert dropped.outcome is Outcome.DROPPED
        assert (await a.throttle(WF, "k", 3, interval=5.0, trailing=False)).outcome is (
            Outcome.DROPPED
        )
        assert (a.statistics().dropped_pings, b.statistics().dropped_pings) == (1, 1)
        await trio.sleep_until(t0 + 5.0)  # exactly the window's end: the next window
        again = await b.throttle(WF, "k", 4, interval=5.0, trailing=False)
        assert again.outcome is Outcome.FIRE_IMMEDIATE
        await trio.sleep(10.0)
        assert fired(fires) == [
            ("A", 1, 1, "leading", "leading"),
            ("B", 4, 1, "leading", "leading"),
        ]


async def test_an_audit_fires_the_latest_payload_at_its_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A", "B"]) as (a, b):
        t0 = trio.current_time()
        opened = await a.throttle(WF, "k", 1, interval=10.0, leading=False)
        assert opened.outcome is Outcome.SCHEDULE_TRAILING
        for t, payload in ((3.0, 2), (9.0, 3)):
            await trio.sleep_until(t0 + t)
            assert (await b.throttle(WF, "k", payload, interval=10.0, leading=False)).outcome is (
                Outcome.COALESCE
            )
        await trio.sleep_until(t0 + 11.0)
        assert fired(fires) == [("A", 3, 3, "trailing", "interval")]
        assert fires.of("k")[0][1].fired_at == near(t0 + 10.0)


async def test_a_batch_fires_at_its_nth_item_wherever_it_comes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A", "B"]) as (a, b):
        t0 = trio.current_time()
        await a.batch(WF, "k", "x", max_wait=60.0, max_items=3)
        await trio.sleep(1.0)
        await b.batch(WF, "k", "y", max_wait=60.0, max_items=3)
        await trio.sleep(1.0)
        third = await b.batch(WF, "k", "z", max_wait=60.0, max_items=3)
        assert (third.outcome, third.ping_count) == (Outcome.COALESCE, 3)
        await trio.sleep(0.5)
        assert [f[1:] for f in fired(fires)] == [(["x", "y", "z"], 3, "trailing", "max-items")]
        assert fires.of("k")[0][1].fired_at == near(t0 + 2.0)  # that item's instant
        # The next item opens the next batch, fired by max_wait.
        nxt = await a.batch(WF, "k", "w", max_wait=60.0, max_items=3)
        assert nxt.outcome is Outcome.SCHEDULE_TRAILING
        await trio.sleep(61.0)
        assert [f[1:] for f in fired(fires)][1:] == [(["w"], 1, "trailing", "max-wait")]


async def test_a_batch_fires_before_an_item_that_would_pass_max_bytes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A", "B"]) as (a, b):
        await a.batch(WF, "k", "aaaa", max_wait=60.0, max_bytes=10)  # 6 bytes as JSON
        await trio.sleep(1.0)
        over = await b.batch(WF, "k", "bbbb", max_wait=60.0, max_bytes=10)  # 6 more
        assert over.outcome is Outcome.SCHEDULE_TRAILING  # it opened the next batch
        await trio.sleep(0.5)
        assert [f[1:] for f in fired(fires)] == [(["aaaa"], 1, "trailing", "max-bytes")]
        with pytest.raises(ValueError, match="13 bytes as JSON, more than max_bytes=10"):
            await a.batch(WF, "k", "x" * 11, max_wait=60.0, max_bytes=10)
        await trio.sleep(61.0)
        assert [f[1] for f in fired(fires)] == [["aaaa"], ["bbbb"]]


async def test_a_rate_limit_counts_the_fires_of_every_process(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A", "B"]) as (a, b):
        t0 = trio.current_time()
        one = await a.rate_limit(WF, "k", 1, limit=2, period=10.0)
        await trio.sleep(1.0)
        two = await b.rate_limit(WF, "k", 2, limit=2, period=10.0)
        three = await a.rate_limit(WF, "k", 3, limit=2, period=10.0)
        assert [r.outcome for r in (one, two, three)] == [
            Outcome.FIRE_IMMEDIATE,
            Outcome.FIRE_IMMEDIATE,
            Outcome.DROPPED,
        ]
        assert len({one.active_run_id, two.active_run_id}) == 2  # each fire its own run
        await trio.sleep_until(t0 + 10.0)
        four = await b.rate_limit(WF, "k", 4, limit=2, period=10.0)
        assert four.outcome is Outcome.FIRE_IMMEDIATE
        await trio.sleep(1.0)
        assert fired(fires) == [
            ("A", 1, 1, "leading", "leading"),
            ("B", 2, 1, "leading", "leading"),
            ("B", 4, 1, "leading", "leading"),
        ]
        assert [f.fired_at for _, f in fires.of("k")] == [near(t0), near(t0 + 1.0), near(t0 + 10.0)]
        assert [f.run_id for _, f in fires.of("k")][:2] == [one.active_run_id, two.active_run_id]
        assert a.statistics().dropped_pings == 1


async def test_a_ping_of_another_mode_or_parameters_raises_and_changes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A", "B"]) as (a, b):
        await a.throttle(WF, "k", 1, interval=10.0)
        with pytest.raises(ValueError, match=r"throttle\(interval=5.0.*differs from throttle"):
            await b.throttle(WF, "k", 2, interval=5.0)
        with pytest.raises(ValueError, match=r"debounce\(\) differs from throttle"):
            await b.debounce(WF, "k", 2, delay=10.0, max_delay=10.0, mode="both")
        with pytest.raises(ValueError, match=r"rate_limit\(limit=1, period=10.0\) differs"):
            await b.rate_limit(WF, "k", 2, limit=1, period=10.0)
        await b.debounce(WF, "d", 1, delay=10.0)
        with pytest.raises(ValueError, match=r"batch\(.*\) differs from debounce\(\)"):
            await a.batch(WF, "d", 2, max_wait=10.0)
        await trio.sleep(11.0)
        assert fired(fires) == [("A", 1, 1, "leading", "leading")]
        assert [f.payload for _, f in fires.of("d")] == [1]


async def test_a_span_a_shared_window_cannot_keep_is_refused_by_its_own_name(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A"]) as (a,):
        with pytest.raises(ValueError, match=r"^interval of a shared window must be at most"):
            await a.throttle(WF, "k", interval=1e300)
        with pytest.raises(ValueError, match=r"^max_wait of a shared window must be at most"):
            await a.batch(WF, "k", 1, max_wait=1e300)
        with pytest.raises(ValueError, match=r"^period of a shared window must be at most"):
            await a.rate_limit(WF, "k", limit=1, period=1e300)
        assert len(a) == 0
    assert fires.log == []


async def test_nowait_forms_need_no_backend(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A"]) as (a,):
        with pytest.raises(RuntimeError, match=r"await the throttle\(\) method"):
            a.throttle_nowait(WF, "k", interval=1.0)
        with pytest.raises(RuntimeError, match=r"await the rate_limit\(\) method"):
            a.rate_limit_nowait(WF, "k", limit=1, period=1.0)
        with pytest.raises(RuntimeError, match=r"await the batch\(\) method"):
            a.batch_nowait(WF, "k", 1, max_wait=1.0)


async def test_a_dead_owners_throttle_fires_its_trailing_edge_at_a_survivor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with process(store, fires, "B") as (b, _, _):
        async with process(store, fires, "A") as (a, _, a_scope):
            await a.throttle(WF, "k", 1, interval=30.0)
            await b.throttle(WF, "k", 2, interval=30.0)
            a_scope.cancel()  # A dies: no exit, no hand-off
        await trio.sleep(30.0 + 2 * LEASE)
        assert fired(fires) == [
            ("A", 1, 1, "leading", "leading"),
            ("B", 2, 1, "trailing", "interval"),
        ]


async def test_a_flush_fires_a_throttle_now_and_starts_its_cool_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A", "B"]) as (a, b):
        t0 = trio.current_time()
        await a.throttle(WF, "k", 1, interval=10.0)
        await b.throttle(WF, "k", 2, interval=10.0)
        await trio.sleep(3.0)
        # A owns the window; its ping alone gave it no trailing fire, so the flush says
        # False (none *known*: docs/protocol.rst, "Modes across processes") and fires
        # what B's ping left pending.
        assert not await a.flush(WF, "k")
        await trio.sleep(0.1)
        assert fired(fires) == [
            ("A", 1, 1, "leading", "leading"),
            ("A", 2, 1, "trailing", "flush"),
        ]
        assert fires.of("k")[1][1].fired_at == near(t0 + 3.0)
        # The cool-down runs from the flush: a ping at 12 (past the old end, 10) is
        # still in it, and fires at 13.
        await trio.sleep_until(t0 + 12.0)
        assert (await b.throttle(WF, "k", 3, interval=10.0)).outcome is Outcome.COALESCE
        await trio.sleep_until(t0 + 14.0)
        assert fired(fires)[2:] == [("A", 3, 1, "trailing", "interval")] or fired(fires)[2:] == [
            ("B", 3, 1, "trailing", "interval")
        ]
        assert fires.of("k")[2][1].fired_at == near(t0 + 13.0)


async def test_a_cancel_drops_the_pending_trailing_fire_and_keeps_no_cool_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A", "B"]) as (a, b):
        await a.throttle(WF, "k", 1, interval=10.0)
        await b.throttle(WF, "k", 2, interval=10.0)
        assert await b.cancel(WF, "k")  # a peer's window: closed by a cancel tombstone
        await trio.sleep(1.0)
        # No cool-down: the next ping fires at once, closer than the interval.
        assert (await b.throttle(WF, "k", 3, interval=10.0)).outcome is Outcome.FIRE_IMMEDIATE
        await trio.sleep(30.0)
        assert fired(fires) == [
            ("A", 1, 1, "leading", "leading"),
            ("B", 3, 1, "leading", "leading"),
        ]
        assert a.statistics().pending_trailing_fires == 0


async def test_a_cool_down_or_a_rate_window_with_nothing_pending_is_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Rule 10: they hold no pending fire, so wait_idle() and the exit do not wait for
    # them, across processes as in one.
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A", "B"]) as (a, b):
        t0 = trio.current_time()
        await a.rate_limit(WF, "r", 1, limit=5, period=600.0)
        await b.rate_limit(WF, "r", 2, limit=5, period=600.0)
        await a.throttle(WF, "t", 1, interval=60.0)
        await b.throttle(WF, "t", 2, interval=60.0)
        await trio.sleep(61.0)  # the trailing fire at 60 opened a cool-down to 120
        assert len(fires.of("t")) == 2
        for c in (a, b):
            assert c.statistics().pending_trailing_fires == 0
            await c.wait_idle()
        assert trio.current_time() - t0 < 62.0  # neither waited for a window's end


async def test_an_audit_ping_whose_write_lands_after_the_fire_keeps_the_spacing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # B's ping at 2.5 is written only at 3.5, after the window's fire at 3: it opens
    # the next audit window at 3, not at 2.5, so the fires stay an interval apart.
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with (
        process(store, fires, "A") as (a, _, _),
        process(store, fires, "B") as (b, b_backend, _),
    ):
        t0 = trio.current_time()
        await a.throttle(WF, "k", "a0", interval=3.0, leading=False)
        await trio.sleep_until(t0 + 2.5)
        b_backend.faults.stall_next(1.0, ops=("put",))
        late = await b.throttle(WF, "k", "b0", interval=3.0, leading=False)
        assert late.outcome is Outcome.SCHEDULE_TRAILING
        await trio.sleep(30.0)
    assert [(f.payload, f.fired_at - t0) for _, f in fires.of("k")] == [
        ("a0", near(3.0)),
        ("b0", near(6.0)),
    ]


async def test_a_document_whose_flow_does_not_fit_its_window_is_unreadable(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A throttle's flow forged into a batch's: the document is treated as absent (a
    # warning), never fired by the wrong rules.
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with processes(store, fires, ["A"]) as (a,):
        await a.throttle(WF, "k", "p0", interval=10.0)
        key = window_key(WF, "k")
        entry = store.raw_get(key)
        assert entry is not None
        assert entry.value is not None
        doc = json.loads(entry.value)
        doc["flow"] = {"kind": "batch", "span": 10.0, "max_items": 3}
        store.raw_put(key, json.dumps(doc).encode())
        with caplog.at_level(logging.WARNING, logger="trio_debounce"):
            opened = await a.batch(WF, "k", "x", max_wait=10.0, max_items=3)
        assert opened.outcome is Outcome.SCHEDULE_TRAILING  # a new batch
        assert "unreadable" in caplog.text
        await trio.sleep(11.0)
    assert [(f.payload, f.reason.value) for _, f in fires.of("k")] == [
        ("p0", "leading"),
        (["x"], "max-wait"),
    ]


@pytest.mark.parametrize("kind", ["batch", "throttle", "debounce"])
async def test_a_lost_answer_under_a_peers_write_is_recognised_not_applied_twice(
    autojump_clock: trio.testing.MockClock, kind: str
) -> None:
    # B's write lands but its answer is lost, and A writes on top before B re-reads:
    # B finds its write id in the window's `writes` and does not write its ping again
    # (which would count it twice, and put a batch's item in it twice).
    store, fires = MemoryStore(epoch=1_000.0), Fires()

    async def ping(c: Any, payload: str) -> None:
        if kind == "batch":
            await c.batch(WF, "k", payload, max_wait=10.0, max_items=50)
        elif kind == "throttle":
            await c.throttle(WF, "k", payload, interval=10.0)
        else:
            await c.debounce(WF, "k", payload, delay=10.0, max_delay=10.0)

    async with (
        process(store, fires, "A") as (a, _, _),
        process(store, fires, "B") as (b, b_backend, _),
    ):
        await ping(a, "a0")
        await ping(a, "a1")
        await trio.sleep(1.0)
        b_backend.faults.apply_then_fail_next(1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ping, a, "a2")
            nursery.start_soon(ping, b, "b0")
        await trio.sleep(30.0)
    assert sum(f.ping_count for _, f in fires.of("k")) == 4  # each accepted ping once
    if kind == "batch":
        [(_, fire)] = fires.of("k")
        assert sorted(fire.payload) == ["a0", "a1", "a2", "b0"]


async def test_a_lost_answer_is_recognised_after_its_window_fired_and_the_next_opened(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # B's item lands in the batch, its answer is late (stalled past op_timeout), and
    # meanwhile an item that overflows it fires the batch and opens the next: B's
    # re-read finds its write id in the next batch's `writes` (the key's last write
    # ids) and does not write its item again into the next batch.
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with (
        process(store, fires, "A") as (a, _, _),
        process(store, fires, "B") as (b, b_backend, _),
    ):
        await a.batch(WF, "k", "a0", max_wait=60.0, max_bytes=10)
        b_backend.faults.delay_next(3.0, ops=("put",))  # lands now, answered in 3 s
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(b.batch, WF, "k", "b0", max_wait=60.0, max_bytes=10))
            await trio.sleep(0.5)
            await a.batch(WF, "k", "a1xx", max_wait=60.0, max_bytes=10)  # overflows
        await trio.sleep(61.0)
    items = [item for _, f in fires.of("k") for item in f.payload]
    assert sorted(items) == ["a0", "a1xx", "b0"]  # each item in one batch, once
