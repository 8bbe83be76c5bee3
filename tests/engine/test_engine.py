"""The window engine (``trio_debounce._engine``), tested directly.

* Named tests for the tie rule, ``max_count``, the cap, overflow and the payload
  policies, on the pure functions.
* A property test: a minimal window table over the engine (no Trio) against the
  independent reference model in ``tests/harness/model.py``, every fire's time, payload,
  count and edge, with many pings at the exact due time, cap and count.
* A property test: ``debounce_nowait``'s hand-inlined hot path leaves a window
  exactly as :func:`_engine.absorb` would, on every input it takes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness.model import DEFAULT as MODEL_DEFAULT
from tests.harness.model import Model, ModelFire, Options
from trio_debounce import FireReason, Mode, open_coordinator
from trio_debounce import _engine as engine
from trio_debounce._options import WindowOptions, window_options

INF = math.inf


def _add(acc: Any, new: Any) -> Any:
    return acc + new


_SUM: tuple[Any, None] = (_add, None)


def _opts(mode: Mode = Mode.TRAILING, **options: Any) -> WindowOptions:
    return window_options(
        mode,
        options.get("max_count"),
        options.get("payload_policy", "last"),
        options.get("max_items"),
        options.get("overflow"),
        options.get("overlap", "allow"),
        options.get("run_timeout"),
        options.get("ordered", False),
        {"sum": _SUM},
    )


# ------------------------------------------------------------------ named rules


def test_a_ping_at_the_due_time_belongs_to_the_next_window() -> None:
    w = engine.open_window(0.0, "a", delay=2.0, max_delay=None, mode=Mode.TRAILING)
    assert w.deadline == 2.0
    assert w.cap == INF
    assert w.trailing
    assert engine.absorbs(w, 1.999)
    assert not engine.absorbs(w, 2.0)
    assert engine.is_due(w, 2.0)
    assert not engine.is_due(w, 1.5)
    assert engine.due_reason(w, 2.0) == engine.DUE_DELAY
    assert engine.due_reason(w, 1.0) is None


def test_the_cap_bounds_every_ping() -> None:
    w = engine.open_window(10.0, 0, delay=1.0, max_delay=3.0, mode=Mode.TRAILING)
    assert (w.deadline, w.cap) == (11.0, 13.0)
    for i, t in enumerate((10.5, 11.25, 12.0, 12.75), start=1):
        assert engine.absorbs(w, t)
        engine.absorb(w, t, i, delay=1.0)
    assert w.deadline == 13.0
    assert w.count == 5
    assert w.payload == 4
    assert engine.due_reason(w, 13.0) == engine.DUE_CAP


def test_the_ping_that_reaches_max_count_makes_the_window_due_at_its_time() -> None:
    w = engine.open_window(
        0.0, 1, delay=5.0, max_delay=None, mode=Mode.TRAILING, opts=_opts(max_count=3)
    )
    engine.absorb(w, 0.0, 2, delay=5.0)
    assert w.deadline == 5.0
    assert engine.absorbs(w, 0.0)
    engine.absorb(w, 0.0, 3, delay=5.0)
    # Due at once: a ping at this very instant opens the next window.
    assert w.deadline == 0.0
    assert w.count == 3
    assert not engine.absorbs(w, 0.0)
    assert engine.due_reason(w, 0.0) == engine.DUE_COUNT
    assert engine.fire_payload(w) == 3


def test_max_count_one_is_due_at_its_first_ping() -> None:
    w = engine.open_window(
        4.0, "x", delay=5.0, max_delay=None, mode=Mode.BOTH, opts=_opts(Mode.BOTH, max_count=1)
    )
    assert w.deadline == 4.0
    assert not w.trailing
    assert engine.leading(Mode.BOTH)
    assert not engine.leading(Mode.TRAILING)


def test_a_both_edges_window_has_a_trailing_fire_from_its_second_ping() -> None:
    w = engine.open_window(0.0, "a", delay=1.0, max_delay=None, mode=Mode.BOTH)
    assert (w.trailing, engine.scheduled_at(w)) == (False, None)
    assert engine.absorb(w, 0.5, "b", delay=1.0) is True
    assert (w.trailing, engine.scheduled_at(w)) == (True, 1.5)
    assert engine.absorb(w, 0.7, "c", delay=1.0) is False


def test_a_leading_window_never_has_a_trailing_fire() -> None:
    w = engine.open_window(0.0, "a", delay=1.0, max_delay=None, mode=Mode.LEADING)
    for t in (0.5, 1.0, 1.5):
        assert engine.absorb(w, t, "b", delay=1.0) is False
    assert not w.trailing
    assert engine.scheduled_at(w) is None
    assert w.deadline == 2.5


def test_collect_keeps_order_then_arrival_and_fire_early_fills() -> None:
    opts = _opts(payload_policy="collect", max_items=3, ordered=True)
    w = engine.open_window(0.0, "a", delay=1.0, max_delay=None, mode=Mode.TRAILING, opts=opts)
    engine.absorb(w, 0.1, "b", delay=1.0, order=-1.0)
    assert not engine.is_full(w)
    engine.absorb(w, 0.2, "c", delay=1.0, order=0.0)  # ties order 0: after "a"
    assert engine.fire_payload(w) == ["b", "a", "c"]
    assert engine.is_full(w)
    assert w.max_order == 0.0


def test_collect_drop_oldest_drops_the_lowest() -> None:
    opts = _opts(payload_policy="collect", max_items=2, overflow="drop-oldest", ordered=True)
    w = engine.open_window(
        0.0, "a", delay=1.0, max_delay=None, mode=Mode.TRAILING, opts=opts, order=5
    )
    engine.absorb(w, 0.1, "b", delay=1.0, order=3)
    engine.absorb(w, 0.2, "c", delay=1.0, order=9)
    assert engine.fire_payload(w) == ["a", "c"]
    assert not engine.is_full(w)


def test_first_and_last_with_order_keys() -> None:
    last = engine.open_window(
        0.0, "a", delay=1.0, max_delay=None, mode=Mode.TRAILING, opts=_opts(ordered=True), order=2
    )
    first = engine.open_window(
        0.0,
        "a",
        delay=1.0,
        max_delay=None,
        mode=Mode.TRAILING,
        opts=_opts(payload_policy="first", ordered=True),
        order=2,
    )
    for payload, order in (("b", 1), ("c", 2), ("d", 0)):
        engine.absorb(last, 0.1, payload, delay=1.0, order=order)
        engine.absorb(first, 0.1, payload, delay=1.0, order=order)
    assert engine.fire_payload(last) == "c"  # highest order key; ties: the later
    assert engine.fire_payload(first) == "d"  # lowest order key; ties: the earlier


def test_a_waiting_window_absorbs_and_keeps_its_time() -> None:
    opts = _opts(overlap="queue-latest")
    w = engine.open_window(0.0, "a", delay=1.0, max_delay=None, mode=Mode.TRAILING, opts=opts)
    assert engine.wait_for_run(w, 1.0, 3.0)
    assert w.waiting
    assert w.deadline == 3.0
    assert engine.absorbs(w, 3.0)  # waiting: joins even at its time
    engine.absorb(w, 2.0, "b", delay=0.1)
    assert w.deadline == 3.0
    assert engine.scheduled_at(w) is None
    engine.commit(w, 2.5)
    assert (w.waiting, w.deadline) == (False, 2.5)
    assert not engine.wait_for_run(w, 3.0, 3.0)
    assert not engine.wait_for_run(w, 3.0, None)


def test_stale_order_keys() -> None:
    assert not engine.is_stale(1.0, None)
    assert engine.is_stale(1.0, 1.0)
    assert engine.is_stale(0.5, 1.0)
    assert not engine.is_stale(1.5, 1.0)
    assert engine.fired_order_after(None, 3.0) == 3.0
    assert engine.fired_order_after(4.0, 3.0) == 4.0
    assert engine.fired_order_after(4.0, None) == 4.0


# ------------------------------------------------ a minimal table vs the model

GRID = 0.5
MODES = (Mode.TRAILING, Mode.LEADING, Mode.BOTH)
KEYS = (("wf", "a"), ("wf", "b"))


class EngineTable:
    """The least a caller of the engine does: one window per key, a fire when a
    window is due (at its deadline), no tasks and no I/O."""

    def __init__(self) -> None:
        self.windows: dict[tuple[str, str], engine.WindowState] = {}
        self.run_ids: dict[tuple[str, str], str] = {}
        self.fires: list[ModelFire] = []

    def advance(self, t: float) -> None:
        while True:
            due = [(w.deadline, i) for i, w in self.windows.items() if engine.is_due(w, t)]
            if not due:
                return
            at, ident = min(due)
            self._close(ident, at)

    def _close(self, ident: tuple[str, str], at: float) -> None:
        w = self.windows.pop(ident)
        if w.trailing:
            self.fires.append(
                ModelFire(
                    at,
                    ident,
                    engine.fire_payload(w),
                    w.count,
                    "trailing",
                    self.run_ids[ident],
                    w.first_ping_at,
                )
            )

    def ping(
        self,
        t: float,
        ident: tuple[str, str],
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: Mode,
        run_id: str,
        opts: WindowOptions,
    ) -> tuple[str, str, float | None, int]:
        w = self.windows.get(ident)
        if w is not None and not engine.absorbs(w, t):
            self._close(ident, w.deadline)  # due: it fired at its due time
            w = None
        if w is not None and engine.is_full(w):
            self._close(ident, t)
            w = None
        if w is None:
            value = engine.first_value(_SUM, payload) if opts.reducer else None
            w = engine.open_window(
                t, payload, delay=delay, max_delay=max_delay, mode=mode, opts=opts, value=value
            )
            self.windows[ident] = w
            self.run_ids[ident] = run_id
            if engine.leading(mode):
                self.fires.append(ModelFire(t, ident, payload, 1, "leading", run_id, t))
                return ("fire-immediate", run_id, None, 1)
            return ("schedule-trailing", run_id, engine.scheduled_at(w), 1)
        value = _SUM[0](w.acc, payload) if opts.reducer else None
        engine.absorb(w, t, payload, delay=delay, value=value)
        return ("coalesce", self.run_ids[ident], engine.scheduled_at(w), w.count)


@st.composite
def _pings(draw: st.DrawFn) -> list[tuple[float, int, float, float | None]]:
    out = []
    t = 0.0
    for _ in range(draw(st.integers(1, 30))):
        t += draw(st.sampled_from((0.0, 0.0, GRID, 2 * GRID, 3 * GRID)))
        delay = draw(st.integers(0, 6)) * GRID
        extra = draw(st.none() | st.integers(0, 6))
        max_delay = None if extra is None else delay + extra * GRID
        out.append((t, draw(st.integers(0, len(KEYS) - 1)), delay, max_delay))
    return out


@settings(max_examples=300, deadline=None)
@given(
    pings=_pings(),
    mode=st.sampled_from(MODES),
    max_count=st.none() | st.integers(1, 4),
    policy=st.sampled_from(("last", "first", "collect", "sum")),
    max_items=st.integers(1, 4),
)
def test_the_engine_matches_the_model(
    pings: list[tuple[float, int, float, float | None]],
    mode: Mode,
    max_count: int | None,
    policy: str,
    max_items: int,
) -> None:
    accumulates = policy not in ("last", "first")
    items = max_items if accumulates else None
    opts = _opts(mode, max_count=max_count, payload_policy=policy, max_items=items)
    model_opts = (
        Options(max_count=max_count, payload_policy=policy, max_items=items)
        if (max_count, policy) != (None, "last")
        else MODEL_DEFAULT
    )
    model = Model(reducers={"sum": _SUM})
    table = EngineTable()
    for n, (t, k, delay, max_delay) in enumerate(pings):
        ident, run_id = KEYS[k], f"run-{n}"
        expected = model.ping(t, ident, n, delay, max_delay, mode.value, run_id, model_opts)
        got = table.ping(t, ident, n, delay, max_delay, mode, run_id, opts)
        assert got == expected, (n, t)
    model.advance(INF)
    table.advance(INF)
    assert sorted(table.fires, key=repr) == sorted(model.fires, key=repr)


# ----------------------------------------- the hot path equals the engine


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from((0.0, 0.0, 0.125, 0.25, 0.5, 1.0)),
            st.sampled_from((0.0, 0.25, 0.5, 1.0, 2.0)),
            st.none() | st.sampled_from((1.0, 2.0, 3.0)),
        ),
        min_size=1,
        max_size=25,
    ),
    mode=st.sampled_from(MODES),
)
def test_the_inlined_hot_path_equals_the_engine(
    steps: list[tuple[float, float, float | None]], mode: Mode
) -> None:
    async def main() -> None:
        mirror: engine.WindowState | None = None
        async with open_coordinator(handlers={"wf": _noop}, on_exit="cancel") as coordinator:
            for i, (dt, delay, max_delay) in enumerate(steps):
                await trio.sleep(dt)
                if max_delay is not None and max_delay < delay:
                    max_delay = delay
                now = trio.current_time()
                result = coordinator.debounce_nowait(
                    "wf", "k", i, delay=delay, max_delay=max_delay, mode=mode
                )
                if mirror is None or not engine.absorbs(mirror, now):
                    mirror = engine.open_window(now, i, delay=delay, max_delay=max_delay, mode=mode)
                    expected_count = 1
                else:
                    engine.absorb(mirror, now, i, delay=delay)
                    expected_count = mirror.count
                window = coordinator._windows[("wf", "k")]
                assert result.ping_count == expected_count == window.count
                assert result.scheduled_at == engine.scheduled_at(mirror)
                assert (window.deadline, window.cap, window.payload, window.trailing) == (
                    mirror.deadline,
                    mirror.cap,
                    mirror.payload,
                    mirror.trailing,
                )
                await trio.lowlevel.checkpoint()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def _noop(fire: Any) -> None:
    pass


@pytest.mark.parametrize("mode", MODES)
def test_the_hot_path_is_taken_by_the_property_test(mode: Mode) -> None:
    # The property test above must exercise the inlined path, not only the slow one.
    async def main() -> int:
        async with open_coordinator(handlers={"wf": _noop}, on_exit="cancel") as coordinator:
            coordinator.debounce_nowait("wf", "k", 0, delay=1.0, mode=mode)
            coordinator.debounce_nowait("wf", "k", 1, delay=1.0, mode=mode)
            coordinator.debounce_nowait("wf", "k", 2, delay=1.0, mode=mode)
            return coordinator._hot_pings

    hot = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # trailing: the second and third pings; both: the third (from the second the
    # window is pending); leading: never (no pending trailing fire).
    assert hot == {Mode.TRAILING: 2, Mode.BOTH: 1, Mode.LEADING: 0}[mode]


def test_a_cause_from_the_call_site_names_the_fire() -> None:
    R = FireReason
    # Judged by time without a cause; the cause wins when given.
    assert engine.trailing_reason(1.0, 2.0, math.inf, 1, None) is R.FLUSH
    assert engine.trailing_reason(2.0, 2.0, math.inf, 1, None) is R.DELAY
    for cause in (R.OVERFLOW, R.EXIT, R.RUN_END):
        assert engine.trailing_reason(2.0, 2.0, math.inf, 1, None, cause) is cause
    # On a reason judged elsewhere: an exit names only a fire before its due time.
    assert engine.caused(R.FLUSH, R.EXIT) is R.EXIT
    assert engine.caused(R.DELAY, R.EXIT) is R.DELAY
    assert engine.caused(R.INTERVAL, None) is R.INTERVAL
    for late in (R.RUN_END, R.ADOPTION):
        assert engine.caused(R.DELAY, late) is late
        assert engine.caused(R.FLUSH, late) is late
