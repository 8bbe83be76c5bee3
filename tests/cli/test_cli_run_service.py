"""``trio-debounce run`` as a service: SIGTERM and SIGHUP, exit statuses, usage errors.

Real processes on the real clock, like tests/cli/test_cli_run.py: the CLI runs as a
subprocess and its COMMANDs are small shell or ``python -c`` programs. Every wait is
bounded, and timing bounds are generous (the machine may be loaded); a child that
outlives a test is killed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.nats_server import NatsServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and sh"),
]

CLI = [sys.executable, "-m", "trio_debounce"]

#: Starts the CLI with SIGINT, SIGTERM and SIGHUP at their default dispositions, as a
#: service manager or a shell's foreground job gives them: a test run started in the
#: background, or under nohup, would pass on an ignored signal, and the CLI leaves an
#: inherited SIG_IGN alone.
_DEFAULT_SIGNALS = (
    "import os, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "if sys.argv[1] == 'nohup':\n"
    "    signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)

#: How long a test waits for something that should take well under a second.
WAIT = 20.0


def child_env() -> dict[str, str]:
    """The CLI's environment, without TRIO_DEBOUNCE_* settings from the caller's shell."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TRIO_DEBOUNCE_")}


class Cli:
    """One ``trio-debounce run`` process; threads read its stdout and stderr by line."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, *, nohup: bool = False
    ) -> None:
        start = [sys.executable, "-c", _DEFAULT_SIGNALS, "nohup" if nohup else "-"]
        self.proc = subprocess.Popen(
            [*start, *CLI[1:], "run", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env() if env is None else env,
        )
        self.out: queue.Queue[str | None] = queue.Queue()
        self.err: queue.Queue[str | None] = queue.Queue()
        self.err_lines: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def fire(self) -> dict[str, Any]:
        """The next fire line on stdout."""
        try:
            line = self.out.get(timeout=WAIT)
        except queue.Empty:
            pytest.fail(f"no fire line within {WAIT} s; stderr: {self.stderr()!r}")
        assert line is not None, f"stdout closed early; stderr: {self.stderr()!r}"
        fire: dict[str, Any] = json.loads(line)
        return fire

    def err_line(self, containing: str) -> str:
        """Wait for a line on stderr that contains ``containing``."""
        deadline = time.monotonic() + WAIT
        while True:
            try:
                line = self.err.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {containing!r} on stderr within {WAIT} s: {self.err_lines}")
            assert line is not None, f"stderr closed without {containing!r}: {self.err_lines}"
            self.err_lines.append(line)
            if containing in line:
                return line

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = WAIT) -> int:
        return self.proc.wait(timeout=timeout)

    def rest_of_stdout(self) -> list[dict[str, Any]]:
        """The fire lines not read yet, once the process has exited."""
        self._threads[0].join(WAIT)
        fires = []
        while (line := self.out.get_nowait()) is not None:
            fires.append(json.loads(line))
        return fires

    def stderr(self) -> str:
        """Everything on stderr so far (all of it once the process has exited)."""
        if self.proc.poll() is not None:
            self._threads[1].join(WAIT)
        with contextlib.suppress(queue.Empty):
            while (line := self.err.get_nowait()) is not None:
                self.err_lines.append(line)
        return "".join(self.err_lines)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None and not stream.closed:
                with contextlib.suppress(OSError):
                    stream.close()


@contextlib.contextmanager
def cli(
    args: list[str], env: dict[str, str] | None = None, *, nohup: bool = False
) -> Iterator[Cli]:
    process = Cli(args, env, nohup=nohup)
    try:
        yield process
    finally:
        process.close()


def wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.01)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def killed_at_the_end(pid_file: Path) -> Iterator[None]:
    """Kill the process whose pid ``pid_file`` holds, if it outlives the test (as an
    orphaned COMMAND of a CLI that died would)."""
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


# ---------------------------------------------------------------- SIGTERM, SIGHUP


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_flushes_the_pending_windows_and_exits_143(signum: int) -> None:
    with cli(["--delay", "60", "--mode", "both"]) as run:
        run.send("a\n")
        assert run.fire()["key"] == "a"  # the leading fire: the CLI is up and reading
        # A second ping of a (its trailing fire is now pending), then b: b's leading
        # fire proves that a's ping was taken first.
        run.send("a\nb\n")
        leading_b = run.fire()
        assert (leading_b["key"], leading_b["edge"]) == ("b", "leading")
        start = time.monotonic()
        run.signal(signum)
        assert run.wait() == 143
        assert time.monotonic() - start < 10  # not the 60 s delay
        fires = run.rest_of_stdout()
        assert [(f["key"], f["edge"], f["pings"]) for f in fires] == [("a", "trailing", 2)]
        assert f"{signal.Signals(signum).name}: stopping" in run.stderr()


def test_an_ignored_sighup_stays_ignored() -> None:
    with cli(["--delay", "60", "--mode", "both"], nohup=True) as run:  # as nohup starts it
        run.send("a\n")
        assert run.fire()["key"] == "a"
        run.send("a\nb\n")
        assert run.fire()["key"] == "b"
        run.signal(signal.SIGHUP)
        run.send("c\n")  # still reading
        assert run.fire()["key"] == "c"
        run.signal(signal.SIGTERM)
        assert run.wait() == 143
        assert [(f["key"], f["edge"]) for f in run.rest_of_stdout()] == [("a", "trailing")]
        assert "SIGHUP" not in run.stderr()


def test_running_and_flushed_commands_finish_within_the_grace(tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = (
        f'read line; touch "{tmp_path}/started-$line"; sleep 1; '
        f'echo "$line $TRIO_DEBOUNCE_PINGS" >> "{out}"'
    )
    with cli(["--delay", "60", "--mode", "both", "--jobs", "2", "--", "sh", "-c", script]) as run:
        run.send("a\n")  # a's leading fire starts a command
        wait_for(tmp_path / "started-a", "the first command's start")
        # A second ping of a (its trailing fire is now pending), then b: b's leading
        # command starts, which proves that a's ping was taken first.
        run.send("a\nb\n")
        wait_for(tmp_path / "started-b", "the second command's start")
        start = time.monotonic()
        run.signal(signal.SIGTERM)
        assert run.wait() == 143
        elapsed = time.monotonic() - start
        # Every command ran to its end: the two running ones, and a's flushed one,
        # which started when one of them ended (--jobs 2).
        lines = out.read_text().splitlines()
        assert (sorted(lines), lines[-1]) == (["a 1", "a 2", "b 1"], "a 2")
        assert elapsed < 9  # well inside the default 10 s grace
        assert "SIGTERM: stopping: pending windows fire now" in run.stderr()


#: A COMMAND that ignores SIGTERM (noting it), records its pid, and sleeps.
STUBBORN = (
    "import os, signal, sys, time\n"
    "d = sys.argv[1]\n"
    "signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(d, 'term'), 'w').close())\n"
    "open(os.path.join(d, 'pid'), 'w').write(str(os.getpid()))\n"
    "open(os.path.join(d, 'started'), 'w').close()\n"
    "time.sleep(60)\n"
    "open(os.path.join(d, 'finished'), 'w').close()\n"
)


def test_a_command_that_outlasts_the_grace_gets_sigterm_then_sigkill(tmp_path: Path) -> None:
    command = ["--", sys.executable, "-c", STUBBORN, str(tmp_path)]
    with (
        killed_at_the_end(tmp_path / "pid"),
        cli(["--delay", "0", "--stop-grace", "0.5", *command]) as run,
    ):
        run.send("k\n")
        wait_for(tmp_path / "started", "the command's start")
        pid = int((tmp_path / "pid").read_text())
        start = time.monotonic()
        run.signal(signal.SIGTERM)
        assert run.wait() == 143
        elapsed = time.monotonic() - start
        assert (tmp_path / "term").exists()  # SIGTERM at the end of the grace...
        assert not pid_alive(pid)  # ...then SIGKILL: no orphan left running
        assert not (tmp_path / "finished").exists()
        assert 0.9 <= elapsed < 10  # 0.5 s of grace, 0.5 s after SIGTERM


def test_a_second_signal_skips_the_grace(tmp_path: Path) -> None:
    started, pid_file = tmp_path / "started", tmp_path / "pid"
    script = f'echo $$ > "{pid_file}"; touch "{started}"; exec sleep 60'
    with (
        killed_at_the_end(pid_file),
        cli(["--delay", "0", "--", "sh", "-c", script]) as run,
    ):
        run.send("k\n")
        wait_for(started, "the command's start")
        start = time.monotonic()
        run.signal(signal.SIGTERM)
        run.err_line("SIGTERM: stopping")  # the first signal was seen: the grace runs
        run.signal(signal.SIGTERM)
        assert run.wait() == 143
        assert time.monotonic() - start < 8  # not the default grace of 10 s
        assert not pid_alive(int(pid_file.read_text()))


def test_a_stop_signal_hands_shared_windows_off_to_a_peer(nats_server: NatsServer) -> None:
    # With a 30 s lease a peer takes a dead process's windows over only after 30 s or
    # more, but a handed-off window at its next look (a heartbeat: 10 s).
    env = {**child_env(), "TRIO_DEBOUNCE_LEASE": "30", "TRIO_DEBOUNCE_CONNECT_TIMEOUT": "5"}
    bucket = f"service-{uuid.uuid4().hex[:12]}"
    options = ["--delay", "3", "--mode", "both", "--key-field", "key"]
    options += ["--backend", nats_server.url, "--bucket", bucket]
    with (
        cli([*options, "--process-id", "peer"], env) as peer,
        cli([*options, "--process-id", "leaver"], env) as leaver,
    ):
        for name, process in (("peer", peer), ("leaver", leaver)):
            process.send(json.dumps({"key": f"ready-{name}"}) + "\n")
            assert process.fire()["key"] == f"ready-{name}"
        leaver.send(json.dumps({"key": "k", "n": 1}) + "\n")
        assert leaver.fire()["key"] == "k"  # the leading fire
        leaver.send(json.dumps({"key": "k", "n": 2}) + "\n" + json.dumps({"key": "sync"}) + "\n")
        assert leaver.fire()["key"] == "sync"  # k's second ping is stored
        leaver.signal(signal.SIGTERM)
        assert leaver.wait() == 143
        left = time.monotonic()
        assert leaver.rest_of_stdout() == []  # k's trailing fire was not run here
        taken = peer.fire()
        assert (taken["key"], taken["edge"], taken["pings"]) == ("k", "trailing", 2)
        assert taken["payload"] == {"key": "k", "n": 2}
        assert time.monotonic() - left < 25  # a hand-off, not a lapsed lease
        peer.proc.stdin.close()  # type: ignore[union-attr]
        assert peer.wait() == 0, peer.stderr()


def test_a_command_cut_short_by_a_stop_is_run_again_by_a_peer(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # The leaver's command outlasts the 10 s grace (exec: SIGTERM reaches the sleep
    # itself, so no grandchild holds the test's pipes); the peer's ends at once.
    script = (
        f'read line; echo "$WHO start" >> "{out}"; '
        f'[ "$WHO" = peer ] || exec sleep 60; echo "$WHO end" >> "{out}"'
    )
    env = {**child_env(), "TRIO_DEBOUNCE_LEASE": "9", "TRIO_DEBOUNCE_CONNECT_TIMEOUT": "5"}
    bucket = f"service-{uuid.uuid4().hex[:12]}"
    options = ["--delay", "0.2", "--backend", nats_server.url, "--bucket", bucket]
    command = ["--", "sh", "-c", script]
    with (
        cli([*options, "--process-id", "peer", *command], {**env, "WHO": "peer"}) as peer,
        cli([*options, "--process-id", "leaver", *command], {**env, "WHO": "leaver"}) as leaver,
    ):
        leaver.send("k\n")
        deadline = time.monotonic() + WAIT
        while "leaver start" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline, f"no command started: {leaver.stderr()!r}"
            time.sleep(0.05)
        start = time.monotonic()
        leaver.signal(signal.SIGTERM)
        leaver.err_line("SIGTERM: stopping: pending windows are handed off")
        leaver.signal(signal.SIGTERM)  # skip the grace
        assert leaver.wait() == 143
        assert time.monotonic() - start < 8
        assert "key 'k': stopping the command: SIGTERM" in leaver.stderr()
        # The fire's record stayed in the bucket: the peer runs it again, to its end.
        deadline = time.monotonic() + 40
        while "peer end" not in out.read_text():
            assert time.monotonic() < deadline, f"the peer never ran k: {peer.stderr()!r}"
            time.sleep(0.1)
        assert out.read_text().split("\n") == ["leaver start", "peer start", "peer end", ""]
        peer.proc.stdin.close()  # type: ignore[union-attr]
        assert peer.wait() == 0, peer.stderr()


# ---------------------------------------------------------------- exit statuses


def test_a_failing_command_makes_the_exit_status_1(tmp_path: Path) -> None:
    failing = [*CLI, "run", "--delay", "0", "--", "sh", "-c", "exit 3"]
    proc = subprocess.run(failing, input="a\n", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "key 'a': command exited with status 3" in proc.stderr
    missing = [*CLI, "run", "--delay", "0", "--", str(tmp_path / "no-such-command")]
    proc = subprocess.run(missing, input="a\n", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "cannot run command" in proc.stderr
    # A rejected line counts first: status 2.
    proc = subprocess.run(failing, input="\na\n", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "line 1: empty line" in proc.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_rejected_line_makes_the_status_2_even_when_output_fails() -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [*CLI, "run", "--delay", "0"],
            input="\na\n",  # line 1 is rejected (empty); a's fire cannot be written
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert "line 1: empty line" in proc.stderr
    assert "cannot write output" in proc.stderr


# ---------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    ("args", "stray"),
    [
        (["events.jsonl", "--delay", "1"], "events.jsonl"),
        (["--delay", "0", "echo", "hi"], "echo"),
        (["--delay", "0", "echo", "--", "true"], "echo"),
    ],
)
def test_a_positional_argument_without_dashes_is_a_usage_error(
    args: list[str], stray: str, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [*CLI, "run", *args], input="a\n", capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "usage:" in proc.stderr
    assert f"unexpected argument {stray!r}" in proc.stderr
    assert "--" in proc.stderr.split("unexpected argument", 1)[1]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "--stop-grace must be >= 0, got -1.0"),
        ("nan", "--stop-grace must not be NaN"),
        ("inf", "--stop-grace must be finite"),
        ("soon", "invalid float value: 'soon'"),
    ],
)
def test_a_bad_stop_grace_is_a_usage_error(value: str, message: str) -> None:
    proc = subprocess.run(
        [*CLI, "run", "--delay", "0", "--stop-grace", value],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "usage:" in proc.stderr
    assert message in proc.stderr
