"""Throttle, batch and rate limit across processes against a real ``nats-server`` with
JetStream (docs/protocol.rst, "Flow-control windows"): coordinators with distinct
process ids share one bucket in one ``trio.run``, each through its own connection, on
the real clock (see test_nats_backend.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from tests.harness.fires import Fires
from tests.harness.nats_server import NatsServer
from tests.nats.test_nats_backend import config, processes
from trio_debounce import Fire, Outcome
from trio_debounce._keys import window_key
from trio_debounce.nats._store import open_nats_store

pytestmark = pytest.mark.slow


async def test_each_mode_keeps_one_window_per_key_across_processes(
    nats_server: NatsServer,
) -> None:
    fires = Fires()
    cfg = config(nats_server)
    with trio.fail_after(30):
        async with processes(cfg, fires, "ABC") as (a, b, c):
            # Throttle: A's ping fires the leading edge; B's and C's are absorbed and
            # fire once as the trailing edge at the interval's end.
            assert (await a.throttle("wf", "t", 0, interval=1.0)).outcome is (
                Outcome.FIRE_IMMEDIATE
            )
            for i, who in enumerate((b, c, b), start=1):
                r = await who.throttle("wf", "t", i, interval=1.0)
                assert r.outcome is Outcome.COALESCE
            # Audit: the first ping opens the window; the latest fires at its end.
            opened = await c.throttle("wf", "au", "p", interval=1.0, leading=False)
            assert opened.outcome is Outcome.SCHEDULE_TRAILING
            for payload, who in (("q", a), ("r", b)):
                r = await who.throttle("wf", "au", payload, interval=1.0, leading=False)
                assert r.outcome is Outcome.COALESCE
            # Batch: the third item fires the batch, whoever sends it.
            for item, who in (("x", a), ("y", b), ("z", c)):
                await who.batch("wf", "b", item, max_wait=30.0, max_items=3)
            # Rate limit: two fires in the window, the third ping dropped.
            outcomes = [
                (await who.rate_limit("wf", "r", i, limit=2, period=30.0)).outcome
                for i, who in enumerate((a, b, c))
            ]
            assert outcomes == [Outcome.FIRE_IMMEDIATE, Outcome.FIRE_IMMEDIATE, Outcome.DROPPED]
            # Another mode on the key raises; nothing changes.
            with pytest.raises(ValueError, match="differs from"):
                await c.debounce("wf", "r", "x", delay=1.0)
            # The document is version 4 (older readers refuse it).
            async with open_nats_store(cfg) as store:
                entry = await store.get(window_key("wf", "r"))
                assert entry is not None
                assert entry.value is not None
                doc = json.loads(entry.value)
                assert (doc["v"], doc["flow"]["kind"], doc["flow"]["fires"]) == (
                    4,
                    "rate-limit",
                    2,
                )
            await trio.sleep(1.5)  # past the throttle's end
            # In the cool-down: absorbed, fired at its end.
            assert (await c.throttle("wf", "t", 9, interval=1.0)).outcome is Outcome.COALESCE
            await trio.sleep(1.5)
    throttled = [(f.payload, f.ping_count, f.reason.value) for _, f in fires.of("t")]
    assert throttled == [(0, 1, "leading"), (3, 3, "interval"), (9, 1, "interval")]
    times = [f.fired_at for _, f in fires.of("t")]
    assert times[1] - times[0] == pytest.approx(1.0, abs=0.05)
    assert times[2] - times[1] == pytest.approx(1.0, abs=0.05)  # the cool-down's end
    assert [(f.payload, f.ping_count, f.reason.value) for _, f in fires.of("au")] == [
        ("r", 3, "interval")
    ]
    assert [(f.payload, f.reason.value) for _, f in fires.of("b")] == [
        (["x", "y", "z"], "max-items")
    ]
    rated = fires.of("r")
    assert [f.payload for _, f in rated] == [0, 1]
    assert len({f.run_id for _, f in rated}) == 2


async def test_a_rate_limit_holds_under_concurrent_pings_of_three_processes(
    nats_server: NatsServer,
) -> None:
    fires = Fires()
    results: list[Outcome] = []
    with trio.fail_after(30):
        async with processes(config(nats_server), fires, "ABC") as coordinators:

            async def ping(i: int) -> None:
                who = coordinators[i % 3]
                r = await who.rate_limit("wf", "hot", i, limit=4, period=60.0)
                results.append(r.outcome)

            async with trio.open_nursery() as nursery:
                for i in range(30):
                    nursery.start_soon(ping, i)
            await trio.sleep(0.5)
            dropped = sum(c.statistics().dropped_pings for c in coordinators)
    # Every compare-and-swap counted: exactly the limit fired, the rest dropped.
    assert results.count(Outcome.FIRE_IMMEDIATE) == 4
    assert results.count(Outcome.DROPPED) == dropped == 26
    assert len(fires.of("hot")) == 4
    assert len({f.run_id for _, f in fires.of("hot")}) == 4


async def test_a_queue_latest_audit_waits_for_its_keys_run_in_another_process(
    nats_server: NatsServer,
) -> None:
    # A's run holds back the audit window B pinged: it fires at the run's end, and the
    # two processes' handlers of the key never overlap.
    fires = Fires()
    running: list[int] = [0, 0]
    opts: dict[str, Any] = {"interval": 0.3, "leading": False, "overlap": "queue-latest"}
    with trio.fail_after(30):
        async with processes(config(nats_server), fires, "AB") as (a, b):
            for name, c in (("A", a), ("B", b)):
                record = fires.handler(name)

                async def handler(fire: Fire, record: Any = record) -> None:
                    await record(fire)
                    running[0] += 1
                    running[1] = max(running)
                    try:
                        await trio.sleep(1.5)
                    finally:
                        running[0] -= 1

                c.set_handler("wf", handler)
            await a.throttle("wf", "q", 0, **opts)
            await trio.sleep(0.6)  # A's fire at 0.3 runs until 1.8
            await b.throttle("wf", "q", 1, **opts)  # due at 0.9: waits
            await trio.sleep(0.6)
            r = await a.throttle("wf", "q", 2, **opts)
            assert r.outcome is Outcome.COALESCE
            assert r.scheduled_at is None
            await trio.sleep(3.0)
    fired = fires.of("q")
    assert [(f.payload, f.ping_count, f.reason.value) for _, f in fired] == [
        (0, 1, "interval"),
        (2, 2, "run-end"),
    ]
    assert fired[1][1].fired_at - fired[0][1].fired_at == pytest.approx(1.5, abs=0.1)
    assert running[1] == 1
