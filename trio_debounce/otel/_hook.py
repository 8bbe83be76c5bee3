"""The coordinator's events as OpenTelemetry metrics and spans (see
:doc:`/observability`, "OpenTelemetry")."""

from __future__ import annotations

import collections
from contextvars import Token
from typing import Final

import trio
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from .._events import (
    CoordinatorEvent,
    FireFinished,
    FireStarted,
    PingAnswered,
    PingFailedOpen,
    PingRejected,
    StoreCalled,
    WindowTakenOver,
)
from .._types import Outcome
from .._version import __version__

#: The windows whose first and last pings' span contexts are kept for their fire's
#: links, at most: the oldest are forgotten first (a window that never fires, such as
#: a cancelled one, is forgotten this way).
WINDOWS_KEPT = 10_000

_NAME = "trio_debounce"

# The histograms' bucket boundaries, given to the SDK as advice (a View of the user's
# overrides them). The SDK's default boundaries (0, 5, 10, 25, ... 10000) suit
# milliseconds, not seconds: every store request would fall in the first bucket.
#: Fire lateness and handler run time, seconds: from a scheduling delay (ms) up to a
#: failover (a lease, minutes).
SECONDS_BUCKETS: Final = (1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
#: Pings per fire: 1 (nothing coalesced) up to storms.
PINGS_BUCKETS: Final = (1, 2, 3, 5, 10, 20, 50, 100, 250, 1000, 10000)
#: Window age at fire, seconds: about ``delay`` to ``max_delay``, ms to an hour.
AGE_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
#: Store request time, seconds: a loopback round trip (0.1 ms) up to ``op_timeout``.
STORE_BUCKETS: Final = (5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class OpenTelemetryHook:
    """An ``on_event`` hook (see :func:`~trio_debounce.open_coordinator`) that records
    the coordinator's events as OpenTelemetry metrics, and each fire as a span.

    .. code-block:: python

       from trio_debounce.otel import OpenTelemetryHook

       async with open_coordinator(handlers=..., on_event=OpenTelemetryHook()) as coord:
           ...

    Metrics (instrument names; the unit is ``s`` for seconds; attribute keys in
    brackets). The debounce key is never a metric attribute (its cardinality is
    unbounded); the workflow name is.

    * ``trio_debounce.pings``, counter [``workflow``, ``outcome``]: pings by outcome
      (:class:`~trio_debounce.Outcome` values, or ``"rejected"`` for a ping that
      raised; a workflow that is not a ``str`` is recorded as ``"<invalid>"``).
    * ``trio_debounce.pings.failed_open``, counter [``workflow``]: pings the backend
      failed to register that went to a local window.
    * ``trio_debounce.fires``, counter [``workflow``, ``edge``, ``reason``]: handler
      starts, by edge and :data:`~trio_debounce.FireReason`.
    * ``trio_debounce.handler.failures``, counter [``workflow``]: handlers that
      raised.
    * ``trio_debounce.takeovers``, counter [``workflow``, ``by``]: shared windows of
      dead processes taken over.
    * ``trio_debounce.store.conflicts``, counter [``op``]: compare-and-swap conflicts.
    * ``trio_debounce.fire.lateness`` (s), histogram [``workflow``, ``edge``,
      ``reason``]: handler start minus the fire's logical time (``Fire.fired_at``).
    * ``trio_debounce.fire.pings``, histogram [``workflow``]: pings per fire
      (``Fire.ping_count``; the coalescing ratio is its mean).
    * ``trio_debounce.window.age`` (s), histogram [``workflow``]: handler start minus
      the window's first ping.
    * ``trio_debounce.handler.duration`` (s), histogram [``workflow``, ``outcome``]:
      handler run time (``returned``, ``raised`` or ``cancelled``).
    * ``trio_debounce.store.duration`` (s), histogram [``op``, ``outcome``]: store
      requests (with a backend).

    Spans: one ``trio_debounce fire`` span per handler run (kind ``INTERNAL``), current
    while the handler runs (so the handler's own spans are its children), with the
    attributes ``trio_debounce.workflow``, ``.key``, ``.run_id``, ``.edge``,
    ``.reason``, ``.attempt`` and ``.ping_count``; status ``ERROR`` with the exception
    recorded when the handler raised. It links to the spans that were current when the
    window's first and last pings were made *in this process* (one link when they are
    the same span; none for a ping made outside any span). Pings made in other
    processes are not linked: that would need trace context in the shared document,
    which it does not carry.

    Args:
      meter_provider: the :class:`opentelemetry.metrics.MeterProvider` to record to
        (the global one when None).
      tracer_provider: the :class:`opentelemetry.trace.TracerProvider` to trace to (the
        global one when None).

    Without an SDK configured, the global providers are no-ops: the hook then costs a
    few calls per event and records nothing. It is called inline, like every hook
    (a slow exporter belongs behind a batching processor, as the SDK's
    ``BatchSpanProcessor`` is). To add a hook of your own, call both:
    ``on_event=lambda event: (otel(event), mine(event))``.
    """

    def __init__(
        self,
        *,
        meter_provider: metrics.MeterProvider | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        meter = metrics.get_meter(_NAME, __version__, meter_provider=meter_provider)
        self._tracer = trace.get_tracer(_NAME, __version__, tracer_provider=tracer_provider)
        self._pings = meter.create_counter(
            "trio_debounce.pings", unit="{ping}", description="Pings, by outcome."
        )
        self._failed_open = meter.create_counter(
            "trio_debounce.pings.failed_open",
            unit="{ping}",
            description="Pings the backend failed to register, sent to a local window.",
        )
        self._fires = meter.create_counter(
            "trio_debounce.fires", unit="{fire}", description="Handler starts, by edge and reason."
        )
        self._failures = meter.create_counter(
            "trio_debounce.handler.failures",
            unit="{fire}",
            description="Handlers that raised.",
        )
        self._takeovers = meter.create_counter(
            "trio_debounce.takeovers",
            unit="{window}",
            description="Shared windows of dead processes taken over.",
        )
        self._conflicts = meter.create_counter(
            "trio_debounce.store.conflicts",
            unit="{request}",
            description="Compare-and-swap conflicts.",
        )
        self._lateness = meter.create_histogram(
            "trio_debounce.fire.lateness",
            unit="s",
            description="Handler start minus the fire's logical time.",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self._fire_pings = meter.create_histogram(
            "trio_debounce.fire.pings",
            unit="{ping}",
            description="Pings per fire.",
            explicit_bucket_boundaries_advisory=PINGS_BUCKETS,
        )
        self._age = meter.create_histogram(
            "trio_debounce.window.age",
            unit="s",
            description="Handler start minus the window's first ping.",
            explicit_bucket_boundaries_advisory=AGE_BUCKETS,
        )
        self._handler_time = meter.create_histogram(
            "trio_debounce.handler.duration",
            unit="s",
            description="Handler run time.",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self._store_time = meter.create_histogram(
            "trio_debounce.store.duration",
            unit="s",
            description="Store request time.",
            explicit_bucket_boundaries_advisory=STORE_BUCKETS,
        )
        #: (workflow, key, run id) -> span contexts of the window's first and last
        #: pings made here (in insertion order: the oldest is forgotten first).
        self._pinged: collections.OrderedDict[
            tuple[str, str, str], tuple[SpanContext, SpanContext]
        ] = collections.OrderedDict()
        #: The handler task -> its fire's span and the context token it attached.
        self._running: dict[object, tuple[trace.Span, Token[otel_context.Context]]] = {}

    def __call__(self, event: CoordinatorEvent) -> None:
        if isinstance(event, PingAnswered):
            self._ping(event)
        elif isinstance(event, FireStarted):
            self._started(event)
        elif isinstance(event, FireFinished):
            self._finished(event)
        elif isinstance(event, StoreCalled):
            attributes = {"op": event.op, "outcome": event.outcome}
            self._store_time.record(event.duration, attributes)
            if event.outcome == "conflict":
                self._conflicts.add(1, {"op": event.op})
        elif isinstance(event, PingRejected):
            workflow = event.workflow if isinstance(event.workflow, str) else "<invalid>"
            self._pings.add(1, {"workflow": workflow, "outcome": "rejected"})
        elif isinstance(event, PingFailedOpen):
            self._failed_open.add(1, {"workflow": event.workflow})
        elif isinstance(event, WindowTakenOver):
            self._takeovers.add(1, {"workflow": event.workflow, "by": event.by})

    def _ping(self, event: PingAnswered) -> None:
        result = event.result
        self._pings.add(1, {"workflow": event.workflow, "outcome": result.outcome.value})
        if result.outcome is Outcome.STALE:
            return
        here = trace.get_current_span().get_span_context()
        if not here.is_valid:
            return
        ident = (event.workflow, event.key, result.active_run_id)
        pinged = self._pinged.pop(ident, None)
        self._pinged[ident] = (here if pinged is None else pinged[0], here)
        if len(self._pinged) > WINDOWS_KEPT:
            self._pinged.popitem(last=False)

    def _started(self, event: FireStarted) -> None:
        fire = event.fire
        edge = fire.edge.value
        attributes = {"workflow": fire.workflow, "edge": edge, "reason": event.reason}
        self._fires.add(1, attributes)
        self._lateness.record(event.lateness, attributes)
        self._fire_pings.record(fire.ping_count, {"workflow": fire.workflow})
        self._age.record(event.at - fire.first_ping_at, {"workflow": fire.workflow})
        ident = (fire.workflow, fire.key, fire.run_id)
        # A leading fire leaves the window open: its trailing fire links the same pings.
        pinged = self._pinged.get(ident) if edge == "leading" else self._pinged.pop(ident, None)
        links: list[Link] = []
        if pinged is not None:
            first, last = pinged
            links.append(Link(first, {"trio_debounce.ping": "first"}))
            if last != first:
                links.append(Link(last, {"trio_debounce.ping": "last"}))
        span = self._tracer.start_span(
            "trio_debounce fire",
            context=otel_context.Context(),  # a root: the handler's task has no parent
            kind=SpanKind.INTERNAL,
            attributes={
                "trio_debounce.workflow": fire.workflow,
                "trio_debounce.key": fire.key,
                "trio_debounce.run_id": fire.run_id,
                "trio_debounce.edge": edge,
                "trio_debounce.reason": event.reason,
                "trio_debounce.attempt": fire.attempt,
                "trio_debounce.ping_count": fire.ping_count,
            },
            links=links,
        )
        # FireStarted and FireFinished come from the handler's own task, around it.
        token = otel_context.attach(trace.set_span_in_context(span))
        self._running[trio.lowlevel.current_task()] = (span, token)

    def _finished(self, event: FireFinished) -> None:
        fire = event.fire
        self._handler_time.record(
            event.duration, {"workflow": fire.workflow, "outcome": event.outcome}
        )
        if event.outcome == "raised":
            self._failures.add(1, {"workflow": fire.workflow})
        running = self._running.pop(trio.lowlevel.current_task(), None)
        if running is None:
            return
        span, token = running
        otel_context.detach(token)
        if event.error is not None:
            span.record_exception(event.error)
            status = "cancelled" if event.outcome == "cancelled" else "raised"
            span.set_status(Status(StatusCode.ERROR, status))
        span.end()
