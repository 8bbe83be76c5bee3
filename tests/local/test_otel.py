"""``trio_debounce.otel``: the coordinator's events as OpenTelemetry metrics and
spans, read back through the SDK's in-memory reader and exporter (MockClock)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

from tests.harness.fires import Fires
from tests.harness.memory import backend
from trio_debounce import Fire, open_coordinator
from trio_debounce.otel import OpenTelemetryHook
from trio_debounce.otel._hook import AGE_BUCKETS, PINGS_BUCKETS, SECONDS_BUCKETS
from trio_debounce.testing import MemoryStore

WF = "wf"


class Otel:
    """An SDK meter provider and tracer provider that keep everything in memory."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader])
        self.exporter = InMemorySpanExporter()
        self.tracers = TracerProvider()
        self.tracers.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.hook = OpenTelemetryHook(meter_provider=self.meters, tracer_provider=self.tracers)
        self.tracer = self.tracers.get_tracer("the application")

    def points(self) -> dict[str, list[tuple[dict[str, Any], Any]]]:
        """Instrument name -> [(attributes, value)]: a counter's value, or a
        histogram's (count, sum)."""
        out: dict[str, list[tuple[dict[str, Any], Any]]] = {}
        data = self.reader.get_metrics_data()
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        value = getattr(point, "value", None)
                        if value is None:
                            value = (point.count, point.sum)  # type: ignore[union-attr]
                        out.setdefault(metric.name, []).append(
                            (dict(point.attributes or {}), value)
                        )
        return out

    def spans(self, name: str) -> list[ReadableSpan]:
        """The finished spans named ``name``."""
        return [s for s in self.exporter.get_finished_spans() if s.name == name]


def attrs(item: Any) -> dict[str, Any]:
    """A span's or a link's attributes."""
    return dict(item.attributes or {})


async def noop(fire: Fire) -> None:
    pass


@pytest.fixture
def otel() -> Iterator[Otel]:
    o = Otel()
    yield o
    o.meters.shutdown()
    o.tracers.shutdown()


async def test_a_burst_is_counted_measured_and_traced(
    autojump_clock: trio.testing.MockClock, otel: Otel
) -> None:
    async def handler(fire: Fire) -> None:
        with otel.tracer.start_as_current_span("the handler's work"):
            await trio.sleep(0.25)

    async with open_coordinator(handlers={WF: handler}, on_event=otel.hook) as c:
        with otel.tracer.start_as_current_span("request 1"):
            await c.debounce(WF, "doc-1", 1, delay=1.0)
        await trio.sleep(0.5)
        with otel.tracer.start_as_current_span("request 2"):
            await c.debounce(WF, "doc-1", 2, delay=1.0)
            await c.debounce(WF, "doc-1", 3, delay=1.0)
        await c.debounce(WF, "doc-2", 4, delay=1.0)  # outside any span: no link
    points = otel.points()
    pings = {(a["workflow"], a["outcome"]): v for a, v in points["trio_debounce.pings"]}
    assert pings == {(WF, "schedule-trailing"): 2, (WF, "coalesce"): 2}
    assert points["trio_debounce.fires"] == [
        ({"workflow": WF, "edge": "trailing", "reason": "delay"}, 2)
    ]
    [(_, per_fire)] = points["trio_debounce.fire.pings"]
    assert per_fire == (2, 4)  # the coalescing ratio: 4 pings in 2 fires
    [(_, lateness)] = points["trio_debounce.fire.lateness"]
    assert lateness[0] == 2
    assert lateness[1] == pytest.approx(0.0, abs=1e-6)
    [(_, age)] = points["trio_debounce.window.age"]
    assert age[1] == pytest.approx(1.5 + 1.0)  # doc-1: 0.5 s of pings, then the delay
    [(labels, handled)] = points["trio_debounce.handler.duration"]
    assert labels == {"workflow": WF, "outcome": "returned"}
    assert handled[1] == pytest.approx(0.5)
    for series in points.values():
        for attributes, _ in series:
            assert "key" not in attributes  # never a metric attribute

    requests = {s.name: s for s in otel.spans("request 1") + otel.spans("request 2")}
    fires = {attrs(s)["trio_debounce.key"]: s for s in otel.spans("trio_debounce fire")}
    assert set(fires) == {"doc-1", "doc-2"}
    doc1 = fires["doc-1"]
    assert [link.context for link in doc1.links] == [
        requests["request 1"].context,
        requests["request 2"].context,
    ]
    assert [attrs(link)["trio_debounce.ping"] for link in doc1.links] == ["first", "last"]
    assert doc1.parent is None
    assert attrs(doc1)["trio_debounce.ping_count"] == 3
    assert attrs(doc1)["trio_debounce.reason"] == "delay"
    assert fires["doc-2"].links == ()
    # The handler's own spans are children of its fire's.
    work = {s.parent.span_id for s in otel.spans("the handler's work") if s.parent}
    assert work == {doc1.context.span_id, fires["doc-2"].context.span_id}
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing left attached


async def test_a_failing_handler_and_a_leading_edge(
    autojump_clock: trio.testing.MockClock, otel: Otel
) -> None:
    async def handler(fire: Fire) -> None:
        if fire.payload == "bad":
            raise RuntimeError("boom")

    async with open_coordinator(handlers={WF: handler}, on_event=otel.hook) as c:
        with otel.tracer.start_as_current_span("request"):
            await c.debounce(WF, "k", "ok", delay=1.0, mode="both")
            await c.debounce(WF, "k", "bad", delay=1.0, mode="both")
    points = otel.points()
    fires = {(a["edge"], a["reason"]): v for a, v in points["trio_debounce.fires"]}
    assert fires == {("leading", "leading"): 1, ("trailing", "delay"): 1}
    assert points["trio_debounce.handler.failures"] == [({"workflow": WF}, 1)]
    spans = {attrs(s)["trio_debounce.edge"]: s for s in otel.spans("trio_debounce fire")}
    assert spans["leading"].status.status_code is StatusCode.UNSET
    trailing = spans["trailing"]
    assert trailing.status.status_code is StatusCode.ERROR
    assert [e.name for e in trailing.events] == ["exception"]
    # Both edges link the window's pings (the leading edge: its one ping so far).
    [request] = otel.spans("request")
    assert [link.context for link in spans["leading"].links] == [request.context]
    assert [link.context for link in trailing.links] == [request.context]


async def test_store_requests_and_conflicts_with_a_backend(
    autojump_clock: trio.testing.MockClock, otel: Otel
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    b = backend(store, "A")
    async with open_coordinator(
        handlers={WF: fires.handler("A")}, backend=b, on_event=otel.hook
    ) as c:
        await c.debounce(WF, "k", 1, delay=1.0)
        b.faults.conflict_next()
        await c.debounce(WF, "k", 2, delay=1.0)
    points = otel.points()
    ops = {(a["op"], a["outcome"]) for a, _ in points["trio_debounce.store.duration"]}
    assert {("get", "ok"), ("put", "ok"), ("put", "conflict"), ("entries", "ok")} <= ops
    assert points["trio_debounce.store.conflicts"] == [({"op": "put"}, 1)]


async def test_without_an_sdk_the_hook_records_nothing_and_never_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The global providers of opentelemetry-api alone are no-ops.
    async with open_coordinator(handlers={WF: noop}, on_event=OpenTelemetryHook()) as c:
        await c.debounce(WF, "k", 1, delay=1.0)
        await trio.sleep(2.0)
        assert c.statistics().fires == 1
        assert c.statistics().hook_errors == 0


async def test_the_histograms_advise_bucket_boundaries_in_seconds(
    autojump_clock: trio.testing.MockClock, otel: Otel
) -> None:
    """The SDK's default boundaries (0, 5, 10, ... 10000) suit milliseconds: each
    histogram advises its own, which an SDK without a View of the user's applies."""
    async with open_coordinator(handlers={WF: noop}, on_event=otel.hook) as c:
        await c.debounce(WF, "k", 1, delay=1.0)
    data = otel.reader.get_metrics_data()
    assert data is not None
    bounds = {
        metric.name: tuple(point.explicit_bounds)
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        for point in metric.data.data_points
        if hasattr(point, "explicit_bounds")
    }
    assert bounds == {
        "trio_debounce.fire.lateness": SECONDS_BUCKETS,
        "trio_debounce.fire.pings": PINGS_BUCKETS,
        "trio_debounce.window.age": AGE_BUCKETS,
        "trio_debounce.handler.duration": SECONDS_BUCKETS,
    }
    assert bounds["trio_debounce.fire.lateness"][0] == 0.001
