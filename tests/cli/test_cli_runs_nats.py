"""``trio-debounce runs``, ``runs cancel`` and ``runs retry`` against a real
nats-server (the ``nats_server`` fixture; never a mock), beside a live coordinator in
the test process that holds the runs (real clock): the listing, a cancel that the live
owner respects, a retry that its next sweep claims and runs; the permissions that
docs/cli.rst states, with users restricted to them; an unreachable server and a
missing bucket.

The SQLite side, with every filter and refusal: tests/cli/test_cli_runs.py.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from tests.cli.test_cli_run_nats import CLI, child_env
from tests.harness.env import operator_long
from tests.harness.nats_server import NatsServer, NatsServerFactory, free_port
from trio_debounce import Coordinator, RunFire, RunOptions, open_coordinator
from trio_debounce.abc import RunState, RunStore
from trio_debounce.nats import NatsConfig, open_nats_run_store

pytestmark = pytest.mark.slow

#: The live coordinator's options: a sweep every half second.
BEAT = 0.5


def cli(url: str, bucket: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``trio-debounce runs ARGS --backend URL --bucket BUCKET``, in its own process."""
    return subprocess.run(
        [*CLI, "runs", *args, "--backend", url, "--bucket", bucket],
        capture_output=True,
        text=True,
        env=child_env(**{"TRIO_DEBOUNCE_CONNECT_TIMEOUT": "5", "NO_COLOR": "", **env}),
        timeout=60,
    )


async def acli(url: str, bucket: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """:func:`cli` in a thread, while the test's coordinator runs."""
    return await trio.to_thread.run_sync(functools.partial(cli, url, bucket, *args, **env))


def jsonl(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    """The runs a ``--format jsonl`` listing printed, by run id."""
    assert proc.returncode == 0, proc.stderr
    docs = [json.loads(line) for line in proc.stdout.splitlines()]
    return {doc["run_id"]: doc for doc in docs}


async def until(read: Callable[[], Awaitable[object]], value: object) -> None:
    """Poll ``read()`` until it returns ``value`` (the caller bounds the wait)."""
    while True:
        if await read() == value:
            return
        await trio.sleep(0.05)


def outcome(store: RunStore, run_id: str) -> Callable[[], Awaitable[str | None]]:
    async def read() -> str | None:
        run = await store.get_run(run_id)
        return None if run is None else run.outcome

    return read


class Handler:
    """The live coordinator's run handler: "busy" runs until released; "broken"
    fails its first attempt."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, Any, int]] = []
        self.release = trio.Event()

    async def __call__(self, run: RunFire) -> None:
        self.calls.append((run.run_id, run.attempt, run.payload, run.fencing_token))
        if run.run_id == "busy":
            await self.release.wait()
        elif run.run_id == "broken" and run.attempt == 1:
            raise RuntimeError("the first attempt fails")

    def of(self, run_id: str) -> list[tuple[str, int, Any, int]]:
        return [call for call in self.calls if call[0] == run_id]


@asynccontextmanager
async def live_owner(
    url: str, bucket: str, handler: Handler
) -> AsyncIterator[tuple[RunStore, Coordinator]]:
    """A coordinator, process id "owner-1", on a NATS run store (the bucket created)."""
    config = NatsConfig(
        servers=(url,), bucket=bucket, op_timeout=2.0, connect_timeout=3.0, ping_interval=1.0
    )
    options = RunOptions(process_id="owner-1", lease=3.0, heartbeat_interval=BEAT, horizon=30.0)
    async with (
        open_nats_run_store(config) as store,
        open_coordinator(run_handlers={"wf": handler}, run_store=store, run_options=options)
        as coordinator,
    ):  # fmt: skip
        yield store, coordinator
        handler.release.set()


@operator_long  # the library's side: MockClock tests in tests/shared, tests/runs
async def test_listing_and_steering_beside_a_live_coordinator(nats_server: NatsServer) -> None:
    bucket = f"runs-{uuid.uuid4().hex[:12]}"
    url = nats_server.url
    handler = Handler()
    with trio.fail_after(90):
        async with live_owner(url, bucket, handler) as (store, coordinator):
            await coordinator.schedule("wf", "busy", after=0.1, persist=True)
            await coordinator.schedule("wf", "broken", {"n": 1}, after=0.1, persist=True)
            soon = await coordinator.schedule("wf", "soon", after=6.0, persist=True)
            await coordinator.schedule("wf", "far", after=3600.0, persist=True)
            await until(outcome(store, "broken"), "failed")
            assert sorted(c[0] for c in handler.calls) == ["broken", "busy"]
            assert coordinator.has_run("soon")  # armed by its live owner

            # The listing: every run, as the live owner holds it.
            runs = jsonl(await acli(url, bucket, "--format", "jsonl"))
            held = {
                k: (d["state"], d["outcome"], d["owner"], d["attempt"]) for k, d in runs.items()
            }
            assert held == {
                "busy": ("started", None, "owner-1", 1),
                "broken": ("done", "failed", "owner-1", 1),
                "soon": ("pending", None, "owner-1", 0),
                "far": ("pending", None, "owner-1", 0),
            }  # fmt: skip
            assert runs["soon"]["scheduled_at"] == soon.scheduled_at  # epoch seconds
            assert runs["broken"]["payload"] == '{"n":1}'

            # Cancel: the live owner has "soon" armed, and never runs it.
            cancelled = await acli(url, bucket, "cancel", "soon")
            assert cancelled.returncode == 0, cancelled.stderr
            assert cancelled.stdout.startswith("cancelled run 'soon' (workflow 'wf', pending")
            assert "held by 'owner-1'" in cancelled.stdout
            refused = await acli(url, bucket, "cancel", "busy")
            assert (refused.returncode, refused.stdout) == (1, "")
            assert "run 'busy' is started, not pending: not cancelled" in refused.stderr
            missing = await acli(url, bucket, "cancel", "nobody")
            assert missing.returncode == 1
            assert "no run 'nobody' in the store" in missing.stderr

            # Retry: the owner's next sweep claims the unclaimed run and runs it.
            not_failed = await acli(url, bucket, "retry", "busy")
            assert not_failed.returncode == 1
            assert "run 'busy' not retried: it is started, not failed" in not_failed.stderr
            retried = await acli(url, bucket, "retry", "broken")
            assert retried.returncode == 0, retried.stderr
            assert "runs it as attempt 2" in retried.stdout
            # (Within a sweep: tests/runs/test_runs_steer.py times it on MockClock.)
            await until(outcome(store, "broken"), "ran")
            [first, second] = handler.of("broken")
            assert second[1:3] == (2, {"n": 1})
            assert second[3] > first[3]  # a higher fencing token
            assert coordinator.statistics().runs.taken_over == 1  # by its claim sweep

            # The filters, and the table.
            pending = jsonl(await acli(url, bucket, "--format", "jsonl", "--state", "pending"))
            assert list(pending) == ["far"]
            ran = jsonl(await acli(url, bucket, "--format", "jsonl", "--outcome", "ran"))
            assert list(ran) == ["broken"]
            other = await acli(url, bucket, "--workflow", "other")
            assert (other.returncode, other.stdout) == (0, "(none)\n")
            table = await acli(url, bucket)
            assert table.returncode == 0, table.stderr
            header, *rows = table.stdout.splitlines()
            assert header.split()[:4] == ["RUN", "WORKFLOW", "STATE", "OUTCOME"]
            assert [row.split()[:3] for row in rows] == [
                ["busy", "wf", "started"],
                ["broken", "wf", "done"],
                ["far", "wf", "pending"],
            ]
            assert re.search(r"  in 3[56]\d\d\.\d s  ", rows[2])
            assert "\x1b[" not in table.stdout

            # Past the time "soon" was due, and a sweep more: never run.
            await trio.sleep(max(0.0, soon.scheduled_at - time.time()) + 2 * BEAT)
            assert handler.of("soon") == []
            assert await store.get_run("soon") is None


def permissions_conf(bucket: str) -> str:
    """Users with the permissions docs/cli.rst gives each command, and an admin."""
    read = [
        f"$JS.API.STREAM.INFO.KV_{bucket}",
        f"$JS.API.CONSUMER.CREATE.KV_{bucket}",
        f"$JS.API.CONSUMER.CREATE.KV_{bucket}.>",
        f"$JS.API.CONSUMER.INFO.KV_{bucket}.>",
        f"$JS.FC.KV_{bucket}.>",
    ]
    steer = [
        *read,
        f"$KV.{bucket}.r.>",
        f"$JS.API.DIRECT.GET.KV_{bucket}.>",
        f"$JS.API.STREAM.PURGE.KV_{bucket}",
    ]

    def user(name: str, publish: list[str]) -> str:
        return (
            f"{{user: {name}, password: {name}-pw, permissions: "
            f'{{publish: {json.dumps(publish)}, subscribe: ["_INBOX.>"]}}}}'
        )

    return (
        "authorization { users = [\n"
        "  {user: admin, password: admin-pw}\n"
        f"  {user('reader', read)}\n"
        f"  {user('steerer', steer)}\n"
        "] }\n"
    )


@operator_long
async def test_a_read_only_user_lists_and_a_steering_user_steers(
    nats_server_factory: NatsServerFactory,
) -> None:
    bucket = f"perms-{uuid.uuid4().hex[:12]}"
    server = nats_server_factory(conf=permissions_conf(bucket))
    admin = server.url.replace("nats://", "nats://admin:admin-pw@")
    reader = {"TRIO_DEBOUNCE_NATS_USER": "reader", "TRIO_DEBOUNCE_NATS_PASSWORD": "reader-pw"}
    steerer = {"TRIO_DEBOUNCE_NATS_USER": "steerer", "TRIO_DEBOUNCE_NATS_PASSWORD": "steerer-pw"}
    handler = Handler()
    with trio.fail_after(90):
        async with live_owner(admin, bucket, handler) as (store, coordinator):
            await coordinator.schedule("wf", "later", after=3600.0, persist=True)
            await coordinator.schedule("wf", "broken", {"n": 2}, after=0.1, persist=True)
            await until(outcome(store, "broken"), "failed")

            listed = jsonl(await acli(server.url, bucket, "--format", "jsonl", **reader))
            assert sorted(listed) == ["broken", "later"]
            for action, run_id in (("cancel", "later"), ("retry", "broken")):
                denied = await acli(server.url, bucket, action, run_id, **reader)
                assert (denied.returncode, denied.stdout) == (2, "")
                [line] = denied.stderr.splitlines()
                assert line.startswith(f"trio-debounce: error: cannot {action} run {run_id!r}: ")
                assert "NATS denied a permission" in line
            assert (await store.get_run("later")) is not None

            cancelled = await acli(server.url, bucket, "cancel", "later", **steerer)
            assert cancelled.returncode == 0, cancelled.stderr
            retried = await acli(server.url, bucket, "retry", "broken", **steerer)
            assert retried.returncode == 0, retried.stderr
            await until(outcome(store, "broken"), "ran")
            assert await store.get_run("later") is None
            state = jsonl(await acli(server.url, bucket, "--format", "jsonl", **steerer))
            assert {k: d["state"] for k, d in state.items()} == {"broken": RunState.DONE.value}


async def test_an_unreachable_server_and_a_missing_bucket_exit_2(nats_server: NatsServer) -> None:
    nowhere = f"nats://127.0.0.1:{free_port()}"
    commands: list[tuple[str, ...]] = [("--format", "jsonl"), ("cancel", "r"), ("retry", "r")]
    # Unreachable: one command (they open the store through the same path).
    for args in commands[:1]:
        proc = await acli(nowhere, "b", *args, TRIO_DEBOUNCE_CONNECT_TIMEOUT="1")
        assert (proc.returncode, proc.stdout) == (2, "")
        [line] = proc.stderr.splitlines()  # one line, no reconnect chatter
        assert line.startswith("trio-debounce: error: cannot ")
        assert "no NATS server answered within 1.0 s" in line
        assert "Connect call failed" in line  # the first connection error, as run says
    bucket = f"absent-{uuid.uuid4().hex[:12]}"
    for args in [*commands, ()]:
        proc = await acli(nats_server.url, bucket, *args)
        assert (proc.returncode, proc.stdout) == (2, "")
        [line] = proc.stderr.splitlines()
        assert f"KV bucket {bucket!r} does not exist" in line  # and is not created
