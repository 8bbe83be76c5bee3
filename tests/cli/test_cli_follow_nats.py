"""``trio-debounce windows --follow`` against a real nats-server (never a mock), with a
live ``trio-debounce run --backend`` process owning the windows, and the followers
connected as a read-only user with exactly the permissions docs/cli.rst lists.

Real processes on the real clock. Not timing-sensitive: the window is kept open by
pings until both followers have shown it, every wait has a generous bound, and
processes are killed in a ``finally``.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest

from tests.cli.test_cli_inspect_nats import cli
from tests.cli.test_cli_run import _FOREGROUND
from tests.cli.test_cli_run_nats import CLI, Peer, child_env
from tests.harness.env import operator_long
from tests.harness.nats_server import NatsServerFactory
from trio_debounce import WindowChange
from trio_debounce._cli._follow import change_json, key_prefix

WRITER = ("writer", "wr1ter-pa55-3c1d")
READER = ("reader", "r3ader-pa55-9e7b")
#: The peer's delay, seconds.
DELAY = 2.0
#: How long each fire's command runs, seconds: the window is "firing" meanwhile.
RUN = 1.5


def read_only_conf(bucket: str) -> str:
    """A server configuration with a writer (every permission) and a reader with the
    permissions that docs/cli.rst lists for ``windows``, ``processes`` and
    ``--follow`` on ``bucket``."""
    stream = f"KV_{bucket}"
    reader = {
        "publish": {
            "allow": [
                f"$JS.API.STREAM.INFO.{stream}",
                f"$JS.API.CONSUMER.CREATE.{stream}",
                f"$JS.API.CONSUMER.CREATE.{stream}.>",
                f"$JS.API.CONSUMER.INFO.{stream}.>",
                f"$JS.FC.{stream}.>",
            ]
        },
        "subscribe": {"allow": ["_INBOX.>"]},
    }
    users = [
        {"user": WRITER[0], "password": WRITER[1]},
        {"user": READER[0], "password": READER[1], "permissions": reader},
    ]
    return f"authorization {{ users: {json.dumps(users)} }}\n"


def user_env(user: tuple[str, str], **extra: str) -> dict[str, str]:
    return child_env(
        TRIO_DEBOUNCE_CONNECT_TIMEOUT="5",
        TRIO_DEBOUNCE_NATS_USER=user[0],
        TRIO_DEBOUNCE_NATS_PASSWORD=user[1],
        **extra,
    )


class Follower:
    """One ``trio-debounce windows --follow`` process (SIGINT at its default, as in a
    foreground job), its stdout read line by line by a thread."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _FOREGROUND, *CLI[1:], "windows", "--follow", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def next_line(self, timeout: float) -> str | None:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        self.seen.append(line)
        return line

    def next_change(self, timeout: float) -> dict[str, Any]:
        line = self.next_line(timeout)
        if line is None:
            pytest.fail(f"no change within {timeout} s; stderr: {self.stderr()!r}")
        change: dict[str, Any] = json.loads(line)
        return change

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None
        return self.proc.stderr.read()

    def stop(self, signum: int) -> tuple[int, str]:
        """Send ``signum``; the exit status and stderr."""
        self.proc.send_signal(signum)
        _, err = self.proc.communicate(timeout=20)
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.mark.slow
@operator_long  # the library's side: MockClock tests in tests/shared, tests/runs
def test_follow_a_window_of_a_live_peer(nats_server_factory: NatsServerFactory) -> None:
    bucket = f"follow-{uuid.uuid4().hex[:12]}"
    server = nats_server_factory(conf=read_only_conf(bucket))
    where = ["--backend", server.url, "--bucket", bucket]
    reader = user_env(READER, NO_COLOR="")
    command = [sys.executable, "-c", f"import time; time.sleep({RUN})"]
    options = ["--delay", str(DELAY), "--key-field", "key", "--process-id", "owner-1"]
    peer = Peer([*options, *where, "--", *command], user_env(WRITER))
    followers: list[Follower] = []
    try:
        # The bucket exists once the peer's lease is in it (the reader cannot create it).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            listed = cli("processes", *where, "--format", "jsonl", env=reader)
            if listed.returncode == 0 and "owner-1" in listed.stdout:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the peer never showed up: {listed.stderr!r}; {peer.stderr!r}")
        jsonl = Follower([*where, "--format", "jsonl", "--key", "al*"], reader)
        table = Follower(where, reader)
        followers += [jsonl, table]

        # Keep the window open (a ping every half delay) until the follower shows it:
        # listed if the follower came up after the first ping, opened if before.
        deadline = time.monotonic() + 30
        first: dict[str, Any] | None = None
        while first is None and time.monotonic() < deadline:
            peer.send({"key": "alpha"})
            peer.send({"key": "beta"})  # not alpha*: never in the jsonl follower's output
            line = jsonl.next_line(timeout=DELAY / 2)
            first = None if line is None else json.loads(line)
        assert first is not None, f"no change within 30 s; stderr: {jsonl.stderr()!r}"
        assert first["change"] in ("listed", "opened")
        assert (first["workflow"], first["key"], first["owner"]) == ("run", "alpha", "owner-1")
        assert (first["state"], first["mode"]) == ("open", "trailing")
        assert first["first_ping_at"] <= first["at"] <= first["due_at"]  # epoch seconds
        assert first["owner_lease_left"] > 0
        run_id = first["run_id"]
        # The table follower is up too once it shows alpha.
        deadline = time.monotonic() + 30
        while not any(" alpha " in line for line in table.seen):
            peer.send({"key": "alpha"})
            assert table.next_line(timeout=DELAY / 2) is not None or time.monotonic() < deadline

        # Its ping count moves, then it fires (in the owner, its command runs for RUN
        # seconds: it is "firing") and disappears (the command returned).
        peer.send({"key": "alpha"})
        changes = [jsonl.next_change(timeout=10)]
        while changes[-1]["change"] != "closed":
            changes.append(jsonl.next_change(timeout=DELAY + RUN + 10))
        *updates, fired, closed = changes
        counts = [first["ping_count"]] + [u["ping_count"] for u in updates]
        assert updates
        assert {u["change"] for u in updates} == {"updated"}
        assert counts == sorted(set(counts))  # moves up, one line per change
        assert all(u["state"] == "open" and u["owner"] == "owner-1" for u in updates)
        assert (fired["change"], fired["state"], fired["owner"]) == ("fired", "firing", "owner-1")
        assert fired["ping_count"] == counts[-1]
        assert closed.keys() == {"change", "at", "workflow", "key", "run_id"}
        assert (closed["key"], closed["run_id"]) == ("alpha", run_id)
        assert fired["run_id"] == run_id
        # The record lives while the command runs, and its end is seen within a poll.
        assert RUN - 0.5 <= closed["at"] - fired["at"] <= RUN + 10
        assert all(c["key"] == "alpha" for c in changes)  # --key al*

        # The table: a header once, then one line per change, beta's too.
        deadline = time.monotonic() + 10
        while not any(" closed " in line and " alpha" in line for line in table.seen):
            table.next_line(timeout=1)
            assert time.monotonic() < deadline, table.seen
        header, *rows = table.seen
        assert header.split()[:4] == ["TIME", "CHANGE", "WORKFLOW", "KEY"]
        assert "TIME" not in "".join(rows)
        assert any(row.split()[1:4] == ["fired", "run", "alpha"] for row in rows)
        assert any(row.split()[2:4] == ["run", "beta"] for row in rows)
        assert "\x1b[" not in "".join(rows)  # not a terminal: no colour

        # SIGTERM: exit 143; Ctrl-C (SIGINT): exit 130.
        assert jsonl.stop(signal.SIGTERM) == (143, "")
        status, err = table.stop(signal.SIGINT)
        assert status == 130
        assert err == "trio-debounce: interrupted\n"
    finally:
        for follower in followers:
            follower.kill()
        peer.kill()

    # A bucket that cannot be read exits 2: a missing one (never created), or one that
    # the reader has no permission on.
    writer = user_env(WRITER)
    absent = f"absent-{uuid.uuid4().hex[:12]}"
    proc = cli("windows", "--follow", "--backend", server.url, "--bucket", absent, env=writer)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert f"KV bucket {absent!r} does not exist" in proc.stderr
    proc = cli("windows", "--follow", "--backend", server.url, "--bucket", absent, env=reader)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert "cannot follow the windows" in proc.stderr


def test_the_watch_gets_the_literal_start_of_the_key_glob() -> None:
    assert [key_prefix(p) for p in (None, "al*", "*a", "a?c", "ab[cd]", "exact", "")] == [
        None,
        "al",
        None,
        "a",
        "ab",
        "exact",
        None,
    ]


def test_a_closed_change_in_json_names_only_its_window() -> None:
    change = WindowChange("closed", "wf", "k", "run-1", None, 12.5)
    assert change_json(change) == {
        "change": "closed",
        "at": 12.5,
        "workflow": "wf",
        "key": "k",
        "run_id": "run-1",
    }
