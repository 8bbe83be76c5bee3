"""Two coordinators with one process id, on the in-memory backend under MockClock.

The later start wins, the earlier is fenced at its next heartbeat: its pings raise
:exc:`~trio_debounce.ProcessIdTakenError`, and its open windows go to the live
coordinator as a dead process's do, so no window fires twice. A restart before the
predecessor's lease lapsed (a crash) is not refused. (The deferred-run side has the
same rule: tests/test_runs.py::test_two_coordinators_with_one_process_id_fence_the_older.)
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.fires import Fires
from trio_debounce import BackendConfigError, Mode, ProcessIdTakenError, open_coordinator
from trio_debounce.testing import MemoryBackend, MemoryStore

LEASE = 6.0
SKEW = 1.0
BEAT = LEASE / 3


def backend(store: MemoryStore, name: str) -> MemoryBackend:
    return MemoryBackend(store, process_id=name, process_lease=LEASE, max_clock_skew=SKEW)


async def test_the_later_start_fences_the_earlier(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store, fires = MemoryStore(), Fires()
    async with open_coordinator(
        handlers={"wf": fires.handler("old")}, backend=backend(store, "svc")
    ) as old:
        await old.debounce("wf", "k", "before", delay=3 * LEASE)
        async with open_coordinator(
            handlers={"wf": fires.handler("new")}, backend=backend(store, "svc")
        ) as new:
            await trio.sleep(BEAT + 0.1)
            with pytest.raises(ProcessIdTakenError, match="'svc'"):
                await old.debounce("wf", "other", "refused", delay=1.0)
            result = await new.debounce("wf", "fresh", "fine", delay=1.0)
            assert result.owner
            await trio.sleep(4 * LEASE)
            # The old coordinator's window fires once, on the live one.
            assert [(who, f.payload) for who, f in fires.of("k")] == [("new", "before")]
            assert [(who, f.payload) for who, f in fires.of("fresh")] == [("new", "fine")]
            assert fires.of("other") == []
    assert "was taken by another coordinator" in caplog.text
    assert issubclass(ProcessIdTakenError, BackendConfigError)  # never failed open


async def test_a_restart_before_the_lease_lapsed_is_not_refused(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store, fires = MemoryStore(), Fires()
    crashed = backend(store, "svc")
    await crashed.refresh_lease()  # wrote its lease, then died (no more heartbeats)
    await crashed.register("wf", "k", mode=Mode.TRAILING, delay=2.0, max_delay=None, run_id="r1")
    await trio.sleep(1.0)
    async with open_coordinator(
        handlers={"wf": fires.handler("new")}, backend=backend(store, "svc")
    ) as new:
        await trio.sleep(2 * LEASE)
        assert (await new.debounce("wf", "x", "p", delay=1.0)).owner
        await trio.sleep(2.0)
        # Had the predecessor lived on, its next heartbeat would find itself fenced.
        with pytest.raises(ProcessIdTakenError):
            await crashed.refresh_lease()
    assert "replacing the live lease" in caplog.text
    assert [(who, f.run_id) for who, f in fires.of("k")] == [("new", "r1")]
    assert [who for who, _ in fires.of("x")] == ["new"]


async def test_a_live_twins_fire_in_flight_is_not_run_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The earlier coordinator fired (its fire record is written, its handler runs) when
    # the later one starts and reconciles: the record is not an interrupted fire, the
    # earlier one completes it. Were it to die in the handler instead, the record would
    # be adopted once its lease lapsed (at-least-once).
    store = MemoryStore()
    old = backend(store, "svc")
    await old.refresh_lease()
    for key in ("done", "dies"):
        await old.register("wf", key, mode=Mode.TRAILING, delay=1.0, max_delay=None, run_id=key)
    await trio.sleep(1.5)
    fired = [await old.finalize("wf", key, key) for key in ("done", "dies")]
    assert all(f.fire_id is not None for f in fired)
    new = backend(store, "svc")
    await new.refresh_lease()  # replaces the live lease: the old one is fenced next beat
    assert (await new.adopt_orphans({"wf"})).fires == []
    await trio.sleep(BEAT)
    assert fired[0].fire_id is not None
    await old.complete(fired[0].fire_id)  # its handler returned
    with pytest.raises(ProcessIdTakenError):
        await old.refresh_lease()
    await trio.sleep(LEASE + SKEW)  # the old lease lapsed: "dies" was interrupted
    await new.refresh_lease()
    orphans = await new.adopt_orphans({"wf"})
    assert [(f.run_id, f.attempt) for f in orphans.fires] == [("dies", 2)]
