"""Hostile input to the CLI: random mixes of good and bad lines.

``replay`` stops at the first bad line with exit status 2 and a message naming that
line (nothing on stdout); input with no bad line replays with status 0 and one JSON
line per fire. ``run`` reports each bad line by number and goes on (exit status 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cli.test_cli_replay import run_cli

#: Bad lines, each with the reason the CLI gives for it.
BAD_LINES = st.sampled_from(
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe\x00binary", "not UTF-8"),
        (b"\x00", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1]", "expected a JSON object"),
        (b'"key"', "expected a JSON object"),
        (b'{"key": "a"}', "missing time field"),
        (b'{"ts": 1}', "missing key field"),
        (b'{"ts": "1", "key": "a"}', "must be a JSON number"),
        (b'{"ts": null, "key": "a"}', "must be a JSON number"),
        (b'{"ts": NaN, "key": "a"}', "NaN is not a JSON value"),
        (b'{"ts": Infinity, "key": "a"}', "Infinity is not a JSON value"),
        (b'{"ts": 1e999, "key": "a"}', "out of range"),
        (b'{"ts": 1e300, "key": "a"}', "below 2**53"),
        (b'{"ts": ' + b"9" * 5000 + b', "key": "a"}', "not valid JSON"),
        (b'{"ts": 1, "key": ["a"]}', "must be a JSON string"),
        (b'{"ts": 1, "key": ""}', "empty string"),
        (b'{"ts": 1, "key": "a", "x": ' + b"[" * 200_000 + b"}", "not valid JSON"),
    ]
)

keys = st.one_of(
    st.sampled_from(["a", "b", "a.b", "*", ">", " ", "\u2028", "🙂", "x" * 200_000]),
    st.text(min_size=1, max_size=10),
)


@st.composite
def logs(draw: st.DrawFn) -> tuple[list[bytes], int | None, str]:
    """Lines of a log, the 1-based number of the first bad one (None: all good), and
    the reason the CLI gives for it."""
    lines: list[bytes] = []
    ts: float = draw(st.integers(-1000, 1000))
    bad_at: int | None = None
    reason = ""
    for _ in range(draw(st.integers(0, 8))):
        if bad_at is None and draw(st.integers(0, 5)) == 0:
            line, reason = draw(BAD_LINES)
            bad_at = len(lines) + 1
        elif bad_at is None and draw(st.integers(0, 8)) == 0 and lines:
            # a time earlier than the previous line's: refused without --sort
            line = json.dumps({"ts": ts - 1, "key": "a"}).encode()
            reason = "--sort"
            bad_at = len(lines) + 1
        else:
            ts += draw(st.sampled_from([0, 0.5, 1, 7, 10**6]))
            event = {"ts": ts, "key": draw(keys), "p": draw(st.integers())}
            line = json.dumps(event, ensure_ascii=draw(st.booleans())).encode()
        lines.append(line)
    return lines, bad_at, reason


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(log=logs(), mode=st.sampled_from(["trailing", "leading", "both"]))
def test_replay_of_hostile_input(
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    log: tuple[list[bytes], int | None, str],
    mode: str,
) -> None:
    lines, bad_at, reason = log
    path = tmp_path_factory.mktemp("log") / "log.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    code, out, err = run_cli(["replay", str(path), "--delay", "5", "--mode", mode], capsys)
    if bad_at is None:
        assert (code, err) == (0, "")
        fires = [json.loads(line) for line in out.splitlines()]
        assert all(f["pings"] >= 1 for f in fires)
        assert bool(fires) == bool(lines)
    else:
        assert (code, out) == (2, "")
        assert f"line {bad_at}:" in err
        assert reason in err
        assert len(err) < 2000  # the message does not echo a huge line


@pytest.mark.slow
def test_run_reports_each_hostile_line_and_goes_on(tmp_path: Path) -> None:
    lines = [
        json.dumps({"k": "x", "n": 1}).encode(),
        b"\xff\xfe binary",
        b'{"k": "' + b"y" * 1_000_000 + b'", "n": 2}',
        b'{"k": NaN}',
        b'{"k": ["x"]}',
        b"",
        json.dumps({"k": "x", "n": 3}).encode(),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "trio_debounce", "run", "--delay", "0.1", "--key-field", "k"],
        input=b"\n".join(lines) + b"\n",
        capture_output=True,
        timeout=60,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 2
    assert "line 2: not UTF-8" in err
    assert "line 4:" in err
    assert "line 5: key field 'k' must be a JSON string" in err
    assert "line 6: not valid JSON" in err
    assert "line 3" not in err  # a long line is a line like any other
    assert len(err) < 5000
    fires = sorted(
        (json.loads(line) for line in proc.stdout.splitlines()), key=lambda f: len(f["key"])
    )
    assert [(f["key"], f["payload"]["n"]) for f in fires] == [("x", 3), ("y" * 1_000_000, 2)]
