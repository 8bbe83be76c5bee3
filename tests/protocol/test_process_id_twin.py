"""Two coordinators with one process id, on the in-memory backend under MockClock.

A start that finds a live lease of another opening of its process id watches it for
the holder's heartbeat interval plus the skew margin: renewed meanwhile, a live twin
holds the id and the start is refused with :exc:`~trio_debounce.ProcessIdTakenError`
(nothing written, the earlier coordinator runs on); not renewed, the holder crashed or
stalls and the start takes the id over. A stalled holder that resumes is fenced at its
next heartbeat, its windows go to the live coordinator, and a fire it had started runs
once. (The deferred-run side: tests/runs/test_runs.py, ``*process_id*``.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import BEAT, LEASE, SKEW, backend
from trio_debounce import (
    BackendConfigError,
    BackendUnavailableError,
    Mode,
    ProcessIdTakenError,
    RunOptions,
    open_coordinator,
)
from trio_debounce._keys import process_key
from trio_debounce._process import TWIN_LOOKS, Look, TwinWatch
from trio_debounce.abc import Lease
from trio_debounce.testing import MemoryRunStore, MemoryStore


def lease_doc(store: MemoryStore, name: str) -> dict[str, object]:
    entry = store.raw_get(process_key(name))
    assert entry is not None
    assert entry.value is not None
    doc = json.loads(entry.value)
    assert isinstance(doc, dict)
    return doc


async def test_a_live_twin_is_refused_and_the_earlier_runs_on(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store, fires = MemoryStore(), Fires()
    first = backend(store, "svc")
    async with open_coordinator(handlers={"wf": fires.handler("old")}, backend=first) as old:
        await old.debounce("wf", "k", "before", delay=3 * LEASE)
        await trio.sleep(0.5)
        keys_before = {e.key for e in await store.entries("")}
        t0 = trio.current_time()
        with pytest.raises(ProcessIdTakenError) as info:
            async with open_coordinator(
                handlers={"wf": fires.handler("new")}, backend=backend(store, "svc")
            ):
                pytest.fail("the twin started")  # pragma: no cover
        # Refused at a look after the holder's first renewal, within the watch.
        assert 0 < trio.current_time() - t0 <= BEAT + SKEW
        message = str(info.value)
        assert "'svc'" in message
        assert first.epoch in message
        assert {e.key for e in await store.entries("")} == keys_before
        assert lease_doc(store, "svc")["epoch"] == first.epoch  # nothing written
        # The earlier one runs on: pings are stored, windows fire once, on it.
        assert (await old.debounce("wf", "after", "fine", delay=1.0)).owner
        await trio.sleep(4 * LEASE)
        assert first.lease_held()
    assert [(who, f.payload) for who, f in fires.log] in (
        [("old", "fine"), ("old", "before")],
        [("old", "before"), ("old", "fine")],
    )
    assert "is held by a live coordinator" in caplog.text
    assert issubclass(ProcessIdTakenError, BackendConfigError)  # never failed open


async def test_a_crashed_predecessor_is_taken_over_after_one_heartbeat_and_the_skew(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store, fires = MemoryStore(), Fires()
    crashed = backend(store, "svc")
    await crashed.refresh_lease()  # wrote its lease, then died (no more heartbeats)
    await crashed.register("wf", "k", mode=Mode.TRAILING, delay=2.0, max_delay=None, run_id="r1")
    assert lease_doc(store, "svc")["beat"] == BEAT
    await trio.sleep(1.0)
    successor = backend(store, "svc")
    t0 = trio.current_time()
    await successor.wait_process_id_free()
    assert trio.current_time() - t0 == BEAT + SKEW
    async with open_coordinator(handlers={"wf": fires.handler("new")}, backend=successor) as new:
        await trio.sleep(2 * LEASE)
        assert (await new.debounce("wf", "x", "p", delay=1.0)).owner
        await trio.sleep(2.0)
        # Had the predecessor only stalled, its next heartbeat finds itself fenced.
        with pytest.raises(ProcessIdTakenError):
            await crashed.refresh_lease()
    assert "was not renewed" in caplog.text
    assert [(who, f.run_id) for who, f in fires.of("k")] == [("new", "r1")]
    assert [who for who, _ in fires.of("x")] == ["new"]


@pytest.mark.parametrize("leave", ["handoff", "release", "lapse"])
async def test_no_wait_for_a_released_deleted_or_lapsed_lease(
    autojump_clock: trio.testing.MockClock, leave: str
) -> None:
    store = MemoryStore()
    before = backend(store, "svc")
    await before.refresh_lease()
    if leave == "handoff":
        await before.handoff()
        assert lease_doc(store, "svc")["released"] is True
    elif leave == "release":
        await before.release()
    else:
        await trio.sleep(LEASE + SKEW + 0.001)
    successor = backend(store, "svc")
    t0 = trio.current_time()
    await successor.wait_process_id_free()
    assert trio.current_time() == t0
    fires = Fires()
    async with open_coordinator(handlers={"wf": fires.handler("new")}, backend=successor) as new:
        assert (await new.debounce("wf", "k", delay=1.0)).owner
    assert [who for who, _ in fires.of("k")] == ["new"]


async def test_the_holders_recorded_interval_sets_the_watch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The holder's lease is 12 s (a heartbeat every 4 s), the newcomer's 6 s (2 s):
    # the newcomer watches 4 s + the skew, so it sees the slower holder's renewal.
    store = MemoryStore()
    async with open_coordinator(backend=backend(store, "svc", process_lease=12.0)):
        await trio.sleep(0.1)
        t0 = trio.current_time()
        with pytest.raises(ProcessIdTakenError):
            async with open_coordinator(backend=backend(store, "svc")):
                pass  # pragma: no cover
        assert BEAT + SKEW < trio.current_time() - t0 <= 4.0 + SKEW


async def test_a_lease_without_a_recorded_interval_is_watched_for_our_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    expires = store.epoch + trio.current_time() + 3 * LEASE
    older = {"v": 1, "process": "svc", "epoch": "e0", "expires": expires}
    store.raw_put(process_key("svc"), json.dumps(older).encode())
    successor = backend(store, "svc")
    t0 = trio.current_time()
    await successor.wait_process_id_free()
    assert trio.current_time() - t0 == BEAT + SKEW
    await successor.refresh_lease()
    assert lease_doc(store, "svc")["epoch"] == successor.epoch


async def test_a_stalled_holder_is_fenced_once_it_resumes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The holder cannot renew for a while (here: its store calls fail; a blocked event
    # loop looks the same from outside). The newcomer sees no renewal, takes the id
    # over; the holder resumes, finds its lease taken, and is fenced.
    store, fires = MemoryStore(), Fires()
    stalled = backend(store, "svc")
    async with open_coordinator(handlers={"wf": fires.handler("old")}, backend=stalled) as old:
        await old.debounce("wf", "k", "before", delay=3 * LEASE)
        await trio.sleep(0.1)
        stalled.faults.partitioned = True
        async with open_coordinator(
            handlers={"wf": fires.handler("new")}, backend=backend(store, "svc")
        ) as new:
            stalled.faults.partitioned = False
            await trio.sleep(2 * BEAT)
            with pytest.raises(ProcessIdTakenError, match="'svc'"):
                await old.debounce("wf", "other", "refused", delay=1.0)
            assert (await new.debounce("wf", "fresh", "fine", delay=1.0)).owner
            await trio.sleep(4 * LEASE)
    assert [(who, f.payload) for who, f in fires.of("k")] == [("new", "before")]
    assert [(who, f.payload) for who, f in fires.of("fresh")] == [("new", "fine")]
    assert fires.of("other") == []


async def test_a_first_lease_write_after_a_failed_start_watches_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A start that failed open (the store did not answer) writes its first lease from
    # a later heartbeat or ping: that write watches the live lease as the start does,
    # without blocking (it fails as unavailable until the watch ends).
    store = MemoryStore()
    crashed, live = backend(store, "a"), backend(store, "b")
    await crashed.refresh_lease()
    await live.refresh_lease()
    late_a, late_b = backend(store, "a"), backend(store, "b")
    for late in (late_a, late_b):
        with pytest.raises(BackendUnavailableError, match="watched for a renewal"):
            await late.refresh_lease()
    await trio.sleep(BEAT)
    await live.refresh_lease()
    await trio.sleep(SKEW)
    await late_a.refresh_lease()  # "a" was not renewed: taken over
    assert lease_doc(store, "a")["epoch"] == late_a.epoch
    with pytest.raises(ProcessIdTakenError):
        await late_b.refresh_lease()  # "b" was: refused, nothing written
    assert lease_doc(store, "b")["epoch"] == live.epoch
    with pytest.raises(ProcessIdTakenError):
        await late_b.register("wf", "k", mode=Mode.TRAILING, delay=1.0, max_delay=None, run_id="r")
    await live.refresh_lease()  # the live one is not fenced


async def test_a_stalled_twins_fire_in_flight_is_not_run_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The earlier coordinator fired (its fire record is written, its handler runs),
    # then stalled past a heartbeat interval while the later one started, waited and
    # took the id over: the record is not an interrupted fire, the earlier one
    # completes it once it resumes. Were it to die in the handler instead, the record
    # would be adopted once its lease lapsed (at-least-once).
    store = MemoryStore()
    old = backend(store, "svc")
    await old.refresh_lease()
    for key in ("done", "dies"):
        await old.register("wf", key, mode=Mode.TRAILING, delay=1.0, max_delay=None, run_id=key)
    await trio.sleep(1.5)
    fired = [await old.finalize("wf", key, key) for key in ("done", "dies")]
    assert all(f.fire_id is not None for f in fired)
    new = backend(store, "svc")
    await new.wait_process_id_free()  # no renewal for BEAT + SKEW: the old one stalls
    await new.refresh_lease()  # replaces its live lease: it is fenced at its next beat
    assert (await new.adopt_orphans({"wf"})).fires == []
    assert fired[0].fire_id is not None
    await old.complete(fired[0].fire_id)  # it resumes: its handler returned
    with pytest.raises(ProcessIdTakenError):
        await old.refresh_lease()
    await trio.sleep(LEASE + SKEW)  # the old lease lapsed: "dies" was interrupted
    await new.refresh_lease()
    orphans = await new.adopt_orphans({"wf"})
    assert [(f.run_id, f.attempt) for f in orphans.fires] == [("dies", 2)]


@pytest.mark.parametrize(
    ("beat", "watch"),
    [("2", BEAT), (-1, BEAT), (0, BEAT), (True, BEAT), (1e300, LEASE)],
)
async def test_a_recorded_interval_no_interval_has_is_ignored_or_capped(
    autojump_clock: trio.testing.MockClock, beat: object, watch: float
) -> None:
    # Written by something else: the watch uses our own interval, and never lasts
    # longer than our own lease (plus the skew), so a start cannot hang on it.
    store = MemoryStore()
    expires = store.epoch + trio.current_time() + 10 * LEASE
    doc = {"v": 1, "process": "svc", "epoch": "e0", "expires": expires, "beat": beat}
    store.raw_put(process_key("svc"), json.dumps(doc).encode())
    successor = backend(store, "svc")
    t0 = trio.current_time()
    await successor.wait_process_id_free()
    assert trio.current_time() - t0 == watch + SKEW


def run_options(name: str) -> RunOptions:
    return RunOptions(process_id=name, lease=LEASE, heartbeat_interval=BEAT, max_clock_skew=SKEW)


async def test_a_restart_watches_the_backend_and_run_leases_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A crashed process left both leases live: the restart waits one watch, not two.
    store = MemoryStore()
    await backend(store, "svc").refresh_lease()
    expires = store.epoch + trio.current_time() + LEASE
    assert await MemoryRunStore(store).put_lease(Lease("svc", 1, expires, heartbeat_interval=BEAT))
    t0 = trio.current_time()
    async with open_coordinator(
        backend=backend(store, "svc"),
        run_store=MemoryRunStore(store),
        run_options=run_options("svc"),
    ):
        # The watch, then the first writes (a compare-and-swap backoff of a few ms).
        assert BEAT + SKEW <= trio.current_time() - t0 < BEAT + SKEW + 0.5
    run_lease = await MemoryRunStore(store).get_lease("svc")
    assert run_lease is not None
    assert run_lease.epoch == 2


async def test_a_live_run_lease_refuses_the_start_before_the_backend_writes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    async with open_coordinator(run_store=MemoryRunStore(store), run_options=run_options("svc")):
        with pytest.raises(ProcessIdTakenError, match="'svc'"):
            async with open_coordinator(
                backend=backend(store, "svc"),
                run_store=MemoryRunStore(store),
                run_options=run_options("svc"),
            ):
                pytest.fail("the twin started")  # pragma: no cover
        assert store.raw_get(process_key("svc")) is None  # the backend wrote nothing


# ------------------------------------------------- the watch itself (pure, _process)


def _watch(**overrides: object) -> TwinWatch:
    args: dict[str, Any] = {
        "epoch": "e1",
        "revision": 7,
        "expires": 1_000.0 + 30.0,  # wall: lapses 30 s after the read
        "heartbeat": 10.0,
        "own_heartbeat": 4.0,
        "lease": 30.0,
        "skew": 1.0,
        "wall_now": 1_000.0,
        "trio_now": 50.0,
    }
    return TwinWatch.start(**(args | overrides))


def test_the_watch_lasts_the_holders_heartbeat_plus_the_skew() -> None:
    watch = _watch()
    assert watch.until == 50.0 + 10.0 + 1.0
    assert watch.step == pytest.approx(11.0 / TWIN_LOOKS)
    assert watch.next_look(50.0) == pytest.approx(50.0 + 11.0 / TWIN_LOOKS)
    assert watch.next_look(60.9) == watch.until  # never past the watch's end


@pytest.mark.parametrize("recorded", [None, "10", True, 0.0, -1.0, float("inf"), float("nan")])
def test_a_heartbeat_not_recorded_or_unusable_is_ours(recorded: object) -> None:
    assert _watch(heartbeat=recorded).until == 50.0 + 4.0 + 1.0


def test_the_watch_is_capped_at_our_lease_and_at_the_holders_expiry() -> None:
    assert _watch(heartbeat=100.0).until == 50.0 + 30.0 + 1.0  # our lease
    # lapses 2 s after the read: dead beyond the skew 3 s after it, whatever its beat
    assert _watch(expires=1_002.0).until == pytest.approx(50.0 + 2.0 + 1.0)


def test_a_look_tells_a_renewal_from_a_silence() -> None:
    watch = _watch()
    assert watch.look(revision=7, expires=1_030.0, now=55.0) is Look.WATCHING
    assert watch.look(revision=8, expires=1_030.0, now=55.0) is Look.RENEWED
    assert watch.look(revision=7, expires=1_040.0, now=55.0) is Look.RENEWED
    assert watch.look(revision=8, expires=1_040.0, now=99.0) is Look.RENEWED  # renewal wins
    assert watch.look(revision=7, expires=1_030.0, now=watch.until) is Look.OVER
