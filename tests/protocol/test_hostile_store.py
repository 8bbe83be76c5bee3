"""KV documents written by something else, on the in-memory store under MockClock.

Garbage, empty values, unknown versions, truncated, huge and ill-typed documents, and
delete markers, planted at every kind of key (window, process lease, fire record,
sweeper lock, deferred run, run lease) or landing between the steps of the protocol:
each is treated as absent (with a warning) or as a cancel, the coordinator's nursery
never crashes, nothing hangs, and a ping or a schedule made afterwards fires.
"""

from __future__ import annotations

import json
import logging

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.protocol.fuzz import documents
from trio_debounce import Fire, Mode, RunFire, RunOptions, open_coordinator
from trio_debounce._keys import process_key, run_key, run_lease_key, window_key
from trio_debounce._protocol import SWEEPER_KEY, WindowDoc, _FireRecord
from trio_debounce.testing import MemoryBackend, MemoryRunStore, MemoryStore

T0 = 1_700_000_000.0
VALID_WINDOW = WindowDoc(
    "ghost", "e", "run-ghost", Mode.TRAILING, 1.0, None, T0, T0, T0 + 1, None, T0 + 1, 1,
    "w", "w", "7",
).encode()  # fmt: skip

#: Values no reader of this library wrote (None: a delete marker).
BAD_VALUES: dict[str, bytes | None] = {
    "garbage": b"\xff\x00\x13garbage\x80",
    "empty": b"",
    "unknown-version": json.dumps({**json.loads(VALID_WINDOW), "v": 99}).encode(),
    "truncated": VALID_WINDOW[: len(VALID_WINDOW) // 2],
    "huge": json.dumps({"v": 1, "junk": "x" * 600_000}).encode(),
    "wrong-types": json.dumps(
        {k: [v] for k, v in json.loads(VALID_WINDOW).items() if k != "v"} | {"v": 1}
    ).encode(),
    "not-an-object": b"[1, 2, 3]",
    "deep": b"[" * 50_000,
    "infinite": VALID_WINDOW.replace(b'"delay":1.0', b'"delay":1e999'),
    "delete-marker": None,
}


def plant_everywhere(store: MemoryStore, value: bytes | None) -> list[str]:
    """``value`` at a key of every kind; returns the keys."""
    keys = [
        window_key("wf", "k"),
        window_key("wf", "other"),
        process_key("ghost"),
        "f.ghostfire",
        SWEEPER_KEY,
        run_key("run-1"),
        run_key("run-planted"),
        run_lease_key("ghost"),
    ]
    for key in keys:
        store.raw_put(key, value)
    return keys


class Log:
    def __init__(self) -> None:
        self.fires: list[Fire] = []
        self.runs: list[RunFire] = []

    async def fire(self, fire: Fire) -> None:
        self.fires.append(fire)

    async def run(self, run: RunFire) -> None:
        self.runs.append(run)


def run_options(name: str) -> RunOptions:
    return RunOptions(process_id=name, lease=6.0, max_clock_skew=1.0, horizon=30.0)


@pytest.mark.parametrize("value", list(BAD_VALUES.values()), ids=list(BAD_VALUES))
async def test_foreign_documents_of_every_kind(
    value: bytes | None, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    planted = plant_everywhere(store, value)
    log = Log()
    with trio.fail_after(300):
        async with open_coordinator(
            handlers={"wf": log.fire},
            run_handlers={"wf": log.run},
            backend=MemoryBackend(store, process_id="a", process_lease=6.0),
            run_store=MemoryRunStore(store),
            run_options=run_options("a"),
        ) as coord:
            await trio.sleep(20)  # heartbeats, sweeps and adoption scans see them all
            result = await coord.debounce("wf", "k", "mine", delay=1.0)
            assert result.owner
            await coord.schedule("wf", "run-1", {"x": 1}, after=2.0, persist=True)
            await trio.sleep(20)
    assert [(f.key, f.payload) for f in log.fires] == [("k", "mine")]
    assert [(r.run_id, r.payload) for r in log.runs] == [("run-1", {"x": 1})]
    if value is not None and value != b"":
        warned = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
        # the window and run documents at least are named in a warning
        assert planted[0] in warned
        assert planted[5][:80] in warned


def ghost_window(payload: str) -> bytes:
    doc = json.loads(VALID_WINDOW)
    doc["payload"] = payload
    return json.dumps(doc).encode()


@pytest.mark.parametrize("payload", ["not json{", "[" * 50_000, "\ud800"])
async def test_documents_whose_payload_cannot_be_read_fire_with_none(
    payload: str, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A dead process's window and interrupted fire hold payloads this serializer
    # cannot read: they are adopted and fired with payload None, and a warning says so
    # (these crashed the coordinator's nursery with the decoder's exception).
    store = MemoryStore()
    store.raw_put(window_key("wf", "k"), ghost_window(payload))
    record = _FireRecord("ghost", "e", "wf", "k2", "r", payload, 1, T0, T0, 1)
    store.raw_put("f.ghostfire", record.encode())
    run = json.loads(
        b'{"v":1,"id":"run-p","wf":"wf","payload":"","at":1700000001.0,"exp":null,'
        b'"state":"pending","owner":null,"epoch":0,"version":1,"attempt":0,"token":0,'
        b'"created":1700000000.0,"started":null,"finished":null,"outcome":null}'
    )
    run["payload"] = payload
    store.raw_put(run_key("run-p"), json.dumps(run).encode())
    log = Log()
    with trio.fail_after(300):
        async with open_coordinator(
            handlers={"wf": log.fire},
            run_handlers={"wf": log.run},
            backend=MemoryBackend(store, process_id="a", process_lease=6.0),
            run_store=MemoryRunStore(store),
            run_options=run_options("a"),
        ) as coord:
            await trio.sleep(30)
            await coord.debounce("wf", "after", 1, delay=1.0)
            await trio.sleep(5)
    if payload == "\ud800":
        # An escaped lone surrogate cannot be written back: the documents are unreadable.
        assert [(f.key, f.payload) for f in log.fires] == [("after", 1)]
        assert "lone surrogate" in caplog.text
    else:
        fired = sorted((f.key, f.payload) for f in log.fires)
        assert fired == [("after", 1), ("k", None), ("k2", None)]
        assert "cannot be deserialized" in caplog.text
    # A persisted run whose payload is not JSON fails (logged), never runs on a guess.
    assert log.runs == []
    assert run_key("run-p") in caplog.text or "'run-p'" in caplog.text


async def test_run_document_under_another_runs_key_is_ignored(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A run document whose id is not the id its key encodes must not be taken for
    # that other run (its compare-and-swap writes would go to a key it was not read
    # from).
    store = MemoryStore()
    shared = MemoryRunStore(store)
    log = Log()
    with trio.fail_after(300):
        async with open_coordinator(
            run_handlers={"wf": log.run}, run_store=shared, run_options=run_options("a")
        ) as coord:
            await coord.schedule("wf", "real", 1, after=100.0, persist=True)
            entry = store.raw_get(run_key("real"))
            assert entry is not None
            assert entry.value is not None
            store.raw_put(run_key("alias"), entry.value)
            assert await shared.get_run("alias") is None
            assert [r.run_id for r in await shared.list_runs()] == ["real"]
            await trio.sleep(200)
    assert [r.run_id for r in log.runs] == ["real"]
    assert "alias" not in [r.run_id for r in log.runs]


# ------------------------------------------------------------------- positions

interference = st.tuples(
    st.floats(0.0, 12.0),
    # (not the run lease: a foreign write there reads as a twin with our process id,
    # and the scheduler stops claiming runs, as documented in runs.rst)
    st.sampled_from(["window", "ghost", "lease", "fire", "run"]),
    st.sampled_from(["delete-marker", "garbage", "bad-payload"]),
)


# No shrinking: each example is a whole coordinator run (a failure prints as drawn).
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
@given(
    hits=st.lists(interference, max_size=6),
    pings=st.lists(st.floats(0.0, 12.0), min_size=1, max_size=5),
    delivery=st.sampled_from(["at-least-once", "at-most-once"]),
)
def test_foreign_writes_between_protocol_steps(
    hits: list[tuple[float, str, str]], pings: list[float], delivery: str
) -> None:
    """Every store call takes 0.1 s, so foreign writes land between the get and the
    compare-and-swap of a register, in a finalize, an adoption or a run claim.

    A foreign delete marker is a cancel (documented); garbage is an absent document.
    No call hangs, the nursery never crashes, and a ping and a schedule made after the
    last interference fire.
    """

    async def main() -> None:
        store = MemoryStore()
        backend = MemoryBackend(store, process_id="a", process_lease=6.0, op_timeout=3.0)
        backend.faults.delay_next(0.1, n=1_000_000)
        run_store = MemoryRunStore(store)
        run_store.faults.delay_next(0.1, n=1_000_000)
        # a dead process's window, for the adoption scans to take over
        store.raw_put(window_key("wf", "ghost"), VALID_WINDOW)
        log = Log()
        values = {
            "delete-marker": None,
            "garbage": b"\x00garbage",
            "bad-payload": ghost_window("not json{"),
        }

        async def interfere() -> None:
            start = trio.current_time()
            for at, kind, what in sorted(hits):
                await trio.sleep_until(start + at)
                fires = [e.key for e in await store.entries("f.")] or ["f.x"]
                key = {
                    "window": window_key("wf", "k"),
                    "ghost": window_key("wf", "ghost"),
                    "lease": process_key("a"),
                    "fire": fires[0],
                    "run": run_key("run-1"),
                }[kind]
                store.raw_put(key, values[what])

        with trio.fail_after(600):
            async with (
                open_coordinator(
                    handlers={"wf": log.fire},
                    run_handlers={"wf": log.run},
                    backend=backend,
                    run_store=run_store,
                    run_options=run_options("a"),
                    delivery=delivery,  # type: ignore[arg-type]
                ) as coord,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(interfere)
                start = trio.current_time()
                await coord.schedule("wf", "run-1", 1, after=5.0, persist=True)
                for at in sorted(pings):
                    await trio.sleep_until(start + at)
                    await coord.debounce("wf", "k", at, delay=1.0)
                await trio.sleep_until(start + 13)
                n_fires, n_runs = len(log.fires), len(log.runs)
                await coord.debounce("wf", "k", "last", delay=1.0)
                await coord.schedule("wf", "run-2", 2, after=2.0, persist=True)
                await trio.sleep(30)
        assert [f.payload for f in log.fires[n_fires:] if f.key == "k"][-1:] == ["last"]
        assert ("run-2", 2) in [(r.run_id, r.payload) for r in log.runs[n_runs:]]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("value", [None, b"\x00garbage"], ids=["delete-marker", "garbage"])
async def test_foreign_write_between_the_get_and_the_create_of_a_register(
    value: bytes | None, autojump_clock: trio.testing.MockClock
) -> None:
    store = MemoryStore()
    backend = MemoryBackend(store, process_id="a")
    log = Log()
    async with open_coordinator(handlers={"wf": log.fire}, backend=backend) as coord:
        await backend.refresh_lease()
        backend.faults.delay_next(0.5, ops=("get",))  # the register's read of the window
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: coord.debounce("wf", "k", "p", delay=1.0))
            await trio.sleep(0.25)
            store.raw_put(window_key("wf", "k"), value)
        # the create conflicts with the foreign entry, re-reads and writes over it
        await trio.sleep(5)
    assert [(f.key, f.payload) for f in log.fires] == [("k", "p")]


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_foreign_delete_during_finalize_is_a_cancel(
    delivery: str, autojump_clock: trio.testing.MockClock
) -> None:
    store = MemoryStore()
    backend = MemoryBackend(store, process_id="a")
    log = Log()
    async with open_coordinator(
        handlers={"wf": log.fire},
        backend=backend,
        delivery=delivery,  # type: ignore[arg-type]
    ) as coord:
        await coord.debounce("wf", "k", "p", delay=1.0)
        await trio.sleep(0.9)
        if delivery == "at-least-once":
            # The fire record's write lands at once and is answered late; the delete
            # lands between it and the window's delete.
            backend.faults.delay_next(0.5, ops=("put",))
            await trio.sleep(0.3)
        else:
            # At-most-once commits with one compare-and-swap against the revision the
            # owner cached from its write: the delete lands just before it.
            await trio.sleep(0.05)
        store.raw_put(window_key("wf", "k"), None)
        await trio.sleep(5)
        # the fire's commit conflicted with the delete: nothing fired, nothing left
        assert log.fires == []
        assert [e for e in await store.entries("f.") if e.value is not None] == []
        await coord.debounce("wf", "k", "again", delay=1.0)
        await trio.sleep(5)
    assert [(f.key, f.payload) for f in log.fires] == [("k", "again")]


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    window=documents("window"),
    fire=documents("fire"),
    lease=documents("lease"),
    payload=st.sampled_from([None, 1, "p", [1, 2]]),
)
def test_fuzzed_documents_under_a_running_coordinator(
    window: bytes, fire: bytes, lease: bytes, payload: object
) -> None:
    """Whatever the documents say (a dead owner's window, a fire record, a lease, each
    readable or not), the coordinator adopts or ignores them without crashing, and a
    ping of the same window made afterwards fires with its payload."""

    async def main() -> None:
        store = MemoryStore()
        store.raw_put(window_key("wf", "k"), window)
        store.raw_put("f.fuzzed", fire)
        store.raw_put(process_key("proc"), lease)
        log = Log()
        with trio.fail_after(600):
            async with open_coordinator(
                handlers={"wf": log.fire},
                backend=MemoryBackend(store, process_id="a", process_lease=6.0),
            ) as coord:
                await trio.sleep(20)
                before = len(log.fires)
                try:
                    result = await coord.debounce("wf", "k", payload, delay=1.0)
                except ValueError as exc:
                    # the open window's mode or options differ (documented)
                    assert "differs" in str(exc) or "order_key" in str(exc), exc  # noqa: PT017
                    return
                await trio.sleep(30)
                fired = [f.payload for f in log.fires[before:] if f.key == "k"]
                if result.owner:
                    assert fired[-1:] == [payload], fired
                # else: coalesced into a window whose owner's lease (as planted) is
                # live: that owner fires it, as documented

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
