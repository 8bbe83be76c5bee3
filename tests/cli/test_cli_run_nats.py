"""``trio-debounce run --backend``: windows shared by real processes through a real
nats-server (the ``nats_server`` fixture; never a mock).

Like tests/cli/test_cli_run.py these run real processes on the real clock. The delays are
short and every wait has a generous bound; processes are killed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest

from tests.harness.nats_server import NatsServer, NatsServerFactory, free_port

CLI = [sys.executable, "-m", "trio_debounce"]

DELAY = 0.5
KEYS = ["alpha", "beta", "gamma"]
ROUNDS = 4  # pings per key per process


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI process: no TRIO_DEBOUNCE_* inherited from the
    developer's shell (a token or bucket there would change the test), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_DEBOUNCE_")}
    env.update(extra)
    return env


class Peer:
    """One ``trio-debounce run`` process, its stdout read line by line by a thread."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [*CLI, "run", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr = ""
        self._out = threading.Thread(target=self._read_stdout, daemon=True)
        self._err = threading.Thread(target=self._read_stderr, daemon=True)
        self._out.start()
        self._err.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def next_fire(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no fire line within {timeout} s; stderr so far: {self.stderr!r}")
        assert line is not None, f"stdout closed early; stderr: {self.stderr!r}"
        fire: dict[str, Any] = json.loads(line)
        return fire

    def finish(self, timeout: float) -> list[dict[str, Any]]:
        """Close stdin, wait for the exit, and return the fire lines not yet read."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=timeout)
        self._out.join(timeout)
        self._err.join(timeout)
        fires = []
        while (line := self.lines.get_nowait()) is not None:
            fires.append(json.loads(line))
        return fires

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None and not stream.closed:
                with contextlib.suppress(OSError):  # a broken pipe on flush
                    stream.close()


@pytest.mark.realtime
@pytest.mark.slow
def test_three_processes_fire_each_burst_once(nats_server: NatsServer) -> None:
    start = time.monotonic()
    bucket = f"cli-{uuid.uuid4().hex[:12]}"
    env = child_env(TRIO_DEBOUNCE_CONNECT_TIMEOUT="5")
    options = ["--delay", str(DELAY), "--key-field", "key"]
    options += ["--backend", nats_server.url, "--bucket", bucket]
    peers: list[Peer] = []
    try:
        for index in range(3):
            peers.append(Peer([*options, "--process-id", f"peer-{index}"], env))
        # Each process pings a key of its own and prints its fire once it is up and
        # connected: only then may the shared burst start (lines written earlier
        # would wait in the pipe and reach the bucket later, in another window).
        for index, peer in enumerate(peers):
            peer.send({"key": f"ready-{index}"})
        for index, peer in enumerate(peers):
            ready = peer.next_fire(timeout=10)
            assert (ready["key"], ready["pings"]) == (f"ready-{index}", 1)

        # The burst: every process pings every key ROUNDS times, interleaved, over
        # about 0.15 s (well inside DELAY, so each key's pings make one window).
        burst_start = time.time()
        sent: dict[str, list[dict[str, Any]]] = {key: [] for key in KEYS}
        for round_ in range(ROUNDS):
            # A longer gap before the last round, so that its pings are stored last.
            time.sleep(0.15 if round_ == ROUNDS - 1 else 0.05)
            for index, peer in enumerate(peers):
                for key in KEYS:
                    event = {"key": key, "peer": index, "n": round_}
                    sent[key].append(event)
                    peer.send(event)
        burst_end = time.time()
        assert burst_end - burst_start < DELAY

        time.sleep(DELAY + 1.0)  # silence: every window is due, and fired
        silence_end = time.time()
        printed = [(index, fire) for index, peer in enumerate(peers) for fire in peer.finish(10)]
        for peer in peers:
            assert peer.proc.returncode == 0, peer.stderr
            assert peer.stderr == ""
    finally:
        for peer in peers:
            peer.kill()

    assert sorted(fire["key"] for _, fire in printed) == KEYS  # one fire per burst
    for _, fire in printed:
        assert fire["pings"] == 3 * ROUNDS  # the count across the three processes
        assert fire["edge"] == "trailing"
        # the latest stored payload, whichever process sent it: one of the last round
        assert fire["payload"] in sent[fire["key"]]
        assert fire["payload"]["n"] == ROUNDS - 1
        # a trailing fire DELAY after the burst's last ping, before stdin was closed
        assert burst_start <= fire["first_ping_at"] < burst_end
        assert fire["fired_at"] - fire["first_ping_at"] >= DELAY - 0.05
        assert fire["fired_at"] <= silence_end
    assert time.monotonic() - start < 20


@pytest.mark.realtime
@pytest.mark.slow
def test_no_server_exits_2_with_one_line_within_connect_timeout() -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    proc = subprocess.run(
        [*CLI, "run", "--delay", "0.1", "--backend", f"nats://127.0.0.1:{port}"],
        input="a\n",
        capture_output=True,
        text=True,
        timeout=20,
        env=child_env(TRIO_DEBOUNCE_CONNECT_TIMEOUT="1"),
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("trio-debounce: error: cannot start the backend: ")
    assert f"no NATS server answered within 1.0 s (tried nats://127.0.0.1:{port})" in proc.stderr
    assert 1.0 <= elapsed < 6.0  # the connect timeout, plus start-up and shutdown


@pytest.mark.realtime
@pytest.mark.slow
def test_refused_credentials_exit_2_with_one_line_at_once(
    nats_server_factory: NatsServerFactory,
) -> None:
    server = nats_server_factory(token="right")
    start = time.monotonic()
    proc = subprocess.run(
        [*CLI, "run", "--delay", "0.1", "--backend", server.url],
        input="a\n",
        capture_output=True,
        text=True,
        timeout=20,
        env=child_env(TRIO_DEBOUNCE_NATS_TOKEN="wrong", TRIO_DEBOUNCE_CONNECT_TIMEOUT="10"),
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (
        "trio-debounce: error: cannot start the backend: connect: NATS refused the credentials\n"
    )
    assert "wrong" not in proc.stderr
    assert time.monotonic() - start < 6.0  # refused at once, not after the timeout


@pytest.mark.slow
def test_two_processes_share_a_rate_limit_and_a_throttle(nats_server: NatsServer) -> None:
    # --mode with --backend: one window per key across both processes. The rate limit
    # lets 2 fires through among the 6 events; the throttle fires B's first event as
    # its leading edge, A's later ones once as the trailing edge.
    bucket = f"cli-{uuid.uuid4().hex[:12]}"
    env = child_env(TRIO_DEBOUNCE_CONNECT_TIMEOUT="5")
    common = ["--key-field", "key", "--backend", nats_server.url, "--bucket", bucket]
    rate = ["--mode", "rate-limit", "--limit", "2", "--period", "60", *common]
    throttle = ["--mode", "throttle", "--interval", "1", *common]
    peers: list[Peer] = []
    try:
        peers = [
            Peer([*rate, "--process-id", "rate-a"], env),
            Peer([*rate, "--process-id", "rate-b"], env),
            Peer([*throttle, "--process-id", "thr-a"], env),
            Peer([*throttle, "--process-id", "thr-b"], env),
        ]
        ra, rb, ta, tb = peers
        # Each is connected once a key of its own has fired (at once: a leading edge).
        for index, peer in enumerate(peers):
            peer.send({"key": f"ready-{index}"})
        for index, peer in enumerate(peers):
            assert peer.next_fire(timeout=10)["key"] == f"ready-{index}"
        ra.send({"key": "r", "n": 0})
        assert ra.next_fire(timeout=10)["payload"]["n"] == 0  # the window's first fire
        for n in range(1, 6):
            (rb, ra)[n % 2].send({"key": "r", "n": n})
        tb.send({"key": "t", "n": 0})
        assert tb.next_fire(timeout=10)["reason"] == "leading"
        for n in (1, 2):
            ta.send({"key": "t", "n": n})
        time.sleep(2.0)  # the throttle's interval has ended; every rate event is in
        printed = [fire for peer in peers for fire in peer.finish(10)]
        for peer in peers:
            assert peer.proc.returncode == 0, peer.stderr
    finally:
        for peer in peers:
            peer.kill()
    rated = [f for f in printed if f["key"] == "r"]
    assert len(rated) == 1  # the second of the window's two fires (the first read above)
    assert rated[0]["reason"] == "leading"
    throttled = [(f["payload"]["n"], f["pings"], f["reason"]) for f in printed if f["key"] == "t"]
    assert throttled == [(2, 2, "interval")]


@pytest.mark.slow
def test_a_key_the_bucket_cannot_hold_is_a_bad_line(nats_server: NatsServer) -> None:
    lines = [
        json.dumps({"k": "x" * 2000}),  # too long once encoded as a KV key
        '{"k": "\\ud800"}',  # valid JSON, but a lone surrogate
        json.dumps({"k": "ok"}),
    ]
    proc = subprocess.run(
        [*CLI, "run", "--delay", "0.1", "--key-field", "k", "--backend", nats_server.url],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=20,
        env=child_env(TRIO_DEBOUNCE_NATS_BUCKET=f"cli-{uuid.uuid4().hex[:12]}"),
    )
    assert proc.returncode == 2  # lines were rejected; the stream went on
    assert [json.loads(line)["key"] for line in proc.stdout.splitlines()] == ["ok"]
    errors = proc.stderr.splitlines()
    assert len(errors) == 2, proc.stderr
    assert errors[0].startswith("trio-debounce: line 1: ")
    assert "too long" in errors[0]
    assert errors[1].startswith("trio-debounce: line 2: ")
    assert "lone surrogate" in errors[1]


@pytest.mark.slow
def test_replay_has_no_backend_option() -> None:
    proc = subprocess.run(
        [*CLI, "replay", "-", "--delay", "1", "--backend", "nats://127.0.0.1:4222"],
        input='{"key": "a", "ts": 1}\n',
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "unrecognized arguments: --backend" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        (["--bucket", "b"], {}, "--bucket needs --backend"),
        (["--process-id", "p"], {}, "--process-id needs --backend"),
        (["--backend", "http://127.0.0.1:1"], {}, "URLs must start with nats:// or tls://"),
        (["--backend", " , "], {}, "--backend must name at least one server URL"),
        (["--backend", "nats://127.0.0.1:1", "--bucket", "a.b"], {}, "bucket must match"),
        (
            ["--backend", "nats://127.0.0.1:1"],
            {"TRIO_DEBOUNCE_OP_TIMEOUT": "soon"},
            "TRIO_DEBOUNCE_OP_TIMEOUT must be seconds, got 'soon'",
        ),
    ],
)
def test_bad_backend_options_exit_2_before_connecting(
    options: list[str], env: dict[str, str], message: str
) -> None:
    proc = subprocess.run(
        [*CLI, "run", "--delay", "0.1", *options],
        input="a\n",
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(**env),
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
