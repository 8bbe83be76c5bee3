"""The reference model of the flow-control modes (``tests/harness/flow_model.py``).

* Named tests: one per mode's rule (throttle, throttle without trailing, audit, batch,
  rate limit) and per decision of the specification (ties at a window's end, cool-down
  chaining, spacing, no empty fire, drops, batch bounds, flush, cancel, pending,
  parameter clashes and validation).
* A property test: random timelines of pings, flushes, cancels and clashing pings on
  one to three keys, checking the invariants (ping accounting, throttle spacing, batch
  bounds, rate-limit fires per window, fires in time order, the outcomes' fires).

The engine's and the coordinator's property tests compare the real thing with this
model; these tests make sure the model itself follows the specification.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness.flow_model import FlowFire, FlowModel

A = ("wf", "a")
B = ("wf", "b")
C = ("wf", "c")
INF = math.inf


def _fires(model: FlowModel, ident: tuple[str, str] = A) -> list[FlowFire]:
    return [f for f in model.fires if f.ident == ident]


def _summary(fires: list[FlowFire]) -> list[tuple[float, Any, int, str, str]]:
    return [(f.fired_at, f.payload, f.ping_count, f.edge, f.reason) for f in fires]


# ------------------------------------------------------------------ throttle


def test_throttle_fires_leading_at_once_and_the_latest_at_the_window_end() -> None:
    m = FlowModel()
    assert m.throttle(0.0, A, "p0", interval=1.0) == "fire-immediate"
    assert _summary(m.fires) == [(0.0, "p0", 1, "leading", "leading")]
    assert m.throttle(0.25, A, "p1", interval=1.0) == "coalesce"
    assert m.throttle(0.5, A, "p2", interval=1.0) == "coalesce"
    m.advance(0.99)
    assert len(m.fires) == 1
    m.advance(1.0)
    # The trailing fire counts the two absorbed pings, not the leading one again.
    assert _summary(m.fires)[1:] == [(1.0, "p2", 2, "trailing", "interval")]


def test_throttle_a_later_ping_does_not_extend_the_window() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    m.throttle(0.75, A, "p1", interval=1.0)
    m.throttle(0.9, A, "p2", interval=1.0)
    m.advance(1.0)
    assert [f.fired_at for f in m.fires] == [0.0, 1.0]


def test_throttle_trailing_fire_opens_a_cool_down_and_cool_downs_chain() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    m.throttle(0.5, A, "p1", interval=1.0)
    m.advance(1.0)  # trailing fire at 1.0: cool-down [1, 2)
    # A ping in the cool-down is absorbed, with no leading fire ...
    assert m.throttle(1.25, A, "p2", interval=1.0) == "coalesce"
    assert len(m.fires) == 2
    # ... and fires as a trailing edge at 2.0, which opens the next cool-down [2, 3).
    assert m.throttle(2.5, A, "p3", interval=1.0) == "coalesce"
    m.advance(INF)
    assert _summary(m.fires) == [
        (0.0, "p0", 1, "leading", "leading"),
        (1.0, "p1", 1, "trailing", "interval"),
        (2.0, "p2", 1, "trailing", "interval"),
        (3.0, "p3", 1, "trailing", "interval"),
    ]
    assert m.windows == {}


def test_throttle_cool_down_with_no_ping_closes_then_a_ping_fires_leading() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    m.throttle(0.5, A, "p1", interval=1.0)
    m.advance(1.5)
    assert A in m.windows  # the cool-down [1, 2)
    m.advance(2.0)
    assert A not in m.windows  # no ping: nothing fired, the window closed
    assert len(m.fires) == 2
    assert m.throttle(2.0, A, "p2", interval=1.0) == "fire-immediate"
    assert _summary(m.fires)[2:] == [(2.0, "p2", 1, "leading", "leading")]


def test_throttle_a_ping_at_exactly_the_end_lands_in_the_cool_down() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    m.throttle(0.5, A, "p1", interval=1.0)
    # The end at 1.0 happens first (trailing fire, cool-down [1, 2)); the ping joins it.
    assert m.throttle(1.0, A, "p2", interval=1.0) == "coalesce"
    assert _summary(m.fires)[1:] == [(1.0, "p1", 1, "trailing", "interval")]
    m.advance(INF)
    assert _summary(m.fires)[2:] == [(2.0, "p2", 1, "trailing", "interval")]


def test_throttle_a_ping_at_exactly_the_end_of_a_quiet_window_fires_leading() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    assert m.throttle(1.0, A, "p1", interval=1.0) == "fire-immediate"
    assert [(f.fired_at, f.edge) for f in m.fires] == [(0.0, "leading"), (1.0, "leading")]


def test_throttle_fires_of_one_key_are_at_least_interval_apart() -> None:
    m = FlowModel()
    for i in range(41):  # a ping every 0.25 s for 10 s
        m.throttle(i * 0.25, A, i, interval=1.0)
    m.advance(INF)
    times = [f.fired_at for f in m.fires]
    # The ping at each whole second lands in the cool-down the fire there opened.
    assert times == [float(s) for s in range(12)]
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(times))
    # Each trailing fire carries the latest ping since the previous fire.
    assert [f.payload for f in m.fires] == [0, *range(3, 40, 4), 40]
    assert sum(f.ping_count for f in m.fires) == 41


def test_throttle_never_fires_an_empty_window() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    m.advance(INF)
    assert _summary(m.fires) == [(0.0, "p0", 1, "leading", "leading")]
    assert m.windows == {}  # no cool-down after a quiet window


def test_throttle_without_trailing_drops_and_counts() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"interval": 1.0, "trailing": False}
    assert m.throttle(0.0, A, "p0", **kw) == "fire-immediate"
    assert m.throttle(0.5, A, "p1", **kw) == "dropped"
    assert m.throttle(0.75, A, "p2", **kw) == "dropped"
    assert m.dropped == 2
    assert not m.pending(0.75, A)
    m.advance(INF)
    assert _summary(m.fires) == [(0.0, "p0", 1, "leading", "leading")]
    assert m.windows == {}


def test_throttle_without_trailing_window_ends_at_open_plus_interval() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"interval": 1.0, "trailing": False}
    m.throttle(0.0, A, "p0", **kw)
    assert m.throttle(0.99, A, "p1", **kw) == "dropped"
    assert m.throttle(1.0, A, "p2", **kw) == "fire-immediate"  # the tie: a new window
    assert m.throttle(1.5, A, "p3", **kw) == "dropped"
    assert m.throttle(2.25, A, "p4", **kw) == "fire-immediate"
    assert [(f.fired_at, f.payload) for f in m.fires] == [(0.0, "p0"), (1.0, "p2"), (2.25, "p4")]
    assert m.dropped == 2


def test_audit_fires_the_latest_at_open_plus_interval_without_restarting() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"interval": 1.0, "leading": False}
    assert m.throttle(0.0, A, "p0", **kw) == "schedule-trailing"
    assert m.fires == []
    assert m.throttle(0.5, A, "p1", **kw) == "coalesce"
    assert m.throttle(0.9, A, "p2", **kw) == "coalesce"
    m.advance(1.0)
    # Every ping of the window counts (there was no leading fire).
    assert _summary(m.fires) == [(1.0, "p2", 3, "trailing", "interval")]


def test_audit_has_no_cool_down_and_a_ping_at_the_end_opens_a_new_window() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"interval": 1.0, "leading": False}
    m.throttle(0.0, A, "p0", **kw)
    m.advance(1.0)
    assert m.windows == {}
    assert m.throttle(1.0, A, "p1", **kw) == "schedule-trailing"
    m.advance(INF)
    assert _summary(m.fires) == [
        (1.0, "p0", 1, "trailing", "interval"),
        (2.0, "p1", 1, "trailing", "interval"),
    ]


# ------------------------------------------------------------------ batch


def test_batch_fires_at_the_nth_item_by_that_call() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"size": 1, "max_wait": 5.0, "max_items": 3}
    assert m.batch(0.0, A, "i0", **kw) == "schedule-trailing"
    assert m.batch(1.0, A, "i1", **kw) == "coalesce"
    assert m.fires == []
    assert m.batch(2.0, A, "i2", **kw) == "coalesce"
    assert _summary(m.fires) == [(2.0, ["i0", "i1", "i2"], 3, "trailing", "max-items")]
    assert m.windows == {}
    assert m.batch(2.0, A, "i3", **kw) == "schedule-trailing"  # the next batch


def test_batch_max_items_one_fires_immediate() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"size": 1, "max_wait": 5.0, "max_items": 1}
    assert m.batch(0.0, A, "i0", **kw) == "fire-immediate"
    assert m.batch(0.0, A, "i1", **kw) == "fire-immediate"
    assert _summary(m.fires) == [
        (0.0, ["i0"], 1, "trailing", "max-items"),
        (0.0, ["i1"], 1, "trailing", "max-items"),
    ]
    assert not m.pending(0.0, A)


def test_batch_fires_at_max_wait_and_an_item_at_exactly_the_end_opens_the_next() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"size": 1, "max_wait": 2.0}
    m.batch(0.5, A, "i0", **kw)
    m.batch(1.0, A, "i1", **kw)
    assert m.batch(2.5, A, "i2", **kw) == "schedule-trailing"
    assert _summary(m.fires) == [(2.5, ["i0", "i1"], 2, "trailing", "max-wait")]
    m.advance(INF)
    assert _summary(m.fires)[1:] == [(4.5, ["i2"], 1, "trailing", "max-wait")]


def test_batch_default_max_items_is_1000() -> None:
    m = FlowModel()
    for i in range(999):
        m.batch(0.0, A, i, size=1, max_wait=1.0)
    assert m.fires == []
    assert m.batch(0.0, A, 999, size=1, max_wait=1.0, max_items=1000) == "coalesce"
    assert [(f.ping_count, f.reason) for f in m.fires] == [(1000, "max-items")]


def test_batch_fires_before_an_item_that_would_pass_max_bytes() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"max_wait": 5.0, "max_bytes": 10}
    assert m.batch(0.0, A, "i0", size=4, **kw) == "schedule-trailing"
    assert m.batch(1.0, A, "i1", size=6, **kw) == "coalesce"  # exactly 10: fits
    assert m.fires == []
    # 10 + 1 > 10: the batch fires at 2.0, then the item opens the next one.
    assert m.batch(2.0, A, "i2", size=1, **kw) == "schedule-trailing"
    assert _summary(m.fires) == [(2.0, ["i0", "i1"], 2, "trailing", "max-bytes")]
    assert m.windows[A].opened == 2.0
    m.advance(INF)
    assert _summary(m.fires)[1:] == [(7.0, ["i2"], 1, "trailing", "max-wait")]


def test_batch_an_item_bigger_than_max_bytes_raises_and_changes_nothing() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"max_wait": 5.0, "max_bytes": 10}
    m.batch(0.0, A, "i0", size=4, **kw)
    before = copy.deepcopy(m)
    with pytest.raises(ValueError, match="11"):
        m.batch(1.0, A, "big", size=11, **kw)
    assert m == before
    with pytest.raises(ValueError, match="11"):
        m.batch(1.0, B, "big", size=11, **kw)  # on a key with no window, too
    assert m == before


def test_batch_every_fire_is_within_its_bounds() -> None:
    m = FlowModel()
    sizes = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 1, 1, 2, 6]
    for i, size in enumerate(sizes):
        m.batch(i * 0.5, A, (i, size), size=size, max_wait=2.0, max_items=3, max_bytes=7)
    m.advance(INF)
    assert {f.reason for f in m.fires} == {"max-items", "max-bytes", "max-wait"}
    for f in m.fires:
        assert 1 <= len(f.payload) <= 3
        assert sum(size for _, size in f.payload) <= 7
        assert f.ping_count == len(f.payload)
    assert [item for f in m.fires for item in f.payload] == list(enumerate(sizes))


# ------------------------------------------------------------------ rate limit


def test_rate_limit_fires_the_first_k_pings_then_drops() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"limit": 2, "period": 1.0}
    assert m.rate_limit(0.0, A, "p0", **kw) == "fire-immediate"
    assert m.rate_limit(0.25, A, "p1", **kw) == "fire-immediate"
    assert m.rate_limit(0.5, A, "p2", **kw) == "dropped"
    assert m.rate_limit(0.75, A, "p3", **kw) == "dropped"
    assert m.dropped == 2
    assert _summary(m.fires) == [
        (0.0, "p0", 1, "leading", "leading"),
        (0.25, "p1", 1, "leading", "leading"),
    ]


def test_rate_limit_window_is_fixed_from_its_first_ping() -> None:
    m = FlowModel()
    kw: dict[str, Any] = {"limit": 1, "period": 1.0}
    m.rate_limit(0.5, A, "p0", **kw)
    assert m.rate_limit(1.25, A, "p1", **kw) == "dropped"  # the window is [0.5, 1.5)
    assert m.rate_limit(1.5, A, "p2", **kw) == "fire-immediate"  # the tie: a new window
    assert m.rate_limit(2.25, A, "p3", **kw) == "dropped"
    m.advance(INF)
    assert [(f.fired_at, f.payload) for f in m.fires] == [(0.5, "p0"), (1.5, "p2")]
    assert m.dropped == 2
    assert m.windows == {}


# ------------------------------------------------------------------ decisions


def test_ping_count_per_kind_of_fire() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "t0", interval=1.0)  # leading: 1
    m.throttle(0.0, B, "a0", interval=1.0, leading=False)
    m.batch(0.0, C, "b0", size=1, max_wait=1.0)
    m.rate_limit(0.0, ("wf", "d"), "r0", limit=3, period=1.0)  # rate: 1
    m.throttle(0.1, A, "t1", interval=1.0)
    m.throttle(0.1, B, "a1", interval=1.0, leading=False)  # audit: both
    m.throttle(0.2, A, "t2", interval=1.0)  # trailing: 2 (not the leading one)
    m.batch(0.5, C, "b1", size=1, max_wait=1.0)  # batch: its items
    m.advance(INF)
    counts = sorted((f.ident[1], f.edge, f.ping_count) for f in m.fires)
    assert counts == [
        ("a", "leading", 1),
        ("a", "trailing", 2),
        ("b", "trailing", 2),
        ("c", "trailing", 2),
        ("d", "leading", 1),
    ]


def test_advance_processes_ends_in_time_order_across_keys() -> None:
    m = FlowModel()
    m.throttle(0.0, B, "b", interval=2.0, leading=False)
    m.throttle(0.5, A, "a", interval=1.0, leading=False)
    m.batch(1.0, C, "c", size=1, max_wait=0.5)
    m.advance(10.0)
    assert [(f.fired_at, f.ident) for f in m.fires] == [(1.5, A), (1.5, C), (2.0, B)]


def test_drops_are_counted_across_keys_and_modes() -> None:
    m = FlowModel()
    m.throttle(0.0, A, 0, interval=1.0, trailing=False)
    m.rate_limit(0.0, B, 0, limit=1, period=1.0)
    m.throttle(0.1, A, 1, interval=1.0, trailing=False)
    m.rate_limit(0.2, B, 1, limit=1, period=1.0)
    m.rate_limit(0.3, B, 2, limit=1, period=1.0)
    assert m.dropped == 3


# ------------------------------------------------------------------ flush


def test_flush_a_throttle_fires_now_and_starts_a_cool_down() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    m.throttle(0.25, A, "p1", interval=1.0)
    assert m.flush(0.5, A)
    assert _summary(m.fires)[1:] == [(0.5, "p1", 1, "trailing", "flush")]
    w = m.windows[A]
    assert (w.opened, w.end, w.count) == (0.5, 1.5, 0)
    assert m.throttle(1.0, A, "p2", interval=1.0) == "coalesce"  # in the cool-down
    m.advance(INF)
    assert _summary(m.fires)[2:] == [(1.5, "p2", 1, "trailing", "interval")]


def test_flush_a_throttle_with_nothing_pending_is_false_and_changes_nothing() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    m.throttle(0.0, B, "p0", interval=1.0, trailing=False)
    m.advance(0.5)
    before = copy.deepcopy(m)
    assert not m.flush(0.5, A)  # after the leading fire, no ping since
    assert not m.flush(0.5, B)  # leading only
    assert m == before
    # A quiet cool-down has nothing pending either.
    m.throttle(0.75, A, "p1", interval=1.0)
    m.advance(1.5)
    assert A in m.windows
    before = copy.deepcopy(m)
    assert not m.flush(1.5, A)
    assert m == before


def test_flush_audit_and_batch_fire_now_and_close() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0, leading=False)
    m.batch(0.0, B, "i0", size=1, max_wait=1.0)
    m.throttle(0.25, A, "p1", interval=1.0, leading=False)
    m.batch(0.25, B, "i1", size=1, max_wait=1.0)
    assert m.flush(0.5, A)
    assert m.flush(0.5, B)
    assert _summary(m.fires) == [
        (0.5, "p1", 2, "trailing", "flush"),
        (0.5, ["i0", "i1"], 2, "trailing", "flush"),
    ]
    assert m.windows == {}
    assert not m.flush(0.5, A)
    m.advance(INF)
    assert len(m.fires) == 2


def test_flush_a_rate_window_or_no_window_is_false() -> None:
    m = FlowModel()
    m.rate_limit(0.0, A, "p0", limit=2, period=1.0)
    before = copy.deepcopy(m)
    assert not m.flush(0.0, A)
    assert not m.flush(0.0, B)
    assert m == before


# ------------------------------------------------------------------ cancel


def test_cancel_drops_what_is_pending_and_leaves_no_cool_down() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    m.throttle(0.25, A, "p1", interval=1.0)
    assert m.cancel(0.5, A)
    assert m.windows == {}
    assert m.throttle(0.5, A, "p2", interval=1.0) == "fire-immediate"  # at once
    m.advance(INF)
    assert [f.payload for f in m.fires] == ["p0", "p2"]


def test_cancel_a_cool_down_rate_window_audit_or_batch_is_true() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    m.throttle(0.25, A, "p1", interval=1.0)
    m.advance(1.25)  # the quiet cool-down [1, 2)
    assert m.cancel(1.25, A)
    m.rate_limit(1.25, B, "r0", limit=1, period=1.0)
    assert m.cancel(1.25, B)
    assert m.rate_limit(1.25, B, "r1", limit=1, period=1.0) == "fire-immediate"
    m.throttle(1.25, C, "a0", interval=1.0, leading=False)
    assert m.cancel(1.5, C)
    m.batch(1.5, C, "i0", size=1, max_wait=1.0)
    assert m.cancel(1.5, C)
    n = len(m.fires)
    m.advance(INF)
    assert len(m.fires) == n
    assert not m.cancel(INF, A)


def test_cancel_with_no_window_is_false() -> None:
    m = FlowModel()
    assert not m.cancel(0.0, A)
    m.throttle(0.0, A, "p0", interval=1.0)
    assert not m.cancel(1.0, A)  # the quiet window closed at 1.0 (the tie)


# ------------------------------------------------------------------ pending


def test_pending_is_true_only_while_a_fire_is_pending() -> None:
    m = FlowModel()
    m.throttle(0.0, A, "p0", interval=1.0)
    m.rate_limit(0.0, B, "r0", limit=1, period=10.0)
    assert not m.pending(0.0, A)  # after the leading fire, nothing absorbed
    m.throttle(0.5, A, "p1", interval=1.0)
    assert m.pending(0.5, A)
    assert not m.pending(1.0, A)  # fired at 1.0; the cool-down holds nothing
    assert A in m.windows
    m.throttle(1.5, A, "p2", interval=1.0)
    assert m.pending(1.5, A)
    assert B in m.windows
    assert not m.pending(1.5, B)
    m.throttle(1.5, C, "a0", interval=1.0, leading=False)
    assert m.pending(1.5, C)
    assert m.open_windows(1.5) == 2
    assert not m.pending(2.5, C)
    assert m.open_windows(2.5) == 0


def test_pending_and_open_windows_for_a_batch() -> None:
    m = FlowModel()
    assert m.open_windows(0.0) == 0
    m.batch(0.0, A, "i0", size=1, max_wait=1.0, max_items=2)
    m.batch(0.0, B, "i0", size=1, max_wait=1.0, max_items=2)
    assert m.pending(0.0, A)
    assert m.open_windows(0.0) == 2
    m.batch(0.5, A, "i1", size=1, max_wait=1.0, max_items=2)
    assert not m.pending(0.5, A)
    assert m.open_windows(0.5) == 1
    assert m.open_windows(1.0) == 0


# ------------------------------------------------------------------ clashes


@pytest.mark.parametrize(
    ("opening", "clashing"),
    [
        (
            lambda m: m.throttle(0.0, A, 0, interval=1.0),
            lambda m: m.throttle(0.5, A, 1, interval=2.0),
        ),
        (
            lambda m: m.throttle(0.0, A, 0, interval=1.0),
            lambda m: m.throttle(0.5, A, 1, interval=1.0, leading=False),
        ),
        (
            lambda m: m.throttle(0.0, A, 0, interval=1.0, trailing=False),
            lambda m: m.throttle(0.5, A, 1, interval=1.0),
        ),
        (
            lambda m: m.throttle(0.0, A, 0, interval=1.0, trailing=False),
            lambda m: m.rate_limit(0.5, A, 1, limit=1, period=1.0),
        ),
        (
            lambda m: m.batch(0.0, A, 0, size=1, max_wait=1.0, max_items=3),
            lambda m: m.batch(0.5, A, 1, size=1, max_wait=1.0, max_items=4),
        ),
        (
            lambda m: m.batch(0.0, A, 0, size=1, max_wait=1.0),
            lambda m: m.batch(0.5, A, 1, size=1, max_wait=1.0, max_bytes=100),
        ),
        (
            lambda m: m.batch(0.0, A, 0, size=1, max_wait=1.0),
            lambda m: m.throttle(0.5, A, 1, interval=1.0),
        ),
        (
            lambda m: m.rate_limit(0.0, A, 0, limit=2, period=1.0),
            lambda m: m.rate_limit(0.5, A, 1, limit=3, period=1.0),
        ),
        (
            lambda m: m.rate_limit(0.0, A, 0, limit=2, period=1.0),
            lambda m: m.batch(0.5, A, 1, size=1, max_wait=1.0),
        ),
    ],
)
def test_a_parameter_or_mode_clash_raises_and_changes_nothing(
    opening: Callable[[FlowModel], str], clashing: Callable[[FlowModel], str]
) -> None:
    m = FlowModel()
    opening(m)
    m.advance(0.5)
    before = copy.deepcopy(m)
    with pytest.raises(ValueError, match="differs"):
        clashing(m)
    assert m == before


def test_a_clash_with_a_cool_down_raises() -> None:
    m = FlowModel()
    m.throttle(0.0, A, 0, interval=1.0)
    m.throttle(0.5, A, 1, interval=1.0)
    m.advance(1.5)
    before = copy.deepcopy(m)
    with pytest.raises(ValueError, match="differs"):
        m.throttle(1.5, A, 2, interval=0.5)
    with pytest.raises(ValueError, match="differs"):
        m.batch(1.5, A, 2, size=1, max_wait=1.0)
    assert m == before
    m.advance(2.0)
    assert m.batch(2.0, A, 2, size=1, max_wait=1.0) == "schedule-trailing"  # closed


def test_default_max_items_equals_an_explicit_1000() -> None:
    m = FlowModel()
    m.batch(0.0, A, 0, size=1, max_wait=1.0)
    assert m.batch(0.5, A, 1, size=1, max_wait=1.0, max_items=1000) == "coalesce"


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda m: m.throttle(0.0, A, 0, interval=0.0), "0.0"),
        (lambda m: m.throttle(0.0, A, 0, interval=-1.0), "-1.0"),
        (lambda m: m.throttle(0.0, A, 0, interval=INF), "inf"),
        (lambda m: m.throttle(0.0, A, 0, interval=math.nan), "nan"),
        (lambda m: m.throttle(0.0, A, 0, interval=1.0, leading=False, trailing=False), "leading"),
        (lambda m: m.batch(0.0, A, 0, size=1, max_wait=0.0), "max_wait"),
        (lambda m: m.batch(0.0, A, 0, size=1, max_wait=1.0, max_items=0), "max_items"),
        (lambda m: m.batch(0.0, A, 0, size=1, max_wait=1.0, max_bytes=0), "max_bytes"),
        (lambda m: m.rate_limit(0.0, A, 0, limit=0, period=1.0), "limit"),
        (lambda m: m.rate_limit(0.0, A, 0, limit=1, period=-2.0), "-2.0"),
    ],
)
def test_a_bad_parameter_raises_naming_it_and_changes_nothing(
    call: Callable[[FlowModel], str], named: str
) -> None:
    m = FlowModel()
    m.throttle(0.0, B, 0, interval=1.0)
    m.throttle(0.0, B, 1, interval=1.0)
    before = copy.deepcopy(m)
    with pytest.raises(ValueError, match=named):
        call(m)
    assert m == before


# ------------------------------------------------------------------ the property

GRID = 0.25
KEYS = (A, B, C)


@dataclass(frozen=True)
class Config:
    """One key's mode and parameters for a whole timeline."""

    mode: str  # "throttle", "batch", "rate"
    interval: float = 1.0  # throttle's interval, batch's max_wait, rate's period
    leading: bool = True
    trailing: bool = True
    max_items: int | None = None
    max_bytes: int | None = None
    limit: int = 1

    def ping(self, m: FlowModel, t: float, ident: tuple[str, str], n: int, size: int) -> str:
        if self.mode == "throttle":
            return m.throttle(
                t, ident, n, interval=self.interval, leading=self.leading, trailing=self.trailing
            )
        if self.mode == "batch":
            return m.batch(
                t,
                ident,
                (n, size),
                size=size,
                max_wait=self.interval,
                max_items=self.max_items,
                max_bytes=self.max_bytes,
            )
        return m.rate_limit(t, ident, n, limit=self.limit, period=self.interval)


CONFIGS = st.one_of(
    st.builds(
        Config,
        mode=st.just("throttle"),
        interval=st.sampled_from((0.5, 1.0, 1.25)),
        leading=st.booleans(),
        trailing=st.booleans(),
    ).filter(lambda c: c.leading or c.trailing),
    st.builds(
        Config,
        mode=st.just("batch"),
        interval=st.sampled_from((0.5, 1.0, 1.5)),
        max_items=st.none() | st.integers(1, 4),
        max_bytes=st.none() | st.integers(3, 6),
    ),
    st.builds(
        Config,
        mode=st.just("rate"),
        interval=st.sampled_from((0.5, 1.0, 1.25)),
        limit=st.integers(1, 3),
    ),
)

# (time step, key, operation, size); operations: ping (mostly), flush, cancel, clash.
Step = tuple[float, int, str, int]
STEPS = st.lists(
    st.tuples(
        st.sampled_from((0.0, 0.0, GRID, 2 * GRID, 4 * GRID)),
        st.integers(0, len(KEYS) - 1),
        st.sampled_from(("ping",) * 6 + ("flush", "cancel", "clash")),
        st.integers(1, 7),
    ),
    min_size=1,
    max_size=40,
)


def _clash(config: Config) -> Config:
    """A configuration whose ping clashes with a window of ``config``."""
    if config.mode == "throttle":
        return Config("throttle", interval=config.interval + GRID, leading=config.leading)
    if config.mode == "batch":
        return Config("rate", interval=config.interval)
    return Config("rate", interval=config.interval, limit=config.limit + 1)


@settings(max_examples=300, deadline=None)
@given(configs=st.lists(CONFIGS, min_size=3, max_size=3), steps=STEPS)
def test_the_model_keeps_its_invariants_on_random_timelines(
    configs: list[Config], steps: list[Step]
) -> None:
    m = FlowModel()
    ping_times: list[float] = []
    accepted = dropped = cancelled = 0
    cancelled_items: dict[tuple[str, str], list[Any]] = {k: [] for k in KEYS}
    accepted_items: dict[tuple[str, str], list[Any]] = {k: [] for k in KEYS}
    # The fires and the (successful) cancels, in the order they happened.
    timeline: list[FlowFire | tuple[str, tuple[str, str]]] = []
    # The latest accepted ping of each throttle key (a trailing fire carries it).
    latest: dict[tuple[str, str], int] = {}

    def sync() -> None:
        for f in m.fires[len(timeline) - _cancels(timeline) :]:
            timeline.append(f)
            if f.edge == "trailing" and configs[KEYS.index(f.ident)].mode == "throttle":
                assert f.payload == latest[f.ident], f

    t = 0.0
    for dt, k, op, size in steps:
        t += dt
        ident, config = KEYS[k], configs[k]
        m.advance(t)
        sync()
        seen, held_before = len(m.fires), m.pending_pings(t, ident)
        if op == "flush":
            flushed = m.flush(t, ident)
            assert flushed == (held_before > 0)
            new = m.fires[seen:]
            assert [f.reason for f in new] == (["flush"] if flushed else [])
        elif op == "cancel":
            had = ident in m.windows
            if had:
                cancelled_items[ident] += m.windows[ident].items
            assert m.cancel(t, ident) == had
            cancelled += held_before
            if had:
                timeline.append(("cancel", ident))
            assert not m.pending(t, ident)
        elif op == "clash":
            if ident not in m.windows:
                continue
            before = copy.deepcopy(m)
            with pytest.raises(ValueError, match="differs"):
                _clash(config).ping(m, t, ident, len(ping_times), 1)
            assert m == before
        else:
            n, was_dropped = len(ping_times), m.dropped
            too_big = config.mode == "batch" and size > (config.max_bytes or INF)
            if too_big:
                before = copy.deepcopy(m)
                with pytest.raises(ValueError, match="max_bytes"):
                    config.ping(m, t, ident, n, size)
                assert m == before
                continue
            outcome = config.ping(m, t, ident, n, size)
            ping_times.append(t)
            _check_outcome(m, config, outcome, m.fires[seen:], t, ident, n)
            if outcome == "dropped":
                dropped += 1
                assert m.dropped == was_dropped + 1
            else:
                accepted += 1
                assert m.dropped == was_dropped
                if config.mode == "batch":
                    accepted_items[ident].append((n, size))
                else:
                    latest[ident] = n
        sync()
        total = sum(f.ping_count for f in m.fires)
        # Every ping is fired, still pending, dropped, or was discarded by a cancel.
        assert total + m.pending_pings(t) + m.dropped + cancelled == accepted + dropped
        assert m.dropped == dropped
        assert m.open_windows(t) == sum(m.pending(t, i) for i in KEYS)

    m.advance(INF)
    sync()
    assert m.windows == {}
    assert m.open_windows(INF) == 0
    assert sum(f.ping_count for f in m.fires) + cancelled == accepted
    assert [f for f in timeline if isinstance(f, FlowFire)] == m.fires
    assert [f.fired_at for f in m.fires] == sorted(f.fired_at for f in m.fires)
    for f in m.fires:
        assert f.ping_count >= 1  # never an empty fire
    for ident, config in zip(KEYS, configs, strict=True):
        events = [e for e in timeline if (e[1] if isinstance(e, tuple) else e.ident) == ident]
        if config.mode == "throttle":
            _check_throttle(config, events, ping_times)
        elif config.mode == "batch":
            _check_batch(config, events, ping_times)
            fired = [item for e in events if isinstance(e, FlowFire) for item in e.payload]
            assert sorted(fired + cancelled_items[ident]) == accepted_items[ident]
            assert [n for n, _ in fired] == sorted(n for n, _ in fired)  # in order
        else:
            _check_rate(config, events)


def _cancels(timeline: list[FlowFire | tuple[str, tuple[str, str]]]) -> int:
    return sum(1 for e in timeline if isinstance(e, tuple))


def _check_outcome(
    m: FlowModel,
    config: Config,
    outcome: str,
    new: list[FlowFire],
    t: float,
    ident: tuple[str, str],
    n: int,
) -> None:
    """The fires a ping's own call made match its outcome."""
    assert all(f.fired_at == t and f.ident == ident for f in new)
    if outcome == "fire-immediate":
        assert len(new) == 1
        if config.mode == "batch":
            assert (new[0].reason, new[0].payload[-1][0]) == ("max-items", n)
            assert config.max_items == 1
        else:
            assert (new[0].edge, new[0].reason, new[0].payload) == ("leading", "leading", n)
        assert not m.pending(t, ident)
    elif outcome == "dropped":
        assert new == []
        assert config.mode == "rate" or not config.trailing
    elif outcome == "schedule-trailing":
        assert config.mode == "batch" or not config.leading
        assert [f.reason for f in new] in ([], ["max-bytes"])
        assert m.pending(t, ident)
    else:
        assert outcome == "coalesce"
        if config.mode == "batch":
            assert [f.reason for f in new] in ([], ["max-items"])
            assert m.pending(t, ident) == (not new)
        else:
            assert new == []
            assert m.pending(t, ident)


def _check_throttle(
    config: Config, events: list[FlowFire | tuple[str, tuple[str, str]]], ping_times: list[float]
) -> None:
    """Fires of a key at least ``interval`` apart (but after a cancel, and a flush)."""
    last: float | None = None
    for e in events:
        if isinstance(e, tuple):
            last = None
            continue
        if last is not None and e.reason != "flush":
            assert e.fired_at - last >= config.interval, (last, e)
        last = e.fired_at
        if e.edge == "leading":
            assert (e.reason, e.ping_count) == ("leading", 1)
            assert ping_times[e.payload] == e.fired_at
        else:
            assert config.trailing
            assert e.reason in ("interval", "flush")
            assert ping_times[e.payload] <= e.fired_at


def _check_batch(
    config: Config, events: list[FlowFire | tuple[str, tuple[str, str]]], ping_times: list[float]
) -> None:
    """Every batch within its bounds: items, bytes, and the wait from its first item."""
    max_items = config.max_items or 1000
    for e in events:
        if isinstance(e, tuple):
            continue
        assert e.edge == "trailing"
        assert 1 <= len(e.payload) <= max_items
        assert e.ping_count == len(e.payload)
        if config.max_bytes is not None:
            assert sum(size for _, size in e.payload) <= config.max_bytes
        ids = [n for n, _ in e.payload]
        assert ids == sorted(ids)
        first = ping_times[ids[0]]
        assert e.fired_at - first <= config.interval
        if e.reason == "max-wait":
            assert e.fired_at == first + config.interval
        elif e.reason == "max-items":
            assert len(e.payload) == max_items
            assert ping_times[ids[-1]] == e.fired_at


def _check_rate(config: Config, events: list[FlowFire | tuple[str, tuple[str, str]]]) -> None:
    """At most ``limit`` fires per fixed window (from the first fire, ``period`` long)."""
    start: float | None = None
    count = 0
    for e in events:
        if isinstance(e, tuple):
            start = None
            continue
        assert (e.edge, e.reason, e.ping_count) == ("leading", "leading", 1)
        if start is None or e.fired_at >= start + config.interval:
            start, count = e.fired_at, 0
        count += 1
        assert count <= config.limit, (start, e)
