"""The window engine's flow-control half: the rules of throttle, audit, batch and rate
limit windows, as pure functions (see :doc:`/semantics`, "Throttle, batch and rate
limit").

Like :mod:`trio_debounce._engine`, it knows nothing of Trio, of I/O or of a clock:
times are plain floats on the caller's clock, and every function reads or changes only
the :class:`FlowState` it is given. The same tie rule holds: a window whose end has
been reached is over (:func:`is_over`), so a ping at that instant belongs to the next
window (a throttle's cool-down, or a new window).

A flow window is one key's window of one of four kinds (:class:`Flow`), its parameters
(:class:`FlowSpec`) fixed by its first ping. What happens to it is decided here:

* :func:`open_flow`: a ping opens a window; a leading edge fires at once;
* :func:`absorb_flow`: a ping in the open window is absorbed, appended, dropped, or
  fires (rate limit), or completes or overflows a batch;
* :func:`end_flow`: the window's end is reached: a trailing fire or nothing, and what
  comes next (a throttle's cool-down, or no window);
* :func:`flush_flow`: a flush fires what is pending now.

``tests/harness/flow_model.py`` is an independent reference model of the same rules.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from ._types import FireReason, Mode

#: The default ``max_items`` of a batch: a batch is always bounded.
DEFAULT_BATCH_ITEMS: Final = 1000


class Flow(str, enum.Enum):
    """The kind of a flow window (the coordinator method that opened it)."""

    THROTTLE = "throttle"
    AUDIT = "audit"
    BATCH = "batch"
    RATE_LIMIT = "rate-limit"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class FlowSpec:
    """A flow window's parameters, fixed by its first ping (validated by the caller).

    Attributes:
      flow (Flow): the kind.
      span (float): seconds from a window's opening to its end: the throttle or audit
        ``interval``, the batch's ``max_wait``, the rate limit's ``period``.
      leading (bool): a throttle fires the window's first ping at once.
      trailing (bool): a throttle fires the latest ping absorbed since its last fire
        at the window's end (and opens a cool-down).
      max_items (int): a batch fires with its N-th item (1 and more).
      max_bytes (int | None): a batch fires before an item that would take its size
        past this many bytes (None: no byte bound).
      limit (int): the fires a rate-limit window allows.
      queue (bool): ``overlap="queue-latest"`` (an audit or a batch): a window that
        comes due while its key's run (a fire of such a window) executes waits for
        that run to end, absorbing pings, and fires then.
      run_timeout (float | None): seconds after its fire at which a ``queue`` run
        stops blocking its key (None: when its handler returns).
    """

    flow: Flow
    span: float
    leading: bool = True
    trailing: bool = True
    max_items: int = DEFAULT_BATCH_ITEMS
    max_bytes: int | None = None
    limit: int = 1
    queue: bool = False
    run_timeout: float | None = None


def span_name(flow: Flow) -> str:
    """The parameter that gives a window of ``flow`` its span: a throttle's or an
    audit's ``interval``, a batch's ``max_wait``, a rate limit's ``period``."""
    if flow is Flow.BATCH:
        return "max_wait"
    if flow is Flow.RATE_LIMIT:
        return "period"
    return "interval"


def describe(spec: FlowSpec | None) -> str:
    """A window's parameters, for a clash's message (None: a debounce window)."""
    if spec is None:
        return "debounce()"
    flow = spec.flow
    overlap = ""
    if spec.queue:
        overlap = f", overlap='queue-latest', run_timeout={spec.run_timeout!r}"
    if flow is Flow.BATCH:
        return (
            f"batch(max_items={spec.max_items}, max_wait={spec.span!r}, "
            f"max_bytes={spec.max_bytes!r}{overlap})"
        )
    if flow is Flow.RATE_LIMIT:
        return f"rate_limit(limit={spec.limit}, period={spec.span!r})"
    return (
        f"throttle(interval={spec.span!r}, leading={spec.leading}, "
        f"trailing={spec.trailing}{overlap})"
    )


def stored_as(spec: FlowSpec) -> Mode:
    """The debounce mode a flow window is shared as, with ``delay`` and ``max_delay``
    both ``spec.span`` (so it ends at its opening plus ``span``, whatever its pings do):
    a both-edges throttle as ``both``, a leading-only throttle and a rate limit as
    ``leading`` (their later pings fire or drop, never extend), an audit and a batch as
    ``trailing``. A throttle's cool-down is a ``trailing`` window (see
    :doc:`/protocol`, "Flow-control windows")."""
    if spec.flow is Flow.THROTTLE:
        return Mode.BOTH if spec.trailing else Mode.LEADING
    if spec.flow is Flow.RATE_LIMIT:
        return Mode.LEADING
    return Mode.TRAILING


class FlowState:
    """The state of one flow window; times on the caller's clock.

    Attributes:
      end (float): the window's opening (for a cool-down: the trailing fire that
        opened it) plus ``span``: when the window is over.
      count (int): pings absorbed since the window's last fire (a batch: its items).
      payload (Any): the latest absorbed payload (a batch: the list of its items).
      size (int): a batch's bytes so far.
      fired (int): the fires a rate-limit window has made.
      first_ping_at (float): the time of the first ping counted in ``count``.
      waiting (bool): a ``queue-latest`` window came due while its key's run blocked
        it: it absorbs pings and fires when the run stops blocking (``end`` is then
        the run's ``run_timeout``, or inf); see :func:`wait_for_run`.
    """

    __slots__ = ("count", "end", "fired", "first_ping_at", "payload", "size", "waiting")

    def __init__(self, opened_at: float, end: float) -> None:
        self.end = end
        self.count = 0
        self.payload: Any = None
        self.size = 0
        self.fired = 0
        self.first_ping_at = opened_at
        self.waiting = False

    @property
    def pending(self) -> bool:
        """Is a fire pending (a ping absorbed since the window's last fire)? Rate-limit
        windows never have one."""
        return self.count > 0


class FlowFire(NamedTuple):
    """A fire the rules decided: what the handler gets, besides the window's ids.

    Attributes:
      payload (Any): the ping's payload (a leading fire), the latest absorbed one, or
        a batch's list of items.
      ping_count (int): the pings this fire accounts for (each accepted ping is in one
        fire): 1 for a leading fire, the pings absorbed since the last fire for a
        trailing one, a batch's items.
      first_ping_at (float): the time of the first of those pings.
      fired_at (float): the fire's logical time.
      leading (bool): a leading edge (else trailing).
      reason (FireReason): why it fired.
    """

    payload: Any
    ping_count: int
    first_ping_at: float
    fired_at: float
    leading: bool
    reason: FireReason


class Absorbed(enum.Enum):
    """What :func:`absorb_flow` did with a ping."""

    #: Absorbed: a fire is (still) pending.
    ABSORBED = "absorbed"
    #: Dropped (throttle without a trailing edge, rate limit past its limit).
    DROPPED = "dropped"
    #: Fired at once: a rate-limit window's leading fire.
    FIRED = "fired"
    #: Completed the batch: it fired with this item, and the window is over.
    COMPLETED = "completed"
    #: The batch fired first (the item would have taken it past ``max_bytes``); the
    #: item opens the next batch (the caller calls :func:`open_flow`).
    OVERFLOWED = "overflowed"


def _latest(state: FlowState, t: float, payload: Any) -> None:
    if state.count == 0:
        state.first_ping_at = t
    state.count += 1
    state.payload = payload


def open_flow(
    spec: FlowSpec, t: float, payload: Any, size: int = 0, blocked_until: float | None = None
) -> tuple[FlowState, FlowFire | None]:
    """The window a ping at ``t`` opens, and its leading fire if it fires at once
    (a throttle with a leading edge, a rate limit, a batch of one item).

    A batch of ``max_items`` 1 fires at once and is over: the caller finds
    :func:`is_over`-style end at ``t`` (its ``end`` is ``t``); under
    ``overlap="queue-latest"``, while its key's run blocks until ``blocked_until``,
    it waits instead (:func:`wait_for_run`).
    """
    flow = spec.flow
    state = FlowState(t, t + spec.span)
    if flow is Flow.BATCH:
        state.first_ping_at = t
        state.count = 1
        state.payload = [payload]
        state.size = size
        if spec.max_items <= 1:
            if wait_for_run(state, t, blocked_until):
                return state, None
            fire = _take_batch(state, t, FireReason.MAX_ITEMS)
            state.end = t
            return state, fire
        return state, None
    if flow is Flow.RATE_LIMIT:
        state.fired = 1
        return state, FlowFire(payload, 1, t, t, True, FireReason.LEADING)
    if spec.leading:  # a throttle
        return state, FlowFire(payload, 1, t, t, True, FireReason.LEADING)
    _latest(state, t, payload)  # an audit window
    return state, None


def absorb_flow(
    spec: FlowSpec,
    state: FlowState,
    t: float,
    payload: Any,
    size: int = 0,
    blocked_until: float | None = None,
) -> tuple[Absorbed, FlowFire | None]:
    """A ping at ``t`` in the open window (``t < state.end``: the caller checked
    :func:`is_over`). Returns what it did, and the fire it made, if any.

    ``blocked_until``: under ``overlap="queue-latest"``, until when the key's run
    blocks its next fire (None: no run blocks). A batch that this item brings to
    ``max_items`` then waits for the run (:func:`wait_for_run`) instead of firing, and
    a waiting batch that already holds ``max_items`` items fires before the next one
    (reason ``max-items``), which opens the next batch: a batch stays bounded, even
    while it waits.
    """
    flow = spec.flow
    if flow is Flow.RATE_LIMIT:
        if state.fired >= spec.limit:
            return Absorbed.DROPPED, None
        state.fired += 1
        return Absorbed.FIRED, FlowFire(payload, 1, t, t, True, FireReason.LEADING)
    if flow is Flow.BATCH:
        full = state.count >= spec.max_items  # a batch that waits, full
        if full or (spec.max_bytes is not None and state.size + size > spec.max_bytes):
            reason = FireReason.MAX_ITEMS if full else FireReason.MAX_BYTES
            fire = _take_batch(state, t, reason)
            state.end = t
            return Absorbed.OVERFLOWED, fire
        state.count += 1
        state.payload.append(payload)
        state.size += size
        if state.count >= spec.max_items:
            if wait_for_run(state, t, blocked_until):
                return Absorbed.ABSORBED, None
            fire = _take_batch(state, t, FireReason.MAX_ITEMS)
            state.end = t
            return Absorbed.COMPLETED, fire
        return Absorbed.ABSORBED, None
    if flow is Flow.THROTTLE and not spec.trailing:
        return Absorbed.DROPPED, None
    _latest(state, t, payload)
    return Absorbed.ABSORBED, None


def wait_for_run(state: FlowState, at: float, blocked_until: float | None) -> bool:
    """An ``overlap="queue-latest"`` window is due at ``at``; its key's run blocks its
    next fire until ``blocked_until`` (None: no run blocks). If the run still blocks
    at ``at``, the window waits (True): it absorbs pings, and fires when the run ends
    or at ``blocked_until`` (its new ``end``), reason ``run-end``, as a debounce
    window does (:func:`trio_debounce._engine.wait_for_run`). Else it fires at ``at``
    (False)."""
    if blocked_until is not None and at < blocked_until:
        state.waiting = True
        state.end = blocked_until
        return True
    return False


def _take_batch(state: FlowState, t: float, reason: FireReason) -> FlowFire:
    fire = FlowFire(state.payload, state.count, state.first_ping_at, t, False, reason)
    state.payload, state.count, state.size, state.waiting = [], 0, 0, False
    return fire


def _take_trailing(state: FlowState, t: float, reason: FireReason) -> FlowFire:
    fire = FlowFire(state.payload, state.count, state.first_ping_at, t, False, reason)
    state.payload, state.count, state.waiting = None, 0, False
    return fire


def is_over(state: FlowState, t: float) -> bool:
    """Is the window over at ``t``? The tie rule: a reached end is over, so a ping at
    exactly ``state.end`` belongs to what comes next."""
    return t >= state.end


def end_flow(spec: FlowSpec, state: FlowState) -> tuple[FlowFire | None, bool]:
    """The window's end (``state.end``) is reached: its trailing fire, if one is
    pending, and whether a window goes on (True: ``state`` is now a throttle's
    cool-down ``[end, end + span)``, opened by that fire; False: the window is over).

    A window that waited for its key's run (:func:`wait_for_run`) fires with reason
    ``run-end``: the caller sets ``end`` to the run's end, or it is the run's
    ``run_timeout``. One that did not wait, but is due while a run blocks, is the
    caller's to make wait first.
    """
    at = state.end
    flow = spec.flow
    if flow is Flow.RATE_LIMIT or not state.pending:
        return None, False
    waited = state.waiting
    if flow is Flow.BATCH:
        return _take_batch(state, at, FireReason.RUN_END if waited else FireReason.MAX_WAIT), False
    fire = _take_trailing(state, at, FireReason.RUN_END if waited else FireReason.INTERVAL)
    if flow is Flow.AUDIT:
        return fire, False
    _cool_down(spec, state, at)
    return fire, True


def _cool_down(spec: FlowSpec, state: FlowState, at: float) -> None:
    state.end = at + spec.span
    state.first_ping_at = at


def flush_flow(spec: FlowSpec, state: FlowState, t: float) -> tuple[FlowFire | None, bool]:
    """A flush at ``t``: the pending fire now (reason ``flush``), if any, and whether
    the window goes on (a throttle's cool-down ``[t, t + span)``). Without a pending
    fire, nothing changes: ``(None, True)``."""
    if spec.flow is Flow.RATE_LIMIT or not state.pending:
        return None, True
    if spec.flow is Flow.BATCH:
        return _take_batch(state, t, FireReason.FLUSH), False
    fire = _take_trailing(state, t, FireReason.FLUSH)
    if spec.flow is Flow.AUDIT:
        return fire, False
    _cool_down(spec, state, t)
    return fire, True
