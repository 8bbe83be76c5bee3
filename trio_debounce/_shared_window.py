"""A shared window's local side, and its task: sleep to the due time, finalize, fire.

A :class:`SharedWindow` is this process's view of a window shared through a backend,
a plain slotted record like the local :class:`~trio_debounce._window.Window`.
:class:`SharedFires` holds the table of them, arms them, and does everything that
happens once one is armed: its task sleeps until the window is due, asks the backend to
finalize it, and either sleeps again (the backend rescheduled it), drops it
(abandoned), or runs its trailing fire. Fires this process took from another owner (a
due window its ping found, a window that waited for a ``queue-latest`` run that ended
here), fires run again after their process died (at-least-once), and a failed
register's late write run here too. ``_shared`` decides what a ping does to the table;
nothing here calls back up.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import trio
from trio.lowlevel import enable_ki_protection

from . import _engine
from ._backend import (
    DebounceBackend,
    Delivery,
    Finalization,
    Finalized,
    OrphanFire,
    OwnedWindow,
)
from ._errors import BackendError, LeaseLapsedError
from ._events import WindowDeletedExternally
from ._firing import Handlers, Ledger
from ._types import Edge, Fire, FireReason, Handler, Mode
from ._wallclock import trio_to_wall, wall_to_trio
from ._window import CLOSED, FLUSHED, OPEN, Window

logger = logging.getLogger("trio_debounce")

_TRAILING = Mode.TRAILING
_BOTH = Mode.BOTH


class SharedWindow:
    """This process's local side of a window shared through a backend.

    The owner's task sleeps until the window is due and then asks the backend to
    finalize it; a window this process ``takes_fire`` of (a non-owner whose ping moved
    the fire earlier than the owner armed) does the same with ``take=True``. Times are
    on Trio's clock.
    """

    __slots__ = (
        "cause",
        "confirmed_at",
        "count",
        "deadline",
        "finalizing",
        "first_ping_at",
        "ident",
        "mode",
        "on_fire",
        "payload",
        "pending_trailing",
        "run_id",
        "scope",
        "state",
        "takes_fire",
    )

    def __init__(
        self,
        ident: tuple[str, str],
        run_id: str,
        mode: Mode,
        deadline: float,
        first_ping_at: float,
        count: int,
        payload: Any,
        on_fire: Handler | None,
        takes_fire: bool,
    ) -> None:
        self.ident = ident
        self.run_id = run_id
        self.mode = mode
        self.deadline = deadline
        self.first_ping_at = first_ping_at
        self.count = count
        #: The latest payload of this process's pings (the owner's latest local one).
        self.payload = payload
        self.on_fire = on_fire
        #: True: not the owner; this process takes the fire from it by compare-and-swap.
        self.takes_fire = takes_fire
        #: When (Trio's clock) the backend last said this window is ours to fire.
        self.confirmed_at = -math.inf
        #: True while the task's finalize is in flight (its commit may land any time).
        self.finalizing = False
        #: True while this window is counted as a pending trailing fire.
        self.pending_trailing = False
        self.scope: trio.CancelScope | None = None
        self.state = OPEN
        #: What this process knows made the fire (the exit's flush, the end of the
        #: run it waited for, an adoption past its due time), or None; the backend's
        #: reason is judged by time (see :func:`_engine.caused`).
        self.cause: FireReason | None = None

    def __repr__(self) -> str:
        role = "taker" if self.takes_fire else "owner"
        return (
            f"<SharedWindow {self.ident!r} {role} run={self.run_id} pings={self.count} "
            f"deadline={self.deadline!r} state={self.state}>"
        )


#: Does a window of ``mode`` with ``count`` pings have a trailing fire to come?
trailing_pending = _engine.trailing_pending


def owner_pending(shared: SharedWindow) -> bool:
    """Is a trailing fire pending on this shared window, as far as this process knows?

    An owner's both-edges window counts from its first ping: peers' pings may have
    given it a trailing fire that the owner learns of only when it finalizes.
    """
    return trailing_pending(shared.mode, shared.count) or (
        shared.mode is _BOTH and not shared.takes_fire
    )


class SharedFires:
    """The shared windows armed in this process, and their tasks.

    Args:
      nursery: the coordinator's nursery: each window's task runs in it.
      now: the run's clock, bound.
      backend: the backend the windows are shared through.
      delivery: the coordinator's delivery promise.
      ledger: the coordinator's counters and lifecycle flags.
      handlers: the coordinator's handlers and error policy.
      abort: called when a window's task sees the nursery cancelled before the
        coordinator knew it was going down (an enclosing cancel scope).
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        now: Callable[[], float],
        backend: DebounceBackend,
        delivery: Delivery,
        ledger: Ledger,
        handlers: Handlers,
        abort: Callable[[], None],
    ) -> None:
        self._nursery = nursery
        self._now = now
        self._backend = backend
        self._delivery = delivery
        self._ledger = ledger
        self._handlers = handlers
        self._abort = abort
        #: The local side of the shared windows, by (workflow, key).
        self.windows: dict[tuple[str, str], SharedWindow] = {}
        #: Run id -> when (Trio's clock) its shared window closed here, kept until the
        #: next reconcile whose listing began after that.
        self.closed_runs: dict[str, float] = {}
        #: Reconcile at the next heartbeat (a commit whose answer was lost is proven
        #: then, while its proof is fresh; a failed register may have landed).
        self.reconcile_soon = False

    def to_trio(self, wall_at: float) -> float:
        """A wall-clock time from the backend, on Trio's clock."""
        return wall_to_trio(wall_at, wall_now=self._backend.wall_time(), trio_now=self._now())

    def set_pending(self, shared: SharedWindow, pending: bool) -> None:
        """Count (or stop counting) a shared window's trailing fire as pending."""
        if pending and not shared.pending_trailing:
            shared.pending_trailing = True
            self._ledger.pending_added()
        elif not pending and shared.pending_trailing:
            shared.pending_trailing = False
            self._ledger.pending_dropped()

    def detach(self, shared: SharedWindow) -> None:
        """Mark a shared window closed here and take it out of the table."""
        shared.state = CLOSED
        if self.windows.get(shared.ident) is shared:
            del self.windows[shared.ident]
        # A reconcile whose listing began before this must not re-arm the window.
        self.closed_runs[shared.run_id] = self._now()

    def settle_deleted(self, shared: SharedWindow) -> bool:
        """If the backend found ``shared`` deleted by another writer (see
        ``DebounceBackend.take_deleted``), count it once, as a cancel if its trailing
        fire was pending, and stop counting that fire; True then."""
        if not self._backend.take_deleted(shared.run_id):
            return False
        self._ledger.deleted_externally += 1
        if self._ledger.hook is not None:
            workflow, key = shared.ident
            self._ledger.emit(WindowDeletedExternally(workflow, key, shared.run_id, self._now()))
        if shared.pending_trailing:
            self._ledger.cancelled += 1
            self.set_pending(shared, False)
        return True

    def close(self, shared: SharedWindow) -> None:
        """Close a shared window here without firing it (its pending fire is dropped)."""
        self.settle_deleted(shared)
        self.detach(shared)
        self.set_pending(shared, False)
        if shared.scope is not None:
            shared.scope.cancel()

    def start(self, shared: SharedWindow) -> None:
        """Start the task of a newly armed shared window."""
        self._nursery.start_soon(self._run, shared)

    def start_fire(self, shared: SharedWindow, result: Finalization) -> None:
        """Run, as a task, the fire of a window the backend finalized for us."""
        self.set_pending(shared, True)
        self._nursery.start_soon(self._fire, shared, result)

    def arm(
        self,
        ident: tuple[str, str],
        run_id: str,
        mode: Mode,
        deadline: float,
        first_ping_at: float,
        count: int,
        payload: Any,
        on_fire: Handler | None,
        takes_fire: bool,
    ) -> SharedWindow:
        """The local window of a shared one: update it, or arm a new task for it."""
        shared = self.windows.get(ident)
        if (
            shared is not None
            and shared.run_id != run_id
            and shared.state == OPEN
            and self.settle_deleted(shared)
        ):
            self.close(shared)  # deleted from outside: the new window replaces it
        if shared is None or shared.run_id != run_id or shared.state != OPEN:
            shared = SharedWindow(
                ident, run_id, mode, deadline, first_ping_at, count, payload, on_fire, takes_fire
            )
            self.windows[ident] = shared
            self.start(shared)
        else:
            if deadline < shared.deadline and shared.scope is not None:
                shared.scope.deadline = deadline
            shared.deadline = deadline
            shared.count = count
            shared.payload = payload
            if on_fire is not None:
                shared.on_fire = on_fire
            shared.takes_fire = takes_fire
        shared.confirmed_at = self._now()
        self.set_pending(shared, owner_pending(shared))
        return shared

    # ------------------------------------------------------------------ the task

    @enable_ki_protection
    async def _run(self, shared: SharedWindow) -> None:
        """The window's task: sleep until it is due, finalize it through the backend,
        then sleep again (rescheduled), stop (abandoned, dropped) or fire it."""
        backend = self._backend
        ledger = self._ledger
        workflow, key = shared.ident
        try:
            while True:
                while shared.state == OPEN:
                    deadline = shared.deadline
                    if self._now() >= deadline:
                        break
                    with trio.CancelScope(deadline=deadline) as scope:
                        shared.scope = scope
                        await trio.sleep_forever()
                    shared.scope = None
                if shared.state == CLOSED:
                    return
                force = shared.state == FLUSHED
                shared.finalizing = True
                try:
                    result = await backend.finalize(
                        workflow,
                        key,
                        shared.run_id,
                        take=shared.takes_fire,
                        force=force,
                        delivery=self._delivery,
                    )
                except BackendError as exc:
                    ledger.backend_errors += 1
                    if self._delivery == "at-most-once":
                        # Never fire on a guess: this window is dropped (a loss point).
                        logger.warning(
                            "finalize of %r/%r (run %s) failed (%s); at-most-once: the fire "
                            "is dropped",
                            workflow,
                            key,
                            shared.run_id,
                            exc,
                        )
                        ledger.dropped += 1
                        self.close(shared)
                        return
                    # A commit whose answer was lost is proven (or taken back) by the
                    # next adopt_orphans: at the next heartbeat, not a reconcile period
                    # later, while its proof is fresh (see docs/protocol.rst).
                    self.reconcile_soon = True
                    if not shared.takes_fire and isinstance(exc, LeaseLapsedError):
                        # Paused past our own lease: a peer may own the window now. Do
                        # not fire on our stale view; ask again after a heartbeat (the
                        # backend proves a commit whose answer was lost then, or at
                        # its next adopt_orphans).
                        logger.warning(
                            "finalize of %r/%r (run %s) failed (%s) and this process's "
                            "lease has lapsed; retrying instead of firing",
                            workflow,
                            key,
                            shared.run_id,
                            exc,
                        )
                        shared.deadline = self._now() + backend.heartbeat_interval
                        continue
                    if shared.takes_fire:
                        logger.warning(
                            "could not take the fire of %r/%r (run %s): %s; its owner fires it",
                            workflow,
                            key,
                            shared.run_id,
                            exc,
                        )
                        self.close(shared)
                        return
                    logger.warning(
                        "finalize of %r/%r (run %s) failed (%s); the owner fires anyway and "
                        "deletes the window when the backend answers",
                        workflow,
                        key,
                        shared.run_id,
                        exc,
                    )
                    ledger.unconfirmed += 1
                    now = self._now()
                    fired_at = now if force else min(shared.deadline, now)
                    # Unconfirmed: this process's latest payload, and fencing token 0
                    # (older than any confirmed fire's).
                    result = Finalization(
                        Finalized.FIRE,
                        trio_to_wall(fired_at, wall_now=backend.wall_time(), trio_now=now),
                        shared.count,
                        None,
                        shared.mode,
                        payload=shared.payload,
                        reason=FireReason.FLUSH if force else FireReason.DELAY,
                    )
                finally:
                    shared.finalizing = False
                if result.outcome is Finalized.RESCHEDULE:
                    assert result.scheduled_at is not None
                    if shared.state == FLUSHED:
                        # A flushed "queue-latest" window waits for its key's run.
                        shared.state = OPEN
                    if ledger.wake_exit_on_pending:
                        ledger.idle_lot.unpark_all()  # a hand-off exit may take it now
                    shared.deadline = self.to_trio(result.scheduled_at)
                    shared.count = result.ping_count
                    shared.confirmed_at = self._now()
                    self.set_pending(shared, owner_pending(shared))
                    continue
                if result.outcome is Finalized.ABANDONED:
                    self.close(shared)
                    return
                break
        except trio.Cancelled:
            shared.scope = None
            if not ledger.closed:
                self._abort()
            self.settle_deleted(shared)
            if shared.pending_trailing:
                ledger.cancelled += 1
            self.close(shared)
            raise
        await self._fire(shared, result)

    async def _fire(self, shared: SharedWindow, result: Finalization) -> None:
        """Run the trailing fire of a shared window that the backend finalized for us
        (it deleted the window, exactly once), if its mode and count call for one."""
        assert result.scheduled_at is not None
        ledger = self._ledger
        workflow, key = shared.ident
        count = result.ping_count
        pending = trailing_pending(result.mode or shared.mode, count)
        first = shared.first_ping_at
        if result.first_ping_at is not None:
            first = self.to_trio(result.first_ping_at)
        fired_at = self.to_trio(result.scheduled_at)
        was_pending = shared.pending_trailing
        shared.pending_trailing = False  # moved from pending to running below, in one step
        self.detach(shared)
        if not pending:
            # The record goes before the window stops counting as pending, so an exit
            # cannot release the lease first (a peer would adopt the record and fire).
            await self.complete(result.fire_id)
            if was_pending:
                ledger.pending_dropped()
            return
        if not was_pending:
            ledger.pending += 1
        handler = self._handlers.of(shared.on_fire, workflow)
        fire = Fire(
            workflow,
            key,
            result.payload,
            shared.run_id,
            count,
            first,
            fired_at,
            Edge.TRAILING,
            1,
            result.fencing_token,
            _engine.caused(result.reason, shared.cause),
        )
        ledger.pending -= 1
        ledger.running += 1
        ledger.fires += 1
        await self.call(handler, fire, result.fire_id, shared_run=result.blocks)

    # ---------------------------------------------------------- taken fires

    async def take_fire(
        self,
        ident: tuple[str, str],
        run_id: str,
        *,
        early: bool,
        fire_at: float | None = None,
        cause: FireReason | None = None,
    ) -> None:
        """Take the fire of the shared window ``run_id`` now, from whoever owns it (a
        compare-and-swap): an overflowing window under ``overflow="fire-early"``
        (``early``: even while its key's run blocks; the backend says ``"overflow"``),
        or a window that waited for a ``queue-latest`` run that ended here (``cause``
        ``"run-end"``). Its handler runs as a task. ``fire_at``: the fire's logical
        time (wall clock; a batch's: the item it could not hold).

        Raises:
          BackendError: with ``early``, if the store failed (the ping is not stored).
        """
        workflow, key = ident
        try:
            result = await self._backend.finalize(
                workflow,
                key,
                run_id,
                take=True,
                force=True,
                delivery=self._delivery,
                early=early,
                **({} if fire_at is None else {"fire_at": fire_at}),
            )
        except BackendError as exc:
            self._ledger.backend_errors += 1
            self.reconcile_soon = True  # a lost commit is settled at the next heartbeat
            if early:
                raise
            logger.warning(
                "could not take the fire of %r/%r (run %s) whose run ended here: %s; its "
                "owner fires it when it looks again",
                workflow,
                key,
                run_id,
                exc,
            )
            return
        if result.outcome is not Finalized.FIRE:
            return
        self.run_taken(ident, run_id, result, cause)

    def prove_taken(self, ident: tuple[str, str], run_id: str) -> None:
        """Prove, as a task, an at-most-once take of run ``run_id`` whose commit's
        answer was lost (see ``DebounceBackend.attach``), and run its fire if it
        landed. The exit waits for it (it counts as a pending fire): at most a lease."""
        self._ledger.pending_added()
        self._nursery.start_soon(self._prove_taken, ident, run_id)

    async def _prove_taken(self, ident: tuple[str, str], run_id: str) -> None:
        workflow, key = ident
        try:
            # A finalize of the take: its re-reads recognise every write sent for the
            # run (a write that lands late included), for up to a lease.
            result = await self._backend.finalize(
                workflow, key, run_id, take=True, delivery=self._delivery
            )
        except BackendError as exc:
            self._ledger.backend_errors += 1
            self._ledger.dropped += 1
            logger.warning(
                "the fire of %r/%r (run %s) that a ping took could not be proven (%s); "
                "at-most-once: the fire is dropped",
                workflow,
                key,
                run_id,
                exc,
            )
        else:
            if result.outcome is Finalized.FIRE:
                self.run_taken(ident, run_id, result)
            # Otherwise none of its writes landed: the window is as the store has it,
            # for its owner, a later ping or an adopter to fire.
        finally:
            self._ledger.pending_dropped()

    def run_taken(
        self,
        ident: tuple[str, str],
        run_id: str,
        result: Finalization,
        cause: FireReason | None = None,
    ) -> None:
        """Run the fire of the shared window ``run_id`` that this process took (a
        ``fire`` finalization it committed as a taker): close its local window, if
        any, and start the trailing fire (if its mode and count call for one) as a
        task, with the window's ``on_fire`` here, else the workflow's handler
        (``cause``: what made the fire, see :func:`_engine.caused`)."""
        old = self.windows.get(ident)
        on_fire = None
        if old is not None and old.run_id == run_id:
            on_fire = old.on_fire
            if not old.finalizing:
                self.close(old)
        assert result.first_ping_at is not None
        shared = SharedWindow(
            ident,
            run_id,
            result.mode or _TRAILING,
            self._now(),
            self.to_trio(result.first_ping_at),
            result.ping_count,
            result.payload,
            on_fire,
            takes_fire=True,
        )
        shared.cause = cause
        self.start_fire(shared, result)

    async def end_run(self, ident: tuple[str, str], run_id: str) -> None:
        """A ``queue-latest`` run of a shared window returned: record it, and fire the
        window that waited for it, if any, at the run's end (now, before the write)."""
        ended_at = self._backend.wall_time()
        try:
            waiting = await self._backend.end_run(*ident, run_id)
        except BackendError as exc:
            self._ledger.backend_errors += 1
            logger.warning("could not record the end of run %s of %r/%r: %s", run_id, *ident, exc)
            return
        if waiting is not None:
            await self.take_fire(
                ident, waiting, early=False, fire_at=ended_at, cause=FireReason.RUN_END
            )

    async def complete(self, fire_id: str | None) -> None:
        """The handler of an at-least-once fire returned: delete its fire record."""
        if fire_id is None:
            return
        try:
            await self._backend.complete(fire_id)
        except BackendError as exc:
            self._ledger.backend_errors += 1
            logger.warning("could not delete fire record %s: %s", fire_id, exc)

    async def refire(self, orphan: OrphanFire) -> None:
        """Run again a fire whose process died in its handler (at-least-once): a
        re-run, counted in ``refires``. An orphan with a ``reason`` is a lost commit of
        this process, proven since: its first run, with that reason, a fire."""
        handler = self._handlers.by_workflow.get(orphan.workflow)
        fire = Fire(
            orphan.workflow,
            orphan.key,
            orphan.payload,
            orphan.run_id,
            orphan.ping_count,
            self.to_trio(orphan.first_ping_at),
            self.to_trio(orphan.fired_at),
            orphan.edge,
            orphan.attempt,
            orphan.fencing_token,
            FireReason.RE_RUN if orphan.reason is None else orphan.reason,
        )
        ledger = self._ledger
        if orphan.reason is None:
            ledger.refires += 1
        ledger.fires += 1
        ledger.running += 1
        await self.call(handler, fire, orphan.fire_id)

    @enable_ki_protection
    async def call(
        self,
        handler: Handler | None,
        fire: Fire,
        fire_id: str | None = None,
        *,
        shared_run: bool = False,
    ) -> None:
        """Run a shared window's fire (counted as running by the caller), then its
        after-steps: ``fire_id``, an at-least-once fire record, is deleted once the
        handler has returned or raised (not if it was cancelled: a peer runs it again),
        before the handler counts as finished, so an exit cannot cut the delete short;
        ``shared_run``: a "queue-latest" run, ended in the key's shared record."""
        # KI-protected, so Ctrl-C cannot land between the counters and the try; the
        # handler and on_error run unprotected (see _invoke.invoke and _firing.report).
        finished = False
        try:
            await self._handlers.call(handler, fire)
            finished = True
        finally:
            if finished and fire_id is not None:
                with trio.CancelScope(shield=True):  # bounded by the op deadline
                    await self.complete(fire_id)
            if shared_run and finished:
                # The same across processes, through the key's shared record. (A
                # cancelled run keeps blocking until its run_timeout or our lease.)
                with trio.CancelScope(shield=True):  # bounded by the op deadline
                    await self.end_run((fire.workflow, fire.key), fire.run_id)
            self._ledger.handler_ended()

    # ------------------------------------------------------------ late writes

    async def close_late_write(self, owned: OwnedWindow, local: Window) -> None:
        """A failed register landed after its fail-open window closed: delete the
        shared window, and fire it too if peers' pings reached it (never lose them)."""
        result = await self._backend.finalize(
            owned.workflow, owned.key, owned.run_id, force=True, delivery=self._delivery
        )
        if result.outcome is not Finalized.FIRE:
            return
        local_fired_at = local.flushed_at if local.flushed_at else local.deadline
        if (
            self._ledger.closed
            or result.last_ping_at is None
            or self.to_trio(result.last_ping_at) <= local_fired_at
        ):
            # The local fire came after every ping of the shared window: nothing to run.
            await self.complete(result.fire_id)
            return
        shared = SharedWindow(
            (owned.workflow, owned.key),
            owned.run_id,
            owned.mode,
            self._now(),
            self.to_trio(owned.first_ping_at),
            result.ping_count,
            local.payload,
            local.on_fire,
            takes_fire=False,
        )
        self.start_fire(shared, result)
