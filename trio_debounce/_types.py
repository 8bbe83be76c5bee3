"""Value types shared by the coordinator, the CLI and the tests."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypedDict


class Mode(str, enum.Enum):
    """Which edges of a debounce window fire.

    ``Mode.TRAILING`` (``"trailing"``)
      Fire once, ``delay`` seconds after the last ping of a burst, with the latest
      payload (lodash's ``trailing: true``).
    ``Mode.LEADING`` (``"leading"``)
      Fire the first ping of a burst at once and drop the rest until ``delay`` seconds
      of silence (lodash's ``leading: true, trailing: false``).
    ``Mode.BOTH`` (``"both"``)
      Fire the first ping at once and, if the window received more than one ping, fire
      again at the end of the burst with the latest payload.

    :meth:`Coordinator.debounce` accepts the enum or its string value (:data:`ModeName`).
    """

    TRAILING = "trailing"
    LEADING = "leading"
    BOTH = "both"

    def __str__(self) -> str:
        return self.value


#: The string values of :class:`Mode`, which ``debounce(mode=...)`` accepts in place of
#: the enum. Any other string is a type error (and a :exc:`ValueError` at run time).
ModeName = Literal["trailing", "leading", "both"]


class Edge(str, enum.Enum):
    """Which edge of its window a :class:`Fire` belongs to.

    ``Edge.LEADING`` (``"leading"``)
      The fire of a window's first ping, committed at ping time.
    ``Edge.TRAILING`` (``"trailing"``)
      The fire at the end of a window (its deadline, or a flush).
    """

    LEADING = "leading"
    TRAILING = "trailing"

    def __str__(self) -> str:
        return self.value


class FireReason(str, enum.Enum):
    """Why a fire fired (:attr:`Fire.reason`, :class:`FireStarted`). A str enum: each
    member equals its value (``FireReason.DELAY == "delay"``).

    ``LEADING`` (``"leading"``)
      A leading edge: a window's first ping (debounce, throttle), or a rate-limit
      window's ping within its limit.
    ``DELAY`` (``"delay"``)
      A trailing edge after ``delay`` seconds of silence.
    ``MAX_DELAY`` (``"max-delay"``)
      A trailing edge at the window's cap, ``max_delay`` after its first ping.
    ``MAX_COUNT`` (``"max-count"``)
      A trailing edge at the ping that reached ``max_count``.
    ``MAX_ITEMS`` (``"max-items"``)
      A batch at its ``max_items``-th item.
    ``MAX_BYTES`` (``"max-bytes"``)
      A batch before an item that would take it past ``max_bytes``.
    ``MAX_WAIT`` (``"max-wait"``)
      A batch ``max_wait`` after its first item.
    ``INTERVAL`` (``"interval"``)
      A throttle's (or audit's) trailing edge at the end of its ``interval``.
    ``FLUSH`` (``"flush"``)
      :meth:`~trio_debounce.Coordinator.flush` or ``trio-debounce flush``, before the
      window's due time.
    ``RE_RUN`` (``"re-run"``)
      A later attempt of a fire its process died in (at least once).
    ``OVERFLOW`` (``"overflow"``)
      A window under ``overflow="fire-early"`` (``payload_policy="collect"`` or a
      reducer) fired early: a ping found it holding ``max_items`` payloads. A batch
      says ``"max-bytes"`` instead.
    ``EXIT`` (``"exit"``)
      The coordinator's exit with ``on_exit="flush"`` fired the window before its due
      time.
    ``RUN_END`` (``"run-end"``)
      An ``overlap="queue-latest"`` window came due while its key's run was executing
      and fired when that run stopped blocking (it returned, or its ``run_timeout``
      passed). A window no run held back keeps its usual reason.
    ``ADOPTION`` (``"adoption"``)
      A shared window whose owner died, fired by the process that adopted it, later
      than its due time because of the adoption (a window adopted before its due time
      keeps its usual reason).
    """

    LEADING = "leading"
    DELAY = "delay"
    MAX_DELAY = "max-delay"
    MAX_COUNT = "max-count"
    MAX_ITEMS = "max-items"
    MAX_BYTES = "max-bytes"
    MAX_WAIT = "max-wait"
    INTERVAL = "interval"
    FLUSH = "flush"
    RE_RUN = "re-run"
    OVERFLOW = "overflow"
    EXIT = "exit"
    RUN_END = "run-end"
    ADOPTION = "adoption"

    def __str__(self) -> str:
        return self.value


class Outcome(str, enum.Enum):
    """What one ping did; see :class:`DebounceResult`.

    ``Outcome.SCHEDULE_TRAILING`` (``"schedule-trailing"``)
      The ping opened a trailing window; its fire is pending at ``scheduled_at``.
    ``Outcome.FIRE_IMMEDIATE`` (``"fire-immediate"``)
      The ping opened a leading or both-edges window and fired at once.
    ``Outcome.COALESCE`` (``"coalesce"``)
      The ping landed in an open window and was absorbed by it.
    ``Outcome.STALE`` (``"stale"``)
      The ping had ``drop_stale=True`` and an ``order_key`` not above the highest one
      already fired for its key: it was dropped, and counted in
      :attr:`CoordinatorStatistics.stale_pings`. Nothing changed.
    ``Outcome.DROPPED`` (``"dropped"``)
      The ping was dropped by a flow-control window's rule (a throttle without a
      trailing edge, a rate limit past its limit), and counted in
      :attr:`CoordinatorStatistics.dropped_pings`. Nothing changed.
    """

    SCHEDULE_TRAILING = "schedule-trailing"
    FIRE_IMMEDIATE = "fire-immediate"
    COALESCE = "coalesce"
    STALE = "stale"
    DROPPED = "dropped"

    def __str__(self) -> str:
        return self.value


class DebounceResult(NamedTuple):
    """What :meth:`Coordinator.debounce` did with one ping (immutable).

    A :class:`~typing.NamedTuple`, so building one on the hot path costs a tuple
    allocation, not a frozen dataclass's ``object.__setattr__`` calls.

    Attributes:
      outcome (Outcome): what the ping did.
      active_run_id (str): the run id of the window the ping landed in (the window it
        opened, or the open window that absorbed it); for a ``stale`` ping, the open
        window's, or ``""`` when none is open.
      scheduled_at (float | None): the pending trailing fire time, an absolute time on
        Trio's clock (:func:`trio.current_time`), or ``None`` when no trailing fire is
        pending (leading mode, or a both-edges window with a single ping) or when the
        window is due and waits for its key's run to end (``overlap="queue-latest"``).
      ping_count (int): pings absorbed by the window so far, this one included (a
        ``stale`` ping is not); with a backend, the window's count across all
        processes.
      owner (bool): True if this coordinator owns the window and will fire it. Always
        True without a backend (and for a window opened locally because the backend
        failed, see ``on_backend_error``).
      stored (bool): False only when, with a backend, the ping could not be written
        within the backend's operation deadline under contention, while a live owner
        had a fire pending that comes after this ping's arrival (see
        :doc:`/protocol`). Always True without a backend.
    """

    outcome: Outcome
    active_run_id: str
    scheduled_at: float | None
    ping_count: int
    owner: bool = True
    stored: bool = True


@dataclass(frozen=True, slots=True)
class Fire:
    """One firing of a debounce window, passed to its handler.

    Attributes:
      workflow (str): the window's workflow name.
      key (str): the window's debounce key.
      payload (Any): per the window's ``payload_policy``: the latest payload the window
        received before it fired (``"last"``, the default; with ``order_key``, the one
        with the highest order key), the first one (``"first"``), the list of them
        (``"collect"``) or a reducer's accumulated value. A leading fire carries its
        ping's own payload, under every policy.
      run_id (str): the window's run id. The leading and trailing fires of a
        both-edges window share it and differ by :attr:`edge`.
      ping_count (int): pings the window had absorbed when it fired, the leading ping
        included.
      first_ping_at (float): the time of the window's first ping, on Trio's clock.
      fired_at (float): the *logical* fire time on Trio's clock: the deadline of a
        trailing fire, the ping time of a leading fire, or the time of the
        :meth:`~Coordinator.flush` call. It is never a fresh clock reading taken when
        the handler starts, so it is exact even when a :class:`trio.testing.MockClock`
        autojump lands a few ulps past the deadline.
      edge (Edge): :attr:`Edge.LEADING` or :attr:`Edge.TRAILING`.
      attempt (int): 1, or more when a fire interrupted by its process's death runs
        again in another process (at-least-once delivery, see :doc:`/protocol`).
      fencing_token (int): strictly increases per ``(workflow, key)`` across windows,
        owners and re-creations of the shared store: a side-effect store that keeps
        the highest token it has seen per key can refuse a stale owner's late write.
        With a backend it is ``(bucket creation time in ms) << 40 | revision`` of the
        step that committed the fire (a re-run carries its adoption's, higher than the
        attempt it repeats; an unconfirmed fire carries 0); without one it is a counter
        of this coordinator's fires, meaningful only in this process.
      reason (FireReason): why it fired: ``leading`` for a leading edge, the rule that
        made a trailing edge due (``delay``, ``max-delay``, ``max-count``, and for the
        flow-control modes ``interval``, ``max-items``, ``max-bytes``, ``max-wait``),
        ``flush``, ``exit``, ``overflow``, ``run-end``, ``adoption``, or ``re-run``
        for a later attempt (at least once); see :class:`FireReason`. The same as
        :attr:`FireStarted.reason`.
    """

    workflow: str
    key: str
    payload: Any
    run_id: str
    ping_count: int
    first_ping_at: float
    fired_at: float
    edge: Edge
    attempt: int = 1
    fencing_token: int = 0
    reason: FireReason = FireReason.DELAY


#: The type of a fire handler: ``async def handler(fire: Fire) -> None``, or any callable
#: taking a :class:`Fire` and returning an awaitable (its result is ignored).
Handler = Callable[[Fire], Awaitable[object]]

#: The type of an ``on_error`` callback: ``def on_error(fire: Fire, exc: Exception) -> object``
#: (the return value is ignored).
ErrorCallback = Callable[[Fire, Exception], object]


@dataclass(frozen=True, slots=True)
class RunStatistics:
    """Deferred-run figures of one coordinator, in :class:`CoordinatorStatistics`.

    Counters count from the coordinator's opening.

    Attributes:
      held (int): runs this coordinator holds armed (due within the horizon) or in
        memory (non-persisted), not yet started.
      running (int): run handlers running now.
      scheduled (int): :meth:`Coordinator.schedule` calls that scheduled or
        re-scheduled a run.
      completed (int): runs whose handler returned.
      failed (int): runs whose handler raised on its last allowed attempt.
      retried (int): handler retries after a failure.
      expired (int): runs dropped because they came due after ``expires_at``.
      misfired (int): runs dropped because they came due later than
        ``misfire_grace``.
      stale (int): armed runs not started because their record had changed
        (re-scheduled, cancelled or claimed elsewhere).
      taken_over (int): runs claimed from a dead, fenced or released process.
      dropped_at_exit (int): non-persisted pending runs dropped when the coordinator
        exited.
      heartbeats (int): lease writes that succeeded.
      store_errors (int): run-store calls that failed (heartbeats included).
    """

    held: int = 0
    running: int = 0
    scheduled: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    expired: int = 0
    misfired: int = 0
    stale: int = 0
    taken_over: int = 0
    dropped_at_exit: int = 0
    heartbeats: int = 0
    store_errors: int = 0


@dataclass(frozen=True, slots=True)
class CoordinatorStatistics:
    """A snapshot of a coordinator's state, from :meth:`Coordinator.statistics`.

    Counters (``pings`` to ``handler_errors``) count from the coordinator's opening.

    Attributes:
      open_windows (int): windows in the coordinator's table, as :func:`len` counts
        them (may include a window due at this very instant whose task has not run).
      pending_trailing_fires (int): trailing fires that will happen unless cancelled:
        open trailing windows, both-edges windows with two or more pings, and windows
        that are due or flushed whose handler has not started yet.
      running_handlers (int): handler calls that have started and not yet returned.
      pings (int): pings taken (``debounce`` / ``debounce_nowait`` calls that returned).
      coalesced (int): pings absorbed by an open window (outcome ``coalesce``).
      fires (int): fires started, leading and trailing (a fire that finds no handler
        counts here and in ``handler_errors``).
      cancelled (int): windows closed by :meth:`Coordinator.cancel`, plus pending
        trailing fires dropped when the coordinator exited without firing them (an
        exit by an error or a cancellation counts those it handed off to peers too;
        ``on_exit="cancel"`` counts the shared windows it deleted).
      handler_errors (int): handler calls that raised an :class:`Exception`, plus fires
        that found no handler.
      backend_errors (int): backend calls that failed (register, finalize, cancel,
        heartbeat, reconcile); 0 without a backend.
      fail_open_windows (int): pings that got a local window because the backend
        failed (``on_backend_error="fail-open"``).
      unconfirmed_fires (int): trailing fires the owner ran although finalize could
        not reach the backend (its delete is queued).
      unstored_pings (int): pings absorbed by another process's live window without
        being written, because every write lost a conflict until the backend's
        operation deadline (``DebounceResult.stored`` is False).
      takeovers (int): shared windows this coordinator took over from a dead owner
        (by a ping, or by adopting them without one).
      refires (int): interrupted fires of dead processes this coordinator ran again
        (at-least-once delivery).
      dropped_fires (int): fires not run because they could not be proven
        (at-most-once delivery, backend unreachable at fire time).
      runs (RunStatistics): the deferred-run figures.
      stale_pings (int): pings dropped by ``drop_stale=True`` (outcome ``stale``); not
        counted in ``pings``.
      deleted_externally (int): shared windows this process owned that another writer
        deleted (a peer's :meth:`Coordinator.cancel`, an operator's delete of the key)
        before they fired; each is also counted in ``cancelled`` if a trailing fire was
        pending, and logged once as a warning. See :doc:`/protocol`, "Deleted from
        outside".
      hook_errors (int): calls of the ``on_event`` hook that raised an
        :class:`Exception` (the first one is also logged); see :doc:`/observability`.
      dropped_pings (int): pings a flow-control window dropped (outcome ``dropped``:
        a throttle without a trailing edge, a rate limit past its limit); not counted
        in ``pings``. (``dropped_fires`` counts something else.)
    """

    open_windows: int
    pending_trailing_fires: int
    running_handlers: int
    pings: int
    coalesced: int
    fires: int
    cancelled: int
    handler_errors: int
    backend_errors: int = 0
    fail_open_windows: int = 0
    unconfirmed_fires: int = 0
    unstored_pings: int = 0
    takeovers: int = 0
    refires: int = 0
    dropped_fires: int = 0
    runs: RunStatistics = RunStatistics()
    stale_pings: int = 0
    deleted_externally: int = 0
    hook_errors: int = 0
    dropped_pings: int = 0


# ------------------------------------------------------------------ window options

#: The values of ``debounce(overflow=...)``.
Overflow = Literal["fire-early", "drop-oldest"]
#: The values of ``debounce(overlap=...)``.
Overlap = Literal["allow", "queue-latest"]

#: A reducer: ``fn(accumulated, new) -> accumulated``.
Reducer = Callable[[Any, Any], Any]
#: A reducer's factory of fresh initial values, called once per window.
InitialFactory = Callable[[], Any]


class DebounceOptions(TypedDict, total=False):
    """The window options :meth:`Coordinator.debounce` and
    :meth:`~Coordinator.debounce_nowait` take as keywords (``**options``); every key is
    optional. See :meth:`Coordinator.debounce_nowait` for each one.

    Keys: ``max_count`` (int | None), ``payload_policy`` (str), ``max_items`` (int |
    None), ``overflow`` (``"fire-early"`` | ``"drop-oldest"`` | None), ``overlap``
    (``"allow"`` | ``"queue-latest"``), ``run_timeout`` (float | None, seconds),
    ``order_key`` (float | None), ``drop_stale`` (bool).
    """

    max_count: int | None
    payload_policy: str
    max_items: int | None
    overflow: Overflow | None
    overlap: Overlap
    run_timeout: float | None
    order_key: float | None
    drop_stale: bool
