"""The coordinator's event hook: ``open_coordinator(on_event=hook)`` calls
``hook(event)`` with one of the typed events below as things happen, in the style of
httpcore's ``trace`` extension (one callable, every event, synchronously).

The hook runs inline, in the task where the event happens (a ping's caller, a
handler's task, the heartbeat): a slow hook slows pings. It never breaks the
coordinator: :meth:`Ledger.emit` logs the first exception a hook raises on the
``trio_debounce`` logger, and counts every one in
:attr:`~trio_debounce.CoordinatorStatistics.hook_errors`. Unset, the only cost is one
attribute test on paths that already branch (``docs/benchmarks``).

Times are on Trio's clock (:func:`trio.current_time`), as ``Fire.fired_at`` is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from ._types import DebounceResult, Fire


@dataclass(frozen=True, slots=True)
class PingAnswered:
    """A ping was taken: it opened a window, was absorbed by one, or was dropped as
    stale (``result.outcome`` says which; with a backend, ``result.owner`` and
    ``result.stored`` say whose window and whether it was written).

    Attributes:
      workflow (str): the ping's workflow.
      key (str): the ping's debounce key.
      result (DebounceResult): what the ping's call returned.
      at (float): when the ping was made (Trio's clock, seconds).
    """

    workflow: str
    key: str
    result: DebounceResult
    at: float


@dataclass(frozen=True, slots=True)
class PingRejected:
    """A ping raised instead of being taken: bad input (:exc:`ValueError`,
    :exc:`TypeError`, :exc:`LookupError`), a closed coordinator, or a backend that
    failed with ``on_backend_error="raise"``. Nothing changed.

    Attributes:
      workflow (Any): the ping's workflow, as passed (it may be the bad argument).
      key (Any): the ping's debounce key, as passed.
      error (Exception): what the call raised.
      at (float): when the ping was made (Trio's clock, seconds).
    """

    workflow: Any
    key: Any
    error: Exception
    at: float


@dataclass(frozen=True, slots=True)
class PingFailedOpen:
    """The backend failed to register a ping and the coordinator opened (or used) a
    local window instead (``on_backend_error="fail-open"``, see
    :func:`~trio_debounce.open_coordinator`). A :class:`PingAnswered` follows.

    Attributes:
      workflow (str): the ping's workflow.
      key (str): the ping's debounce key.
      error (Exception): the backend's error.
      at (float): when the coordinator failed open (Trio's clock, seconds).
    """

    workflow: str
    key: str
    error: Exception
    at: float


@dataclass(frozen=True, slots=True)
class FireStarted:
    """A fire's handler is about to run (in its own task).

    Attributes:
      fire (Fire): what the handler gets.
      at (float): when it starts (Trio's clock, seconds).
      lateness (float): ``at - fire.fired_at``, seconds past the fire's logical time
        (its deadline, ping or flush time). About 0 for a fire on time; for a re-run
        (``fire.attempt`` above 1), the time since the interrupted attempt was due.
    """

    fire: Fire
    at: float
    lateness: float


@dataclass(frozen=True, slots=True)
class FireFinished:
    """A fire's handler has ended.

    Attributes:
      fire (Fire): the fire.
      at (float): when it ended (Trio's clock, seconds).
      duration (float): seconds since its :class:`FireStarted`.
      outcome (str): ``"returned"``; ``"raised"`` (an :exc:`Exception`, logged and
        counted in ``handler_errors``; also a fire that found no handler); or
        ``"cancelled"`` (a :exc:`BaseException` such as :exc:`trio.Cancelled` left
        the handler: the fire is not finished, and the error propagates).
      error (BaseException | None): what the handler raised, None if it returned.
    """

    fire: Fire
    at: float
    duration: float
    outcome: Literal["returned", "raised", "cancelled"]
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class WindowTakenOver:
    """This coordinator took over a shared window whose owner's lease had lapsed:
    by a ping into it, or by adopting it at a heartbeat (counted in
    :attr:`~trio_debounce.CoordinatorStatistics.takeovers`).

    Attributes:
      workflow (str): the window's workflow.
      key (str): the window's debounce key.
      by (str): ``"ping"`` or ``"adoption"``.
      at (float): when (Trio's clock, seconds).
    """

    workflow: str
    key: str
    by: Literal["ping", "adoption"]
    at: float


#: Every event :func:`~trio_debounce.open_coordinator`'s ``on_event`` hook receives.
CoordinatorEvent: TypeAlias = (
    PingAnswered | PingRejected | PingFailedOpen | FireStarted | FireFinished | WindowTakenOver
)

#: The type of an ``on_event`` hook: ``def hook(event: CoordinatorEvent) -> object``
#: (a sync callable; its return value is ignored).
EventHook = Callable[[CoordinatorEvent], object]
