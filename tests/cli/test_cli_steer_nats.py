"""``trio-debounce cancel`` and ``flush`` against a real nats-server (the ``nats_server``
fixture; never a mock), steering windows that live ``trio-debounce run --backend``
processes own. Real processes on the real clock: each test takes a few seconds (a 3 s
lease, so a 1 s heartbeat)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.cli.test_cli_run_nats import CLI, Peer, child_env
from tests.harness.env import operator_long
from tests.harness.nats_server import NatsServer

#: The peers' process lease, seconds (heartbeat: a third of it).
LEASE = 3.0


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=60)


def windows(where: list[str], env: dict[str, str]) -> dict[str, dict[str, Any]]:
    listed = cli("windows", *where, "--format", "jsonl", env=env)
    assert listed.returncode == 0, listed.stderr
    return {w["key"]: w for w in map(json.loads, listed.stdout.splitlines())}


def wait_windows(
    where: list[str], env: dict[str, str], until: Callable[[dict[str, dict[str, Any]]], bool]
) -> None:
    """Wait (20 s at most) until the windows satisfy ``until``; the bucket may not
    exist yet (its first peer creates it as it starts)."""
    deadline = time.monotonic() + 20
    listed: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        proc = cli("windows", *where, "--format", "jsonl", env=env)
        if proc.returncode == 0:
            listed = {w["key"]: w for w in map(json.loads, proc.stdout.splitlines())}
            if until(listed):
                return
        time.sleep(0.2)
    pytest.fail(f"the windows never showed: {listed}")


@pytest.mark.slow
@operator_long  # the library's side: MockClock tests in tests/shared, tests/runs
def test_flush_and_cancel_steer_a_live_owners_windows(nats_server: NatsServer) -> None:
    bucket = f"steer-{uuid.uuid4().hex[:12]}"
    env = child_env(TRIO_DEBOUNCE_CONNECT_TIMEOUT="5", TRIO_DEBOUNCE_LEASE=str(LEASE))
    where = ["--backend", nats_server.url, "--bucket", bucket]
    peer = Peer(["--delay", "60", "--key-field", "key", *where, "--process-id", "owner"], env)
    try:
        for n in (1, 2):
            peer.send({"key": "alpha", "n": n})
        peer.send({"key": "beta"})
        wait_windows(
            where, env, lambda w: w.get("alpha", {}).get("ping_count") == 2 and "beta" in w
        )

        asked = time.monotonic()
        flushed = cli("flush", "run", "alpha", *where, "--wait", env=env)
        assert flushed.returncode == 0, flushed.stderr
        assert "requested: its owner 'owner' (live by its lease) fires it at its next" in (
            flushed.stdout
        )
        assert "committed after" in flushed.stdout
        fire = peer.next_fire(timeout=10)
        assert (fire["key"], fire["pings"], fire["payload"]["n"]) == ("alpha", 2, 2)
        assert time.monotonic() - asked < LEASE / 3 + 5  # a heartbeat, plus start-ups

        cancelled = cli("cancel", "run", "beta", *where, env=env)
        assert cancelled.returncode == 0, cancelled.stderr
        assert cancelled.stdout == "cancelled 'run'/'beta'\n"
        assert "beta" not in windows(where, env)

        # Nothing left to steer: exit 1, one line on stderr, nothing written.
        again = cli("cancel", "run", "beta", *where, env=env)
        assert (again.returncode, again.stdout) == (1, "")
        assert "no open window 'run'/'beta'" in again.stderr
        none = cli("flush", "run", "alpha", *where, env=env)
        assert (none.returncode, none.stdout) == (1, "")
        assert "has no trailing fire pending" in none.stderr

        # The owner neither fires the cancelled window nor the flushed one again.
        peer.send({"key": "gamma"})
        assert cli("flush", "run", "gamma", *where, env=env).returncode == 0
        assert peer.next_fire(timeout=10)["key"] == "gamma"
        rest = peer.finish(timeout=30)  # the exit's default flush: nothing is pending
        assert rest == []
    finally:
        peer.kill()


@pytest.mark.slow
@operator_long  # the library's side: MockClock tests in tests/shared, tests/runs
def test_a_flush_of_a_dead_owners_window_is_fired_by_the_survivor(
    nats_server: NatsServer,
) -> None:
    bucket = f"steer-{uuid.uuid4().hex[:12]}"
    env = child_env(TRIO_DEBOUNCE_CONNECT_TIMEOUT="5", TRIO_DEBOUNCE_LEASE=str(LEASE))
    where = ["--backend", nats_server.url, "--bucket", bucket]
    dead = Peer(["--delay", "600", "--key-field", "key", *where, "--process-id", "dead"], env)
    survivor: Peer | None = None
    try:
        dead.send({"key": "k", "n": 1})
        dead.send({"key": "k", "n": 2})
        wait_windows(where, env, lambda w: w.get("k", {}).get("ping_count") == 2)
        dead.kill()
        # Nobody alive to fire it: --wait gives up after --timeout, exit status 124.
        waited = cli("flush", "run", "k", *where, "--wait", "--timeout", "1", env=env)
        assert waited.returncode == 124, waited.stderr
        assert "not committed within 1 s (its window is still open" in waited.stderr
        survivor = Peer(
            ["--delay", "600", "--key-field", "key", *where, "--process-id", "survivor"], env
        )
        fire = survivor.next_fire(timeout=30)  # the lease lapses, the survivor adopts
        assert (fire["key"], fire["pings"], fire["payload"]["n"]) == ("k", 2, 2)
    finally:
        dead.kill()
        if survivor is not None:
            survivor.kill()


@pytest.mark.slow
def test_steering_an_unreachable_or_missing_bucket_exits_2(nats_server: NatsServer) -> None:
    # One command each way: both open the bucket through the same path (run_on_store).
    env = child_env(TRIO_DEBOUNCE_CONNECT_TIMEOUT="1")
    missing = ["--backend", nats_server.url, "--bucket", f"absent-{uuid.uuid4().hex[:12]}"]
    proc = cli("flush", "wf", "k", *missing, env=env)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert "does not exist" in proc.stderr
    down = cli("cancel", "wf", "k", "--backend", "nats://127.0.0.1:9", env=env)
    assert (down.returncode, down.stdout) == (2, "")
    [line] = down.stderr.splitlines()
    assert "no NATS server answered within 1.0 s" in line


@pytest.mark.slow
@operator_long
def test_flush_and_cancel_racing_a_live_owners_pings_never_double_or_lose(
    nats_server: NatsServer,
) -> None:
    """An owner pinged every 20 ms on two keys while flushes hit one and cancels the
    other: every ping of the flushed key is in exactly one fire (none lost, none fired
    twice); the cancelled key's fires never repeat a ping either."""
    bucket = f"steer-{uuid.uuid4().hex[:12]}"
    env = child_env(TRIO_DEBOUNCE_CONNECT_TIMEOUT="5", TRIO_DEBOUNCE_LEASE=str(LEASE))
    where = ["--backend", nats_server.url, "--bucket", bucket]
    peer = Peer(["--delay", "0.5", "--key-field", "key", *where, "--process-id", "owner"], env)
    sent = {"f": 0, "c": 0}
    stop = threading.Event()

    def ping() -> None:
        while not stop.is_set():
            for key in sent:
                sent[key] += 1
                peer.send({"key": key, "n": sent[key]})
            time.sleep(0.02)

    pinger = threading.Thread(target=ping, daemon=True)
    try:
        peer.send({"key": "ready"})
        assert peer.next_fire(timeout=20)["key"] == "ready"
        pinger.start()
        codes = []
        for _ in range(4):
            codes.append(cli("flush", "run", "f", *where, env=env).returncode)
            codes.append(cli("cancel", "run", "c", *where, env=env).returncode)
        stop.set()
        pinger.join()
        assert set(codes) <= {0, 1}, codes  # 1: caught between windows
        assert 0 in codes[0::2]
        assert 0 in codes[1::2]
        fires = peer.finish(timeout=30)  # the exit flushes what is pending
    finally:
        stop.set()
        peer.kill()
    by_key = {key: [f for f in fires if f["key"] == key] for key in sent}
    flushed = by_key["f"]
    assert sum(f["pings"] for f in flushed) == sent["f"]  # none lost, none twice
    lasts = [f["payload"]["n"] for f in flushed]
    assert lasts == sorted(set(lasts))
    assert lasts[-1] == sent["f"]
    cancelled = by_key["c"]
    assert sum(f["pings"] for f in cancelled) < sent["c"]  # the cancels dropped some
    lasts = [f["payload"]["n"] for f in cancelled]
    assert lasts == sorted(set(lasts))


def _permissions(bucket: str, *, steer: bool) -> str:
    """The permissions docs/cli.rst lists for the inspection commands, and with
    ``steer`` for ``cancel`` and ``flush``, as a nats-server ``permissions`` block."""
    stream = f"KV_{bucket}"
    publish = [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
    ]
    if steer:
        publish += [
            f"$KV.{bucket}.w.>",
            f"$KV.{bucket}.c.>",
            f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.STREAM.MSG.GET.{stream}",
        ]
    allow = ", ".join(json.dumps(subject) for subject in publish)
    return (
        f'permissions: {{ publish: {{ allow: [{allow}] }}, subscribe: {{ allow: ["_INBOX.>"] }} }}'
    )


@pytest.mark.slow
@operator_long
def test_the_documented_permissions_are_enough(nats_server_factory: Any) -> None:
    """``windows`` and ``processes`` with a read-only user, ``cancel`` and ``flush``
    with a user that may write only the window and control keys: the permissions
    docs/cli.rst lists, and no more."""
    bucket = f"perm{uuid.uuid4().hex[:12]}"
    read_only, steering = _permissions(bucket, steer=False), _permissions(bucket, steer=True)
    server = nats_server_factory(
        conf=(
            "authorization { users: [\n"
            '  { user: admin, password: "admin-pw-3c1a" }\n'
            f'  {{ user: reader, password: "reader-pw-77ab", {read_only} }}\n'
            f'  {{ user: steerer, password: "steer-pw-19fe", {steering} }}\n'
            "] }\n"
        )
    )
    base = {"TRIO_DEBOUNCE_CONNECT_TIMEOUT": "5", "TRIO_DEBOUNCE_LEASE": str(LEASE)}
    admin = child_env(
        **base, TRIO_DEBOUNCE_NATS_USER="admin", TRIO_DEBOUNCE_NATS_PASSWORD="admin-pw-3c1a"
    )
    reader = child_env(
        **base, TRIO_DEBOUNCE_NATS_USER="reader", TRIO_DEBOUNCE_NATS_PASSWORD="reader-pw-77ab"
    )
    steerer = child_env(
        **base, TRIO_DEBOUNCE_NATS_USER="steerer", TRIO_DEBOUNCE_NATS_PASSWORD="steer-pw-19fe"
    )
    where = ["--backend", server.url, "--bucket", bucket]
    peer = Peer(["--delay", "60", "--key-field", "key", *where, "--process-id", "owner"], admin)
    try:
        peer.send({"key": "a"})
        peer.send({"key": "a"})
        peer.send({"key": "b"})
        wait_windows(where, admin, lambda w: set(w) == {"a", "b"})
        assert set(windows(where, reader)) == {"a", "b"}
        listed = cli("processes", *where, "--format", "jsonl", env=reader)
        assert listed.returncode == 0, listed.stderr
        assert "owner" in listed.stdout
        # The reader may not steer; the steerer may.
        refused = cli("cancel", "run", "b", *where, env=reader)
        assert refused.returncode == 2
        assert "b" in windows(where, admin)
        flushed = cli("flush", "run", "a", *where, "--wait", env=steerer)
        assert flushed.returncode == 0, flushed.stderr
        assert peer.next_fire(timeout=10)["key"] == "a"
        cancelled = cli("cancel", "run", "b", *where, env=steerer)
        assert cancelled.returncode == 0, cancelled.stderr
        assert windows(where, reader) == {}
    finally:
        peer.kill()
