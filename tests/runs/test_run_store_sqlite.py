"""SqliteRunStore: the conformance suite, several processes on one file, migrations,
its own thread limiter, oversized and unreadable records, locks and cancellation.

Real clock throughout: the store's calls run in threads, which MockClock cannot drive.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.env import ROOT
from tests.runs.draining import check_peers_run_a_draining_process_runs
from trio_debounce import (
    BackendConfigError,
    BackendError,
    BackendUnavailableError,
    DocumentTooLargeError,
)
from trio_debounce._runs._sqlite import SqliteRunStore, _map_error, open_sqlite_run_store
from trio_debounce._runs._sqlite_rows import _MIGRATIONS, SCHEMA_VERSION
from trio_debounce.abc import Lease, RunState, StoredRun
from trio_debounce.testing import check_run_store


def _run(run_id: str, at: float = 100.0, **changes: object) -> StoredRun:
    return StoredRun(run_id, "wf", '{"n": 0}', at, created_at=1.0).replace(**changes)


def _raw(path: Path) -> sqlite3.Connection:
    """A plain sqlite3 connection, as another tool would open the file."""
    return sqlite3.connect(path, isolation_level=None, timeout=5.0)


def _scalar(path: Path, query: str) -> object:
    conn = _raw(path)
    try:
        return conn.execute(query).fetchone()[0]
    finally:
        conn.close()


# --- conformance ---------------------------------------------------------------------


async def test_two_stores_on_one_file_conform(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with open_sqlite_run_store(path) as store, open_sqlite_run_store(path) as other:
        await check_run_store(store, other=other)


async def test_one_store_conforms(tmp_path: Path) -> None:
    async with open_sqlite_run_store(tmp_path / "runs.db") as store:
        await check_run_store(store)
        await check_run_store(store)  # again, over the first pass's leftovers


async def test_the_connection_opens_on_the_first_call_and_closes(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    store = SqliteRunStore(path)
    assert not path.exists(), "the constructor does no I/O"
    assert store.path == str(path)
    assert await store.get_run("r") is None
    assert path.exists()
    assert _scalar(path, "PRAGMA journal_mode") == "wal"
    assert _scalar(path, "PRAGMA user_version") == SCHEMA_VERSION
    await store.aclose()
    await store.aclose()  # idempotent
    with pytest.raises(trio.ClosedResourceError):
        await store.get_run("r")
    async with open_sqlite_run_store(path) as opened:
        pass
    with pytest.raises(trio.ClosedResourceError):
        await opened.list_leases()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_payload_bytes"):
        SqliteRunStore(tmp_path / "x.db", max_payload_bytes=0)
    for timeout in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="timeout"):
            SqliteRunStore(tmp_path / "x.db", timeout=timeout)


async def test_revisions_grow_across_runs_and_leases(tmp_path: Path) -> None:
    async with open_sqlite_run_store(tmp_path / "runs.db") as store:
        a = await store.create_run(_run("a"))
        lease = await store.put_lease(Lease("p", 1, 10.0))
        b = await store.create_run(_run("b"))
        assert a is not None
        assert lease is not None
        assert b is not None
        assert a.revision < lease.revision < b.revision
        assert await store.delete_run("b", revision=b.revision)
        again = await store.create_run(_run("b"))
        assert again is not None
        assert again.revision > b.revision


async def test_run_writes_are_full_and_lease_writes_normal(tmp_path: Path) -> None:
    async with open_sqlite_run_store(tmp_path / "runs.db") as store:

        async def synchronous() -> int:
            level = await store._call(lambda c: c.execute("PRAGMA synchronous").fetchone()[0])
            return int(level)

        assert await synchronous() == 2  # FULL from the start
        lease = await store.put_lease(Lease("p", 1, 10.0))
        assert lease is not None
        assert await synchronous() == 1  # NORMAL
        assert await store.create_run(_run("a")) is not None
        assert await synchronous() == 2


async def test_values_sqlite_cannot_keep_are_refused(tmp_path: Path) -> None:
    async with open_sqlite_run_store(tmp_path / "runs.db") as store:
        with pytest.raises(ValueError, match="scheduled_at"):
            await store.create_run(_run("nan", math.nan))
        with pytest.raises(ValueError, match="token"):
            await store.create_run(_run("big", token=2**64))
        with pytest.raises(ValueError, match="no revision"):
            await store.update_run(_run("unwritten"))
        assert await store.list_runs() == []


async def test_empty_filters_and_a_zero_limit_list_nothing(tmp_path: Path) -> None:
    async with open_sqlite_run_store(tmp_path / "runs.db") as store:
        assert await store.create_run(_run("a")) is not None
        assert await store.list_runs(states=set()) == []
        assert await store.list_runs(limit=0) == []
        assert [r.run_id for r in await store.list_runs(due_before=math.inf)] == ["a"]
        with pytest.raises(ValueError, match="limit"):
            await store.list_runs(limit=-1)


def test_sqlite_errors_are_mapped_without_error_codes() -> None:
    # Python 3.10's sqlite3 exceptions carry no sqlite_errorcode: the message decides.
    locked = _map_error(sqlite3.OperationalError("database is locked"), "f.db")
    assert type(locked) is BackendUnavailableError
    assert "f.db" in str(locked)
    assert type(_map_error(sqlite3.DatabaseError("file is not a database"), "f.db")) is (
        BackendConfigError
    )
    assert type(_map_error(sqlite3.IntegrityError("NOT NULL failed"), "f.db")) is BackendError


def test_a_read_only_open_that_would_create_the_wal_says_so() -> None:
    # As root the tests cannot make a directory this process may not write: the
    # error is built as SQLite raises it (SQLITE_READONLY_DIRECTORY, 8 | 6 << 8).
    exc = sqlite3.OperationalError("attempt to write a readonly database")
    exc.sqlite_errorcode = 1544
    read_only = _map_error(exc, "f.db", "ro")
    assert type(read_only) is BackendError
    assert "'f.db' cannot be read without creating its -wal and -shm files" in str(read_only)
    writer = _map_error(exc, "f.db", "rw")  # any other mode: as SQLite says it
    assert type(writer) is BackendError
    assert "-wal" not in str(writer)


# --- several processes ----------------------------------------------------------------


@pytest.mark.slow
def test_processes_compare_and_swap_without_lost_updates(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    processes, attempts = 4, 200

    async def setup() -> None:
        async with open_sqlite_run_store(path) as store:
            assert await store.create_run(_run("counter")) is not None

    trio.run(setup)
    command = [sys.executable, "-m", "tests.runs.sqlite_cas_driver", "cas", str(path), "counter"]
    procs = [
        subprocess.Popen(
            [*command, str(attempts)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    try:
        for proc in procs:  # every one is open before any starts
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(proc.communicate(timeout=60)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0] * processes
    assert [r["errors"] for r in results] == [[]] * processes
    assert [r["backwards"] for r in results] == [0] * processes
    assert all(r["ok"] + r["lost"] == attempts for r in results)
    wins = sum(r["ok"] for r in results)

    async def final() -> StoredRun | None:
        async with open_sqlite_run_store(path) as store:
            return await store.get_run("counter")

    run = trio.run(final)
    assert run is not None
    assert json.loads(run.payload)["n"] == wins, "a lost update"
    assert wins >= attempts  # at least one process's worth: the contention was real
    assert _scalar(path, "PRAGMA integrity_check") == "ok"


# --- migrations -------------------------------------------------------------------------


INDEXES = {"runs_by_state", "runs_by_owner", "runs_by_finished", "runs_by_workflow"}


def _indexes(path: Path) -> set[str]:
    conn = _raw(path)
    try:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'").fetchall()
        return {row[0] for row in rows if not row[0].startswith("sqlite_autoindex")}
    finally:
        conn.close()


async def test_an_empty_database_at_version_0_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    _raw(path).close()  # an empty file: user_version 0
    assert _scalar(path, "PRAGMA user_version") == 0
    async with open_sqlite_run_store(path) as store:
        assert await store.create_run(_run("a")) is not None
    assert _scalar(path, "PRAGMA user_version") == SCHEMA_VERSION
    assert _indexes(path) == INDEXES


async def test_a_version_1_database_is_migrated_in_order(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    conn = _raw(path)
    for statement in _MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute(
        "INSERT INTO runs VALUES ('old', 'wf', '{}', 5.0, NULL, 'pending', NULL, 0, 1, 0, 0, "
        "1.0, NULL, NULL, NULL, 7)"
    )
    conn.execute("UPDATE revision_sequence SET last = 7")
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    assert _indexes(path) == set()
    async with open_sqlite_run_store(path) as store:
        old = await store.get_run("old")
        assert old == StoredRun("old", "wf", "{}", 5.0, created_at=1.0, revision=7)
        new = await store.create_run(_run("new"))
        assert new is not None
        assert new.revision == 8
    assert _scalar(path, "PRAGMA user_version") == SCHEMA_VERSION == 3
    assert _indexes(path) == INDEXES


async def test_a_version_2_database_gets_the_draining_column(tmp_path: Path) -> None:
    # A lease written before the draining mark existed reads as not draining, and
    # can be marked draining once migrated.
    path = tmp_path / "runs.db"
    conn = _raw(path)
    for step in _MIGRATIONS[:2]:
        for statement in step:
            conn.execute(statement)
    conn.execute("INSERT INTO leases VALUES ('p', 3, 100.0, 0, 4)")
    conn.execute("UPDATE revision_sequence SET last = 4")
    conn.execute("PRAGMA user_version = 2")
    conn.close()
    async with open_sqlite_run_store(path) as store:
        old = await store.get_lease("p")
        assert old == Lease("p", 3, 100.0, revision=4)
        assert not old.draining
        marked = await store.put_lease(old.replace(draining=True))
        assert marked is not None
        assert marked.draining
        assert await store.get_lease("p") == marked
    assert _scalar(path, "PRAGMA user_version") == 3


async def test_a_newer_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with open_sqlite_run_store(path):
        pass
    conn = _raw(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    conn.close()
    message = f"schema version {SCHEMA_VERSION + 5}, newer than the version {SCHEMA_VERSION}"
    with pytest.raises(BackendConfigError, match=message):
        async with open_sqlite_run_store(path):
            pytest.fail("opened")  # pragma: no cover
    store = SqliteRunStore(path)  # opened lazily: the first call raises
    with pytest.raises(BackendConfigError, match=message):
        await store.list_runs()
    await store.aclose()
    assert _scalar(path, "PRAGMA user_version") == SCHEMA_VERSION + 5, "left as it was"


async def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    path.write_bytes(b"this is not an SQLite database, not even a little" * 100)
    with pytest.raises(BackendConfigError, match="not an SQLite database"):
        async with open_sqlite_run_store(path):
            pytest.fail("opened")  # pragma: no cover


async def test_a_missing_directory_is_a_backend_error(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="unable to open") as info:
        async with open_sqlite_run_store(tmp_path / "nowhere" / "runs.db"):
            pytest.fail("opened")  # pragma: no cover
    assert not isinstance(info.value, sqlite3.Error)


# --- modes "rw" and "ro": an existing file, never created nor migrated ---------------


def _snapshot(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


@pytest.mark.parametrize("mode", ["rw", "ro"])
async def test_a_missing_file_is_not_created_without_mode_rwc(tmp_path: Path, mode: Any) -> None:
    path = tmp_path / "runs.db"
    with pytest.raises(BackendConfigError, match=f"the run store {str(path)!r} does not exist"):
        async with open_sqlite_run_store(path, mode=mode):
            pytest.fail("opened")  # pragma: no cover
    assert not path.exists()


async def test_mode_ro_reads_and_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with open_sqlite_run_store(path) as writer:
        made = await writer.create_run(_run("a"))
        lease = await writer.put_lease(Lease("p", 1, 10.0))
    before = _snapshot(path)
    await trio.sleep(0.01)  # a write would show in the mtime
    async with open_sqlite_run_store(path, mode="ro") as store:
        assert store.mode == "ro"
        assert await store.get_run("a") == made
        assert await store.list_runs() == [made]
        assert await store.list_leases() == [lease]
        assert made is not None
        writes: list[Callable[[], Awaitable[object]]] = [
            lambda: store.create_run(_run("b")),
            lambda: store.update_run(made.replace(attempt=1)),
            lambda: store.delete_run("a", revision=made.revision),
            lambda: store.put_lease(Lease("q", 1, 10.0)),
        ]
        for write in writes:
            with pytest.raises(BackendError, match="read-only"):
                await write()
    assert _snapshot(path) == before


async def test_mode_ro_reads_beside_a_live_writer(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with (
        open_sqlite_run_store(path) as writer,
        open_sqlite_run_store(path, mode="ro") as reader,
    ):
        made = await writer.create_run(_run("a"))
        assert await reader.list_runs() == [made]


@pytest.mark.parametrize("mode", ["rw", "ro"])
async def test_a_file_of_another_schema_version_is_not_migrated(tmp_path: Path, mode: Any) -> None:
    path = tmp_path / "runs.db"
    _raw(path).close()
    with pytest.raises(BackendConfigError, match="is not a run store"):
        async with open_sqlite_run_store(path, mode=mode):
            pytest.fail("opened")  # pragma: no cover
    conn = _raw(path)
    for statement in _MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    with pytest.raises(BackendConfigError, match="schema version 1, older than the version"):
        async with open_sqlite_run_store(path, mode=mode):
            pytest.fail("opened")  # pragma: no cover
    assert _scalar(path, "PRAGMA user_version") == 1, "not migrated"


async def test_mode_rw_writes_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with open_sqlite_run_store(path):
        pass
    async with open_sqlite_run_store(path, mode="rw") as store:
        made = await store.create_run(_run("a"))
        assert made is not None
        assert await store.delete_run("a", revision=made.revision)


def test_an_unknown_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be 'rwc', 'rw' or 'ro', got 'r'"):
        SqliteRunStore(tmp_path / "x.db", mode="r")  # type: ignore[arg-type]


# --- the store's own thread limiter -----------------------------------------------------


async def test_a_full_default_thread_limiter_does_not_block_the_store(tmp_path: Path) -> None:
    default = trio.to_thread.current_default_thread_limiter()
    release = threading.Event()
    store = SqliteRunStore(tmp_path / "runs.db")  # not opened yet: opening needs a thread too
    try:
        async with trio.open_nursery() as nursery:

            async def block() -> None:
                await trio.to_thread.run_sync(release.wait)

            for _ in range(int(default.total_tokens)):
                nursery.start_soon(block)
            try:
                await trio.testing.wait_all_tasks_blocked()
                assert default.borrowed_tokens == default.total_tokens
                with trio.fail_after(5):
                    assert await store.create_run(_run("a")) is not None
                    assert [r.run_id for r in await store.list_runs()] == ["a"]
                    assert default.borrowed_tokens == default.total_tokens  # still full
            finally:
                release.set()
    finally:
        await store.aclose()


# --- oversized and unreadable records ---------------------------------------------------


async def test_an_oversized_payload_is_refused_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with open_sqlite_run_store(path, max_payload_bytes=1000) as store:
        assert store.max_payload_bytes == 1000
        last = _scalar(path, "SELECT last FROM revision_sequence")
        big = _run("big ☃", payload='"' + "é" * 500 + '"')  # 1002 bytes in UTF-8, 502 chars
        with pytest.raises(DocumentTooLargeError, match=r"'big ☃'.* 1002 bytes.*=1000"):
            await store.create_run(big)
        assert await store.get_run("big ☃") is None
        fits = await store.create_run(big.replace(payload='"' + "é" * 499 + '"'))  # 1000
        assert fits is not None
        with pytest.raises(DocumentTooLargeError, match="'big ☃'"):
            await store.update_run(fits.replace(payload=big.payload))
        assert await store.get_run("big ☃") == fits
        assert _scalar(path, "SELECT last FROM revision_sequence") == int(str(last)) + 1


async def test_unreadable_rows_are_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "runs.db"
    async with open_sqlite_run_store(path) as store:
        good = [await store.create_run(_run(f"good{i}", 10.0 + i)) for i in range(2)]
        lease = await store.put_lease(Lease("alive", 1, 10.0))
        conn = _raw(path)
        rows = [
            ("bad-state", "wf", "{}", 1.0, "exploded", 1),
            ("bad-time", "wf", "{}", "soon", "pending", 2),
            ("bad-payload", "wf", b"\xff\xfe", 2.0, "pending", 3),
            ("bad-revision", "wf", "{}", 3.0, "pending", "x"),
        ]
        for run_id, wf, payload, at, state, revision in rows:
            conn.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, NULL, ?, NULL, 0, 1, 0, 0, 1.0, NULL, "
                "NULL, NULL, ?)",
                (run_id, wf, payload, at, state, revision),
            )
        conn.execute("INSERT INTO leases VALUES ('zombie', 1, 5.0, 7, 99, 0)")
        conn.close()

        with caplog.at_level(logging.WARNING, logger="trio_debounce.runs"):
            listed = await store.list_runs()
            assert listed == good
            # Unreadable rows do not use up the limit (two sort before the good ones).
            assert await store.list_runs(limit=1) == good[:1]
            assert await store.list_runs(states={RunState.PENDING}, limit=2) == good
            assert await store.get_run("bad-state") is None
            assert await store.list_leases() == [lease]
            assert await store.get_lease("zombie") is None
        messages = [r.getMessage() for r in caplog.records if r.name == "trio_debounce.runs"]
        for run_id in ("bad-state", "bad-time", "bad-payload", "bad-revision", "zombie"):
            assert any(run_id in m for m in messages), (run_id, messages)
        assert all(r.levelno == logging.WARNING for r in caplog.records)

        # A create (a first lease) over an unreadable row replaces it.
        replaced = await store.create_run(_run("bad-state", 50.0))
        assert replaced is not None
        assert await store.get_run("bad-state") == replaced
        zombie = await store.put_lease(Lease("zombie", 2, 20.0))
        assert zombie is not None
        assert await store.get_lease("zombie") == zombie


# --- locks and cancellation ---------------------------------------------------------------


@pytest.mark.realtime
async def test_a_lock_held_past_the_timeout_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with open_sqlite_run_store(path, timeout=0.2) as store:
        run = await store.create_run(_run("r"))
        assert run is not None
        blocker = _raw(path)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            start = time.monotonic()
            with pytest.raises(BackendUnavailableError, match="locked") as info:
                await store.update_run(run.replace(owner="p"))
            assert 0.15 < time.monotonic() - start < 3.0
            assert not isinstance(info.value, sqlite3.Error)
            assert await store.get_run("r") == run  # WAL: reads go on beside a writer
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert await store.update_run(run.replace(owner="p")) is not None


@pytest.mark.realtime
async def test_cancelling_a_call_in_flight_lets_its_write_finish(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with open_sqlite_run_store(path, timeout=5.0) as store:
        run = await store.create_run(_run("r"))
        assert run is not None
        blocker = _raw(path)
        blocker.execute("BEGIN IMMEDIATE")  # the store's next write waits in its thread
        results: list[StoredRun | None] = []
        update_scope = trio.CancelScope()

        async def update() -> None:
            with update_scope:
                results.append(await store.update_run(run.replace(owner="p")))
                await trio.lowlevel.checkpoint()

        start = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(update)
            await trio.testing.wait_all_tasks_blocked()
            assert store._limiter.borrowed_tokens == 1  # the update's thread has started
            # A call queued behind it on the store's limiter is cancelled at once.
            with trio.move_on_after(0.1) as queued:
                await store.get_run("r")
            assert queued.cancelled_caught
            assert time.monotonic() - start < 0.4
            update_scope.cancel()
            await trio.sleep(0.5 - (time.monotonic() - start))
            assert results == [], "the update waits for its thread"
            blocker.execute("ROLLBACK")
        elapsed = time.monotonic() - start
        blocker.close()
        assert update_scope.cancelled_caught
        assert 0.4 < elapsed < 3.0, "the call returned once its thread's write finished"
        # The write committed: its result was returned, and it is the stored record.
        assert len(results) == 1
        assert results[0] is not None
        assert await store.get_run("r") == results[0]
        assert await store.update_run(results[0].replace(owner="q")) is not None


@pytest.mark.realtime
async def test_a_call_under_a_deadline_waits_for_a_lock_until_the_deadline_only(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    async with open_sqlite_run_store(path, timeout=5.0) as store:
        run = await store.create_run(_run("r"))
        assert run is not None
        blocker = _raw(path)
        blocker.execute("BEGIN IMMEDIATE")  # held past the caller's deadline
        try:
            start = time.monotonic()
            with pytest.raises(trio.TooSlowError):  # Cancelled, not BackendUnavailableError
                with trio.fail_after(0.3):
                    await store.update_run(run.replace(owner="p"))
            assert 0.25 < time.monotonic() - start < 1.5
        finally:
            blocker.execute("ROLLBACK")
        # Nothing was written and no transaction is left open in the store.
        assert await store.get_run("r") == run
        blocker.execute("BEGIN IMMEDIATE")
        blocker.execute("ROLLBACK")
        blocker.close()
        assert await store.update_run(run.replace(owner="p")) is not None
    assert _scalar(path, "PRAGMA integrity_check") == "ok"


@pytest.mark.realtime
@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_peers_run_a_draining_processs_runs_on_time(tmp_path: Path, delivery: Any) -> None:
    path = tmp_path / "runs.db"
    await check_peers_run_a_draining_process_runs(lambda: open_sqlite_run_store(path), delivery)
