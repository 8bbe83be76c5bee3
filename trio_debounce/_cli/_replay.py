"""Replay an event log through the real coordinator on a virtual clock.

The replay runs :func:`open_coordinator` on a virtual clock (:class:`ReplayClock`, an
exact variant of ``trio.testing.MockClock(autojump_threshold=0)``): whenever every task
is blocked, Trio's clock jumps to the next deadline, so years of history replay in
seconds and the result does not depend on the machine. Events come from a plain
iterator, never from awaited I/O: the autojump would jump virtual time past the next
event while an awaited read waits.

The driver does not sleep until each event's time (a trip through Trio's scheduler and
a cancel scope per event). It sets the clock to the event's time
(:meth:`ReplayClock.advance_to`) and pings, and lets the coordinator's tasks run at a
checkpoint once every ``_BATCH`` events; at the end of the input the block's exit
autojumps through what is left. The window tasks then run behind the clock, which
changes no fire: the coordinator's rules are stated by time, not by when its tasks run
(a ping at or after a window's deadline opens a new window even if the old window's
task has not run, and a fire carries its deadline as ``fired_at``). A task that starts
late also finds its window's deadline moved by more of its pings, so it wakes fewer
times: on a log of 1,000,000 events over 100,000 keys this replays about 40,000 events
a second on a slow 2-core machine, against 7,000 when sleeping until each event.

The flow-control modes (throttle, audit, batch, rate limit: :class:`FlowOptions`) go
the same way: their windows settle every end reached by a ping's time before the ping
(a ping at exactly a window's end belongs to what comes next), so they too replay with
the tasks behind the clock.

Only a handler's own timing is not stated by time: the end of a run is the handler's
return, an event. With ``run_time`` or ``overlap="queue-latest"`` the replay therefore
decides by time itself. Each run ends at its fire time + ``run_time`` (the handler
sleeps until then), and before each event the driver *settles* at the event's time
(:meth:`ReplayClock.settle`): it runs every task due by then, in time order, and pings
only once every other task is blocked at that instant. A run ending at the event's time
has then returned and the window that waited for it has fired; the event opens the
next window. Without the settle, the driver's wake-up and the handler's would be two
tasks woken at the same instant, which Trio runs in a random order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
import trio.testing

from .. import _options, _validate
from .._coordinator import open_coordinator
from .._flow import Flow, span_name
from .._types import DebounceResult, Fire, Mode
from ._events import Event, EventError, parse_event

if TYPE_CHECKING:
    from .._coordinator import Coordinator

_WORKFLOW = "replay"
#: Without exact timing, the replay lets the coordinator's tasks run (a checkpoint)
#: once every this many events.
_BATCH = 8192


#: A flow-control ping: ``(workflow, key, payload, run_id)`` (see :meth:`FlowOptions.pinger`).
FlowPing = Callable[[str, str, Any, str | None], DebounceResult]


@dataclass(frozen=True, slots=True)
class FlowOptions:
    """A flow-control mode of ``replay`` and ``run`` and its parameters, checked by
    the command line (and again by the coordinator).

    Attributes:
      mode (str): ``"throttle"``, ``"audit"`` (a throttle with no leading edge),
        ``"batch"`` or ``"rate-limit"``.
      span (float): a window's length (> 0; the input's time unit, or seconds): the
        ``interval`` of a throttle or an audit, a batch's ``max_wait``, a rate
        limit's ``period``.
      leading, trailing (bool): a throttle's edges.
      max_items, max_bytes (int | None): a batch's bounds (None: the coordinator's
        default, 1000 items; no byte bound).
      limit (int): the fires a rate-limit window allows.
    """

    mode: str
    span: float
    leading: bool = True
    trailing: bool = True
    max_items: int | None = None
    max_bytes: int | None = None
    limit: int = 1

    @property
    def span_option(self) -> str:
        """The option that gave :attr:`span`."""
        return "--" + span_name(Flow(self.mode)).replace("_", "-")

    def arguments(self) -> tuple[str, dict[str, Any]]:
        """The coordinator method of this mode (``"throttle"``, ``"batch"`` or
        ``"rate_limit"``) and its keyword arguments, with these parameters."""
        if self.mode == "batch":
            return "batch", {
                "max_wait": self.span,
                "max_items": self.max_items,
                "max_bytes": self.max_bytes,
            }
        if self.mode == "rate-limit":
            return "rate_limit", {"limit": self.limit, "period": self.span}
        leading = self.leading and self.mode == "throttle"
        return "throttle", {"interval": self.span, "leading": leading, "trailing": self.trailing}

    def pinger(self, coordinator: Coordinator) -> FlowPing:
        """The coordinator's ``_nowait`` method of this mode, with these parameters."""
        name, kwargs = self.arguments()
        methods: dict[str, Callable[..., DebounceResult]] = {
            "batch": coordinator.batch_nowait,
            "rate_limit": coordinator.rate_limit_nowait,
            "throttle": coordinator.throttle_nowait,
        }
        nowait = methods[name]

        def ping(workflow: str, key: str, payload: Any, run_id: str | None) -> DebounceResult:
            return nowait(workflow, key, payload, run_id=run_id, **kwargs)

        return ping

    def call(
        self, coordinator: Coordinator, workflow: str, key: str, payload: Any
    ) -> Awaitable[DebounceResult]:
        """The coordinator's async method of this mode, called for one event (with a
        backend, where a ping is a round trip and :meth:`pinger`'s ``_nowait`` methods
        raise)."""
        name, kwargs = self.arguments()
        methods: dict[str, Callable[..., Awaitable[DebounceResult]]] = {
            "batch": coordinator.batch,
            "rate_limit": coordinator.rate_limit,
            "throttle": coordinator.throttle,
        }
        return methods[name](workflow, key, payload, **kwargs)


def refused_event(exc: ValueError) -> str:
    """Why a flow-control ping refused an event (a batch item larger than
    ``max_bytes``), in the command line's words."""
    reason = str(exc).replace("the item is", "the event is")
    return reason.replace("max_bytes=", "--max-bytes ")


@dataclass(frozen=True, slots=True)
class ReplayFire:
    """One fire of a replay, with times in the input's own epoch and unit."""

    key: str
    fired_at: float
    first_ping_at: float
    payload: Any
    pings: int
    edge: str
    #: For a stable output order: the index of the event that opened the window (the
    #: debounce modes), or the fire's rank among the replay's fires, in the order the
    #: coordinator decided them (the flow-control modes, whose fires of one key at one
    #: instant, such as a rate limit's, share a window).
    order: int
    #: Why it fired (a :class:`~trio_debounce.FireReason` value).
    reason: str = "delay"

    @property
    def latency(self) -> float:
        return self.fired_at - self.first_ping_at

    def to_json(self) -> dict[str, Any]:
        return fire_line(
            self.key,
            self.fired_at,
            self.first_ping_at,
            self.payload,
            self.pings,
            self.edge,
            self.reason,
        )


def fire_line(
    key: str,
    fired_at: float,
    first_ping_at: float,
    payload: Any,
    pings: int,
    edge: str,
    reason: str,
) -> dict[str, Any]:
    """The JSON object the CLI prints for one fire (``replay`` and ``run`` alike)."""
    return {
        "key": key,
        "fired_at": json_number(fired_at),
        "first_ping_at": json_number(first_ping_at),
        "payload": payload,
        "pings": pings,
        "edge": edge,
        "reason": reason,
    }


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay produced: the number of events, the fires in output order, and
    the events dropped (a throttle with no trailing edge, a rate limit past its
    limit: ``statistics().dropped_pings``)."""

    events: int
    fires: list[ReplayFire]
    dropped_pings: int = 0

    def summary(self) -> dict[str, Any]:
        """The ``--format summary`` object (latencies by nearest rank)."""
        latencies = sorted(f.latency for f in self.fires)
        return {
            "events": self.events,
            "fires": len(self.fires),
            "coalescing_ratio": (1 - len(self.fires) / self.events) if self.events else None,
            "latency_p50": json_number(nearest_rank(latencies, 50)),
            "latency_p95": json_number(nearest_rank(latencies, 95)),
            "latency_max": json_number(latencies[-1]) if latencies else None,
            "dropped_pings": self.dropped_pings,
        }


def nearest_rank(sorted_values: list[float], percent: float) -> float | None:
    """The nearest-rank percentile of ascending ``sorted_values``; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(percent / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def json_number(value: float | None) -> float | int | None:
    """Integral floats as ints (so epoch seconds print as they came in), else as is."""
    if value is not None and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def read_events(
    lines: Iterable[str], *, key_field: str, time_field: str, sort: bool
) -> Iterator[Event]:
    """Parse JSON lines into events in time order.

    Without ``sort`` a decreasing timestamp raises :class:`EventError`; with it, all
    events are read first and sorted stably by time (equal times keep input order).
    """
    parsed = (
        parse_event(line, n, key_field=key_field, time_field=time_field)
        for n, line in enumerate(lines, start=1)
    )
    if sort:
        yield from sorted(parsed, key=lambda e: e.ts)
        return
    previous = -math.inf
    for event in parsed:
        if event.ts < previous:
            raise EventError(
                event.line_number,
                f"time {json_number(event.ts)!r} is before the previous event's "
                f"{json_number(previous)!r} "
                "(pass --sort to sort the input)",
            )
        previous = event.ts
        yield event


class ReplayClock(trio.abc.Clock):
    """Virtual time for replays: it jumps *exactly* to the next deadline when idle.

    It behaves like ``trio.testing.MockClock(autojump_threshold=0)``: whenever no task
    can run, time jumps to the next deadline, so a replay never waits. MockClock jumps
    by adding ``deadline - now``, which in floating point can land a few ulps past the
    deadline; a replayed ping would then happen later than its event's time, and the
    time rule (a ping at a window's deadline opens a new window) could flip. This clock
    sets its time to the deadline itself, so every ping happens at its event's exact
    time, in the input's own epoch (negative times included). While :meth:`settle`
    waits, it jumps no further than the settle's time.
    """

    def __init__(self, start: float) -> None:
        self._now = start
        #: While :meth:`settle` waits: the time the clock must not pass.
        self._limit: float | None = None

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return self._now

    def advance_to(self, when: float) -> None:
        """Set the time to ``when`` if that is later, without waiting for the tasks.

        The replay's driver calls it between checkpoints: a window task whose deadline
        this passes runs at the next checkpoint, later on this clock than its deadline.
        The coordinator's rules are stated by time (a ping at or after a window's
        deadline opens a new window, even if the old window's task has not run yet,
        and a fire carries its deadline as ``fired_at``), so this changes no fire.
        """
        if when > self._now:
            self._now = when

    async def settle(self, when: float) -> None:
        """Run every task due by ``when``, in time order; return at ``when`` (if that is
        later than now) once every other task is blocked.

        Trio runs the tasks woken at one instant in a random order. Waiting until no
        task can run (``wait_all_tasks_blocked``) lets each of them, and everything they
        start or wake at that instant, finish first. Meanwhile the clock jumps only to
        deadlines at or before ``when``: past them it stops at ``when`` and reports an
        unbounded sleep, so Trio wakes the waiter instead of a later deadline.
        """
        self._limit = max(when, self._now)
        try:
            await trio.testing.wait_all_tasks_blocked()
        finally:
            self._limit = None

    def deadline_to_sleep_time(self, deadline: float) -> float:
        # Trio asks only when no task is runnable: jump, and sleep not at all.
        limit = self._limit
        if limit is not None and deadline > limit:
            # settle(): nothing is due by the limit. Stop there and let Trio see an
            # idle loop (an unbounded sleep, which wait_all_tasks_blocked cuts to 0).
            self._now = limit
            return math.inf
        if deadline == math.inf:
            return math.inf
        if deadline > self._now:
            self._now = deadline
        return 0.0


def _check_resolution(event: Event, duration: float, what: str) -> None:
    """Refuse a time where adding ``duration`` overflows or is lost to float rounding."""
    end = event.ts + duration
    if not math.isfinite(end) or (duration > 0 and end == event.ts):
        raise EventError(
            event.line_number,
            f"time {json_number(event.ts)!r} plus the {what} {duration!r} cannot be "
            "represented as a float: the values are too large for each other",
        )


def event_order(event: Event, order_field: str) -> float:
    """The order key of ``event``: its ``order_field``, a finite JSON number."""
    obj = event.payload
    if not isinstance(obj, dict) or order_field not in obj:
        raise EventError(event.line_number, f"missing order field {order_field!r}")
    value = obj[order_field]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EventError(
            event.line_number,
            f"order field {order_field!r} must be a JSON number, got {value!r}",
        )
    return value


def replay(
    events: Iterable[Event],
    *,
    delay: float | None = None,
    max_delay: float | None = None,
    mode: Mode | str = Mode.TRAILING,
    max_count: int | None = None,
    payload_policy: str = "last",
    overlap: str = "allow",
    run_time: float = 0.0,
    order_field: str | None = None,
    flow: FlowOptions | None = None,
) -> ReplayResult:
    """Drive ``events`` (in time order) through a coordinator on a virtual clock.

    Durations are in the events' time unit. Events with equal times are pinged in the
    order given.

    Args:
      delay (float | None): the debounce delay; required unless ``flow`` is given.
      max_count, payload_policy, overlap: the window options of
        :meth:`Coordinator.debounce`, for every window.
      run_time (float): how long each fire's handler runs (events' unit, >= 0): with
        ``overlap="queue-latest"``, a window due during a run waits for its end.
      order_field (str | None): each event's order key is this field of its object
        (a JSON number); "latest" is then the event with the highest order key.
      flow (FlowOptions | None): replay a flow-control mode instead of debouncing
        (the debounce arguments are then ignored); each event is its ping's payload,
        or its batch item.

    Returns:
      ReplayResult: the event count, the dropped pings and every fire, sorted by
      (fired_at, key, order in which the windows opened, leading before trailing), or
      for ``flow``, by (fired_at, key, order in which the coordinator decided them).

    Raises:
      EventError: from the ``events`` iterable (parsing is lazy), an event without
        a numeric ``order_field``, or an event the coordinator refuses (a batch item
        larger than ``max_bytes``).
      ValueError, TypeError: bad ``delay``, ``max_delay``, ``mode``, ``run_time`` or
        window options.
    """
    fires: list[Fire] = []
    count = 0
    dropped = 0
    stream = iter(events)
    first = next(stream, None)
    clock = ReplayClock(0.0 if first is None else first.ts)
    run_seconds = _validate.duration("run_time", run_time)
    if flow is None and delay is None:
        raise ValueError("replay needs a delay, or flow options")
    mode = _validate.mode(mode)
    options: dict[str, Any] = {}
    if max_count is not None:
        options["max_count"] = max_count
    if payload_policy != _options.LAST:
        options["payload_policy"] = payload_policy
    if overlap != _options.ALLOW:
        options["overlap"] = overlap

    async def record(fire: Fire) -> None:
        fires.append(fire)
        if run_seconds:
            # A run ends at its fire time + run_time, by time.
            await trio.sleep_until(fire.fired_at + run_seconds)

    # When a handler's timing matters (a run that lasts, or "queue-latest", whose
    # waiting windows fire when a run ends), the driver settles at each event's time
    # before it pings: every run ending by then has returned, and the window that
    # waited for it has fired (see the module docstring). Otherwise nothing depends on
    # when a task runs: the clock is set to each event's time directly and the tasks
    # run every _BATCH events.
    exact = flow is None and (run_seconds > 0 or overlap != _options.ALLOW)

    async def main() -> None:
        nonlocal count, dropped
        async with open_coordinator(handlers={_WORKFLOW: record}) as coordinator:
            everything = itertools.chain(() if first is None else (first,), stream)
            if flow is not None:
                count = await _replay_flow(coordinator, flow, clock, everything)
            else:
                assert delay is not None
                ping = coordinator.debounce_nowait
                for event in everything:
                    _check_resolution(event, delay, "delay")
                    if max_delay is not None:
                        _check_resolution(event, max_delay, "max delay")
                    if exact:
                        await clock.settle(event.ts)
                    else:
                        clock.advance_to(event.ts)
                        if count % _BATCH == 0:
                            await trio.lowlevel.checkpoint()
                    if order_field is not None:
                        options["order_key"] = event_order(event, order_field)
                    ping(
                        _WORKFLOW,
                        event.key,
                        event.payload,
                        delay=delay,
                        max_delay=max_delay,
                        mode=mode,
                        run_id=str(count),
                        **options,
                    )
                    count += 1
        dropped = coordinator.statistics().dropped_pings

    trio.run(main, clock=clock)
    out = [
        ReplayFire(
            key=f.key,
            fired_at=f.fired_at,
            first_ping_at=f.first_ping_at,
            payload=f.payload,
            pings=f.ping_count,
            edge=f.edge.value,
            # A flow window's fires share a run id (a rate limit's have their own);
            # the coordinator numbers its fires in the order it decides them.
            order=int(f.run_id) if flow is None else f.fencing_token,
            reason=f.reason.value,
        )
        for f in fires
    ]
    out.sort(key=lambda f: (f.fired_at, f.key, f.order, f.edge != "leading"))
    return ReplayResult(count, out, dropped)


async def _replay_flow(
    coordinator: Coordinator, flow: FlowOptions, clock: ReplayClock, events: Iterable[Event]
) -> int:
    """Ping every event through ``flow``'s method; return the number of events. The
    clock is set to each event's time and the window tasks run every ``_BATCH``
    events: a flow ping first settles every end its window has reached (the tie
    rule), whether or not its task ran."""
    ping = flow.pinger(coordinator)
    span, what = flow.span, flow.span_option
    count = 0
    for event in events:
        _check_resolution(event, span, what)
        clock.advance_to(event.ts)
        if count % _BATCH == 0:
            await trio.lowlevel.checkpoint()
        try:
            ping(_WORKFLOW, event.key, event.payload, str(count))
        except ValueError as exc:  # an event larger than --max-bytes: bad input
            raise EventError(event.line_number, refused_event(exc)) from None
        count += 1
    return count
