"""The storage interface of deferred runs: records, leases and :class:`RunStore`.

A :class:`RunStore` holds two kinds of record, each with a *revision* that changes with
every write, so that every state change is a compare-and-swap:

* :class:`StoredRun`: one per run id, the run's time, payload, state, owner and
  counters. A run that has finished stays as a tombstone (state ``"done"``) for the
  retention period, so that scheduling the same id again is idempotent.
* :class:`Lease`: one per process id, the liveness of one coordinator: its epoch (bumped
  at each start, fencing the previous incarnation) and its expiry (wall-clock epoch
  seconds, refreshed by the heartbeat).

The store is storage only: the scheduling rules (who may claim, when a run fires, what
each delivery guarantee writes) live in the scheduler (the rest of this package),
once, for every store. See :doc:`/runs`.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal


class RunState(str, enum.Enum):
    """The state of a stored run.

    ``RunState.PENDING`` (``"pending"``)
      Waiting for its time (or for a live owner to start it).
    ``RunState.STARTED`` (``"started"``)
      Its handler was started under at-least-once delivery and has not been recorded
      as finished: if the owner dies, a live process runs it again.
    ``RunState.DONE`` (``"done"``)
      A tombstone: the run ran, started under at-most-once delivery, expired or
      misfired. Kept for the retention period so that scheduling the id again does not
      run it again.
    """

    PENDING = "pending"
    STARTED = "started"
    DONE = "done"

    def __str__(self) -> str:
        return self.value


#: The string values of :class:`RunState`, which ``list_runs(state=...)`` accepts in
#: place of the enum. Any other string is a type error (and a :exc:`ValueError` at run
#: time).
RunStateName = Literal["pending", "started", "done"]


@dataclass(frozen=True, slots=True)
class StoredRun:
    """One run as a store holds it (immutable; change it with :meth:`replace`).

    Attributes:
      run_id (str): unique per store, across workflows.
      workflow (str): the workflow whose run handler runs it.
      payload (str): the payload as JSON text (``"null"`` in a tombstone, except one
        whose outcome is ``"failed"``, which keeps it for a retry).
      scheduled_at (float): when the run is due, wall-clock epoch seconds.
      expires_at (float | None): after this wall time the run is dropped, not run.
      state (RunState): see :class:`RunState`.
      owner (str | None): the process id that holds the claim (None: unclaimed).
      epoch (int): the owner's epoch when it claimed; a lease with a later epoch fences
        the claim.
      version (int): bumped by each re-schedule (1 for a new run).
      attempt (int): how many times a handler was started for it.
      token (int): the fencing token, bumped by each claim and each start.
      created_at (float): when the run was first scheduled, wall epoch seconds.
      started_at (float | None): when the last attempt started, wall epoch seconds.
      finished_at (float | None): when it became a tombstone, wall epoch seconds.
      outcome (str | None): for a tombstone: ``"ran"``, ``"failed"``, ``"expired"`` or
        ``"misfired"``.
      revision (int): the store's revision of this record (0 for one not yet
        written); compare-and-swap writes name it.
    """

    run_id: str
    workflow: str
    payload: str
    scheduled_at: float
    expires_at: float | None = None
    state: RunState = RunState.PENDING
    owner: str | None = None
    epoch: int = 0
    version: int = 1
    attempt: int = 0
    token: int = 0
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    outcome: str | None = None
    revision: int = 0

    def replace(self, **changes: object) -> StoredRun:
        """A copy with ``changes`` applied (:func:`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Lease:
    """The liveness record of one process (one coordinator) on a run store.

    Attributes:
      process_id (str): the process id.
      epoch (int): bumped at each start of a coordinator with this process id.
      expires_at (float): wall-clock epoch seconds after which (plus the tolerated
        clock skew) the process counts as dead.
      released (bool): the coordinator left and released its claims: peers may take its
        runs over at once.
      revision (int): the store's revision of this record (0: not yet written).
      heartbeat_interval (float | None): seconds between the holder's renewals: how
        long a coordinator starting with the same process id watches a live lease for
        a renewal (a live twin) before it takes the id over. None when unknown (a
        lease written before it was recorded, or a store that does not keep it, such
        as :class:`~trio_debounce.SqliteRunStore`): the newcomer uses its own.
      draining (bool): the coordinator is leaving (a normal exit waiting for its
        running handlers): it renews the lease but starts no more runs, so peers claim
        its pending runs at their next sweep, never its started ones. A store that
        predates the field reads False, and its peers wait for the release as before.
    """

    process_id: str
    epoch: int
    expires_at: float
    released: bool = False
    revision: int = 0
    heartbeat_interval: float | None = None
    draining: bool = False

    def replace(self, **changes: object) -> Lease:
        """A copy with ``changes`` applied (:func:`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


class _Any(enum.Enum):
    ANY = "ANY"


#: ``owner=ANY`` in :meth:`RunStore.list_runs`: runs of every owner, unclaimed included.
ANY = _Any.ANY


class RunStore(abc.ABC):
    """Where deferred runs and process leases are kept, shared by the processes that
    open coordinators on it.

    Every write is a compare-and-swap on the record's revision: it applies only if the
    record is unchanged since it was read, and returns the new record (with its new
    revision), or ``None`` when it lost. Each method is atomic on its own; nothing
    spans two calls. Implementations: ``trio_debounce.SqliteRunStore`` (one host,
    several processes), ``trio_debounce.nats.open_nats_run_store`` (a JetStream KV
    bucket) and ``trio_debounce.testing.MemoryRunStore`` (MockClock tests, with fault
    injection). :func:`trio_debounce.testing.check_run_store` is the conformance suite.

    Errors: :exc:`~trio_debounce.BackendUnavailableError` when the store cannot be
    reached or does not answer in time (a write may still have been applied),
    :exc:`~trio_debounce.DocumentTooLargeError` before sending a record larger than the
    store accepts, :exc:`~trio_debounce.BackendError` for anything else.
    """

    #: The largest payload (JSON text, UTF-8 bytes) a run may carry in this store.
    max_payload_bytes: int

    def wall_time(self) -> float:
        """The wall clock this store's processes share, epoch seconds.

        :func:`time.time` for real stores; the fake's follows Trio's clock, so that
        :class:`trio.testing.MockClock` drives persisted times too.
        """
        return time.time()

    @abc.abstractmethod
    async def get_run(self, run_id: str) -> StoredRun | None:
        """The run ``run_id``, or None if the store has no record of it."""

    async def get_run_current(self, run_id: str) -> StoredRun | None:
        """:meth:`get_run` from the store's authority: never an older record than the
        latest write acknowledged to anyone (for a replicated store, like
        :meth:`KvStore.get_current <trio_debounce.abc.KvStore.get_current>`). The
        scheduler decides by it whether a write whose answer was lost landed. The
        default calls :meth:`get_run`: right for a store whose reads are never stale.

        Returns:
          StoredRun | None: the run, or None if the store has no record of it.
        """
        return await self.get_run(run_id)

    @abc.abstractmethod
    async def create_run(self, run: StoredRun) -> StoredRun | None:
        """Write ``run`` if the store has no record of ``run.run_id``.

        Returns the written record (with its revision), or None if a record exists.
        """

    @abc.abstractmethod
    async def update_run(self, run: StoredRun) -> StoredRun | None:
        """Replace the record of ``run.run_id`` if its revision is still
        ``run.revision``.

        Returns the written record, or None if the record changed or is gone.
        """

    @abc.abstractmethod
    async def delete_run(self, run_id: str, *, revision: int) -> bool:
        """Remove the record of ``run_id`` if its revision is still ``revision``.

        Returns True if it was removed, False if it changed or was already gone.
        """

    @abc.abstractmethod
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
        """Runs that match every filter given, ordered by ``scheduled_at`` (then run id).

        Args:
          states: only runs in these states (all states when None).
          owner: only runs claimed by this process id (``None``: only unclaimed ones;
            :data:`ANY`, the default: any owner).
          workflow: only runs of this workflow.
          due_before: only runs with ``scheduled_at < due_before`` (wall seconds).
          finished_before: only tombstones with ``finished_at < finished_before``.
          limit: at most this many (the earliest due).

        The view may lag writes made by other processes by a moment (a store may
        serve it from an index); every decision taken from it is confirmed by a
        compare-and-swap.
        """

    @abc.abstractmethod
    async def get_lease(self, process_id: str) -> Lease | None:
        """The lease of ``process_id``, or None if it has none.

        Read from the store itself, never from an index that may lag: the scheduler
        confirms here a lease that :meth:`list_leases` shows expired or missing
        before it claims that process's runs.
        """

    @abc.abstractmethod
    async def put_lease(self, lease: Lease) -> Lease | None:
        """Write ``lease`` if the stored lease's revision is still ``lease.revision``
        (0: the process has no lease yet).

        Returns the written lease, or None if it lost.
        """

    @abc.abstractmethod
    async def delete_lease(self, process_id: str, *, revision: int) -> bool:
        """Remove the lease of ``process_id`` if its revision is still ``revision``."""

    @abc.abstractmethod
    async def list_leases(self) -> list[Lease]:
        """Every lease in the store, in no particular order. A store may serve it
        from an index its watch keeps, which can lag a write by a moment (the NATS
        run store does); the conformance suite allows 5 s."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release what the store holds (connections, threads). Idempotent."""
