"""``trio-debounce replay --mode throttle|audit|batch|rate-limit``: the flow-control
modes on the virtual clock, fire by fire on hand-made logs (ties at exactly a window's
end included), against the reference model on the real log, and the options that go
with each mode."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cli.test_cli_replay import BATCHES, run_cli, write_lines
from tests.harness.flow_model import FlowFire, FlowModel
from trio_debounce._cli import _replay
from trio_debounce._cli._events import Event
from trio_debounce._cli._replay import FlowOptions, read_events, replay

#: One fire as the tests state it: (key, fired_at, first_ping_at, payload's "n" (a
#: batch: the list of its items' "n"), pings, edge, reason).
Row = tuple[str, float, float, Any, int, str, str]


def _rows(out: str) -> list[Row]:
    rows = []
    for line in out.splitlines():
        f = json.loads(line)
        payload = f["payload"]
        n = [p["n"] for p in payload] if isinstance(payload, list) else payload["n"]
        rows.append(
            (f["key"], f["fired_at"], f["first_ping_at"], n, f["pings"], f["edge"], f["reason"])
        )
    return rows


def _replay_cli(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    timeline: Sequence[tuple[float, str]],
    options: list[str],
    batch: int,
) -> tuple[list[Row], dict[str, Any]]:
    """Replay ``timeline`` (events ``{"ts", "key", "n"}``, "n" their index) with
    ``options`` and the checkpoint interval ``batch``: the fires, and the summary."""
    log = write_lines(
        tmp_path / "log.jsonl", [{"ts": t, "key": k, "n": n} for n, (t, k) in enumerate(timeline)]
    )
    with mock.patch.object(_replay, "_BATCH", batch):
        code, out, err = run_cli(["replay", str(log), *options], capsys)
        assert (code, err) == (0, "")
        code, summary, err = run_cli(["replay", str(log), *options, "--format", "summary"], capsys)
        assert (code, err) == (0, "")
    return _rows(out), json.loads(summary)


# ----------------------------------------------------------- hand-made logs, by mode


@pytest.mark.parametrize("batch", BATCHES)
def test_throttle_both_edges_and_its_cool_downs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], batch: int
) -> None:
    timeline = [(0, "a"), (3, "a"), (10, "a"), (10, "b"), (20, "a"), (45, "a")]
    rows, summary = _replay_cli(
        tmp_path, capsys, timeline, ["--mode", "throttle", "--interval", "10"], batch
    )
    assert rows == [
        # a's first ping fires at once and opens [0, 10); the ping at 3 waits for its end.
        ("a", 0, 0, 0, 1, "leading", "leading"),
        # At 10 the window ends: the ping at 3 fires, and opens the cool-down [10, 20).
        # The ping at exactly 10 is in that cool-down, not a new leading edge.
        ("a", 10, 3, 1, 1, "trailing", "interval"),
        ("b", 10, 10, 3, 1, "leading", "leading"),
        # The cool-down's end fires its ping (10) and opens [20, 30), which the ping at
        # exactly 20 joins; its end fires it and opens [30, 40), which ends empty.
        ("a", 20, 10, 2, 1, "trailing", "interval"),
        ("a", 30, 20, 4, 1, "trailing", "interval"),
        # No window is open at 45: a leading edge again.
        ("a", 45, 45, 5, 1, "leading", "leading"),
        # b's window [10, 20) had no later ping: no trailing fire.
    ]
    assert (summary["events"], summary["fires"], summary["dropped_pings"]) == (6, 6, 0)


@pytest.mark.parametrize("batch", BATCHES)
def test_throttle_without_a_trailing_edge_drops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], batch: int
) -> None:
    timeline = [(0, "a"), (3, "a"), (10, "a"), (19.5, "a"), (20, "a")]
    options = ["--mode", "throttle", "--interval", "10", "--no-trailing"]
    rows, summary = _replay_cli(tmp_path, capsys, timeline, options, batch)
    assert rows == [
        ("a", 0, 0, 0, 1, "leading", "leading"),  # 3 is dropped
        ("a", 10, 10, 2, 1, "leading", "leading"),  # at exactly the end: a new window
        ("a", 20, 20, 4, 1, "leading", "leading"),  # 19.5 is dropped; 20 opens the next
    ]
    assert (summary["events"], summary["fires"], summary["dropped_pings"]) == (5, 3, 2)
    assert summary["latency_max"] == 0


@pytest.mark.parametrize(
    "options",
    [
        ["--mode", "audit", "--interval", "10"],
        ["--mode", "throttle", "--interval", "10", "--no-leading"],
    ],
)
@pytest.mark.parametrize("batch", BATCHES)
def test_audit_fires_the_latest_at_the_end_of_each_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], batch: int
) -> None:
    timeline = [(0, "a"), (4, "a"), (10, "a"), (12, "a"), (30, "a")]
    rows, summary = _replay_cli(tmp_path, capsys, timeline, options, batch)
    assert rows == [
        ("a", 10, 0, 1, 2, "trailing", "interval"),  # the latest of [0, 10)
        ("a", 20, 10, 3, 2, "trailing", "interval"),  # 10 opened [10, 20): the tie rule
        ("a", 40, 30, 4, 1, "trailing", "interval"),
    ]
    assert (summary["fires"], summary["dropped_pings"], summary["latency_max"]) == (3, 0, 10)


def _size(event: Any) -> int:
    """An item's size as the coordinator counts it against max_bytes
    (``JsonSerializer``: compact JSON, ASCII-escaped, in UTF-8)."""
    return len(json.dumps(event, separators=(",", ":")).encode("utf-8"))


@pytest.mark.parametrize("batch", BATCHES)
def test_batch_fires_at_max_items_max_wait_and_before_max_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], batch: int
) -> None:
    events: list[dict[str, Any]] = [
        {"ts": 0, "key": "a", "n": 0},
        {"ts": 1, "key": "a", "n": 1},
        {"ts": 2, "key": "a", "n": 2},
        {"ts": 5, "key": "a", "n": 3},
        {"ts": 15, "key": "a", "n": 4},
        {"ts": 16, "key": "a", "n": 5, "pad": "x" * 40},
    ]
    # The premise: the first three items fit in 90 bytes; the item at 15 and the
    # padded one do not.
    sizes = [_size(e) for e in events]
    assert sizes == [24, 24, 24, 24, 25, 74]
    log = write_lines(tmp_path / "log.jsonl", events)
    options = ["--mode", "batch", "--max-wait", "10", "--max-items", "3", "--max-bytes", "90"]
    with mock.patch.object(_replay, "_BATCH", batch):
        code, out, err = run_cli(["replay", str(log), *options], capsys)
    assert (code, err) == (0, "")
    assert _rows(out) == [
        ("a", 2, 0, [0, 1, 2], 3, "trailing", "max-items"),  # the third item's instant
        # 5 opens [5, 15); the item at exactly 15 belongs to the next batch.
        ("a", 15, 5, [3], 1, "trailing", "max-wait"),
        # The padded item would take the batch past 90 bytes: the batch fires first,
        # at that instant, and the item opens the next one.
        ("a", 16, 15, [4], 1, "trailing", "max-bytes"),
        ("a", 26, 16, [5], 1, "trailing", "max-wait"),
    ]
    # The payload is the list of the whole events, in order.
    assert json.loads(out.splitlines()[0])["payload"] == events[:3]


def test_batch_event_larger_than_max_bytes_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_lines(
        tmp_path / "log.jsonl", [{"ts": 0, "key": "a"}, {"ts": 1, "key": "a", "pad": "x" * 80}]
    )
    options = ["--mode", "batch", "--max-wait", "10", "--max-bytes", "50"]
    code, out, err = run_cli(["replay", str(log), *options], capsys)
    assert (code, out) == (2, "")
    assert "line 2: the event is 107 bytes as JSON, more than --max-bytes 50" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("batch", BATCHES)
def test_rate_limit_fixed_windows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], batch: int
) -> None:
    timeline = [(0, "a"), (0, "a"), (0, "a"), (3, "b"), (5, "a"), (10, "a"), (12, "a"), (15, "a")]
    rows, summary = _replay_cli(
        tmp_path,
        capsys,
        timeline,
        ["--mode", "rate-limit", "--limit", "2", "--period", "10"],
        batch,
    )
    assert rows == [
        # [0, 10): the first two pings at 0 fire, each its own fire, in input order;
        # the third at 0 and the one at 5 are dropped.
        ("a", 0, 0, 0, 1, "leading", "leading"),
        ("a", 0, 0, 1, 1, "leading", "leading"),
        ("b", 3, 3, 3, 1, "leading", "leading"),
        # 10 is exactly the end: it opens [10, 20), where 10 and 12 fire and 15 drops.
        ("a", 10, 10, 5, 1, "leading", "leading"),
        ("a", 12, 12, 6, 1, "leading", "leading"),
    ]
    assert (summary["events"], summary["fires"], summary["dropped_pings"]) == (8, 5, 3)


def test_debounce_fires_carry_their_reason_and_drop_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timeline = [(0, "a"), (1, "a"), (2, "a"), (10, "b")]
    rows, summary = _replay_cli(
        tmp_path, capsys, timeline, ["--delay", "1.5", "--max-delay", "2", "--mode", "both"], 8192
    )
    assert rows == [
        ("a", 0, 0, 0, 1, "leading", "leading"),
        ("a", 2, 0, 1, 2, "trailing", "max-delay"),  # the ping at 2 is the next window's
        ("a", 2, 2, 2, 1, "leading", "leading"),
        ("b", 10, 10, 3, 1, "leading", "leading"),
    ]
    assert summary["dropped_pings"] == 0
    rows, _ = _replay_cli(tmp_path, capsys, timeline, ["--delay", "1.5"], 8192)
    assert [(r[1], r[6]) for r in rows] == [(3.5, "delay"), (11.5, "delay")]


# ------------------------------------------------------- the reference log, by mode

#: Each flow mode on ../shared/data/nats-py-commits.jsonl (docs/cli.rst, "Reference
#: figures"): the options, the model's parameters, and the figures (fires, dropped
#: pings, latency p50, latency max), which the model computes independently.
FLOW_REFERENCE = [
    pytest.param(
        ["--mode", "throttle", "--interval", "3600"],
        ("throttle", {"interval": 3600}),
        (1222, 0, 0, 3600),
        id="throttle",
    ),
    pytest.param(
        ["--mode", "throttle", "--interval", "3600", "--no-trailing"],
        ("throttle", {"interval": 3600, "trailing": False}),
        (1051, 270, 0, 0),
        id="throttle-no-trailing",
    ),
    pytest.param(
        ["--mode", "audit", "--interval", "3600"],
        ("throttle", {"interval": 3600, "leading": False}),
        (1051, 0, 3600, 3600),
        id="audit",
    ),
    pytest.param(
        ["--mode", "batch", "--max-wait", "3600", "--max-items", "4", "--max-bytes", "200"],
        ("batch", {"max_wait": 3600, "max_items": 4, "max_bytes": 200}),
        (1067, 0, 3600, 3600),
        id="batch",
    ),
    pytest.param(
        ["--mode", "rate-limit", "--limit", "2", "--period", "3600"],
        ("rate_limit", {"limit": 2, "period": 3600}),
        (1226, 95, 0, 0),
        id="rate-limit",
    ),
]


def _model_fires(
    events: list[dict[str, Any]], method: str, params: dict[str, Any]
) -> list[FlowFire]:
    """The reference model's fires for ``events`` (the payload the CLI pings with is
    the whole event), in output order: by time, then key (stable: a key's fires at one
    instant keep the model's order)."""
    model = FlowModel()
    for event in events:
        ident = ("replay", event["key"])
        if method == "batch":
            model.batch(event["ts"], ident, event, size=_size(event), **params)
        else:
            getattr(model, method)(event["ts"], ident, event, **params)
    model.advance(math.inf)
    return sorted(model.fires, key=lambda f: (f.fired_at, f.ident[1]))


@pytest.mark.parametrize(("options", "model", "figures"), FLOW_REFERENCE)
def test_reference_log_replays_as_the_model_fires(
    nats_py_log: Path,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    model: tuple[str, dict[str, Any]],
    figures: tuple[int, int, int, int],
) -> None:
    events = [json.loads(line) for line in nats_py_log.read_text().splitlines()]
    expected = [
        (f.fired_at, f.ident[1], f.payload, f.ping_count, f.edge, f.reason)
        for f in _model_fires(events, *model)
    ]
    outputs = []
    for _ in range(2):
        code, out, err = run_cli(["replay", str(nats_py_log), *options], capsys)
        assert (code, err) == (0, "")
        outputs.append(out)
    assert outputs[0] == outputs[1]  # deterministic, to the byte
    fires = [json.loads(line) for line in outputs[0].splitlines()]
    got = [
        (f["fired_at"], f["key"], f["payload"], f["pings"], f["edge"], f["reason"]) for f in fires
    ]
    assert got == expected
    # Every event is in one fire, or dropped.
    model_dropped = len(events) - sum(f[3] for f in expected)
    code, out, _ = run_cli(["replay", str(nats_py_log), *options, "--format", "summary"], capsys)
    summary = json.loads(out)
    assert summary["events"] == 1321
    assert (
        summary["fires"],
        summary["dropped_pings"],
        summary["latency_p50"],
        summary["latency_max"],
    ) == figures
    assert figures[:2] == (len(expected), model_dropped)


# ------------------------------------------------------------ against the model


def _flow_options(
    mode: str, span: int, extra: int, flag: bool
) -> tuple[FlowOptions, str, dict[str, Any]]:
    """A flow mode with its parameters: the replay's options, and the model's."""
    if mode == "throttle":
        return (
            FlowOptions("throttle", span, trailing=flag),
            "throttle",
            {"interval": span, "trailing": flag},
        )
    if mode == "audit":
        return FlowOptions("audit", span), "throttle", {"interval": span, "leading": False}
    if mode == "batch":
        max_bytes = 60 if flag else None
        return (
            FlowOptions("batch", span, max_items=extra, max_bytes=max_bytes),
            "batch",
            {"max_wait": span, "max_items": extra, "max_bytes": max_bytes},
        )
    return (
        FlowOptions("rate-limit", span, limit=extra),
        "rate_limit",
        {"limit": extra, "period": span},
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.sampled_from("ab"), st.integers(0, 12)),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from(["throttle", "audit", "batch", "rate-limit"]),
    st.integers(1, 6),
    st.integers(1, 4),
    st.booleans(),
    st.sampled_from(BATCHES),
)
def test_flow_replay_matches_the_model_on_a_grid_of_ties(
    raw: list[tuple[int, str, int]], mode: str, span: int, extra: int, flag: bool, batch: int
) -> None:
    # Integer times and spans: pings fall exactly on window ends, cool-down ends and
    # batch ages all the time; items of several sizes meet the byte bound.
    events = [
        Event(float(ts), key, {"n": i, "pad": "x" * pad}, i + 1)
        for i, (ts, key, pad) in enumerate(sorted(raw, key=lambda e: e[0]))
    ]
    flow, method, params = _flow_options(mode, span, extra, flag)
    model = FlowModel()
    for e in events:
        if method == "batch":
            model.batch(e.ts, ("replay", e.key), e.payload, size=_size(e.payload), **params)
        else:
            getattr(model, method)(e.ts, ("replay", e.key), e.payload, **params)
    model.advance(math.inf)
    expected = [
        (f.fired_at, f.ident[1], f.payload, f.ping_count, f.edge, f.reason)
        for f in sorted(model.fires, key=lambda f: (f.fired_at, f.ident[1]))
    ]
    with mock.patch.object(_replay, "_BATCH", batch):
        result = replay(events, flow=flow)
    got = [(f.fired_at, f.key, f.payload, f.pings, f.edge, f.reason) for f in result.fires]
    assert got == expected
    assert result.dropped_pings == model.dropped
    assert result.events == len(events)


def test_flow_replay_output_does_not_depend_on_the_checkpoint_interval(nats_py_log: Path) -> None:
    def fires(batch: int) -> list[Any]:
        lines = nats_py_log.read_text().splitlines()
        events = read_events(lines, key_field="key", time_field="ts", sort=False)
        with mock.patch.object(_replay, "_BATCH", batch):
            result = replay(events, flow=FlowOptions("throttle", 600))
        return [f.to_json() for f in result.fires]

    every_event = fires(1)
    assert len(every_event) > 1000
    assert fires(_replay._BATCH) == every_event


# ------------------------------------------------------------------ the options


@pytest.mark.parametrize(
    ("options", "named"),
    [
        # a flow mode's own options
        (["--mode", "throttle"], "--mode throttle needs --interval"),
        (["--mode", "audit"], "--mode audit needs --interval"),
        (["--mode", "batch"], "--mode batch needs --max-wait"),
        (["--mode", "rate-limit", "--limit", "2"], "--mode rate-limit needs --period"),
        (["--mode", "rate-limit", "--period", "2"], "--mode rate-limit needs --limit"),
        (["--mode", "throttle", "--interval", "0"], "--interval must be > 0"),
        (["--mode", "throttle", "--interval", "-1"], "--interval must be > 0"),
        (["--mode", "throttle", "--interval", "inf"], "--interval must be finite"),
        (["--mode", "audit", "--interval", "nan"], "--interval must not be NaN"),
        (["--mode", "throttle", "--interval", "x"], "argument --interval: invalid float value"),
        (["--mode", "batch", "--max-wait", "0"], "--max-wait must be > 0"),
        (["--mode", "batch", "--max-wait", "1", "--max-items", "0"], "--max-items must be >= 1"),
        (["--mode", "batch", "--max-wait", "1", "--max-bytes", "0"], "--max-bytes must be >= 1"),
        (["--mode", "batch", "--max-wait", "1", "--max-items", "1.5"], "invalid int value"),
        (["--mode", "rate-limit", "--limit", "0", "--period", "1"], "--limit must be >= 1"),
        (["--mode", "rate-limit", "--limit", "1", "--period", "0"], "--period must be > 0"),
        (
            ["--mode", "throttle", "--interval", "1", "--no-leading", "--no-trailing"],
            "--no-leading and --no-trailing",
        ),
        # another flow mode's options
        (
            ["--mode", "throttle", "--interval", "1", "--limit", "2"],
            "--limit is an option of --mode rate-limit",
        ),
        (
            ["--mode", "batch", "--max-wait", "1", "--interval", "2"],
            "--interval is an option of --mode throttle and audit",
        ),
        (
            ["--mode", "audit", "--interval", "1", "--no-trailing"],
            "--mode audit is throttle --no-leading",
        ),
        (
            ["--mode", "rate-limit", "--limit", "1", "--period", "1", "--max-items", "2"],
            "--max-items is an option of --mode batch",
        ),
        # debounce options with a flow mode, even at their defaults
        (
            ["--mode", "throttle", "--interval", "1", "--delay", "1"],
            "--delay is an option of the debounce modes",
        ),
        (
            ["--mode", "throttle", "--interval", "1", "--delay", "0"],
            "--delay is an option of the debounce modes",
        ),
        (["--mode", "audit", "--interval", "1", "--max-delay", "1"], "--max-delay is an option"),
        (["--mode", "batch", "--max-wait", "1", "--max-count", "2"], "--max-count is an option"),
        (["--mode", "batch", "--max-wait", "1", "--payload", "last"], "--payload is an option"),
        (["--mode", "batch", "--max-wait", "1", "--overlap", "allow"], "--overlap is an option"),
        (["--mode", "batch", "--max-wait", "1", "--run-time", "0"], "--run-time is an option"),
        (
            ["--mode", "rate-limit", "--limit", "1", "--period", "1", "--order-field", "n"],
            "--order-field is an option",
        ),
        # flow options with a debounce mode
        (
            ["--delay", "1", "--interval", "1"],
            "--interval is an option of --mode throttle and audit, not of --mode trailing",
        ),
        (
            ["--mode", "both", "--delay", "1", "--no-trailing"],
            "--no-trailing is an option of --mode throttle",
        ),
        (
            ["--mode", "leading", "--delay", "1", "--max-wait", "1"],
            "--max-wait is an option of --mode batch",
        ),
        (["--mode", "trailing"], "--mode trailing needs --delay"),
        (["--mode", "sideways", "--delay", "1"], "invalid choice: 'sideways'"),
    ],
)
def test_options_of_another_mode_and_bad_values_exit_2_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], named: str
) -> None:
    log = write_lines(tmp_path / "e.jsonl", [{"ts": 0, "key": "a"}])
    code, out, err = run_cli(["replay", str(log), *options], capsys)
    assert (code, out) == (2, "")
    assert "usage: trio-debounce replay" in err
    assert named in err
    assert "Traceback" not in err


def test_a_time_plus_the_interval_beyond_float_resolution_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_lines(tmp_path / "e.jsonl", [{"ts": 4.5e15, "key": "a"}])
    code, out, err = run_cli(
        ["replay", str(log), "--mode", "throttle", "--interval", "0.25"], capsys
    )
    assert (code, out) == (2, "")
    assert "line 1: time 4500000000000000 plus the --interval 0.25 cannot be represented" in err


def test_flow_summary_of_empty_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    code, out, _ = run_cli(
        [
            "replay",
            str(log),
            "--mode",
            "rate-limit",
            "--limit",
            "1",
            "--period",
            "1",
            "--format",
            "summary",
        ],
        capsys,
    )
    assert code == 0
    assert json.loads(out) == {
        "events": 0,
        "fires": 0,
        "coalescing_ratio": None,
        "latency_p50": None,
        "latency_p95": None,
        "latency_max": None,
        "dropped_pings": 0,
    }
