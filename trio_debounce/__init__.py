"""Trio-native debouncing: run a job once per burst of triggers, not once per trigger.

The entry point is :func:`open_coordinator`; see the docs for the exact semantics.
"""

from __future__ import annotations

from ._backend import Delivery as Delivery
from ._backend import Finalization as Finalization
from ._backend import Finalized as Finalized
from ._backend import OrphanFire as OrphanFire
from ._backend import Orphans as Orphans
from ._backend import OwnedWindow as OwnedWindow
from ._backend import ProcessInfo as ProcessInfo
from ._backend import Registered as Registered
from ._backend import Registration as Registration
from ._backend import WindowChange as WindowChange
from ._backend import WindowInfo as WindowInfo
from ._backend import WindowStatus as WindowStatus
from ._coordinator import Coordinator as Coordinator
from ._coordinator import OnBackendError as OnBackendError
from ._coordinator import OnExit as OnExit
from ._coordinator import open_coordinator as open_coordinator
from ._errors import BackendAuthError as BackendAuthError
from ._errors import BackendConfigError as BackendConfigError
from ._errors import BackendError as BackendError
from ._errors import BackendUnavailableError as BackendUnavailableError
from ._errors import DocumentTooLargeError as DocumentTooLargeError
from ._errors import LeaseLapsedError as LeaseLapsedError
from ._errors import ProcessIdTakenError as ProcessIdTakenError
from ._errors import RevisionConflict as RevisionConflict
from ._events import BackendEvent as BackendEvent
from ._events import CommitProven as CommitProven
from ._events import CoordinatorEvent as CoordinatorEvent
from ._events import EventHook as EventHook
from ._events import FireFinished as FireFinished
from ._events import FireStarted as FireStarted
from ._events import LeadingReRunSkipped as LeadingReRunSkipped
from ._events import LeaseLapsed as LeaseLapsed
from ._events import LeaseRenewed as LeaseRenewed
from ._events import PingAnswered as PingAnswered
from ._events import PingFailedOpen as PingFailedOpen
from ._events import PingRejected as PingRejected
from ._events import StoreCalled as StoreCalled
from ._events import WindowDeletedExternally as WindowDeletedExternally
from ._events import WindowTakenOver as WindowTakenOver
from ._payload import JsonSerializer as JsonSerializer
from ._payload import PayloadSerializer as PayloadSerializer
from ._runs import DropReason as DropReason
from ._runs import ExpiredCallback as ExpiredCallback
from ._runs import RunFire as RunFire
from ._runs import RunHandler as RunHandler
from ._runs import RunInfo as RunInfo
from ._runs import RunOptions as RunOptions
from ._runs import RunState as RunState
from ._runs import RunStateName as RunStateName
from ._runs import RunStatistics as RunStatistics
from ._runs import ScheduledRun as ScheduledRun
from ._runs import SqliteRunStore as SqliteRunStore
from ._runs import open_sqlite_run_store as open_sqlite_run_store
from ._types import CoordinatorStatistics as CoordinatorStatistics
from ._types import DebounceOptions as DebounceOptions
from ._types import DebounceResult as DebounceResult
from ._types import Edge as Edge
from ._types import ErrorCallback as ErrorCallback
from ._types import Fire as Fire
from ._types import FireReason as FireReason
from ._types import Handler as Handler
from ._types import Mode as Mode
from ._types import ModeName as ModeName
from ._types import Outcome as Outcome
from ._version import __version__ as __version__


def _fixup_module_metadata() -> None:
    # Make reprs, tracebacks and docs say trio_debounce.X, not trio_debounce._mod.X,
    # as trio does.
    for obj in (
        BackendAuthError,
        BackendConfigError,
        BackendError,
        BackendUnavailableError,
        DocumentTooLargeError,
        LeaseLapsedError,
        ProcessIdTakenError,
        FireFinished,
        FireStarted,
        PingAnswered,
        PingFailedOpen,
        PingRejected,
        WindowTakenOver,
        WindowDeletedExternally,
        StoreCalled,
        LeaseRenewed,
        LeaseLapsed,
        CommitProven,
        LeadingReRunSkipped,
        Finalization,
        Finalized,
        OwnedWindow,
        OrphanFire,
        Orphans,
        WindowStatus,
        WindowInfo,
        WindowChange,
        ProcessInfo,
        JsonSerializer,
        PayloadSerializer,
        Registered,
        Registration,
        RevisionConflict,
        RunFire,
        RunInfo,
        RunOptions,
        RunStatistics,
        ScheduledRun,
        SqliteRunStore,
        open_sqlite_run_store,
        Coordinator,
        CoordinatorStatistics,
        DebounceOptions,
        DebounceResult,
        Edge,
        Fire,
        Mode,
        Outcome,
        open_coordinator,
    ):
        obj.__module__ = __name__


_fixup_module_metadata()
del _fixup_module_metadata
