"""``trio-debounce replay``: reference figures on real data, output format, bad input."""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness.env import REQUIRE_SHARED_ENV, shared_file
from tests.harness.model import Model, Options
from trio_debounce._cli import _replay, main
from trio_debounce._cli._events import Event
from trio_debounce._cli._replay import read_events, replay


def run_cli(
    args: list[str],
    capsys: pytest.CaptureFixture[str],
    stdin: str | None = None,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> tuple[int, str, str]:
    if stdin is not None:
        assert monkeypatch is not None
        fake = io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8")))
        monkeypatch.setattr(sys, "stdin", fake)
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    code = info.value.code
    assert isinstance(code, int)
    return code, out, err


def write_lines(path: Path, events: list[Any]) -> Path:
    path.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in events))
    return path


#: Checkpoint intervals of the replay (see _replay._BATCH): after every event, every
#: few events (tasks run behind the clock, and a window may be pinged again before its
#: task starts), and the default (a short log is one batch: tasks run only at exit).
BATCHES = [1, 3, _replay._BATCH]

# The table in ../shared/README.md, computed by an independent model of the rules.
REFERENCE = [
    (["--mode", "trailing", "--delay", "600", "--max-delay", "3600"], 1162, 600, 1625),
    (["--mode", "trailing", "--delay", "3600", "--max-delay", "7200"], 1041, 3600, 7200),
    (["--mode", "trailing", "--delay", "3600"], 1039, 3600, 12287),
    (["--mode", "leading", "--delay", "3600", "--max-delay", "7200"], 1041, 0, 0),
    (["--mode", "both", "--delay", "3600", "--max-delay", "7200"], 1212, 0, 7200),
]


@pytest.mark.parametrize(("options", "fires", "p50", "latency_max"), REFERENCE)
def test_replay_of_the_reference_log_matches_every_row(
    nats_py_log: Path,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    fires: int,
    p50: int,
    latency_max: int,
) -> None:
    code, out, err = run_cli(["replay", str(nats_py_log), *options, "--format", "summary"], capsys)
    assert (code, err) == (0, "")
    summary = json.loads(out)
    assert summary["events"] == 1321
    assert (summary["fires"], summary["latency_p50"], summary["latency_max"]) == (
        fires,
        p50,
        latency_max,
    )
    assert summary["coalescing_ratio"] == pytest.approx(1 - fires / 1321)
    # The jsonl output agrees with the summary, in order, with whole events as payloads.
    code, out, _ = run_cli(["replay", str(nats_py_log), *options], capsys)
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == fires
    assert max(f["fired_at"] - f["first_ping_at"] for f in lines) == latency_max
    order = [(f["fired_at"], f["key"]) for f in lines]
    assert order == sorted(order)
    assert all(set(f["payload"]) == {"ts", "key", "id"} for f in lines)
    # The fields, in a stable order, the reason last.
    assert all(
        list(f) == ["key", "fired_at", "first_ping_at", "payload", "pings", "edge", "reason"]
        for f in lines
    )
    assert {(f["edge"], f["reason"]) for f in lines} <= {
        ("leading", "leading"),
        ("trailing", "delay"),
        ("trailing", "max-delay"),
    }
    assert summary["dropped_pings"] == 0
    if options[1] == "trailing":
        # every event lands in exactly one window, and every trailing window fires once
        assert sum(f["pings"] for f in lines) == 1321


@pytest.mark.parametrize("mode", ["trailing", "both"])
def test_replay_output_does_not_depend_on_the_checkpoint_interval(
    nats_py_log: Path, mode: str
) -> None:
    # Tasks run every _BATCH events, behind the replay's clock; the fires are the same
    # as when they run after every event, whatever the interval.
    def fires(batch: int) -> list[Any]:
        lines = nats_py_log.read_text().splitlines()
        events = read_events(lines, key_field="key", time_field="ts", sort=False)
        with mock.patch.object(_replay, "_BATCH", batch):
            result = replay(events, delay=600, max_delay=3600, mode=mode)
        return [f.to_json() for f in result.fires]

    every_event = fires(1)
    assert len(every_event) > 1000
    assert fires(7) == every_event
    assert fires(_replay._BATCH) == every_event


def test_jsonl_output_shape_and_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_lines(
        tmp_path / "log.jsonl",
        [
            {"ts": 100, "key": "b", "n": 1},
            {"ts": 100, "key": "a", "n": 2},
            {"ts": 101, "key": "b", "n": 3},
            {"ts": 110, "key": "a", "n": 4},  # a's first window is due at 110: new window
        ],
    )
    code, out, err = run_cli(["replay", str(log), "--delay", "10"], capsys)
    assert (code, err) == (0, "")
    assert [json.loads(line) for line in out.splitlines()] == [
        {
            "key": "a",
            "fired_at": 110,
            "first_ping_at": 100,
            "payload": {"ts": 100, "key": "a", "n": 2},
            "pings": 1,
            "edge": "trailing",
            "reason": "delay",
        },
        {
            "key": "b",
            "fired_at": 111,
            "first_ping_at": 100,
            "payload": {"ts": 101, "key": "b", "n": 3},
            "pings": 2,
            "edge": "trailing",
            "reason": "delay",
        },
        {
            "key": "a",
            "fired_at": 120,
            "first_ping_at": 110,
            "payload": {"ts": 110, "key": "a", "n": 4},
            "pings": 1,
            "edge": "trailing",
            "reason": "delay",
        },
    ]


def test_equal_keys_same_time_fire_in_window_opening_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # delay 0: every event is its own window; equal (fired_at, key) keep input order.
    log = write_lines(tmp_path / "log.jsonl", [{"ts": 5, "key": "k", "n": n} for n in range(5)])
    code, out, _ = run_cli(["replay", str(log), "--delay", "0", "--mode", "both"], capsys)
    assert code == 0
    fires = [json.loads(line) for line in out.splitlines()]
    assert [f["payload"]["n"] for f in fires] == [0, 1, 2, 3, 4]
    assert {f["edge"] for f in fires} == {"leading"}


def test_custom_fields_fractional_and_negative_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_lines(
        tmp_path / "log.jsonl",
        [{"when": -10.5, "id": "x"}, {"when": -10.25, "id": "x"}, {"when": 3, "id": "y"}],
    )
    code, out, _ = run_cli(
        ["replay", str(log), "--delay", "0.5", "--key-field", "id", "--time-field", "when"],
        capsys,
    )
    assert code == 0
    fires = [json.loads(line) for line in out.splitlines()]
    assert [(f["key"], f["fired_at"], f["first_ping_at"], f["pings"]) for f in fires] == [
        ("x", -9.75, -10.5, 2),
        ("y", 3.5, 3, 1),
    ]


def test_summary_of_empty_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    code, out, _ = run_cli(["replay", str(log), "--delay", "1", "--format", "summary"], capsys)
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


def test_stdin_input(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = '{"ts": 1, "key": "k"}\n{"ts": 2, "key": "k"}\n'
    code, out, _ = run_cli(
        ["replay", "-", "--delay", "5", "--format", "summary"],
        capsys,
        stdin=text,
        monkeypatch=monkeypatch,
    )
    assert code == 0
    summary = json.loads(out)
    assert (summary["events"], summary["fires"], summary["latency_max"]) == (2, 1, 6)


def test_decreasing_time_is_an_error_unless_sort(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_lines(
        tmp_path / "log.jsonl",
        [
            {"ts": 10, "key": "a", "n": 0},
            {"ts": 5, "key": "a", "n": 1},
            {"ts": 5, "key": "a", "n": 2},
        ],
    )
    code, out, err = run_cli(["replay", str(log), "--delay", "1"], capsys)
    assert (code, out) == (2, "")
    assert "line 2" in err
    assert "--sort" in err
    code, out, err = run_cli(["replay", str(log), "--delay", "1", "--sort"], capsys)
    assert code == 0
    fires = [json.loads(line) for line in out.splitlines()]
    # stable: the two events at ts 5 keep their input order, so n=2 is the latest
    assert [(f["fired_at"], f["payload"]["n"], f["pings"]) for f in fires] == [
        (6, 2, 2),
        (11, 0, 1),
    ]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"key": "a"}', "missing time field 'ts'"),
        ('{"ts": 1}', "missing key field 'key'"),
        ('{"ts": "1", "key": "a"}', "time field 'ts' must be a JSON number"),
        ('{"ts": true, "key": "a"}', "time field 'ts' must be a JSON number"),
        ('{"ts": NaN, "key": "a"}', "NaN is not a JSON value"),
        ('{"ts": 1e999, "key": "a"}', "out of range"),
        ('{"ts": 1, "key": "a", "x": -Infinity}', "-Infinity is not a JSON value"),
        ('{"ts": 1, "key": "a", "x": ' + "[" * 100000 + "]" * 100000 + "}", "nested too deeply"),
        ('{"ts": 1, "key": "a", "x": ' + "9" * 5000 + "}", "not valid JSON"),
        ('{"ts": 9007199254740992, "key": "a"}', "below 2**53"),
        ('{"ts": 1e300, "key": "a"}', "below 2**53"),
        ('{"ts": 1, "key": 7}', "key field 'key' must be a JSON string"),
        ('{"ts": 1, "key": null}', "key field 'key' must be a JSON string"),
        ('{"ts": 1, "key": ""}', "empty string"),
        ("", "not valid JSON"),
    ],
)
def test_bad_lines_exit_2_naming_line_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, reason: str
) -> None:
    log = write_lines(tmp_path / "log.jsonl", [{"ts": 0, "key": "ok"}, line])
    code, out, err = run_cli(["replay", str(log), "--delay", "1"], capsys)
    assert (code, out) == (2, "")
    assert "line 2:" in err
    assert reason in err


def test_non_utf8_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.jsonl"
    log.write_bytes(b'{"ts": 0, "key": "a"}\n{"ts": 1, "key": "\xff"}\n')
    code, out, err = run_cli(["replay", str(log), "--delay", "1"], capsys)
    assert (code, out) == (2, "")
    assert "line 2: not UTF-8" in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--delay", "-1"], "--delay must be >= 0"),
        (["--delay", "nan"], "--delay must not be NaN"),
        (["--delay", "inf"], "--delay must be finite"),
        (["--delay", "abc"], "invalid float value"),
        (["--delay", "5", "--max-delay", "1"], "--max-delay must be >= --delay"),
        (["--delay", "1", "--mode", "middle"], "invalid choice"),
        (["--delay", "1", "--key-field", ""], "--key-field must not be empty"),
        ([], "--delay"),
    ],
)
def test_bad_options_exit_2_with_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    log = write_lines(tmp_path / "log.jsonl", [{"ts": 0, "key": "ok"}])
    code, out, err = run_cli(["replay", str(log), *options], capsys)
    assert (code, out) == (2, "")
    assert "usage: trio-debounce replay" in err
    assert message in err


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["replay", str(tmp_path / "nope.jsonl"), "--delay", "1"], capsys)
    assert (code, out) == (2, "")
    assert "nope.jsonl" in err


def test_missing_shared_data_skips_or_fails_in_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "shared" / "data" / "absent.jsonl"
    monkeypatch.delenv(REQUIRE_SHARED_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="absent"):
        shared_file(missing)
    monkeypatch.setenv(REQUIRE_SHARED_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=REQUIRE_SHARED_ENV):
        shared_file(missing)


@pytest.mark.slow
def test_closed_stdout_exits_1_quietly(nats_py_log: Path) -> None:
    import subprocess

    with subprocess.Popen(
        [sys.executable, "-m", "trio_debounce", "replay", str(nats_py_log), "--delay", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()  # like `| head -1`
        err = proc.stderr.read()
        assert proc.wait(timeout=30) == 1
    assert json.loads(first)["key"] == "readme.md"
    assert err == b""


@pytest.mark.parametrize(
    ("events", "options", "reason"),
    [
        # 4.5e15 + 0.25 rounds back to 4.5e15: the delay would be lost silently
        ([{"ts": 4.5e15, "key": "a"}], ["--delay", "0.25"], "cannot be represented"),
        ([{"ts": 0, "key": "a"}, {"ts": 2**52, "key": "a"}], ["--delay", "0.5"], "line 2"),
        ([{"ts": 4.5e15, "key": "a"}], ["--delay", "0", "--max-delay", "0.25"], "max delay"),
    ],
)
def test_times_beyond_float_resolution_are_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    events: list[Any],
    options: list[str],
    reason: str,
) -> None:
    log = write_lines(tmp_path / "log.jsonl", events)
    code, out, err = run_cli(["replay", str(log), *options], capsys)
    assert (code, out) == (2, "")
    assert reason in err


def test_huge_but_representable_durations_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_lines(tmp_path / "log.jsonl", [{"ts": 0, "key": "a"}, {"ts": 2**52, "key": "a"}])
    code, out, _ = run_cli(["replay", str(log), "--delay", "1e308"], capsys)
    assert code == 0
    [fire] = [json.loads(line) for line in out.splitlines()]
    assert (fire["pings"], fire["fired_at"]) == (2, 1e308)


def test_a_ping_exactly_at_a_fractional_deadline_opens_a_new_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1.671 + 0.3 == 1.971 exactly in binary floating point, so the third event lands on
    # the window's deadline and must open a new window; times print as they came in.
    assert 1.671 + 0.3 == 1.971
    log = write_lines(
        tmp_path / "log.jsonl",
        [{"ts": 0.3, "key": "x"}, {"ts": 1.671, "key": "a"}, {"ts": 1.971, "key": "a"}],
    )
    code, out, _ = run_cli(["replay", str(log), "--delay", "0.3"], capsys)
    assert code == 0
    fires = [json.loads(line) for line in out.splitlines()]
    assert [(f["key"], f["first_ping_at"], f["fired_at"], f["pings"]) for f in fires] == [
        ("x", 0.3, 0.3 + 0.3, 1),
        ("a", 1.671, 1.971, 1),
        ("a", 1.971, 1.971 + 0.3, 1),
    ]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-3000, 3000), st.sampled_from("abc")), min_size=1, max_size=30),
    st.sampled_from(["trailing", "leading", "both"]),
    st.integers(0, 1500),
    st.one_of(st.none(), st.integers(0, 3000)),
    st.sampled_from(BATCHES),
)
def test_replay_matches_the_model_on_fractional_and_negative_times(
    raw: list[tuple[int, str]], mode: str, delay_ms: int, extra_ms: int | None, batch: int
) -> None:
    # Times in thousandths: decimal fractions that binary floats cannot hold exactly.
    events = [Event(ts / 1000, key, {"n": i}, i + 1) for i, (ts, key) in enumerate(sorted(raw))]
    delay = delay_ms / 1000
    max_delay = None if extra_ms is None else delay + extra_ms / 1000
    model = Model()
    for i, e in enumerate(events):
        model.ping(e.ts, ("replay", e.key), e.payload, delay, max_delay, mode, str(i))
    model.finish(math.inf)
    expected = sorted(
        (f.fired_at, f.key[1], f.first_ping_at, f.ping_count, f.edge, f.payload["n"])
        for f in model.fires
    )
    with mock.patch.object(_replay, "_BATCH", batch):
        result = replay(events, delay=delay, max_delay=max_delay, mode=mode)
    got = sorted(
        (f.fired_at, f.key, f.first_ping_at, f.pings, f.edge, f.payload["n"]) for f in result.fires
    )
    assert got == expected


# -------------------------------------------------------------------- window options


def _lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


def test_replay_max_count_payload_and_order_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_lines(
        tmp_path / "e.jsonl",
        [
            {"ts": 0, "key": "a", "seq": 3},
            {"ts": 1, "key": "a", "seq": 1},
            {"ts": 2, "key": "a", "seq": 2},
            {"ts": 3, "key": "a", "seq": 0},
        ],
    )
    code, out, _ = run_cli(["replay", str(log), "--delay", "5", "--max-count", "3"], capsys)
    assert code == 0
    assert [(f["fired_at"], f["pings"], f["payload"]["seq"]) for f in _lines(out)] == [
        (2, 3, 2),  # due at the third ping
        (8, 1, 0),
    ]
    code, out, _ = run_cli(["replay", str(log), "--delay", "5", "--payload", "first"], capsys)
    assert [f["payload"]["seq"] for f in _lines(out)] == [3]
    code, out, _ = run_cli(["replay", str(log), "--delay", "5", "--payload", "collect"], capsys)
    assert [[p["seq"] for p in f["payload"]] for f in _lines(out)] == [[3, 1, 2, 0]]
    code, out, _ = run_cli(
        ["replay", str(log), "--delay", "5", "--payload", "collect", "--order-field", "seq"],
        capsys,
    )
    assert [[p["seq"] for p in f["payload"]] for f in _lines(out)] == [[0, 1, 2, 3]]
    code, out, _ = run_cli(["replay", str(log), "--delay", "5", "--order-field", "seq"], capsys)
    assert [f["payload"]["seq"] for f in _lines(out)] == [3]  # the highest, not the last


def test_replay_overlap_queue_latest_with_run_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_lines(
        tmp_path / "e.jsonl", [{"ts": t, "key": "a", "n": i} for i, t in enumerate([0, 2, 3, 4])]
    )
    base = ["replay", str(log), "--delay", "0.5", "--run-time", "10"]
    code, out, _ = run_cli(base, capsys)
    assert code == 0
    # runs may overlap: every ping fires after its delay
    assert [f["fired_at"] for f in _lines(out)] == [0.5, 2.5, 3.5, 4.5]
    code, out, _ = run_cli([*base, "--overlap", "queue-latest"], capsys)
    assert [(f["fired_at"], f["pings"], f["payload"]["n"]) for f in _lines(out)] == [
        (0.5, 1, 0),
        (10.5, 3, 3),  # waited for the first run, absorbing the pings at 2, 3 and 4
    ]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--max-count", "0"], "--max-count must be >= 1, got 0"),
        (["--run-time", "-1"], "--run-time must be >= 0"),
        (["--overlap", "queue-latest", "--mode", "leading"], "needs --mode 'trailing'"),
        (["--order-field", ""], "--order-field must not be empty"),
        (["--payload", "sum"], "invalid choice: 'sum'"),
    ],
)
def test_replay_bad_window_options_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], named: str
) -> None:
    log = write_lines(tmp_path / "e.jsonl", [{"ts": 0, "key": "a"}])
    code, out, err = run_cli(["replay", str(log), "--delay", "1", *options], capsys)
    assert (code, out) == (2, "")
    assert named in err


def test_replay_order_field_must_be_a_number_on_every_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_lines(
        tmp_path / "e.jsonl",
        [{"ts": 0, "key": "a", "seq": 1}, {"ts": 1, "key": "a", "seq": "2"}],
    )
    code, out, err = run_cli(["replay", str(log), "--delay", "1", "--order-field", "seq"], capsys)
    assert (code, out) == (2, "")
    assert "line 2: order field 'seq' must be a JSON number, got '2'" in err
    log = write_lines(tmp_path / "f.jsonl", [{"ts": 0, "key": "a"}])
    code, out, err = run_cli(["replay", str(log), "--delay", "1", "--order-field", "seq"], capsys)
    assert (code, out) == (2, "")
    assert "line 1: missing order field 'seq'" in err


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from("ab"), st.integers(0, 4)),
        min_size=1,
        max_size=30,
    ),
    st.integers(0, 6),
    st.sampled_from([None, 1, 2, 3]),
    st.sampled_from(["last", "first", "collect"]),
    st.sampled_from(["allow", "queue-latest"]),
    st.sampled_from([0.0, 1 / 1024, 3 + 1 / 1024, 8 + 1 / 1024, 1.0, 3.0]),
    st.booleans(),
    st.sampled_from(BATCHES),
)
def test_replay_with_options_matches_the_model(
    raw: list[tuple[int, str, int]],
    delay: int,
    max_count: int | None,
    payload: str,
    overlap: str,
    run_time: float,
    ordered: bool,
    batch: int,
) -> None:
    # Integer times; runs end off the integer grid, or on it (1.0, 3.0): the replay
    # decides a run's end by time, before a ping at the same instant, as the model does.
    events = [
        Event(float(ts), key, {"n": i, "seq": seq}, i + 1)
        for i, (ts, key, seq) in enumerate(sorted(raw))
    ]
    opts = Options(max_count=max_count, payload_policy=payload, overlap=overlap)
    model = Model(run_times={str(i): run_time for i in range(len(events))})
    for i, e in enumerate(events):
        order = e.payload["seq"] if ordered else None
        model.ping(e.ts, ("replay", e.key), e.payload, delay, None, "trailing", str(i), opts, order)
    model.finish(math.inf)

    def ns(payload: Any) -> Any:
        return [p["n"] for p in payload] if isinstance(payload, list) else payload["n"]

    expected = sorted(
        (f.fired_at, f.key[1], f.first_ping_at, f.ping_count, f.edge, str(ns(f.payload)))
        for f in model.fires
    )
    with mock.patch.object(_replay, "_BATCH", batch):
        result = replay(
            events,
            delay=delay,
            max_count=max_count,
            payload_policy=payload,
            overlap=overlap,
            run_time=run_time,
            order_field="seq" if ordered else None,
        )
    got = sorted(
        (f.fired_at, f.key, f.first_ping_at, f.pings, f.edge, str(ns(f.payload)))
        for f in result.fires
    )
    assert got == expected


# ------------------------------------------- queue-latest with run times: ties by time

#: (fired_at, key, first_ping_at, pings, payload "n") of one fire.
QueueFire = tuple[float, str, float, int, int]


def _queue_latest_fires(result: _replay.ReplayResult) -> list[QueueFire]:
    return [(f.fired_at, f.key, f.first_ping_at, f.pings, f.payload["n"]) for f in result.fires]


@dataclass
class _RefWindow:
    first: float
    deadline: float
    order: int  # index of the event that opened it
    pings: int = 1
    n: int = 0  # the latest event's "n"


def _by_time(events: list[Event], delay: float, run_time: float) -> list[QueueFire]:
    """A tiny by-time reference of trailing ``queue-latest`` with payload "last".

    A window fires at max(its deadline, the end of its key's run), and a run ends at
    its fire time + ``run_time``. A fire at or before an event's time happens before
    the event (the event then opens the next window); a window whose deadline has come
    while the run goes on waits, and an event joins it without moving its deadline.
    """
    fires: list[tuple[float, str, int, QueueFire]] = []
    windows: dict[str, _RefWindow] = {}
    run_end: dict[str, float] = {}

    def fire_at(key: str) -> float:
        return max(windows[key].deadline, run_end.get(key, -math.inf))

    def fire(key: str) -> None:
        at = fire_at(key)
        w = windows.pop(key)
        run_end[key] = at + run_time
        fires.append((at, key, w.order, (at, key, w.first, w.pings, w.n)))

    for i, e in enumerate(events):
        if e.key in windows and fire_at(e.key) <= e.ts:
            fire(e.key)
        w = windows.get(e.key)
        if w is None:
            windows[e.key] = _RefWindow(e.ts, e.ts + delay, i, n=e.payload["n"])
            continue
        w.pings += 1
        w.n = e.payload["n"]
        if w.deadline > e.ts:  # not due yet: the ping moves the deadline
            w.deadline = e.ts + delay
    for key in list(windows):
        fire(key)
    return [f for *_, f in sorted(fires)]


def _events(timeline: list[tuple[float, str]]) -> list[Event]:
    return [Event(float(ts), key, {"n": i}, i + 1) for i, (ts, key) in enumerate(timeline)]


# Each case: delay 1, run time 2, one or more keys, ties of an event with a run's end.
QUEUE_LATEST_TIES = [
    pytest.param(
        [(0, "a"), (1.5, "a"), (3, "a")],
        [
            # 0 opens a window, due at 1: it fires at 1, and its run lasts until 3.
            (1, "a", 0, 1, 0),
            # 1.5 opens a window, due at 2.5 while the run goes on: it waits, and fires
            # when the run ends at 3, before the event at 3. Its run lasts until 5.
            (3, "a", 1.5, 1, 1),
            # The event at 3 opens the next window (due at 4), which waits until 5.
            (5, "a", 3, 1, 2),
        ],
        id="event-at-the-end-of-a-run-with-a-waiting-window",
    ),
    pytest.param(
        [(0, "a"), (2, "a"), (3, "a")],
        [
            (1, "a", 0, 1, 0),  # the run: 1 to 3
            # 2 opens a window due at 3, the instant the run ends: it fires at 3, before
            # the event at 3 (its deadline and the run's end both come first).
            (3, "a", 2, 1, 1),  # the run: 3 to 5
            (5, "a", 3, 1, 2),  # the event at 3: due at 4, waits until 5
        ],
        id="event-at-a-deadline-and-the-end-of-a-run",
    ),
    pytest.param(
        [(0, "a"), (1, "a")],
        [
            # The window is due at 1: it fires at 1, before the event at 1.
            (1, "a", 0, 1, 0),  # the run: 1 to 3
            (3, "a", 1, 1, 1),  # the event at 1: due at 2, waits until 3
        ],
        id="event-at-a-deadline",
    ),
    pytest.param(
        [(0, "a"), (1.5, "a"), (3, "a"), (3, "a"), (4.5, "a")],
        [
            (1, "a", 0, 1, 0),  # the run: 1 to 3
            (3, "a", 1.5, 1, 1),  # waited from 2.5; fires at 3; the run: 3 to 5
            # Both events at 3 come after that fire: the first opens a window (due at
            # 4), the second joins it; it waits from 4, the event at 4.5 joins it too,
            # and it fires when the run ends at 5.
            (5, "a", 3, 3, 4),
        ],
        id="two-events-at-the-end-of-a-run",
    ),
    pytest.param(
        [(0, "a"), (0, "b"), (1.5, "a"), (1.5, "b"), (3, "b"), (3, "a"), (3, "c")],
        [
            # a and b each follow the first case, at the same instants; c has no run.
            (1, "a", 0, 1, 0),
            (1, "b", 0, 1, 1),
            (3, "a", 1.5, 1, 2),
            (3, "b", 1.5, 1, 3),
            (4, "c", 3, 1, 6),
            (5, "a", 3, 1, 5),
            (5, "b", 3, 1, 4),
        ],
        id="several-keys",
    ),
]


@pytest.mark.parametrize(("timeline", "expected"), QUEUE_LATEST_TIES)
def test_queue_latest_run_end_ties_replay_one_by_time_output(
    timeline: list[tuple[float, str]], expected: list[QueueFire]
) -> None:
    # A run ends at its fire time + run time, and that end (with the fire of the window
    # waiting for it) comes before an event at the same instant, on every replay: Trio
    # runs tasks woken at one instant in a random order, so replay many times.
    events = _events(timeline)
    outputs = {
        tuple(_queue_latest_fires(replay(events, delay=1, overlap="queue-latest", run_time=2)))
        for _ in range(50)
    }
    assert outputs == {tuple(expected)}
    assert expected == _by_time(events, 1, 2)


def test_queue_latest_run_end_tie_cli_prints_one_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_lines(tmp_path / "e.jsonl", [{"ts": t, "key": "a"} for t in (0, 1.5, 3)])
    args = ["replay", str(log), "--delay", "1", "--overlap", "queue-latest", "--run-time", "2"]
    outputs = set()
    for _ in range(50):
        code, out, err = run_cli(args, capsys)
        assert (code, err) == (0, "")
        outputs.add(out)
    assert len(outputs) == 1
    assert [(f["fired_at"], f["first_ping_at"], f["pings"]) for f in _lines(outputs.pop())] == [
        (1, 0, 1),
        (3, 1.5, 1),
        (5, 3, 1),
    ]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 12), st.sampled_from("ab")), min_size=1, max_size=12),
    st.sampled_from([1, 2, 3]),
    st.sampled_from([0, 1, 2, 3]),
)
def test_queue_latest_replay_on_a_grid_of_ties_is_by_time(
    raw: list[tuple[int, str]], delay: int, run_time: int
) -> None:
    # Integer times, delays and run times: runs end, windows fall due and events come
    # at the same instants. Two replays agree, and with the by-time reference.
    events = _events(sorted(raw))
    first, second = (
        _queue_latest_fires(replay(events, delay=delay, overlap="queue-latest", run_time=run_time))
        for _ in range(2)
    )
    assert first == second
    assert first == _by_time(events, delay, run_time)


@pytest.mark.parametrize(
    ("run_time", "expected"),
    [
        # Each event is due at once (max_count 1) and its run ends at once: each run
        # has ended before the next event at the same instant, which fires on its own.
        (0, [(0, "a", 0, 1, 0), (0, "a", 0, 1, 1), (0, "a", 0, 1, 2)]),
        # The first run lasts until 2: the second event's window is due at once and
        # waits, the third joins it, and it fires when the run ends.
        (2, [(0, "a", 0, 1, 0), (2, "a", 0, 2, 2)]),
    ],
)
def test_queue_latest_events_at_one_instant_follow_runs_ended_by_then(
    run_time: float, expected: list[QueueFire]
) -> None:
    events = _events([(0, "a"), (0, "a"), (0, "a")])
    outputs = {
        tuple(
            _queue_latest_fires(
                replay(events, delay=1, max_count=1, overlap="queue-latest", run_time=run_time)
            )
        )
        for _ in range(50)
    }
    assert outputs == {tuple(expected)}
