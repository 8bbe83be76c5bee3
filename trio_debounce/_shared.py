"""The windows shared with other processes through a backend.

:class:`SharedWindows` takes a coordinator's pings when it has a backend: it registers
each one in the shared window (``DebounceBackend.register``), then applies the answer
here: it arms (or updates) the window's local side, a
:class:`~trio_debounce._shared_window.SharedWindow` whose task (in
``_shared_window``) fires it, or starts a leading fire. When the backend fails it
fails open into the coordinator's :class:`~trio_debounce._local.LocalWindows` (and
reconciles later, should the failed write land). ``flush`` and ``cancel`` act on the
shared window, and ``reconcile`` (from the heartbeat, ``_upkeep``) re-arms windows the
backend says are ours and adopts those of dead processes.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple

import trio

from . import _engine, _options, _validate
from ._backend import (
    LATE_WRITE_HORIZON,
    LATE_WRITES_KEPT,
    DebounceBackend,
    Delivery,
    Finalization,
    OwnedWindow,
    Registered,
    Registration,
)
from ._errors import (
    BackendAuthError,
    BackendConfigError,
    BackendError,
    BackendUnavailableError,
)
from ._events import PingAnswered, PingFailedOpen, PingRejected, WindowTakenOver
from ._firing import Handlers, Ledger, closed_error
from ._flow import Flow, FlowSpec, span_name
from ._local import LocalWindows, ping_any
from ._shared_window import SharedFires, SharedWindow, owner_pending, trailing_pending
from ._types import (
    DebounceResult,
    Edge,
    Fire,
    FireReason,
    Handler,
    InitialFactory,
    Mode,
    ModeName,
    Outcome,
    Reducer,
)
from ._window import CLOSED, FLUSHED, OPEN, Window

logger = logging.getLogger("trio_debounce")

#: A ping that finds its shared window full (overflow="fire-early") fires it and pings
#: again; peers filling the next windows as fast make it give up after this many.
_OVERFLOW_ROUNDS = 8

_INF = math.inf
_TRAILING = Mode.TRAILING
_COALESCE = Outcome.COALESCE
_SCHEDULE_TRAILING = Outcome.SCHEDULE_TRAILING
_FIRE_IMMEDIATE = Outcome.FIRE_IMMEDIATE
_STALE = Outcome.STALE
_DROPPED = Outcome.DROPPED
_new_tuple = tuple.__new__


def _uuid4_hex() -> str:
    """A random uuid4 hex for a shared ping's run id: :mod:`random`, not a system call
    per ping as :func:`uuid.uuid4` makes (a run id must be unique, not unguessable)."""
    bits = random.getrandbits(128) & _UUID4_CLEAR | _UUID4_SET
    return f"{bits:032x}"


#: The version (4) and variant (RFC 4122) bits of a uuid4, as uuid.UUID sets them.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


def _backend_options(
    options: Mapping[str, Any],
    mode: Mode,
    reducers: dict[str, tuple[Reducer, InitialFactory | None]],
) -> dict[str, Any]:
    """The options a shared ping passes to the backend's register, validated as
    in-process (only those that differ from their defaults, so a backend that
    predates them keeps working for windows without them)."""
    _options.check_names(options)
    order = options.get("order_key")
    if order is not None:
        order = _options.order_key(order)
    drop_stale = options.get("drop_stale", False)
    if not isinstance(drop_stale, bool):
        raise TypeError(f"drop_stale must be a bool, not {drop_stale!r}")
    if drop_stale and order is None:
        raise ValueError("drop_stale=True needs an order_key on the ping")
    opts = _options.window_options(
        mode,
        options.get("max_count"),
        options.get("payload_policy", _options.LAST),
        options.get("max_items"),
        options.get("overflow"),
        options.get("overlap", _options.ALLOW),
        options.get("run_timeout"),
        order is not None,
        reducers,
    )
    extra: dict[str, Any] = {}
    if opts.max_count is not None:
        extra["max_count"] = opts.max_count
    if opts.payload_policy != _options.LAST:
        extra["payload_policy"] = opts.payload_policy
    if opts.max_items is not None:
        extra["max_items"] = opts.max_items
    if opts.overflow is not None:
        extra["overflow"] = opts.overflow
    if opts.reducer:
        # Referred to by name across processes: each process folds with its own.
        extra["reducer"] = reducers[opts.payload_policy]
    if opts.queue:
        extra["overlap"] = opts.overlap
    if opts.run_timeout is not None:
        extra["run_timeout"] = opts.run_timeout
    if order is not None:
        extra["order_key"] = order
    if drop_stale:
        extra["drop_stale"] = True
    return extra


def _flow_options(spec: FlowSpec, size: int) -> dict[str, Any]:
    """The register options of a flow-control window's ping: a batch is a ``collect``
    window that comes due at its ``max_items``-th item and fires before an item that
    would overflow it; an audit or a batch under ``overlap="queue-latest"`` waits for
    its key's run as a debounce window does (see :doc:`/protocol`, "Flow-control
    windows")."""
    extra: dict[str, Any] = {"flow": spec}
    if spec.flow is Flow.BATCH:
        extra.update(
            payload_policy=_options.COLLECT,
            max_count=spec.max_items,
            max_items=spec.max_items,
            overflow=_options.FIRE_EARLY,
        )
        if spec.max_bytes is not None:
            extra["size"] = size
    if spec.queue:
        extra["overlap"] = _options.QUEUE_LATEST
        if spec.run_timeout is not None:
            extra["run_timeout"] = spec.run_timeout
    return extra


def _flow_result(spec: FlowSpec, result: DebounceResult) -> DebounceResult:
    """A flow ping's result as in one process, from the debounce window's it is
    stored as: a throttle ping that opened a cool-down window was absorbed; a batch of
    one item fired at once (due at once, by its owner's task), unless it waits for its
    key's queue-latest run."""
    if spec.flow is Flow.THROTTLE:
        return result._replace(outcome=_COALESCE)
    if spec.flow is Flow.BATCH and spec.max_items <= 1 and result.scheduled_at is not None:
        # (A queue-latest batch that waits for its key's run has no due time.)
        return result._replace(outcome=_FIRE_IMMEDIATE, scheduled_at=None)
    return result


async def await_ping(
    shared: SharedWindows,
    ledger: Ledger,
    workflow: str,
    key: str,
    at: float,
    call: Awaitable[DebounceResult],
) -> DebounceResult:
    """Await ``call``, a :meth:`SharedWindows.ping` of ``(workflow, key)`` made at
    ``at``: shielded, so the ping is taken or refused as a whole, within the backend's
    operation deadline, never half-applied by a cancellation (a backend whose register
    cannot be cancelled needs no cancel scope: one per ping costs more than the rest of
    a merged ping; ``SharedWindows.ping`` shields the rest). Emits the ping's event."""
    try:
        if shared.register_uncancellable:
            result = await call
        else:
            with trio.CancelScope(shield=True):
                result = await call
    except Exception as exc:
        if ledger.hook is not None:
            ledger.emit(PingRejected(workflow, key, exc, at))
        raise
    if ledger.hook is not None:
        ledger.emit(PingAnswered(workflow, key, result, at))
    return result


class _LastMerge(NamedTuple):
    """The last stored extend-or-coalesce registration applied: the pings of one
    write get the same Registration, and the later ones only count."""

    registration: Registration
    #: The local shared window it left (None if none).
    window: SharedWindow | None
    result: DebounceResult


class SharedWindows:
    """The windows a coordinator shares through its backend.

    Args:
      nursery: the coordinator's nursery (window tasks, leading fires, refires).
      now: the run's clock, bound.
      backend: the backend the windows are shared through.
      delivery: the coordinator's delivery promise.
      on_backend_error: ``"fail-open"`` or ``"raise"``.
      ledger: the coordinator's counters and lifecycle flags.
      handlers: the coordinator's handlers, reducers and error policy.
      local: the coordinator's local windows, where a failed register fails open.
      abort: called when a window's task sees the nursery cancelled first.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        now: Callable[[], float],
        backend: DebounceBackend,
        delivery: Delivery,
        on_backend_error: str,
        ledger: Ledger,
        handlers: Handlers,
        local: LocalWindows,
        abort: Callable[[], None],
    ) -> None:
        self._nursery = nursery
        self._now = now
        self._backend = backend
        #: The backend's register never checkpoints: a ping needs no cancel scope.
        self.register_uncancellable = backend._register_uncancellable
        self._on_backend_error = on_backend_error
        self._ledger = ledger
        self._handlers = handlers
        self._local = local
        self._fires = SharedFires(nursery, now, backend, delivery, ledger, handlers, abort)
        self._delivery = delivery
        #: The local side of the shared windows (the table of ``SharedFires``).
        self.windows = self._fires.windows
        #: Local windows opened because a register failed, by the run id the failed
        #: register proposed (its write may land later).
        self._fail_open_runs: dict[str, Window] = {}
        #: Of those whose local window closed: when a reconcile first found it closed.
        self._fail_open_closed: dict[str, float] = {}
        #: Run ids of registers in flight: the reconcile leaves their windows alone
        #: (the register arms them, or fails open and the next reconcile adopts them).
        self._registering: set[str] = set()
        self._merged: _LastMerge | None = None
        #: Run ids of the shared windows whose documents the release deletes at exit;
        #: other windows this process owns stay in the store for peers to adopt.
        self.release_runs: set[str] = set()
        #: Run ids of the windows an explicit ``on_exit="cancel"`` closed under
        #: at-least-once: the release deletes those that hold only this process's pings
        #: and leaves the others (peers' pings are in them) for a peer to fire.
        self.cancel_runs: set[str] = set()

    @property
    def reconcile_soon(self) -> bool:
        """Reconcile at the next heartbeat (after a failed register or finalize)."""
        return self._fires.reconcile_soon

    @reconcile_soon.setter
    def reconcile_soon(self, value: bool) -> None:
        self._fires.reconcile_soon = value

    def __len__(self) -> int:
        return len(self.windows)

    def is_open(self, ident: tuple[str, str]) -> bool:
        """Is the window ``ident`` open here, and ours to fire?"""
        shared = self.windows.get(ident)
        return shared is not None and shared.state == OPEN and not shared.takes_fire

    # ------------------------------------------------------------------- pings

    async def ping(
        self,
        workflow: str,
        key: str,
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: Mode | ModeName,
        run_id: str | None,
        on_fire: Handler | None,
        options: Mapping[str, Any] | None = None,
        flow: FlowSpec | None = None,
        size: int = 0,
    ) -> DebounceResult:
        """A ping of a shared window (arguments as :meth:`Coordinator.debounce`'s;
        ``options``: the ping's window options as given). ``flow``: a flow-control
        window's spec (``mode``, ``delay`` and ``max_delay`` then as
        :func:`~._flow.stored_as` gives them, ``options`` None), ``size`` a batch
        item's serialized length."""
        if self._ledger.closed:
            raise closed_error()
        # A flow window's span comes as its delay and max_delay: named as its caller
        # gave it (interval, max_wait, period).
        name = "delay" if flow is None else span_name(flow.flow)
        delay = _validate.shared_duration(name, _validate.duration(name, delay))
        if max_delay is not None:
            max_delay = _validate.shared_duration(
                "max_delay", _validate.duration("max_delay", max_delay)
            )
            if max_delay < delay:
                raise _validate.max_delay_below_delay(max_delay, delay)
        _validate.run_id(run_id)
        if run_id is not None:
            _validate.shareable("run_id", run_id)
        _validate.handler("on_fire", on_fire)
        _validate.name("workflow", workflow)
        _validate.name("key", key)
        mode = _validate.mode(mode)
        extra = {} if options is None else _backend_options(options, mode, self._handlers.reducers)
        if flow is not None:
            extra = _flow_options(flow, size)
        ident = (workflow, key)
        local = self._local.windows.get(ident)
        if local is not None and not _engine.is_due(local, self._now()):
            # A window opened locally while the backend failed keeps its burst.
            return ping_any(
                self._local,
                workflow,
                key,
                payload,
                delay,
                max_delay,
                mode,
                run_id,
                on_fire,
                options,
            )
        shared = self.windows.get(ident)
        if (
            on_fire is None
            and workflow not in self._handlers.by_workflow
            and (shared is None or shared.on_fire is None)
        ):
            raise self._handlers.missing(workflow)
        if run_id is None:
            run_id = _uuid4_hex()
        self._registering.add(run_id)
        backend = self._backend

        async def register() -> Registration:
            # Options only when given: a backend that predates them keeps working.
            return await backend.register(
                workflow,
                key,
                mode=mode,
                delay=delay,
                max_delay=max_delay,
                run_id=run_id,
                payload=payload,
                **extra,
            )

        try:
            # register() inlined: one coroutine less per ping.
            registration = await backend.register(
                workflow,
                key,
                mode=mode,
                delay=delay,
                max_delay=max_delay,
                run_id=run_id,
                payload=payload,
                **extra,
            )
            if registration.overflowed:
                # Shielded (debounce() may not be): the ping is not taken yet.
                with trio.CancelScope(shield=True):
                    registration = await self._fire_early(ident, registration, register, extra)
        except BackendError as exc:
            if isinstance(exc, (ValueError, BackendAuthError, BackendConfigError)):
                # Bad input (a document too large) or misconfiguration: never failed open.
                raise
            self._ledger.backend_errors += 1
            # A take of a due fire may have left a lost commit, decided by the next
            # reconcile while its proof is fresh: the next heartbeat, as after a failed
            # finalize (and, failing open, for a write that lands late).
            self._fires.reconcile_soon = True
            if self._on_backend_error == "raise" or flow is not None:
                # A flow-control window never fails open (docs/semantics.rst).
                if isinstance(exc, BackendUnavailableError):
                    raise
                raise BackendUnavailableError(f"the backend failed: {exc}") from exc
            self._ledger.fail_open += 1
            if self._ledger.hook is not None:
                self._ledger.emit(PingFailedOpen(workflow, key, exc, self._now()))
            logger.warning(
                "backend failed to register %r/%r (%s); failing open with a local window",
                workflow,
                key,
                exc,
            )
            if self._ledger.closed:
                raise closed_error() from exc
            result = ping_any(
                self._local,
                workflow,
                key,
                payload,
                delay,
                max_delay,
                mode,
                run_id,
                on_fire,
                options,
            )
            # The write may still land (a timeout is ambiguous) and make us the owner
            # of a shared window with this run id: reconcile soon, and then adopt or
            # close it instead of firing the burst twice.
            self._fail_open_runs[run_id] = self._local.windows[ident]
            self._fail_open_closed.pop(run_id, None)  # a run id given again
            return result
        finally:
            self._registering.discard(run_id)
        for taken in registration.taken:
            # A backend without the hook returns the fires the ping took (due windows
            # it closed before opening the next): they run here.
            self._fires.run_taken(ident, taken.run_id, taken)
        merged = self._merged
        if (
            merged is not None
            and merged.registration is registration
            and on_fire is None
            and not self._ledger.closed
            and self.windows.get(ident) is merged.window
            and (merged.window is None or merged.window.state == OPEN)
        ):
            # Another ping of the write that carried the last one applied: the local
            # window is as that one left it, and _apply would only count the ping.
            self._ledger.pings += 1
            self._ledger.coalesced += 1
            return merged.result
        policy = extra.get("payload_policy", _options.LAST)
        result = self._apply(ident, registration, on_fire, policy, payload)
        if flow is not None and result.outcome is _SCHEDULE_TRAILING:
            result = _flow_result(flow, result)
        if registration.stored and (
            registration.outcome is Registered.EXTENDED
            or registration.outcome is Registered.COALESCED
        ):
            self._merged = _new_tuple(_LastMerge, (registration, self.windows.get(ident), result))
        return result

    def ping_took(self, workflow: str, key: str, result: Finalization) -> None:
        """The backend's ``on_taken`` (see ``DebounceBackend.attach``): a ping of this
        process found a due window and took its fire by compare-and-swap; run it at
        once, even if the ping itself fails afterwards."""
        self._fires.run_taken((workflow, key), result.run_id, result)

    def prove_taken(self, workflow: str, key: str, run_id: str) -> None:
        """The backend's ``on_unproven_take`` (see ``DebounceBackend.attach``): a ping
        of this process took the fire of run ``run_id`` at-most-once and the commit's
        answer did not come in time; prove it (and run it) as a task."""
        self._fires.prove_taken((workflow, key), run_id)

    async def _fire_early(
        self,
        ident: tuple[str, str],
        registration: Registration,
        register: Callable[[], Awaitable[Registration]],
        extra: dict[str, Any],
    ) -> Registration:
        """A ping that found its window full under ``overflow="fire-early"``: the
        window fires at once with what it holds (this process takes the fire by
        compare-and-swap), then the ping opens the next window (or joins the one a
        peer opened meanwhile)."""
        for _ in range(_OVERFLOW_ROUNDS):
            if not registration.overflowed:
                return registration
            # A batch fires at the time of the item it could not hold, which opens the
            # next batch at that time.
            fire_at = registration.scheduled_at if "flow" in extra else None
            await self._fires.take_fire(ident, registration.run_id, early=True, fire_at=fire_at)
            if fire_at is not None:
                extra["now"] = fire_at
            # Not stale: judged by the register that found the window full.
            extra.pop("drop_stale", None)
            registration = await register()
        workflow, key = ident
        raise BackendUnavailableError(
            f"the ping of {workflow!r}/{key!r} found a full window "
            f"{_OVERFLOW_ROUNDS} times in a row; it was not stored"
        )

    # --------------------------------------------------------- the answer

    def _apply(
        self,
        ident: tuple[str, str],
        registration: Registration,
        on_fire: Handler | None,
        policy: str = _options.LAST,
        own_payload: Any = None,
    ) -> DebounceResult:
        """Apply the backend's answer to a ping here: count it, arm or update the
        window's local side, or start its leading fire; the ping's result."""
        ledger = self._ledger
        to_trio = self._fires.to_trio
        run_id, mode, count = registration.run_id, registration.mode, registration.ping_count
        scheduled = to_trio(registration.scheduled_at)
        waiting = registration.waiting
        pending_at = scheduled if trailing_pending(mode, count) and not waiting else None
        if registration.outcome is Registered.STALE:
            ledger.stale += 1
            if not run_id:
                pending_at = None  # no window open
            return _new_tuple(DebounceResult, (_STALE, run_id, pending_at, count, False, True))
        if registration.outcome is Registered.DROPPED:
            ledger.dropped_pings += 1
            return _new_tuple(DebounceResult, (_DROPPED, run_id, pending_at, count, False, True))
        ledger.pings += 1
        if registration.outcome is Registered.FIRED:
            # A rate-limit fire: a leading fire of the ping's own run.
            if not ledger.closed:
                _start_leading(self, ident, registration, on_fire, own_payload)
            return _new_tuple(DebounceResult, (_FIRE_IMMEDIATE, run_id, None, 1, False, True))
        if ledger.closed:
            # The block ended while the ping was in flight: release() gives the window
            # up (if it became ours) so peers open a fresh one.
            return _new_tuple(DebounceResult, (_COALESCE, run_id, pending_at, count, False, True))
        if registration.outcome is Registered.TOOK_OVER:
            ledger.takeovers += 1
            if ledger.hook is not None:
                ledger.emit(WindowTakenOver(ident[0], ident[1], "ping", self._now()))
        if registration.owner:
            self._fires.arm(
                ident,
                run_id,
                mode,
                scheduled,
                to_trio(registration.first_ping_at),
                count,
                registration.payload,  # as stored: an unconfirmed fire carries it
                on_fire,
                takes_fire=False,
            )
            if registration.outcome is Registered.OPENED:
                if mode is _TRAILING:
                    return _new_tuple(
                        DebounceResult, (_SCHEDULE_TRAILING, run_id, pending_at, count, True, True)
                    )
                leading_payload = registration.payload
                if policy == _options.COLLECT:
                    # A leading fire carries its ping's own payload, the list's first.
                    leading_payload = leading_payload[0]
                elif policy != _options.LAST and policy != _options.FIRST:
                    leading_payload = own_payload  # not the reducer's value
                _start_leading(self, ident, registration, on_fire, leading_payload)
                return _new_tuple(
                    DebounceResult, (_FIRE_IMMEDIATE, run_id, pending_at, count, True, True)
                )
            ledger.coalesced += 1
            return _new_tuple(DebounceResult, (_COALESCE, run_id, pending_at, count, True, True))
        ledger.coalesced += 1
        if not registration.stored:
            ledger.unstored += 1
        shared = self.windows.get(ident)
        if registration.take_at is not None:
            self._fires.arm(
                ident,
                run_id,
                mode,
                to_trio(registration.take_at),
                to_trio(registration.first_ping_at),
                count,
                registration.payload,
                on_fire,
                takes_fire=True,
            )
        elif shared is not None and shared.run_id == run_id and shared.state == OPEN:
            shared.payload = registration.payload
            shared.count = count
            if on_fire is not None:
                shared.on_fire = on_fire
        return _new_tuple(
            DebounceResult, (_COALESCE, run_id, pending_at, count, False, registration.stored)
        )

    # ---------------------------------------------------------- cancel and flush

    async def cancel(self, workflow: str, key: str) -> bool:
        """Close the window here and delete the shared one, whoever owns it; True if
        the backend deleted one (False if it failed, under fail-open)."""
        shared = self.windows.get((workflow, key))
        if shared is not None:
            if not self._fires.settle_deleted(shared) and shared.pending_trailing:
                self._ledger.cancelled += 1
            self._fires.close(shared)
        cancelled = False
        with trio.CancelScope(shield=True):
            try:
                cancelled = await self._backend.cancel(workflow, key)
            except BackendError as exc:
                self._ledger.backend_errors += 1
                if self._on_backend_error == "raise":
                    raise
                logger.warning("backend failed to cancel %r/%r: %s", workflow, key, exc)
        return cancelled

    def flush(self, ident: tuple[str, str]) -> bool:
        """Make the task of the window ``ident``, if this process fires it, finalize
        it now (forced); True if it had a trailing fire pending."""
        shared = self.windows.get(ident)
        return shared is not None and self._flush(shared)

    def flush_requested(self, ident: tuple[str, str], run_id: str) -> bool:
        """A flush request from outside (``trio-debounce flush``, read by the heartbeat)
        for run ``run_id`` of the window ``ident``: finalize it now if its task is here
        and still on that run; True if it had a trailing fire pending."""
        shared = self.windows.get(ident)
        return shared is not None and shared.run_id == run_id and self._flush(shared)

    def _flush(self, shared: SharedWindow) -> bool:
        if shared.state != OPEN:
            return False
        shared.state = FLUSHED
        if shared.scope is not None:
            shared.scope.cancel()
        # True only for a fire this process knows is due: an owner's both-edges window
        # with one known ping is finalized too, but fires only if peers pinged it.
        return trailing_pending(shared.mode, shared.count)

    # ------------------------------------------------------------------ exit

    def flush_all(self) -> None:
        """The exit's ``on_exit="flush"``: every pending trailing fire is finalized now."""
        for shared in list(self.windows.values()):
            if shared.pending_trailing and shared.state == OPEN:
                shared.cause = FireReason.EXIT  # if it fires before its due time
                self._flush(shared)

    def hand_off_all(self) -> None:
        """A hand-off exit: leave the open windows in the store for a live peer (or the
        next coordinator). A window whose finalize is in flight finishes first (its
        commit may have landed), and is handed off at the next turn if it reschedules."""
        for shared in list(self.windows.values()):
            if shared.state == OPEN and not shared.finalizing:
                self._fires.close(shared)

    def cancel_all(self) -> None:
        """The exit's ``on_exit="cancel"``: every pending trailing fire is dropped here
        and its document deleted when the block closes; under at-least-once only if it
        holds this process's pings alone (see ``cancel_runs``)."""
        for shared in list(self.windows.values()):
            if shared.pending_trailing and shared.state == OPEN:
                if self._delivery == "at-least-once":
                    self.cancel_runs.add(shared.run_id)  # counted once deleted
                else:
                    self._ledger.cancelled += 1
                    self.release_runs.add(shared.run_id)
                self._fires.close(shared)

    def release_owned(self) -> None:
        """The block closed: the release deletes the documents of the windows open
        here that this process owns (their pending fires, if any, are dropped)."""
        self.release_runs.update(s.run_id for s in self.windows.values() if not s.takes_fire)

    # ------------------------------------------------------------- reconcile

    async def reconcile(self) -> None:
        """Arm a local task for every window the backend says is ours but we lack
        (a write that timed out and committed later, say); adopt the windows and
        interrupted fires of dead processes, for the workflows this coordinator
        handles."""
        ledger = self._ledger
        if ledger.closed:
            return
        fires = self._fires
        to_trio = fires.to_trio
        # Taken before the listing starts: a window confirmed after it may be missing
        # from the listing and must not be dropped.
        listed_at = self._now()
        orphans = await self._backend.adopt_orphans(frozenset(self._handlers.by_workflow))
        if orphans.deferred:
            self.reconcile_soon = True  # again at the next heartbeat, until adopted
        ledger.takeovers += len(orphans.windows)
        adopted_at = self._now()
        adopted_runs = {adopted.run_id for adopted in orphans.windows}
        if ledger.hook is not None:
            for adopted in orphans.windows:
                ledger.emit(WindowTakenOver(adopted.workflow, adopted.key, "adoption", adopted_at))
        for orphan in orphans.fires:
            self._nursery.start_soon(fires.refire, orphan)
        owned_windows = orphans.owned
        seen = {owned.run_id for owned in owned_windows}
        for stale in list(self.windows.values()):
            if (
                not stale.takes_fire
                and stale.state == OPEN
                and stale.confirmed_at < listed_at
                and stale.run_id not in seen
            ):
                # Fired by a peer that took it, cancelled, or taken over since the
                # backend last confirmed it: stop waiting for it (and never fire it
                # unconfirmed later).
                logger.info(
                    "window %r/%r (run %s) is no longer this process's; dropping it",
                    *stale.ident,
                    stale.run_id,
                )
                fires.close(stale)
        _forget_late_writes(self._fail_open_runs, self._fail_open_closed, seen, listed_at)
        for owned in owned_windows:
            ident = (owned.workflow, owned.key)
            shared = self.windows.get(ident)
            if (
                ledger.closed
                or owned.run_id in self._registering
                or fires.closed_runs.get(owned.run_id, -_INF) >= listed_at
            ):
                continue
            if shared is not None and shared.run_id == owned.run_id and shared.state != CLOSED:
                # Open, or flushed and being finalized: ours already. A taker whose
                # window became ours (adopted from its dead owner) is its owner now.
                if shared.takes_fire:
                    shared.takes_fire = False
                    deadline = to_trio(owned.scheduled_at)
                    if deadline < shared.deadline and shared.scope is not None:
                        shared.scope.deadline = deadline
                    shared.deadline = deadline
                    shared.confirmed_at = self._now()
                    fires.set_pending(shared, owner_pending(shared))
                    _note_adoption(shared, owned, adopted_runs, adopted_at, to_trio)
                continue
            local = _take_fail_open(self._fail_open_runs, self._fail_open_closed, owned, ident)
            payload: Any = None
            on_fire: Handler | None = None
            count = owned.ping_count
            if local is not None:
                if local.state != OPEN or self._local.windows.get(ident) is not local:
                    # The local window already fired (or was cancelled) for this burst;
                    # the late write only matters if peers pinged into it since.
                    await self._fires.close_late_write(owned, local)
                    continue
                # Still open: adopt the local burst into the shared window (one fire).
                payload, on_fire = local.payload, local.on_fire
                count = max(count, local.count)
                self._local.close(local)
                logger.info(
                    "a register of %r/%r that failed had landed; its local window joins "
                    "the shared one",
                    owned.workflow,
                    owned.key,
                )
            logger.info(
                "re-arming window %r/%r (run %s) that names this process as its owner",
                owned.workflow,
                owned.key,
                owned.run_id,
            )
            armed = self._fires.arm(
                ident,
                owned.run_id,
                owned.mode,
                to_trio(owned.scheduled_at),
                to_trio(owned.first_ping_at),
                count,
                payload,
                on_fire,
                takes_fire=False,
            )
            _note_adoption(armed, owned, adopted_runs, adopted_at, to_trio)
        fires.closed_runs = {run: at for run, at in fires.closed_runs.items() if at >= listed_at}


def _take_fail_open(
    runs: dict[str, Window], closed: dict[str, float], owned: OwnedWindow, ident: tuple[str, str]
) -> Window | None:
    """Take (and forget) the fail-open window of ``owned``'s run and key, if any (a
    caller's run id may name windows of other keys too)."""
    local = runs.get(owned.run_id)
    if local is None or local.ident != ident:
        return None
    del runs[owned.run_id]
    closed.pop(owned.run_id, None)
    return local


def _forget_late_writes(
    runs: dict[str, Window], closed: dict[str, float], seen: set[str], now: float
) -> None:
    """Forget the fail-open ``runs`` whose local window closed at least
    :data:`LATE_WRITE_HORIZON` seconds before ``now`` (``closed``: when a reconcile
    first found each closed) and that the listing did not show (``seen``); then the
    oldest closed ones beyond :data:`LATE_WRITES_KEPT`."""
    for run_id, window in list(runs.items()):
        if window.state != CLOSED or run_id in seen:
            continue
        if now - closed.setdefault(run_id, now) >= LATE_WRITE_HORIZON:
            del runs[run_id], closed[run_id]
    for run_id in list(closed)[: max(0, len(closed) - LATE_WRITES_KEPT)]:
        del closed[run_id]
        runs.pop(run_id, None)


def _note_adoption(
    shared: SharedWindow,
    owned: OwnedWindow,
    adopted_runs: set[str],
    adopted_at: float,
    to_trio: Callable[[float], float],
) -> None:
    """A window this process adopted from its dead owner at ``adopted_at`` (Trio's
    clock) when it was due already fires late because of the adoption: its reason is
    ``"adoption"``. One adopted before its due time keeps its usual reason."""
    if owned.run_id in adopted_runs and to_trio(owned.scheduled_at) <= adopted_at:
        shared.cause = FireReason.ADOPTION


def _start_leading(
    windows: SharedWindows,
    ident: tuple[str, str],
    registration: Registration,
    on_fire: Handler | None,
    payload: Any,
) -> None:
    """Start the leading fire of ``registration``'s ping (its run, its time) as a task
    in the coordinator's nursery."""
    workflow, key = ident
    fires = windows._fires
    handler = windows._handlers.of(on_fire, workflow)
    # The ping's time (the window's first ping), kept through its retries.
    now = fires.to_trio(registration.first_ping_at)
    fire = Fire(
        workflow,
        key,
        payload,  # as every process reads it back
        registration.run_id,
        1,
        now,
        now,
        Edge.LEADING,
        1,
        registration.fencing_token,
        FireReason.LEADING,
    )
    ledger = windows._ledger
    ledger.fires += 1
    ledger.running += 1
    # Under at-least-once its record (written before the opening write) is completed
    # once the handler returns; a survivor runs it again if not.
    windows._nursery.start_soon(fires.call, handler, fire, registration.fire_id)
