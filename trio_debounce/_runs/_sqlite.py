"""The SQLite implementation of :class:`~trio_debounce.abc.RunStore`: deferred runs in
one database file, shared by the processes of one host.

The database (stdlib :mod:`sqlite3`, WAL journal) holds three tables:

``runs``
  One row per run id, a column per :class:`~trio_debounce.abc.StoredRun` field, and
  the row's ``revision``.
``leases``
  One row per process id, a column per :class:`~trio_debounce.abc.Lease` field.
``revision_sequence``
  A single row, the last revision handed out. Every write takes the next number in
  the same transaction as the write, so revisions increase across the whole file and
  are never reused, not even by a run deleted and created again under the same id.

Every write is one ``BEGIN IMMEDIATE`` transaction (the write lock first, so the
compare and the swap see the same database), without ``RETURNING`` (SQLite before
3.35 lacks it). The schema is versioned with ``PRAGMA user_version``
(the migrations, and the encoding of rows, are in ``_sqlite_rows``).

sqlite3 blocks, so every call runs in a worker thread (:func:`trio.to_thread.run_sync`)
on the store's own :class:`trio.CapacityLimiter`; sqlite3's exceptions are mapped at
this boundary (:func:`_map_error`) onto the library's own.
"""

from __future__ import annotations

import math
import os
import pathlib
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

import trio

from .._errors import (
    BackendConfigError,
    BackendError,
    BackendUnavailableError,
)
from ._sqlite_rows import (
    _INSERT_RUN,
    _LEASE_COLUMNS,
    _RUN_COLUMNS,
    _UPDATE_RUN,
    _check_current,
    _check_integer,
    _check_number,
    _check_text,
    _lease_or_none,
    _lease_values,
    _migrate,
    _rollback,
    _run_or_none,
    _run_values,
)
from ._store import ANY, Lease, RunState, RunStore, StoredRun, _Any

T = TypeVar("T")

#: How a :class:`SqliteRunStore` opens its file (SQLite's URI ``mode`` values).
SqliteMode = Literal["rwc", "rw", "ro"]
_MODES = ("rwc", "rw", "ro")

# SQLite's primary result codes for "another connection holds the lock".
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_READONLY = 8
_SQLITE_NOTADB = 26


def _map_error(exc: sqlite3.Error, path: str, mode: SqliteMode = "rwc") -> BackendError:
    """The library's exception for sqlite3's ``exc`` (raised by a store opened in
    ``mode``)."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    message = str(exc)
    if code is not None:
        busy = code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)
        not_a_database = code & 0xFF == _SQLITE_NOTADB
        read_only = code & 0xFF == _SQLITE_READONLY
    else:
        lowered = message.lower()
        busy = "locked" in lowered or "busy" in lowered
        not_a_database = "not a database" in lowered
        read_only = "readonly" in lowered
    if read_only and mode == "ro":
        # A read of a WAL database that no connection has open creates its -wal and
        # -shm companions: a user who may not write them cannot read it then.
        return BackendError(
            f"SQLite database {path!r} cannot be read without creating its -wal and -shm "
            f"files, which this user may not (no other process has it open): {message}"
        )
    if busy:
        return BackendUnavailableError(
            f"SQLite database {path!r} is locked by another connection: {message}"
        )
    if not_a_database:
        return BackendConfigError(f"{path!r} is not an SQLite database: {message}")
    return BackendError(f"SQLite database {path!r}: {type(exc).__name__}: {message}")


# --- the connection and the store -----------------------------------------------

_FULL = "FULL"
_NORMAL = "NORMAL"


class _Connection:
    """The one sqlite3 connection of a :class:`SqliteRunStore`, used by one worker
    thread at a time (the store's limiter has one token): opened on first use (WAL and
    migrations in mode ``"rwc"``; the schema checked otherwise), each call's wait for
    other connections' locks bounded by the caller's deadline, each write one ``BEGIN
    IMMEDIATE`` transaction."""

    def __init__(
        self,
        path: str,
        timeout: float,
        limiter: trio.CapacityLimiter,
        name: str,
        mode: SqliteMode = "rwc",
    ) -> None:
        self._path = path
        self._timeout = timeout
        self._mode = mode
        self._limiter = limiter
        #: The store's repr, for the errors.
        self._name = name
        self._conn: sqlite3.Connection | None = None
        self._synchronous: str | None = None
        self._busy_milliseconds: int | None = None
        self._closed = False

    async def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` in a worker thread on the store's limiter, with sqlite3's
        exceptions mapped."""
        if self._closed:
            raise trio.ClosedResourceError(f"{self._name} is closed")
        # The caller's deadline, moved to time.monotonic() for the thread's busy wait.
        deadline = trio.current_effective_deadline()
        until = math.inf
        if deadline != math.inf:
            until = time.monotonic() + (deadline - trio.current_time())
        try:
            return await trio.to_thread.run_sync(
                self._in_thread, fn, until, limiter=self._limiter, abandon_on_cancel=False
            )
        except BackendError:
            # The caller was cancelled while the call ran, and the call failed (nothing
            # was written): the cancellation is the answer the caller waits for.
            await trio.lowlevel.checkpoint_if_cancelled()
            raise

    async def write(
        self, synchronous: str, body: Callable[[sqlite3.Connection], T | None]
    ) -> T | None:
        """``body`` as one write transaction (see :meth:`_write`), in a worker thread.

        Raises:
          BackendError: the store is read-only (nothing was written).
        """
        if self._mode == "ro":
            await trio.lowlevel.checkpoint()
            raise BackendError(f"{self._name} is read-only (mode='ro'): nothing was written")
        return await self.call(lambda conn: self._write(conn, synchronous, body))

    async def close(self) -> None:
        """Close the connection (see :meth:`SqliteRunStore.aclose`)."""
        self._closed = True
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(
                self._close_in_thread, limiter=self._limiter, abandon_on_cancel=False
            )
        await trio.lowlevel.checkpoint_if_cancelled()

    # -- the worker-thread side (under the limiter) ------------------------------------

    def _in_thread(self, fn: Callable[[sqlite3.Connection], T], until: float) -> T:
        if self._closed:
            raise trio.ClosedResourceError(f"{self._name} is closed")
        try:
            if self._conn is None:
                conn = self._open(until)
            else:
                conn = self._conn
                self._set_busy_wait(conn, until)
            return fn(conn)
        except sqlite3.Error as exc:
            raise _map_error(exc, self._path, self._mode) from exc

    def _set_busy_wait(self, conn: sqlite3.Connection, until: float) -> float:
        """Let this call wait for other connections' locks up to ``timeout`` seconds, or
        until ``until`` (the caller's deadline, on :func:`time.monotonic`) if sooner.
        Returns the wait allowed, in seconds."""
        budget = self._timeout
        if until != math.inf:
            budget = min(budget, max(0.0, until - time.monotonic()))
        milliseconds = math.ceil(budget * 1000)
        if milliseconds != self._busy_milliseconds:
            conn.execute(f"PRAGMA busy_timeout = {milliseconds}")
            self._busy_milliseconds = milliseconds
        return budget

    def _open(self, until: float) -> sqlite3.Connection:
        if self._mode == "rwc":
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        else:
            # Never created: SQLite's own mode=rw / mode=ro refuse a missing file too,
            # but only with "unable to open database file".
            if not os.path.exists(self._path):
                raise BackendConfigError(f"the run store {self._path!r} does not exist")
            uri = f"{pathlib.Path(os.path.abspath(self._path)).as_uri()}?mode={self._mode}"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        self._busy_milliseconds = None
        try:
            budget = self._set_busy_wait(conn, until)
            if self._mode == "rwc":
                self._enable_wal(conn, budget)
                conn.execute(f"PRAGMA synchronous = {_FULL}")
                _migrate(conn, self._path)
            else:
                _check_current(conn, self._path)
                if self._mode == "rw":
                    # A file at the current version was made by this store: already WAL.
                    self._enable_wal(conn, budget)
                    conn.execute(f"PRAGMA synchronous = {_FULL}")
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._synchronous = _FULL
        return conn

    def _enable_wal(self, conn: sqlite3.Connection, budget: float) -> None:
        # Switching a file to WAL needs a moment without other connections' locks;
        # SQLite does not always wait on the busy handler for it, so retry here.
        deadline = time.monotonic() + budget
        while True:
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as exc:
                if not isinstance(_map_error(exc, self._path), BackendUnavailableError):
                    raise
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
        if str(mode).lower() != "wal":
            raise BackendConfigError(
                f"the run store {self._path!r} cannot use the WAL journal (SQLite kept "
                f"journal_mode={mode!r}); use a file on a local filesystem"
            )

    def _write(
        self,
        conn: sqlite3.Connection,
        synchronous: str,
        body: Callable[[sqlite3.Connection], T | None],
    ) -> T | None:
        """``body`` in one ``BEGIN IMMEDIATE`` transaction: committed if it returns a
        result, rolled back if it returns None (it lost) or raises."""
        if self._synchronous != synchronous:
            # Only between transactions: the level applies to the next commit.
            conn.execute(f"PRAGMA synchronous = {synchronous}")
            self._synchronous = synchronous
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = body(conn)
            conn.execute("COMMIT" if result is not None else "ROLLBACK")
        except BaseException:
            _rollback(conn)
            raise
        return result

    @staticmethod
    def next_revision(conn: sqlite3.Connection) -> int:
        """Take the next revision of the database (inside the write's transaction)."""
        conn.execute("UPDATE revision_sequence SET last = last + 1 WHERE id = 1")
        row = conn.execute("SELECT last FROM revision_sequence WHERE id = 1").fetchone()
        if row is None or not isinstance(row[0], int):
            raise BackendConfigError("the run store's revision sequence is missing or damaged")
        return row[0]

    def _close_in_thread(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except sqlite3.Error as exc:
                raise _map_error(exc, self._path) from exc


class SqliteRunStore(RunStore):
    """Deferred runs in an SQLite database file, shared by the processes of one host.

    Open it with :func:`open_sqlite_run_store`, or construct it and :meth:`aclose` it
    yourself. The constructor does no I/O: the connection is opened, switched to WAL
    and its schema migrated on the first call (by :func:`open_sqlite_run_store`, on
    entry, so that a bad file fails the ``async with``). A first call that fails to
    open leaves the store unopened; the next call tries again.

    Any number of processes (and stores) may open the same file on one host, not on
    a network filesystem. Each store has one connection and runs its calls one at a
    time, in a worker thread on its own :class:`trio.CapacityLimiter`. A cancelled
    call that has started is not abandoned: its transaction commits or rolls back
    before the call returns. Run writes survive a power cut; lease writes survive the
    crash of a process. Rows that no run or lease has are skipped with a warning.
    :ref:`sqlite-run-store` has the details.

    Args:
      path (str | os.PathLike[str]): the database file; created (with its ``-wal``
        and ``-shm`` companions) if absent, in mode ``"rwc"``. The file belongs to the
        store: do not keep other tables in it.
      max_payload_bytes (int): the largest payload (UTF-8 bytes of its JSON text) a
        run may carry; larger ones raise :exc:`~trio_debounce.DocumentTooLargeError`
        before anything is written. Default 1 MiB.
      timeout (float): seconds a call waits for another connection's lock before it
        raises :exc:`~trio_debounce.BackendUnavailableError` (SQLite's busy timeout;
        shorter when the caller's deadline comes first). Default 5.0.
      mode (str): how the file is opened, in SQLite's words. ``"rwc"`` (the default,
        for coordinators): read, write, and create the file if absent; the schema is
        migrated. ``"rw"``: read and write an existing file whose schema is this
        version's; never created nor migrated. ``"ro"``: read an existing file of this
        version's schema, never written (a tool's listing): every write method raises
        :exc:`~trio_debounce.BackendError` without writing. In ``"rw"`` and ``"ro"``
        a missing file, or one of another schema version, raises
        :exc:`~trio_debounce.BackendConfigError`. SQLite needs the ``-wal`` and
        ``-shm`` companions to read a WAL database, so a read-only open of a file that
        no other connection has open creates them (empty) and leaves them: the
        database file itself is not touched. (A user who may not create them can
        read the file only while another process has it open.)

    Raises:
      ValueError: ``max_payload_bytes`` is not positive, ``timeout`` is negative,
        NaN or infinite, or ``mode`` is not one of the three.
      TypeError: ``path`` is not a path, or an argument is not a number.

    Each method raises :exc:`~trio_debounce.BackendUnavailableError` when the database
    stayed locked for ``timeout`` seconds (a write that raised it was not applied),
    :exc:`~trio_debounce.BackendConfigError` when the file is not a run store this
    code can use (not an SQLite database, a newer schema version, no WAL; missing,
    or of an older version, in modes ``"rw"`` and ``"ro"``),
    :exc:`~trio_debounce.BackendError` for any other SQLite error, and
    :exc:`trio.ClosedResourceError` after :meth:`aclose`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_payload_bytes: int = 1024 * 1024,
        timeout: float = 5.0,
        mode: SqliteMode = "rwc",
    ) -> None:
        self._path: str = os.fspath(path)
        if not isinstance(self._path, str):
            raise TypeError(f"path must be a str path, not {path!r}")
        try:
            self._path.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"path {self._path!r} is not valid Unicode text (a lone surrogate): SQLite "
                "cannot open it"
            ) from None
        if (
            isinstance(max_payload_bytes, bool)
            or not isinstance(max_payload_bytes, int)
            or max_payload_bytes <= 0
        ):
            raise ValueError(f"max_payload_bytes must be a positive int, got {max_payload_bytes!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
        if not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        if mode not in _MODES:
            raise ValueError(f"mode must be 'rwc', 'rw' or 'ro', got {mode!r}")
        self.max_payload_bytes = max_payload_bytes
        self._mode: SqliteMode = mode
        self._limiter = trio.CapacityLimiter(1)
        self._connection = _Connection(self._path, float(timeout), self._limiter, repr(self), mode)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._path!r}>"

    @property
    def path(self) -> str:
        """The database file (str)."""
        return self._path

    @property
    def mode(self) -> SqliteMode:
        """How the file was opened: ``"rwc"``, ``"rw"`` or ``"ro"`` (str)."""
        return self._mode

    async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` in a worker thread on the store's limiter."""
        return await self._connection.call(fn)

    # -- runs ------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> StoredRun | None:
        """The run ``run_id``, or None if the store has no (readable) record of it.

        Args:
          run_id (str): the run id.

        Returns:
          StoredRun | None: the stored run, with its revision.

        Raises:
          BackendUnavailableError, BackendConfigError, BackendError,
          trio.ClosedResourceError: see the class.
        """
        _check_text(run_id, "run_id")

        def read(conn: sqlite3.Connection) -> StoredRun | None:
            row = conn.execute(
                f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            return None if row is None else _run_or_none(row, self._path)

        return await self._call(read)

    async def create_run(self, run: StoredRun) -> StoredRun | None:
        """Write ``run`` if the store has no record of ``run.run_id`` (``run.revision``
        is ignored). An unreadable row under that id is replaced.

        Args:
          run (StoredRun): the run to write.

        Returns:
          StoredRun | None: ``run`` with its new revision, or None if a record exists.

        Raises:
          DocumentTooLargeError: the payload exceeds :attr:`max_payload_bytes`
            (nothing is written).
          TypeError, ValueError: a field cannot be stored (a non-finite time, an int
            beyond 64 bits, a str that is not valid Unicode).
          BackendUnavailableError, BackendConfigError, BackendError,
          trio.ClosedResourceError: see the class.
        """
        values = _run_values(run, self.max_payload_bytes)

        def create(conn: sqlite3.Connection) -> StoredRun | None:
            row = conn.execute(
                f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id = ?", (run.run_id,)
            ).fetchone()
            if row is not None:
                if _run_or_none(row, self._path) is not None:
                    return None
                conn.execute("DELETE FROM runs WHERE run_id = ?", (run.run_id,))
            revision = _Connection.next_revision(conn)
            conn.execute(_INSERT_RUN, (*values, revision))
            return run.replace(revision=revision)

        return await self._connection.write(_FULL, create)

    async def update_run(self, run: StoredRun) -> StoredRun | None:
        """Replace the record of ``run.run_id`` if its revision is still
        ``run.revision``.

        Args:
          run (StoredRun): the new record; ``run.revision`` is the one it was read at.

        Returns:
          StoredRun | None: ``run`` with its new revision, or None if the record
          changed or is gone.

        Raises:
          ValueError: ``run.revision`` is not positive (the run was never written), or
            a field cannot be stored (see :meth:`create_run`).
          DocumentTooLargeError: the payload exceeds :attr:`max_payload_bytes`
            (nothing is written).
          BackendUnavailableError, BackendConfigError, BackendError,
          trio.ClosedResourceError: see the class.
        """
        if isinstance(run.revision, bool) or not isinstance(run.revision, int):
            raise TypeError(f"run {run.run_id!r}: revision must be an int, not {run.revision!r}")
        if run.revision <= 0:
            raise ValueError(f"run {run.run_id!r} has no revision to update against")
        values = _run_values(run, self.max_payload_bytes)

        def update(conn: sqlite3.Connection) -> StoredRun | None:
            revision = _Connection.next_revision(conn)
            cursor = conn.execute(_UPDATE_RUN, (*values[1:], revision, run.run_id, run.revision))
            return run.replace(revision=revision) if cursor.rowcount == 1 else None

        return await self._connection.write(_FULL, update)

    async def delete_run(self, run_id: str, *, revision: int) -> bool:
        """Remove the record of ``run_id`` if its revision is still ``revision``.

        Args:
          run_id (str): the run id.
          revision (int): the revision the record was read at.

        Returns:
          bool: True if it was removed, False if it changed or was already gone.

        Raises:
          BackendUnavailableError, BackendConfigError, BackendError,
          trio.ClosedResourceError: see the class.
        """
        _check_text(run_id, "run_id")
        return await self._delete(
            "DELETE FROM runs WHERE run_id = ? AND revision = ?", run_id, revision, _FULL
        )

    async def list_runs(
        self,
        *,
        states: Collection[RunState] | None = None,
        owner: str | _Any | None = ANY,
        workflow: str | None = None,
        due_before: float | None = None,
        finished_before: float | None = None,
        limit: int | None = None,
    ) -> list[StoredRun]:
        """Runs that match every filter given, ordered by ``scheduled_at`` (then run
        id), read in one statement (a consistent snapshot). Unreadable rows are left
        out (with a warning) and do not count towards ``limit``.

        Args:
          states (Collection[RunState] | None): only runs in these states (all states
            when None; none when empty).
          owner (str | ANY | None): only runs claimed by this process id (``None``:
            only unclaimed ones; :data:`~trio_debounce.abc.ANY`, the default: any).
          workflow (str | None): only runs of this workflow.
          due_before (float | None): only runs with ``scheduled_at < due_before``
            (wall-clock epoch seconds).
          finished_before (float | None): only runs with
            ``finished_at < finished_before`` (wall-clock epoch seconds).
          limit (int | None): at most this many (the earliest due).

        Returns:
          list[StoredRun]: the matching runs.

        Raises:
          ValueError: ``limit`` is negative, or a state is not a :class:`RunState`.
          BackendUnavailableError, BackendConfigError, BackendError,
          trio.ClosedResourceError: see the class.
        """
        clauses: list[str] = []
        params: list[Any] = []
        if states is not None:
            wanted = sorted({RunState(state).value for state in states})
            if not wanted:
                await trio.lowlevel.checkpoint()
                return []
            clauses.append(f"state IN ({', '.join('?' * len(wanted))})")
            params.extend(wanted)
        if owner is None:
            clauses.append("owner IS NULL")
        elif owner is not ANY:
            _check_text(owner, "owner")
            clauses.append("owner = ?")
            params.append(owner)
        if workflow is not None:
            _check_text(workflow, "workflow")
            clauses.append("workflow = ?")
            params.append(workflow)
        if due_before is not None:
            _check_number(due_before, "due_before")
            clauses.append("scheduled_at < ?")
            params.append(due_before)
        if finished_before is not None:
            _check_number(finished_before, "finished_before")
            clauses.append("finished_at < ?")
            params.append(finished_before)
        if limit is not None:
            _check_integer(limit, "limit")
            if limit < 0:
                raise ValueError(f"limit must be >= 0, got {limit}")
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        query = f"SELECT {_RUN_COLUMNS} FROM runs{where} ORDER BY scheduled_at, run_id"

        def read(conn: sqlite3.Connection) -> list[StoredRun]:
            found: list[StoredRun] = []
            if limit == 0:
                return found
            # Iterate rather than LIMIT in SQL: unreadable rows must not use up the limit.
            for row in conn.execute(query, params):
                run = _run_or_none(row, self._path)
                if run is not None:
                    found.append(run)
                    if limit is not None and len(found) >= limit:
                        break
            return found

        return await self._call(read)

    # -- leases ----------------------------------------------------------------------

    async def get_lease(self, process_id: str) -> Lease | None:
        """The lease of ``process_id``, or None if it has none (or an unreadable one).

        Args:
          process_id (str): the process id.

        Returns:
          Lease | None: the stored lease, with its revision.

        Raises:
          BackendUnavailableError, BackendConfigError, BackendError,
          trio.ClosedResourceError: see the class.
        """
        _check_text(process_id, "process_id")

        def read(conn: sqlite3.Connection) -> Lease | None:
            row = conn.execute(
                f"SELECT {_LEASE_COLUMNS} FROM leases WHERE process_id = ?", (process_id,)
            ).fetchone()
            return None if row is None else _lease_or_none(row, self._path)

        return await self._call(read)

    async def put_lease(self, lease: Lease) -> Lease | None:
        """Write ``lease`` if the stored lease's revision is still ``lease.revision``
        (0: the process has no lease yet; an unreadable row is replaced). Committed
        with ``synchronous=NORMAL`` (see the class).

        Args:
          lease (Lease): the lease to write.

        Returns:
          Lease | None: ``lease`` with its new revision, or None if it lost.

        Raises:
          ValueError: ``lease.revision`` is negative, or a field cannot be stored.
          TypeError: a field has the wrong type.
          BackendUnavailableError, BackendConfigError, BackendError,
          trio.ClosedResourceError: see the class.
        """
        values = _lease_values(lease)
        _check_integer(lease.revision, "revision")
        if lease.revision < 0:
            raise ValueError(f"lease of {lease.process_id!r}: revision {lease.revision} < 0")

        def put(conn: sqlite3.Connection) -> Lease | None:
            if lease.revision == 0:
                row = conn.execute(
                    f"SELECT {_LEASE_COLUMNS} FROM leases WHERE process_id = ?",
                    (lease.process_id,),
                ).fetchone()
                if row is not None:
                    if _lease_or_none(row, self._path) is not None:
                        return None
                    conn.execute("DELETE FROM leases WHERE process_id = ?", (lease.process_id,))
                revision = _Connection.next_revision(conn)
                conn.execute(
                    f"INSERT INTO leases ({_LEASE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                    (*values, revision, int(lease.draining)),
                )
            else:
                revision = _Connection.next_revision(conn)
                cursor = conn.execute(
                    "UPDATE leases SET epoch = ?, expires_at = ?, released = ?, revision = ?, "
                    "draining = ? WHERE process_id = ? AND revision = ?",
                    (*values[1:], revision, int(lease.draining), lease.process_id, lease.revision),
                )
                if cursor.rowcount != 1:
                    return None
            return Lease(
                lease.process_id,
                lease.epoch,
                lease.expires_at,
                lease.released,
                revision,
                draining=lease.draining,
            )

        return await self._connection.write(_NORMAL, put)

    async def delete_lease(self, process_id: str, *, revision: int) -> bool:
        """Remove the lease of ``process_id`` if its revision is still ``revision``.

        Args:
          process_id (str): the process id.
          revision (int): the revision the lease was read at.

        Returns:
          bool: True if it was removed, False if it changed or was already gone.

        Raises:
          BackendUnavailableError, BackendConfigError, BackendError,
          trio.ClosedResourceError: see the class.
        """
        _check_text(process_id, "process_id")
        return await self._delete(
            "DELETE FROM leases WHERE process_id = ? AND revision = ?",
            process_id,
            revision,
            _NORMAL,
        )

    async def _delete(self, sql: str, key: str, revision: int, synchronous: str) -> bool:
        """Run the revision-checked ``sql`` (``DELETE ... WHERE <key> = ? AND revision
        = ?``) in one write; True if it removed the row."""
        _check_integer(revision, "revision")

        def delete(conn: sqlite3.Connection) -> bool | None:
            cursor = conn.execute(sql, (key, revision))
            return True if cursor.rowcount == 1 else None

        return bool(await self._connection.write(synchronous, delete))

    async def list_leases(self) -> list[Lease]:
        """Every (readable) lease in the store, ordered by process id.

        Returns:
          list[Lease]: the leases.

        Raises:
          BackendUnavailableError, BackendConfigError, BackendError,
          trio.ClosedResourceError: see the class.
        """

        def read(conn: sqlite3.Connection) -> list[Lease]:
            rows = conn.execute(f"SELECT {_LEASE_COLUMNS} FROM leases ORDER BY process_id")
            leases = (_lease_or_none(row, self._path) for row in rows)
            return [lease for lease in leases if lease is not None]

        return await self._call(read)

    # -- life cycle --------------------------------------------------------------------

    async def _ensure_open(self) -> None:
        """Open the connection now (WAL, migrations) if no call has yet."""
        await self._call(lambda conn: None)

    async def aclose(self) -> None:
        """Close the connection. Idempotent; later calls raise
        :exc:`trio.ClosedResourceError`.

        Waits (shielded from cancellation) for a call in flight to finish first, at most
        about ``timeout`` seconds; calls still queued for the store's limiter raise
        :exc:`trio.ClosedResourceError`.
        """
        await self._connection.close()


@asynccontextmanager
async def open_sqlite_run_store(
    path: str | os.PathLike[str],
    *,
    max_payload_bytes: int = 1024 * 1024,
    # SQLite's busy timeout, named as in sqlite3.connect: not a deadline for the call.
    timeout: float = 5.0,  # noqa: ASYNC109
    mode: SqliteMode = "rwc",
) -> AsyncIterator[SqliteRunStore]:
    """Open a :class:`SqliteRunStore` on ``path`` and close it when the block exits.

    The connection is opened on entry (in the default mode ``"rwc"``: the file created
    if absent, switched to WAL, its schema migrated), so that a file the store cannot
    use fails here::

        async with open_sqlite_run_store("runs.db") as store:
            async with open_coordinator(run_store=store, ...) as coordinator:
                ...

    Args:
      path (str | os.PathLike[str]): the database file.
      max_payload_bytes (int): see :class:`SqliteRunStore`.
      timeout (float): see :class:`SqliteRunStore` (seconds).
      mode (str): ``"rwc"``, ``"rw"`` or ``"ro"``; see :class:`SqliteRunStore`.

    Yields:
      SqliteRunStore: the open store.

    Raises:
      BackendConfigError: the file is not an SQLite database, its schema version is
        newer than this code knows, or it cannot use the WAL journal; in modes
        ``"rw"`` and ``"ro"``, the file is missing or its schema is older.
      BackendUnavailableError: another connection held the database locked for
        ``timeout`` seconds.
      BackendError: any other SQLite error (a directory that does not exist, ...).
      ValueError, TypeError: bad arguments (see :class:`SqliteRunStore`).
    """
    store = SqliteRunStore(path, max_payload_bytes=max_payload_bytes, timeout=timeout, mode=mode)
    try:
        await store._ensure_open()
        yield store
    finally:
        await store.aclose()
