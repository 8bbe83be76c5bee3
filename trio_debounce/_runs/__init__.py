"""Deferred runs: one call of a handler at a wall-clock time, optionally kept in a
run store (see :doc:`/runs`).

The modules, from the bottom up:

``_store``
  The storage contract: :class:`StoredRun`, :class:`Lease` and the :class:`RunStore`
  ABC.
``_types``
  The public values: :class:`RunOptions`, :class:`RunFire`, :class:`ScheduledRun`,
  :class:`RunInfo`.
``_kv_store``, ``_sqlite`` (with ``_sqlite_rows``)
  Run stores: on any revisioned key-value store, and on an SQLite file.
``_scheduler``
  :class:`RunScheduler`, what the coordinator calls.

The rest of the library imports from this package, not from its modules.
"""

from __future__ import annotations

from ._kv_store import KvRunStore as KvRunStore
from ._kv_store import decode_lease as decode_lease
from ._kv_store import decode_run as decode_run
from ._kv_store import matches as matches
from ._scheduler import RunScheduler as RunScheduler
from ._sqlite import SqliteRunStore as SqliteRunStore
from ._sqlite import open_sqlite_run_store as open_sqlite_run_store
from ._store import ANY as ANY
from ._store import Lease as Lease
from ._store import RunState as RunState
from ._store import RunStore as RunStore
from ._store import StoredRun as StoredRun
from ._store import _Any as _Any
from ._types import DropReason as DropReason
from ._types import ExpiredCallback as ExpiredCallback
from ._types import RunFire as RunFire
from ._types import RunHandler as RunHandler
from ._types import RunInfo as RunInfo
from ._types import RunOptions as RunOptions
from ._types import RunStatistics as RunStatistics
from ._types import ScheduledRun as ScheduledRun
