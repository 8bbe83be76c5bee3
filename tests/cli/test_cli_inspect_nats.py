"""``trio-debounce windows`` and ``processes`` against a real nats-server (the
``nats_server`` fixture; never a mock), with a live ``trio-debounce run --backend``
process owning the windows. Real processes on the real clock; not timing-sensitive
(the windows stay open for a minute)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from typing import Any

import pytest

from tests.cli.test_cli_run_nats import CLI, Peer, child_env
from tests.harness.nats_server import NatsServer


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=60)


def jsonl(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.slow
def test_windows_and_processes_of_a_live_owner(nats_server: NatsServer) -> None:
    bucket = f"inspect-{uuid.uuid4().hex[:12]}"
    env = child_env(TRIO_DEBOUNCE_CONNECT_TIMEOUT="5", NO_COLOR="")
    where = ["--backend", nats_server.url, "--bucket", bucket]
    peer = Peer(
        ["--delay", "60", "--key-field", "key", *where, "--process-id", "owner-1"],
        env,
    )
    try:
        peer.send({"key": "alpha"})
        peer.send({"key": "beta", "n": 1})
        peer.send({"key": "beta", "n": 2})
        deadline = time.monotonic() + 20
        windows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            listed = cli("windows", *where, "--format", "jsonl", env=env)
            if listed.returncode == 0:
                windows = jsonl(listed)
                if sum(w["ping_count"] for w in windows) == 3:
                    break
            time.sleep(0.2)
        now = time.time()
        assert [(w["key"], w["ping_count"]) for w in windows] == [("alpha", 1), ("beta", 2)]
        for w in windows:
            assert (w["workflow"], w["owner"], w["state"], w["mode"]) == (
                "run",
                "owner-1",
                "open",
                "trailing",
            )
            assert 0 < w["owner_lease_left"] <= 60
            assert w["first_ping_at"] <= now <= w["due_at"]  # times as epoch seconds
            assert w["cap_at"] is None
        # The latest payload of each, as stored: beta's carries one field more.
        assert windows[1]["payload_bytes"] > windows[0]["payload_bytes"] > 0

        only = jsonl(cli("windows", *where, "--format", "jsonl", "--key", "al*", env=env))
        assert [w["key"] for w in only] == ["alpha"]
        other = cli("windows", *where, "--workflow", "other", env=env)
        assert (other.returncode, other.stdout) == (0, "(none)\n")

        table = cli("windows", *where, env=env)
        assert table.returncode == 0, table.stderr
        header, *rows = table.stdout.splitlines()
        assert header.split()[:3] == ["WORKFLOW", "KEY", "MODE"]
        assert [r.split()[1] for r in rows] == ["alpha", "beta"]
        assert "\x1b[" not in table.stdout  # not a terminal: no colour
        assert "s left" in rows[0]
        assert "ago" in rows[0]
        assert "in 5" in rows[0]  # due in about a minute

        [owner] = jsonl(cli("processes", *where, "--format", "jsonl", env=env))
        assert (owner["process_id"], owner["live"], owner["windows"]) == ("owner-1", True, 2)
        assert (owner["draining"], owner["released"], owner["fire_records"]) == (
            False,
            False,
            0,
        )
        assert owner["heartbeat_interval"] > 0
        assert 0 <= owner["last_beat_age"] <= owner["heartbeat_interval"] + 5
        processes = cli("processes", *where, env=env)
        assert processes.returncode == 0, processes.stderr
        assert "owner-1" in processes.stdout
        assert " live " in processes.stdout
    finally:
        peer.kill()


@pytest.mark.slow
def test_a_missing_bucket_is_an_error_and_is_not_created(nats_server: NatsServer) -> None:
    env = child_env(TRIO_DEBOUNCE_CONNECT_TIMEOUT="5")
    bucket = f"absent-{uuid.uuid4().hex[:12]}"
    for command in ("windows", "processes", "windows"):
        proc = cli(command, "--backend", nats_server.url, "--bucket", bucket, env=env)
        assert proc.returncode == 2
        assert proc.stdout == ""
        assert f"KV bucket {bucket!r} does not exist" in proc.stderr
    bad = cli("windows", "--backend", "http://x", env=env)
    assert bad.returncode == 2
    assert "--backend URLs must start with nats:// or tls://" in bad.stderr
