"""Deferred runs: one call of a handler at a wall-clock time, optionally kept in a
run store (see :doc:`/runs`).

One :class:`RunScheduler` belongs to one coordinator and runs as a task in its nursery.
It holds a task per run due within the horizon (sleeping on Trio's clock until the
run's wall-clock time, re-checking the wall clock when it wakes), one heartbeat task
(one lease write per interval, whatever the number of runs) and one claim sweep
(listing the runs due within the horizon, arming this process's, claiming those of
dead, fenced or released processes by compare-and-swap). Every step that decides a
run (start, delete, finish) is a compare-and-swap against the record armed, so a run
re-scheduled, cancelled or claimed elsewhere meanwhile is re-read, re-armed or dropped,
never run stale.

The modules, each importing only from those above it:

``_store``
  The storage contract: :class:`StoredRun`, :class:`Lease` and the :class:`RunStore`
  ABC.
``_types``
  The public values: :class:`RunOptions`, :class:`RunFire`, :class:`ScheduledRun`,
  :class:`RunInfo`.
``_kv_store``; ``_sqlite_rows``, ``_sqlite``
  Run stores: on any revisioned key-value store; on an SQLite file (its rows, then
  the store).
``_calls``
  The scheduler's store calls, each bounded by ``op_timeout``.
``_lease``
  :class:`RunLease`: the process id's lease, its twin watch, heartbeat and release.
``_local``
  :class:`LocalRuns`: the non-persisted runs, their horizon loop and tombstones.
``_delivery``
  :class:`ArmedRuns`: the task of each armed run, its steps and retries.
``_claims``
  :class:`ClaimSweep`: claims, and the purge of old tombstones and leases.
``_scheduler``
  :class:`RunScheduler`, the facade the coordinator calls.
``_steer``
  An operator's cancel and retry of a persisted run, outside any coordinator
  (``trio-debounce runs cancel|retry``): compare-and-swaps on the store alone.

The coordinator and ``trio_debounce`` itself import from this package. The stores'
side (``abc``, ``nats``, ``testing``) imports ``_store`` and ``_kv_store`` themselves:
the package pulls in the scheduler, a layer above them.
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
from ._store import RunStateName as RunStateName
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
