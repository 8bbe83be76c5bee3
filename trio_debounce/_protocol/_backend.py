"""The cross-process debounce protocol over a revisioned key-value store.

:class:`KvDebounceBackend` implements :class:`~trio_debounce.abc.DebounceBackend` on
any :class:`~trio_debounce._kv.KvStore`: NATS JetStream KV in production, the
in-memory fake in tests. The rules are in :doc:`/protocol`; in short:

* One JSON document per window (``w.<workflow>.<key>``), one lease per process
  (``p.<process>``), one sweeper lock (``s.sweeper``).
* Every change is a compare-and-swap on the revision this process last read or wrote
  (remembered per key, so an owner's ping is one request); a conflict re-reads,
  re-applies the ping and retries with jittered backoff until the operation deadline.
* Pings of one key that arrive while its write is in flight are merged, in arrival
  order, into the next single write (group commit; ``apply_ping`` applied per ping).
* A window is owned by a live process while that process's lease (read through a
  local table, so checking a known live owner costs no request) has not expired, give
  or take ``max_clock_skew``.

The backend only builds its parts and hands each call to the one that does it: the
store view (``_view``), the process lease (``_leases``), the keys' turns to write
(``_turns``), the fire records (``_records``), the finalizer (``_finalize``), the
registrar (``_register``) and the housekeeping (``_housekeeping``). Their decisions on
documents are the pure rules of ``_rules``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any

from .. import _validate
from .._backend import (
    DebounceBackend,
    Delivery,
    Finalization,
    Orphans,
    OwnedWindow,
    ProcessInfo,
    Registration,
    WindowChange,
    WindowInfo,
    WindowStatus,
)
from .._events import BackendEvent
from .._flow import FlowSpec
from .._keys import process_key, window_prefix
from .._kv import KvStore
from .._options import InitialFactory, Reducer
from .._payload import JsonSerializer, PayloadSerializer
from .._types import Mode
from ._control import Control
from ._finalize import Finalizer
from ._housekeeping import Housekeeping
from ._inspect import list_processes, list_windows
from ._leases import ProcessLease
from ._records import FireRecords
from ._register import Registrar
from ._rules import Identity
from ._turns import KeyTurns
from ._view import StoreView
from ._watch import WindowFollower


class KvDebounceBackend(DebounceBackend):
    """The debounce protocol over a :class:`~trio_debounce._kv.KvStore`.

    Args:
      store: the shared store.
      process_id (str | None): this process's id; a uuid4 hex when None. Two live
        coordinators must never share one.
      process_lease (float): seconds this process's lease lasts unrenewed (> 0).
      op_timeout (float): seconds a register or finalize may take, retries included.
      max_clock_skew (float): the largest wall-clock difference between hosts that the
        lease arithmetic tolerates, seconds: an owner is dead only once its lease
        expired more than this long ago.
      wall_time: the wall clock, ``() -> float`` epoch seconds (:func:`time.time`).
      serializer (PayloadSerializer | None): how payloads are stored
        (:class:`~trio_debounce.JsonSerializer` when None); every process sharing the
        store must use the same one.
    """

    _register_uncancellable = True

    def __init__(
        self,
        store: KvStore,
        *,
        process_id: str | None = None,
        process_lease: float = 60.0,
        op_timeout: float = 2.0,
        max_clock_skew: float = 1.0,
        wall_time: Callable[[], float] = time.time,
        serializer: PayloadSerializer | None = None,
    ) -> None:
        if process_id is None:
            process_id = uuid.uuid4().hex
        if not isinstance(process_id, str) or not process_id:
            raise ValueError(f"process_id must be a non-empty str, got {process_id!r}")
        # The store and the id are looked at before the durations are checked, as they
        # always were: a call with several bad arguments raises the same error.
        int(store.created * 1000)
        process_key(process_id)
        lease = _validate.positive_duration("process_lease", process_lease)
        op_timeout = _validate.positive_duration("op_timeout", op_timeout)
        skew = _validate.positive_duration("max_clock_skew", max_clock_skew)
        if serializer is None:
            serializer = JsonSerializer()
        self._wall = wall_time
        self._op_timeout = op_timeout
        self._me = me = Identity(process_id, uuid.uuid4().hex, serializer, store.max_value_bytes)
        self._view = view = StoreView(store, heartbeat_interval=lease / 3, skew=skew)
        self._leases = leases = ProcessLease(view, me, seconds=lease, skew=skew, wall=wall_time)
        turns = KeyTurns()
        self._records = records = FireRecords(view, me, op_timeout=op_timeout)
        self._finalizer = finalizer = Finalizer(
            view, leases, turns, records, me, op_timeout=op_timeout, wall=wall_time
        )
        self._registrar = Registrar(
            view, leases, turns, finalizer, records, me, op_timeout=op_timeout, wall=wall_time
        )
        self._housekeeping = Housekeeping(
            view,
            leases,
            records,
            finalizer,
            me,
            op_timeout=op_timeout,
            lease_seconds=lease,
            skew=skew,
            wall=wall_time,
        )
        self._control = Control(view, leases, me, op_timeout=op_timeout, wall=wall_time)

    # ----------------------------------------------------------------- basics

    @property
    def process_id(self) -> str:
        return self._me.process_id

    @property
    def epoch(self) -> str:
        """This opening's epoch: a fresh uuid4 hex, so a restart under the same
        process id does not inherit its predecessor's windows."""
        return self._me.epoch

    @property
    def heartbeat_interval(self) -> float:
        return self._leases.heartbeat_interval

    def wall_time(self) -> float:
        return self._wall()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} process={self.process_id!r} store={self._view.store!r}>"

    # --------------------------------------------------------------- counters

    @property
    def requests(self) -> int:
        """Requests made to the store."""
        return self._view.requests

    @property
    def conflicts(self) -> int:
        """Compare-and-swaps lost (and retried)."""
        return self._view.conflicts

    @property
    def unstored_coalesces(self) -> int:
        """Pings coalesced into a live peer's window without being stored."""
        return self._registrar.unstored_coalesces

    @property
    def takeovers(self) -> int:
        """Windows of dead processes taken over, by a ping or by adoption."""
        return self._registrar.takeovers + self._housekeeping.takeovers

    @property
    def taken_fires(self) -> int:
        """Fires of due windows taken by pings."""
        return self._registrar.taken_fires

    @property
    def adopted_fires(self) -> int:
        """Fire records of dead processes adopted."""
        return self._housekeeping.adopted_fires

    @property
    def skipped_refires(self) -> int:
        """Leading fires of dead processes not run again because a later fire of their
        key had committed (at-least-once)."""
        return self._housekeeping.skipped_refires

    # ------------------------------------------------------------ coordinator

    def attach(
        self,
        *,
        delivery: Delivery,
        on_taken: Callable[[str, str, Finalization], None] | None = None,
        on_unproven_take: Callable[[str, str, str], None] | None = None,
        on_event: Callable[[BackendEvent], None] | None = None,
    ) -> None:
        super().attach(
            delivery=delivery,
            on_taken=on_taken,
            on_unproven_take=on_unproven_take,
            on_event=on_event,
        )
        self._registrar.hand_taken_fires(delivery, on_taken, on_unproven_take)
        self._view.on_event = on_event

    def detach(self) -> None:
        super().detach()
        self._view.on_event = None
        self._registrar.hand_taken_fires(
            self._ping_delivery, self._taken_hook, self._unproven_take_hook
        )

    # ------------------------------------------------------------------ leases

    def lease_held(self) -> bool:
        """Is this process's own lease still live, by its own clock, with the skew
        margin? If not, a peer may have taken its windows over."""
        return self._leases.held()

    async def wait_process_id_free(self) -> None:
        await self._leases.wait_process_id_free()

    async def refresh_lease(self) -> set[str]:
        return await self._leases.refresh(self._finalizer.apply_queued)

    # -------------------------------------------------------------- a window

    async def register(
        self,
        workflow: str,
        key: str,
        *,
        mode: Mode,
        delay: float,
        max_delay: float | None,
        run_id: str,
        payload: Any = None,
        max_count: int | None = None,
        payload_policy: str = "last",
        order_key: float | None = None,
        max_items: int | None = None,
        overflow: str | None = None,
        reducer: tuple[Reducer, InitialFactory | None] | None = None,
        overlap: str = "allow",
        run_timeout: float | None = None,
        drop_stale: bool = False,
        flow: FlowSpec | None = None,
        size: int = 0,
        now: float | None = None,
    ) -> Registration:
        return await self._registrar.register(
            workflow,
            key,
            mode=mode,
            delay=delay,
            max_delay=max_delay,
            run_id=run_id,
            payload=payload,
            max_count=max_count,
            payload_policy=payload_policy,
            order_key=order_key,
            max_items=max_items,
            overflow=overflow,
            reducer=reducer,
            overlap=overlap,
            run_timeout=run_timeout,
            drop_stale=drop_stale,
            flow=flow,
            size=size,
            now=now,
        )

    async def finalize(
        self,
        workflow: str,
        key: str,
        run_id: str,
        *,
        take: bool = False,
        force: bool = False,
        delivery: Delivery = "at-least-once",
        early: bool = False,
        fire_at: float | None = None,
    ) -> Finalization:
        return await self._finalizer.finalize(
            workflow,
            key,
            run_id,
            take=take,
            force=force,
            delivery=delivery,
            early=early,
            fire_at=fire_at,
        )

    async def end_run(self, workflow: str, key: str, run_id: str) -> str | None:
        return await self._finalizer.end_run(workflow, key, run_id)

    async def complete(self, fire_id: str) -> None:
        await self._records.complete(fire_id)

    def take_deleted(self, run_id: str) -> bool:
        deleted = self._view.deleted_runs
        if run_id in deleted:
            deleted.discard(run_id)
            return True
        return False

    async def cancel(self, workflow: str, key: str) -> bool:
        return await self._housekeeping.cancel(workflow, key)

    async def window_status(self, workflow: str, key: str) -> WindowStatus | None:
        return await self._housekeeping.window_status(workflow, key)

    async def request_flush(self, workflow: str, key: str) -> WindowStatus | None:
        _validate.name("workflow", workflow)
        _validate.name("key", key)
        return await self._control.request_flush(workflow, key)

    async def take_flush_requests(self) -> list[tuple[str, str, str]]:
        return await self._control.take_requests()

    async def inspect(
        self, workflow: str | None = None, key_prefix: str | None = None
    ) -> list[WindowInfo]:
        _check_filter(workflow, key_prefix)
        return await list_windows(
            self._view, self._wall(), self._leases.skew, workflow=workflow, key_prefix=key_prefix
        )

    @asynccontextmanager
    async def open_window_watch(
        self, workflow: str | None = None, key_prefix: str | None = None
    ) -> AsyncIterator[AsyncIterator[WindowChange]]:
        """See :meth:`DebounceBackend.open_window_watch`; the follower is described in
        :doc:`/cli`, "Following a bucket". Needs a store that can watch
        (:meth:`KvStore.open_watch`).

        Raises:
          NotImplementedError: the store cannot watch (on entering).
        """
        _check_filter(workflow, key_prefix)
        window_prefix(workflow)  # a bad workflow name raises here
        follower = WindowFollower(
            self._view,
            workflow=workflow,
            key_prefix=key_prefix,
            wall=self._wall,
            skew=self._leases.skew,
            op_timeout=self._op_timeout,
        )
        try:
            await follower.open()
            yield follower
        finally:
            await follower.aclose()

    async def processes(self) -> list[ProcessInfo]:
        return await list_processes(self._view, self._wall(), self._leases.skew)

    # ------------------------------------------------------------ housekeeping

    async def owned_windows(self) -> list[OwnedWindow]:
        return await self._housekeeping.owned_windows()

    async def sweep(self) -> int:
        return await self._housekeeping.sweep()

    async def adopt_orphans(self, workflows: Collection[str]) -> Orphans:
        return await self._housekeeping.adopt_orphans(workflows)

    async def mark_draining(self) -> None:
        await self._housekeeping.mark_draining()

    async def handoff(self) -> None:
        await self._housekeeping.handoff()

    async def release(
        self, runs: Collection[str] | None = None, *, own_only: Collection[str] = ()
    ) -> frozenset[str]:
        return await self._housekeeping.release(runs, own_only=own_only)


def _check_filter(workflow: object, key_prefix: object) -> None:
    """The types of an inspection's filter.

    Raises:
      TypeError: ``workflow`` or ``key_prefix`` is neither a str nor None.
    """
    if workflow is not None and not isinstance(workflow, str):
        raise TypeError(f"workflow must be a str or None, not {workflow!r}")
    if key_prefix is not None and not isinstance(key_prefix, str):
        raise TypeError(f"key_prefix must be a str or None, not {key_prefix!r}")
