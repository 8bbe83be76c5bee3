"""``trio-debounce run``: a live stream on the real clock, in a real process.

These tests need a real process and real time (stdin, signals, commands), so they are
the suite's only tests that sleep for real; the delays are short.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and sh"),
]

CLI = [sys.executable, "-m", "trio_debounce"]


def run(args: list[str], stdin: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "run", *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


def test_plain_lines_are_keys_and_payloads() -> None:
    before = time.time()
    proc = run(["--delay", "0.2"], "a\nb\na\n")
    after = time.time()
    assert (proc.returncode, proc.stderr) == (0, "")
    fires = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda f: f["key"])
    assert [(f["key"], f["payload"], f["pings"], f["edge"], f["reason"]) for f in fires] == [
        ("a", "a", 2, "trailing", "delay"),
        ("b", "b", 1, "trailing", "delay"),
    ]
    for f in fires:
        # wall-clock epoch seconds
        assert before <= f["first_ping_at"] < f["fired_at"] <= after
        assert f["fired_at"] - f["first_ping_at"] >= 0.2 - 1e-6


def test_json_lines_with_a_key_field_and_a_bad_line() -> None:
    lines = [
        json.dumps({"k": "x", "n": 1}),
        "{broken",
        json.dumps({"k": 5}),
        json.dumps({"k": "x", "n": 2}),
        "",
    ]
    proc = run(["--delay", "0.1", "--mode", "both", "--key-field", "k"], "\n".join(lines) + "\n")
    assert proc.returncode == 2  # some lines were rejected; the stream went on
    assert "line 2: not valid JSON" in proc.stderr
    assert "line 3: key field 'k' must be a JSON string" in proc.stderr
    assert "line 5: not valid JSON" in proc.stderr
    fires = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(f["edge"], f["payload"], f["pings"]) for f in fires] == [
        ("leading", {"k": "x", "n": 1}, 1),
        ("trailing", {"k": "x", "n": 2}, 2),
    ]


def test_command_per_fire_with_payload_and_environment(tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = f'cat >> "{out}"; echo "$TRIO_DEBOUNCE_KEY $TRIO_DEBOUNCE_PINGS" >> "{out}"'
    proc = run(["--delay", "0.1", "--", "sh", "-c", script], "k1\nk1\nk1\n")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert out.read_text() == "k1\nk1 3\n"


def test_a_failing_command_is_reported_and_the_stream_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = f'read line; echo "$line" >> "{out}"; [ "$line" != bad ] || exit 3'
    proc = run(["--delay", "0", "--", "sh", "-c", script], "bad\ngood\n")
    assert proc.returncode == 1  # a command failed
    assert "key 'bad': command exited with status 3" in proc.stderr
    assert sorted(out.read_text().split()) == ["bad", "good"]
    missing = run(["--delay", "0", "--", str(tmp_path / "no-such-command")], "a\n")
    assert missing.returncode == 1
    assert "cannot run command" in missing.stderr


@pytest.mark.parametrize(("jobs", "overlap"), [(1, False), (3, True)])
def test_jobs_bounds_concurrent_commands(tmp_path: Path, jobs: int, overlap: bool) -> None:
    lock, log = tmp_path / "lock", tmp_path / "log"
    script = (
        f'mkdir "{lock}" 2>/dev/null || echo overlap >> "{log}"; '
        f'sleep 0.3; rmdir "{lock}" 2>/dev/null; true'
    )
    proc = run(["--delay", "0", "--jobs", str(jobs), "--", "sh", "-c", script], "a\nb\nc\n")
    assert proc.returncode == 0
    assert log.exists() == overlap


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--delay", "-1"], "--delay must be >= 0"),
        (["--delay", "1", "--jobs", "0"], "--jobs must be >= 1"),
        (["--delay", "2", "--max-delay", "1"], "--max-delay must be >= --delay"),
    ],
)
def test_bad_options_exit_2(options: list[str], message: str) -> None:
    proc = run(options, "")
    assert proc.returncode == 2
    assert "usage:" in proc.stderr
    assert message in proc.stderr


# ------------------------------------------------------------ flow-control modes


def test_throttle_fires_a_leading_edge_then_the_latest_at_the_interval() -> None:
    proc = run(["--mode", "throttle", "--interval", "0.3"], "a\na\na\nb\n")
    assert (proc.returncode, proc.stderr) == (0, "")
    fires = sorted(
        (json.loads(line) for line in proc.stdout.splitlines()),
        key=lambda f: (f["key"], f["fired_at"]),
    )
    assert [(f["key"], f["pings"], f["edge"], f["reason"]) for f in fires] == [
        ("a", 1, "leading", "leading"),
        ("a", 2, "trailing", "interval"),  # the pings after the leading fire, at its end
        ("b", 1, "leading", "leading"),
    ]
    # the trailing fire is one interval after the leading one (logical times)
    assert fires[1]["fired_at"] - fires[0]["fired_at"] == pytest.approx(0.3, abs=1e-3)


def test_batch_runs_the_command_with_one_line_per_event(tmp_path: Path) -> None:
    out = tmp_path / "out"
    lines = [json.dumps({"k": "x", "n": n}) for n in range(3)]
    script = f'echo "$TRIO_DEBOUNCE_PINGS $TRIO_DEBOUNCE_REASON" >> "{out}"; cat >> "{out}"'
    args = ["--mode", "batch", "--max-wait", "0.2", "--max-items", "2", "--key-field", "k"]
    proc = run([*args, "--", "sh", "-c", script], "\n".join(lines) + "\n")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    # the first two fill the batch; the third waits for --max-wait
    assert out.read_text().splitlines() == [
        "2 max-items",
        lines[0],
        lines[1],
        "1 max-wait",
        lines[2],
    ]


def test_rate_limit_drops_past_the_limit_and_batch_refuses_a_large_event() -> None:
    proc = run(["--mode", "rate-limit", "--limit", "2", "--period", "60"], "a\na\na\n")
    assert (proc.returncode, proc.stderr) == (0, "")
    fires = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(f["payload"], f["edge"], f["reason"]) for f in fires] == [
        ("a", "leading", "leading")
    ] * 2
    # A batch item is the line (a JSON string without --key-field): 18 bytes here.
    proc = run(
        ["--mode", "batch", "--max-wait", "0.1", "--max-bytes", "10"], "abcdefghijklmnop\na\n"
    )
    assert proc.returncode == 2  # a line was rejected; the stream went on
    assert "line 1: the event is 18 bytes as JSON, more than --max-bytes 10; skipped" in proc.stderr
    [fire] = [json.loads(line) for line in proc.stdout.splitlines()]
    assert (fire["payload"], fire["pings"], fire["reason"]) == (["a"], 1, "max-wait")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--mode", "audit", "--interval", "1", "--delay", "1"],
            "--delay is an option of the debounce modes",
        ),
        (["--mode", "batch"], "--mode batch needs --max-wait"),
        (["--delay", "1", "--limit", "2"], "--limit is an option of --mode rate-limit"),
    ],
)
def test_flow_mode_usage_errors_exit_2(options: list[str], message: str) -> None:
    proc = run(options, "a\n")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert "usage: trio-debounce run" in proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def _unread(fd: int) -> int:
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])


#: Runs the CLI with SIGINT at its default, as a shell gives a foreground job: a test
#: run started in the background of a non-interactive shell has SIGINT ignored, and a
#: child inherits that (Python then leaves Ctrl-C ignored, as it should).
_FOREGROUND = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _start(args: list[str], command: str = "run") -> subprocess.Popen[str]:
    # Used as a context manager, which closes the pipes and reaps the process.
    return subprocess.Popen(
        [sys.executable, "-c", _FOREGROUND, *CLI[1:], command, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.realtime
def test_ctrl_c_while_blocked_reading_stdin_exits_130_within_a_second() -> None:
    with _start(["--delay", "0"]) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.write("ready\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["key"] == "ready"
        # stdin stays open: the process is blocked reading it
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=5) == 130
        assert time.monotonic() - start < 1.0


@pytest.mark.realtime
def test_ctrl_c_while_a_command_runs_exits_130(tmp_path: Path) -> None:
    started = tmp_path / "started"
    with _start(["--delay", "0", "--", "sh", "-c", f'touch "{started}"; sleep 30']) as proc:
        assert proc.stdin is not None
        proc.stdin.write("k\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 10
        while not started.exists():
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.01)
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=5) == 130
        assert time.monotonic() - start < 1.0


def test_closed_stdout_stops_the_stream_with_status_1() -> None:
    with _start(["--delay", "0"]) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        assert proc.stderr is not None
        proc.stdin.write("first\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["key"] == "first"
        proc.stdout.close()  # like `| head -1`
        proc.stdin.write("second\n")  # its fire finds no reader; stdin stays open
        proc.stdin.flush()
        assert proc.wait(timeout=10) == 1
        assert proc.stderr.read() == ""


def test_a_key_that_cannot_go_into_the_environment_is_reported(tmp_path: Path) -> None:
    line = json.dumps({"k": "nul\u0000byte"})
    proc = run(["--delay", "0", "--key-field", "k", "--", "true"], line + "\n")
    assert proc.returncode == 1  # the command could not start
    assert "cannot run command" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_closed_stdin_is_an_error() -> None:
    proc = subprocess.run(
        [*CLI, "run", "--delay", "0"],
        stdin=None,
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=lambda: os.close(0),
    )
    assert proc.returncode == 2
    assert "stdin is closed" in proc.stderr


def test_ctrl_c_while_replay_reads_stdin_exits_130() -> None:
    with _start(["-", "--delay", "1"], command="replay") as proc:
        assert proc.stdin is not None
        proc.stdin.write('{"key": "a", "ts": 1}\n')
        proc.stdin.flush()
        # Wait until the process has read the line, so it is past start-up and blocked
        # reading the rest of stdin (FIONREAD on a pipe: bytes not yet read).
        deadline = time.monotonic() + 20
        while _unread(proc.stdin.fileno()):
            assert time.monotonic() < deadline, "replay never read its input"
            time.sleep(0.01)
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=5) == 130
        assert proc.stderr is not None
        assert "Traceback" not in proc.stderr.read()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_output_that_cannot_be_written_stops_with_status_1() -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [*CLI, "run", "--delay", "0"],
            input="a\nb\n",
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 1
    assert "cannot write output" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_non_blocking_stdin_is_read_all_the_same() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)  # as some parents leave it
    with subprocess.Popen(
        [*CLI, "run", "--delay", "0"], stdin=r, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        os.close(r)
        time.sleep(0.3)  # the reader finds no data yet
        os.write(w, b"a\nb\n")
        os.close(w)
        out, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (0, b"")
    assert sorted(json.loads(line)["key"] for line in out.splitlines()) == ["a", "b"]
