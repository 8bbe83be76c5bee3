"""The rows of :class:`~trio_debounce.SqliteRunStore`: the schema and its migrations,
the SQL of the run table, the checks of the values written, and the decoding of the rows
read (a row no run or lease has is skipped with a warning).
"""

from __future__ import annotations

import logging
import math
import sqlite3
from collections.abc import Sequence
from typing import Any

from .._errors import BackendConfigError, DocumentTooLargeError
from ._store import Lease, RunState, StoredRun

logger = logging.getLogger("trio_debounce.runs")

#: The schema migrations: step ``i`` takes a database from ``user_version`` ``i`` to
#: ``i + 1``. Steps are applied in order, all pending ones in one transaction, and are
#: never edited once released: a change of schema is a new step at the end.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: the tables and the revision sequence.
    (
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY NOT NULL,
            workflow TEXT NOT NULL,
            payload TEXT NOT NULL,
            scheduled_at REAL NOT NULL,
            expires_at REAL,
            state TEXT NOT NULL,
            owner TEXT,
            epoch INTEGER NOT NULL,
            version INTEGER NOT NULL,
            attempt INTEGER NOT NULL,
            token INTEGER NOT NULL,
            created_at REAL NOT NULL,
            started_at REAL,
            finished_at REAL,
            outcome TEXT,
            revision INTEGER NOT NULL
        )""",
        """CREATE TABLE leases (
            process_id TEXT PRIMARY KEY NOT NULL,
            epoch INTEGER NOT NULL,
            expires_at REAL NOT NULL,
            released INTEGER NOT NULL,
            revision INTEGER NOT NULL
        )""",
        """CREATE TABLE revision_sequence (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            last INTEGER NOT NULL
        )""",
        "INSERT INTO revision_sequence (id, last) VALUES (1, 0)",
    ),
    # 2: the indexes of list_runs' filters (each ends in the listing's order).
    (
        "CREATE INDEX runs_by_state ON runs (state, scheduled_at, run_id)",
        "CREATE INDEX runs_by_owner ON runs (owner, scheduled_at, run_id)",
        "CREATE INDEX runs_by_finished ON runs (finished_at) WHERE finished_at IS NOT NULL",
        "CREATE INDEX runs_by_workflow ON runs (workflow, scheduled_at, run_id)",
    ),
    # 3: the draining mark of a lease (a coordinator leaving: peers claim its pending
    # runs while it waits for its running handlers).
    ("ALTER TABLE leases ADD COLUMN draining INTEGER NOT NULL DEFAULT 0",),
)

#: The schema version this code writes (``PRAGMA user_version``).
SCHEMA_VERSION = len(_MIGRATIONS)

_RUN_COLUMNS = (
    "run_id, workflow, payload, scheduled_at, expires_at, state, owner, epoch, version, "
    "attempt, token, created_at, started_at, finished_at, outcome, revision"
)
_LEASE_COLUMNS = "process_id, epoch, expires_at, released, revision, draining"

_INSERT_RUN = (
    f"INSERT INTO runs ({_RUN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_UPDATE_RUN = (
    "UPDATE runs SET workflow = ?, payload = ?, scheduled_at = ?, expires_at = ?, state = ?, "
    "owner = ?, epoch = ?, version = ?, attempt = ?, token = ?, created_at = ?, "
    "started_at = ?, finished_at = ?, outcome = ?, revision = ? "
    "WHERE run_id = ? AND revision = ?"
)

# --- encoding and decoding rows ---------------------------------------------------


def _check_text(value: object, what: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {value!r}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not encodable as UTF-8: {exc}") from None


def _check_real(value: object, what: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, not {value!r}")


def _check_number(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {value!r}")


def _check_integer(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {value!r}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{what} does not fit in 64 bits: {value!r}")


def _run_values(run: StoredRun, max_payload_bytes: int) -> tuple[Any, ...]:
    """The column values of ``run`` in :data:`_RUN_COLUMNS` order, without the revision.

    Raises:
      DocumentTooLargeError: the payload is larger than ``max_payload_bytes``.
      TypeError, ValueError: a field has the wrong type or a value SQLite cannot keep.
    """
    _check_text(run.run_id, "run_id")
    what = f"run {run.run_id[:200]!r}:"
    _check_text(run.payload, f"{what} payload")
    size = len(run.payload.encode())
    if size > max_payload_bytes:
        raise DocumentTooLargeError(
            f"{what} its payload is {size} bytes, more than the store's "
            f"max_payload_bytes={max_payload_bytes}"
        )
    _check_text(run.workflow, f"{what} workflow")
    _check_text(run.owner, f"{what} owner", optional=True)
    _check_text(run.outcome, f"{what} outcome", optional=True)
    for name in ("scheduled_at", "created_at"):
        _check_real(getattr(run, name), f"{what} {name}")
    for name in ("expires_at", "started_at", "finished_at"):
        _check_real(getattr(run, name), f"{what} {name}", optional=True)
    for name in ("epoch", "version", "attempt", "token"):
        _check_integer(getattr(run, name), f"{what} {name}")
    state = RunState(run.state).value
    return (
        run.run_id,
        run.workflow,
        run.payload,
        run.scheduled_at,
        run.expires_at,
        state,
        run.owner,
        run.epoch,
        run.version,
        run.attempt,
        run.token,
        run.created_at,
        run.started_at,
        run.finished_at,
        run.outcome,
    )


def _lease_values(lease: Lease) -> tuple[Any, ...]:
    """The column values of ``lease`` in :data:`_LEASE_COLUMNS` order, without the
    revision.

    Raises:
      TypeError, ValueError: a field has the wrong type or a value SQLite cannot keep.
    """
    _check_text(lease.process_id, "process_id")
    what = f"lease of {lease.process_id[:200]!r}:"
    _check_integer(lease.epoch, f"{what} epoch")
    _check_real(lease.expires_at, f"{what} expires_at")
    if not isinstance(lease.released, bool):
        raise TypeError(f"{what} released must be a bool, not {lease.released!r}")
    if not isinstance(lease.draining, bool):
        raise TypeError(f"{what} draining must be a bool, not {lease.draining!r}")
    return (lease.process_id, lease.epoch, lease.expires_at, int(lease.released))


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"column {name!r} is not text: {value!r:.80}")
    return value


def _optional_text(value: object, name: str) -> str | None:
    return None if value is None else _text(value, name)


def _real(value: object, name: str) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"column {name!r} is not a finite number: {value!r:.80}")
    return float(value)


def _optional_real(value: object, name: str) -> float | None:
    return None if value is None else _real(value, name)


def _integer(value: object, name: str) -> int:
    if not isinstance(value, int):
        raise ValueError(f"column {name!r} is not an integer: {value!r:.80}")
    return value


def _revision(value: object) -> int:
    revision = _integer(value, "revision")
    if revision <= 0:
        raise ValueError(f"column 'revision' is not positive: {revision}")
    return revision


def _decode_run(row: Sequence[Any]) -> StoredRun:
    """The run in a row of :data:`_RUN_COLUMNS`.

    Raises:
      ValueError: a column holds a value no run has.
    """
    return StoredRun(
        run_id=_text(row[0], "run_id"),
        workflow=_text(row[1], "workflow"),
        payload=_text(row[2], "payload"),
        scheduled_at=_real(row[3], "scheduled_at"),
        expires_at=_optional_real(row[4], "expires_at"),
        state=RunState(_text(row[5], "state")),
        owner=_optional_text(row[6], "owner"),
        epoch=_integer(row[7], "epoch"),
        version=_integer(row[8], "version"),
        attempt=_integer(row[9], "attempt"),
        token=_integer(row[10], "token"),
        created_at=_real(row[11], "created_at"),
        started_at=_optional_real(row[12], "started_at"),
        finished_at=_optional_real(row[13], "finished_at"),
        outcome=_optional_text(row[14], "outcome"),
        revision=_revision(row[15]),
    )


def _decode_lease(row: Sequence[Any]) -> Lease:
    """The lease in a row of :data:`_LEASE_COLUMNS`.

    Raises:
      ValueError: a column holds a value no lease has.
    """
    released, draining = row[3], row[5]
    if released not in (0, 1) or isinstance(released, float):
        raise ValueError(f"column 'released' is not 0 or 1: {released!r:.80}")
    if draining not in (0, 1) or isinstance(draining, float):
        raise ValueError(f"column 'draining' is not 0 or 1: {draining!r:.80}")
    return Lease(
        process_id=_text(row[0], "process_id"),
        epoch=_integer(row[1], "epoch"),
        expires_at=_real(row[2], "expires_at"),
        released=bool(released),
        revision=_revision(row[4]),
        draining=bool(draining),
    )


def _run_or_none(row: Sequence[Any], path: str) -> StoredRun | None:
    """The run in ``row``, or None (with a warning) if the row is unreadable."""
    try:
        return _decode_run(row)
    except ValueError as exc:
        logger.warning("ignoring an unreadable run row %.80r in %s: %s", row[0], path, exc)
        return None


def _lease_or_none(row: Sequence[Any], path: str) -> Lease | None:
    """The lease in ``row``, or None (with a warning) if the row is unreadable."""
    try:
        return _decode_lease(row)
    except ValueError as exc:
        logger.warning("ignoring an unreadable lease row %.80r in %s: %s", row[0], path, exc)
        return None


# --- the schema -------------------------------------------------------------------


def _user_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("PRAGMA user_version").fetchone()
    return int(row[0])


def _check_version(version: int, path: str) -> None:
    if version > SCHEMA_VERSION:
        raise BackendConfigError(
            f"the run store {path!r} has schema version {version}, newer than the "
            f"version {SCHEMA_VERSION} this trio_debounce knows: upgrade trio_debounce "
            "(or open another file)"
        )


def _check_current(conn: sqlite3.Connection, path: str) -> None:
    """Refuse a database whose schema is not :data:`SCHEMA_VERSION`: the check of a
    store that must not migrate (``mode="rw"`` or ``"ro"``).

    Raises:
      BackendConfigError: no schema (version 0), an older one, or a newer one.
    """
    version = _user_version(conn)
    _check_version(version, path)
    if version == 0:
        raise BackendConfigError(f"{path!r} is not a run store (it has no schema)")
    if version < SCHEMA_VERSION:
        raise BackendConfigError(
            f"the run store {path!r} has schema version {version}, older than the version "
            f"{SCHEMA_VERSION} this trio_debounce uses; opened without mode='rwc' it is "
            "not migrated (a coordinator of this version migrates it when it opens it)"
        )


def _migrate(conn: sqlite3.Connection, path: str, *, target: int = SCHEMA_VERSION) -> None:
    """Bring the schema of ``conn``'s database to version ``target``.

    The pending steps run in one ``BEGIN IMMEDIATE`` transaction (SQLite's DDL is
    transactional), which re-reads ``user_version`` under the write lock: of several
    processes opening a new file at once, one migrates and the others find it done.

    Raises:
      BackendConfigError: the database's version is newer than :data:`SCHEMA_VERSION`.
      sqlite3.Error: as raised by sqlite3 (mapped by the caller).
    """
    version = _user_version(conn)
    _check_version(version, path)
    if version >= target:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = _user_version(conn)
        _check_version(version, path)
        for step in range(version, target):
            for statement in _MIGRATIONS[step]:
                conn.execute(statement)
        if version < target:
            conn.execute(f"PRAGMA user_version = {int(target)}")
            logger.info("migrated the run store %s from version %d to %d", path, version, target)
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back the transaction of ``conn`` if one is open, on the way out of an error."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error as exc:  # the error being raised matters more
            logger.debug("rollback failed: %s", exc)
