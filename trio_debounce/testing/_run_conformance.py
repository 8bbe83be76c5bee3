"""The conformance suite every :class:`~trio_debounce.abc.RunStore` must pass."""

from __future__ import annotations

import uuid

import trio

from .._runs._store import ANY, Lease, RunState, RunStore, StoredRun


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


async def check_run_store(store: RunStore, *, other: RunStore | None = None) -> None:
    """Run the storage conformance checks against a run store implementation.

    Args:
      store (RunStore): an open store. The checks write records under fresh random run
        ids and process ids and remove what they wrote, so a store in use by others
        (or left over from earlier checks) does not interfere, as long as nobody else
        writes those ids.
      other (RunStore | None): a second handle on the same storage, as another process
        would open it (another connection, another ``SqliteRunStore`` on the same
        file); the checks then also verify that each handle sees the other's writes and
        that compare-and-swap holds across them.

    Works under :class:`trio.testing.MockClock` (pure-Trio stores) and on the real
    clock (stores that use threads or sockets).

    Raises:
      AssertionError: a check failed; the message says which rule was broken.
    """
    tag = uuid.uuid4().hex[:12]
    peer = store if other is None else other
    await _runs(store, peer, tag)
    await _listing(store, peer, tag)
    await _leases(store, peer, tag)
    await _concurrent_creates(store, peer, tag)


def _run(run_id: str, at: float, **changes: object) -> StoredRun:
    return StoredRun(
        run_id=run_id,
        workflow=str(changes.pop("workflow", "wf")),
        payload='{"n": 1}',
        scheduled_at=at,
        created_at=1.0,
    ).replace(**changes)


async def _runs(store: RunStore, peer: RunStore, tag: str) -> None:
    run_id = f"conformance-{tag}-a ☃/.*>"
    _check(await store.get_run(run_id) is None, "get_run of an unknown id must be None")
    created = await store.create_run(_run(run_id, 100.5, owner="p1", epoch=3, token=1))
    _check(created is not None, "create_run of a new id must succeed")
    assert created is not None
    _check(created.revision > 0, "a written run must carry a revision > 0")
    again = await peer.create_run(_run(run_id, 200.0))
    _check(again is None, "create_run of an existing id must return None")
    read = await peer.get_run(run_id)
    _check(read == created, f"get_run must return what was written: {read!r} != {created!r}")
    read = await peer.get_run_current(run_id)
    _check(read == created, f"get_run_current must return what was written: {read!r}")

    started = created.replace(state=RunState.STARTED, attempt=1, token=2, started_at=101.25)
    updated = await peer.update_run(started)
    _check(updated is not None, "update_run against the current revision must succeed")
    assert updated is not None
    _check(updated.revision != created.revision, "an update must change the revision")
    _check(
        updated.replace(revision=0) == started.replace(revision=0),
        "update_run must store every field",
    )
    stale = await store.update_run(created.replace(owner="p2"))
    _check(stale is None, "update_run against a stale revision must return None")
    _check(await store.get_run(run_id) == updated, "a losing update_run must not change the record")

    _check(
        not await store.delete_run(run_id, revision=created.revision),
        "delete_run against a stale revision must return False",
    )
    _check(
        await store.delete_run(run_id, revision=updated.revision),
        "delete_run against the current revision must return True",
    )
    _check(await peer.get_run(run_id) is None, "a deleted run must be gone")
    _check(
        not await store.delete_run(run_id, revision=updated.revision),
        "deleting a deleted run must return False",
    )
    recreated = await peer.create_run(_run(run_id, 300.0))
    _check(recreated is not None, "create_run must succeed over a deleted run")
    assert recreated is not None
    _check(recreated.revision != updated.revision, "a re-created run must not reuse a revision")
    _check(
        await store.update_run(updated) is None,
        "an update against the deleted record's revision must not touch the new record",
    )
    tomb = recreated.replace(state=RunState.DONE, finished_at=301.0, outcome="ran", payload="null")
    done = await store.update_run(tomb)
    _check(done is not None and done.state is RunState.DONE, "a tombstone is an update")
    assert done is not None
    _check(await store.delete_run(run_id, revision=done.revision), "cleanup")


async def _listing(store: RunStore, peer: RunStore, tag: str) -> None:
    wf = f"conformance-{tag}"
    ids = [f"{tag}-list-{i}" for i in range(5)]
    written = []
    for i, run_id in enumerate(ids):
        run = _run(
            run_id,
            1000.0 + 10 * (4 - i),
            workflow=wf,
            owner=None if i == 0 else f"{tag}-p{i % 2}",
        )
        if i == 4:
            run = run.replace(state=RunState.DONE, finished_at=50.0, outcome="ran")
        if i == 3:
            run = run.replace(state=RunState.STARTED, attempt=1)
        made = await store.create_run(run)
        assert made is not None
        written.append(made)

    async def listed(**filters: object) -> list[str]:
        runs = await peer.list_runs(workflow=wf, **filters)  # type: ignore[arg-type]
        return [r.run_id for r in runs]

    # A peer's view may lag by a moment (an index fed by a watch): wait a little.
    for _ in range(100):
        if len(await listed()) >= 5:
            break
        await trio.sleep(0.05)
    every = await listed()
    _check(every == list(reversed(ids)), f"list_runs must order by scheduled_at: {every}")
    pending = await listed(states={RunState.PENDING})
    _check(pending == [ids[2], ids[1], ids[0]], f"filter by state: {pending}")
    active = await listed(states={RunState.PENDING, RunState.STARTED})
    _check(active == [ids[3], ids[2], ids[1], ids[0]], f"filter by states: {active}")
    unowned = await listed(owner=None)
    _check(unowned == [ids[0]], f"owner=None lists unclaimed runs only: {unowned}")
    owned = await listed(owner=f"{tag}-p1")
    _check(owned == [ids[3], ids[1]], f"filter by owner: {owned}")
    any_owner = await listed(owner=ANY)
    _check(len(any_owner) == 5, "owner=ANY lists every run")
    due = await listed(due_before=1020.0)
    _check(due == [ids[4], ids[3]], f"due_before is exclusive: {due}")
    old = await listed(finished_before=51.0)
    _check(old == [ids[4]], f"finished_before lists old tombstones: {old}")
    _check(await listed(finished_before=50.0) == [], "finished_before is exclusive")
    limited = await listed(limit=2)
    _check(limited == [ids[4], ids[3]], f"limit keeps the earliest due: {limited}")
    _check(await peer.list_runs(workflow=f"{wf}-none") == [], "an unknown workflow lists nothing")
    for run in written:
        _check(await store.delete_run(run.run_id, revision=run.revision), "cleanup")


async def _leases(store: RunStore, peer: RunStore, tag: str) -> None:
    pid = f"conformance-{tag}-process ☃"
    _check(await store.get_lease(pid) is None, "get_lease of an unknown process must be None")
    first = await store.put_lease(Lease(pid, 1, 500.0))
    _check(first is not None and first.revision > 0, "creating a lease must succeed")
    assert first is not None
    _check(
        await peer.put_lease(Lease(pid, 2, 600.0)) is None,
        "creating a lease that exists must return None",
    )
    renewed = await peer.put_lease(Lease(pid, 1, 510.0, revision=first.revision))
    _check(renewed is not None, "renewing against the current revision must succeed")
    assert renewed is not None
    _check(
        await store.put_lease(Lease(pid, 1, 520.0, revision=first.revision)) is None,
        "renewing against a stale revision must return None",
    )
    _check(await store.get_lease(pid) == renewed, "get_lease returns the stored lease")
    draining = await store.put_lease(Lease(pid, 1, 510.0, revision=renewed.revision, draining=True))
    _check(draining is not None and draining.draining, "the draining flag is stored")
    assert draining is not None
    read = await peer.get_lease(pid)
    _check(read is not None and read.draining, f"get_lease returns the draining flag: {read}")
    renewed = draining
    released = await store.put_lease(Lease(pid, 1, 510.0, released=True, revision=renewed.revision))
    _check(released is not None and released.released, "the released flag is stored")
    # A listing may lag the writes a little (a NATS KV listing reads the bucket's
    # stream through a consumer): it must show the latest lease within 5 s.
    for _ in range(100):
        listed = [lease for lease in await peer.list_leases() if lease.process_id == pid]
        if listed == [released]:
            break
        await trio.sleep(0.05)
    _check(listed == [released], f"list_leases returns the stored lease: {listed}")
    assert released is not None
    _check(
        not await store.delete_lease(pid, revision=renewed.revision),
        "delete_lease against a stale revision must return False",
    )
    _check(await store.delete_lease(pid, revision=released.revision), "delete_lease")
    _check(await peer.get_lease(pid) is None, "a deleted lease is gone")
    again = await peer.put_lease(Lease(pid, 2, 700.0))
    _check(again is not None, "a lease can be created again after a delete")
    assert again is not None
    _check(await store.delete_lease(pid, revision=again.revision), "cleanup")


async def _concurrent_creates(store: RunStore, peer: RunStore, tag: str) -> None:
    run_id = f"conformance-{tag}-race"
    wins: list[StoredRun] = []

    async def create(target: RunStore, owner: str) -> None:
        made = await target.create_run(_run(run_id, 1.0, owner=owner))
        if made is not None:
            wins.append(made)

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(create, store if i % 2 else peer, f"p{i}")
    _check(len(wins) == 1, f"exactly one concurrent create_run must win, got {len(wins)}")
    current = await store.get_run(run_id)
    _check(current == wins[0], "the winner's record is the stored one")
    assert current is not None

    updates: list[StoredRun] = []

    async def update(target: RunStore, owner: str) -> None:
        made = await target.update_run(current.replace(owner=owner))
        if made is not None:
            updates.append(made)

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(update, store if i % 2 else peer, f"q{i}")
    _check(len(updates) == 1, f"exactly one concurrent update_run must win, got {len(updates)}")
    _check(await store.delete_run(run_id, revision=updates[0].revision), "cleanup")
