"""``overlap="queue-latest"`` of audit and batch windows across processes (issue 20,
rule 6): a key's run blocks its next fire in every process, through the shared
document (docs/protocol.rst, "Flow-control windows" and "queue-latest across
processes"). MockClock, coordinators sharing a ``MemoryBackend`` store."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires, Recorder
from tests.harness.memory import WF, near, process
from trio_debounce import Coordinator, Fire, Outcome
from trio_debounce._keys import window_key
from trio_debounce.testing import MemoryStore

QUEUE: Any = "queue-latest"


@asynccontextmanager
async def two_processes(
    store: MemoryStore, fires: Fires, hold: float
) -> AsyncIterator[tuple[Coordinator, Coordinator, Recorder]]:
    """Processes A and B whose handlers record their fires in ``fires`` and take
    ``hold`` seconds each, counted in one :class:`Recorder` (its ``max_running``: how
    many ran at once, across both)."""
    overlaps = Recorder(hold)
    async with (
        process(store, fires, "A") as (a, _, _),
        process(store, fires, "B") as (b, _, _),
    ):
        for name, c in (("A", a), ("B", b)):
            record = fires.handler(name)

            async def handle(fire: Fire, record: Any = record) -> None:
                await record(fire)
                await overlaps(fire)

            c.set_handler(WF, handle)
        yield a, b, overlaps


def rows(fires: Fires, key: str, t0: float) -> list[tuple[str, Any, Any, int, str]]:
    return [
        (p, near(f.fired_at - t0), f.payload, f.ping_count, f.reason.value)
        for p, f in fires.of(key)
    ]


async def test_an_audits_run_in_one_process_holds_back_the_window_a_peer_pinged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with two_processes(store, fires, 3.0) as (a, b, overlaps):
        t0 = trio.current_time()
        await a.throttle(WF, "k", 0, interval=1.0, leading=False, overlap=QUEUE)
        await trio.sleep(1.5)  # A's fire at 1.0 runs until 4.0
        await b.throttle(WF, "k", 1, interval=1.0, leading=False, overlap=QUEUE)
        await trio.sleep(1.5)  # due at 2.5: waits for A's run
        r = await a.throttle(WF, "k", 2, interval=1.0, leading=False, overlap=QUEUE)
        assert r.outcome is Outcome.COALESCE
        assert r.scheduled_at is None  # waiting
        assert r.ping_count == 2
        # Its document keeps the overlap: a ping without it is another window's.
        with pytest.raises(ValueError, match="queue-latest"):
            await b.throttle(WF, "k", 3, interval=1.0, leading=False)
        entry = store.raw_get(window_key(WF, "k"))
        assert entry is not None
        assert entry.value is not None
        doc = json.loads(entry.value)
        assert (doc["v"], doc["flow"]["kind"], doc["queue"]) == (4, "audit", True)
        await trio.sleep(10.0)
    assert [row[1:] for row in rows(fires, "k", t0)] == [
        (near(1.0), 0, 1, "interval"),
        (near(4.0), 2, 2, "run-end"),  # at the end of A's run
    ]
    assert overlaps.max_running == 1


async def test_a_waiting_batch_across_processes_fires_before_an_item_it_cannot_hold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with two_processes(store, fires, 10.0) as (a, b, _):
        t0 = trio.current_time()

        async def item(who: Any, n: int) -> Any:
            return await who.batch(WF, "k", n, max_wait=1.0, max_items=2, overlap=QUEUE)

        await item(a, 0)
        await trio.sleep(1.0)  # [0] fires at 1.0 (max-wait), runs until 11.0
        await item(b, 1)  # the next batch, due at 2.0
        await trio.sleep(1.5)  # t=2.5: waiting
        r = await item(a, 2)  # full, still held back by the run
        assert r.outcome is Outcome.COALESCE
        assert r.scheduled_at is None
        await trio.sleep(0.5)
        await item(b, 3)  # t=3.0: it cannot hold a third item: [1, 2] fires now
        await trio.sleep(20.0)
    assert [row[1:] for row in rows(fires, "k", t0)] == [
        (near(1.0), [0], 1, "max-wait"),
        (near(3.0), [1, 2], 2, "max-items"),
        (near(13.0), [3], 1, "run-end"),  # due at 4.0, held by the run of [1, 2]
    ]
    assert all(len(f.payload) <= 2 for _, f in fires.of("k"))
