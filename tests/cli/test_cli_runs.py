"""``trio-debounce runs``, ``runs cancel`` and ``runs retry`` on an SQLite run store:
the listing and its filters (a table and JSON lines), the steering's exit statuses,
a store that is never created nor changed by a listing, and usage errors; then, in a
real CLI process, cancel and retry beside a live coordinator on the same file.

The NATS side, with a real nats-server: tests/cli/test_cli_runs_nats.py.
"""

from __future__ import annotations

import functools
import io
import json
import re
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.cli.test_cli_replay import run_cli
from tests.cli.test_cli_run_nats import CLI, child_env
from tests.harness.env import operator_long
from trio_debounce import RunFire, RunOptions, open_coordinator, open_sqlite_run_store
from trio_debounce._cli._inspect import print_items
from trio_debounce._cli._runs import _run_row
from trio_debounce.abc import RunState, RunStore, StoredRun


def make_runs(now: float) -> list[StoredRun]:
    """The runs of a test's store, times around ``now``: one per state and outcome that
    matters."""
    return [
        StoredRun("later", "mail", '{"to":"ada"}', now + 3600, owner="p1", epoch=1, token=1,
                  created_at=now - 5),
        StoredRun("busy", "mail", "{}", now - 3, state=RunState.STARTED, owner="p1", epoch=1,
                  attempt=1, token=2, created_at=now - 9, started_at=now - 3),
        StoredRun("broken", "bill", '{"n":7}', now - 60, expires_at=now + 3600,
                  state=RunState.DONE, outcome="failed", owner="p2", epoch=3, attempt=2,
                  token=5, created_at=now - 90, started_at=now - 50, finished_at=now - 49),
        StoredRun("old", "bill", "null", now - 70, expires_at=now - 65, state=RunState.DONE,
                  outcome="expired", owner="p2", epoch=3, token=1, created_at=now - 90,
                  finished_at=now - 60),
        StoredRun("sent", "mail", "null", now - 80, state=RunState.DONE, outcome="ran",
                  owner="p1", epoch=1, attempt=1, token=2, created_at=now - 90,
                  started_at=now - 80, finished_at=now - 79),
    ]  # fmt: skip


def make_store(path: Path, runs: list[StoredRun]) -> Path:
    async def fill() -> None:
        async with open_sqlite_run_store(path) as store:
            for run in runs:
                assert await store.create_run(run) is not None

    trio.run(fill)
    return path


def stored(path: Path, run_id: str) -> StoredRun | None:
    async def read() -> StoredRun | None:
        async with open_sqlite_run_store(path, mode="ro") as store:
            return await store.get_run(run_id)

    return trio.run(read)


@pytest.fixture
def runs() -> list[StoredRun]:
    return make_runs(time.time())


@pytest.fixture
def db(tmp_path: Path, runs: list[StoredRun]) -> Path:
    return make_store(tmp_path / "runs.db", runs)


def listed(db: Path, capsys: pytest.CaptureFixture[str], *options: str) -> list[dict[str, Any]]:
    code, out, err = run_cli(["runs", "--sqlite", str(db), "--format", "jsonl", *options], capsys)
    assert (code, err) == (0, "")
    return [json.loads(line) for line in out.splitlines()]


def ids(docs: list[dict[str, Any]]) -> list[str]:
    return [doc["run_id"] for doc in docs]


# --- listing -----------------------------------------------------------------------


def test_json_lines_are_the_stored_fields_in_due_order(
    db: Path, runs: list[StoredRun], capsys: pytest.CaptureFixture[str]
) -> None:
    docs = listed(db, capsys)
    assert ids(docs) == ["sent", "old", "broken", "busy", "later"]
    by_id = {doc["run_id"]: doc for doc in docs}
    for run in runs:
        doc = by_id[run.run_id]
        # Every StoredRun field, the state as its string, times as epoch seconds.
        assert doc == {**_fields(run), "state": run.state.value, "revision": doc["revision"]}
    assert by_id["broken"]["payload"] == '{"n":7}'  # a failed tombstone keeps its payload


def _fields(run: StoredRun) -> dict[str, Any]:
    return {name: getattr(run, name) for name in StoredRun.__dataclass_fields__}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--state", "pending"], ["later"]),
        (["--state", "started"], ["busy"]),
        (["--state", "done"], ["sent", "old", "broken"]),
        (["--outcome", "failed"], ["broken"]),
        (["--outcome", "expired"], ["old"]),
        (["--outcome", "misfired"], []),
        (["--workflow", "bill"], ["old", "broken"]),
        (["--workflow", "mail", "--state", "done"], ["sent"]),
        (["--workflow", "mail", "--outcome", "failed"], []),
        (["--workflow", "nobody"], []),
    ],
)
def test_each_filter(
    db: Path, capsys: pytest.CaptureFixture[str], options: list[str], expected: list[str]
) -> None:
    assert ids(listed(db, capsys, *options)) == expected


def test_the_table_for_people(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["runs", "--sqlite", str(db)], capsys)
    assert (code, err) == (0, "")
    header, *rows = out.splitlines()
    assert header.split() == [
        "RUN", "WORKFLOW", "STATE", "OUTCOME", "DUE", "EXPIRES", "HOLDER", "ATTEMPTS",
        "TOKEN", "FINISHED",
    ]  # fmt: skip
    assert [row.split()[0] for row in rows] == ["sent", "old", "broken", "busy", "later"]
    assert "\x1b[" not in out  # not a terminal
    for name in ("STATE", "DUE", "HOLDER"):  # aligned: every column starts in line
        column = header.index(name)
        assert all(row[column - 2 : column] == "  " != row[column] for row in rows), name
    later, busy = rows[4], rows[3]
    assert re.search(r"  in 3[56]\d\d\.\d s  ", later)  # due in an hour
    assert re.search(r"  [34]\.\d s ago  ", busy)
    assert "\N{EN DASH}" in later  # no outcome, expiry nor finish
    assert busy.split()[2:4] == ["started", "\N{EN DASH}"]
    empty = run_cli(["runs", "--sqlite", str(db), "--workflow", "nobody"], capsys)
    assert empty == (0, "(none)\n", "")
    nothing = run_cli(
        ["runs", "--sqlite", str(db), "--workflow", "nobody", "--format", "jsonl"], capsys
    )
    assert nothing == (0, "", "")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("no_color", "coloured"), [(None, True), ("", True), ("1", False)])
def test_colour_only_on_a_terminal_without_no_color(
    monkeypatch: pytest.MonkeyPatch, no_color: str | None, coloured: bool
) -> None:
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    runs = make_runs(time.time())
    out = Terminal()
    print_items("table", runs, _run_row, out)
    text = out.getvalue()
    assert ("\x1b[" in text) == coloured
    if coloured:
        failed = next(line for line in text.splitlines() if line.startswith("broken"))
        assert "\x1b[31mfailed" in failed  # the outcome in red
        busy = next(line for line in text.splitlines() if line.startswith("busy"))
        assert "\x1b[35mstarted" in busy
    plain = io.StringIO()
    print_items("table", runs, _run_row, plain)
    assert "\x1b[" not in plain.getvalue()


# --- never created, never changed by a listing --------------------------------------


def test_a_missing_file_exits_2_and_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "absent.db"
    for command in (["runs"], ["runs", "cancel", "r"], ["runs", "retry", "r"]):
        code, out, err = run_cli([*command, "--sqlite", str(path)], capsys)
        assert (code, out) == (2, "")
        assert f"the run store {str(path)!r} does not exist" in err
        assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_a_listing_never_changes_the_file(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = db.read_bytes(), db.stat().st_mtime_ns
    time.sleep(0.01)  # a write would show in the mtime
    for form in ("table", "jsonl"):
        code, _, err = run_cli(["runs", "--sqlite", str(db), "--format", form], capsys)
        assert (code, err) == (0, "")
    assert (db.read_bytes(), db.stat().st_mtime_ns) == before


def test_a_file_that_is_not_a_run_store_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.db"
    path.write_bytes(b"not a database at all" * 100)
    code, out, err = run_cli(["runs", "--sqlite", str(path)], capsys)
    assert (code, out) == (2, "")
    assert "cannot list the runs:" in err
    assert "not an SQLite database" in err


# --- cancel and retry ---------------------------------------------------------------


def test_cancel_deletes_a_pending_run(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["runs", "cancel", "later", "--sqlite", str(db)], capsys)
    assert (code, err) == (0, "")
    assert out.startswith("cancelled run 'later' (workflow 'mail', pending, due in ")
    assert out.endswith(", held by 'p1')\n")
    assert stored(db, "later") is None
    # The store options may come before the action too.
    code, out, err = run_cli(["runs", "--sqlite", str(db), "cancel", "later"], capsys)
    assert (code, out, err) == (1, "", "trio-debounce: error: no run 'later' in the store\n")


@pytest.mark.parametrize(
    ("run_id", "message"),
    [
        ("busy", "run 'busy' is started, not pending: not cancelled"),
        ("sent", "run 'sent' is done (outcome 'ran'), not pending: not cancelled"),
        ("nobody", "no run 'nobody' in the store"),
    ],
)
def test_cancel_refuses_what_is_not_pending(
    db: Path, capsys: pytest.CaptureFixture[str], run_id: str, message: str
) -> None:
    before = stored(db, run_id)
    code, out, err = run_cli(["runs", "cancel", run_id, "--sqlite", str(db)], capsys)
    assert (code, out, err) == (1, "", f"trio-debounce: error: {message}\n")
    assert stored(db, run_id) == before


def test_retry_makes_a_failed_run_pending_and_unclaimed(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failed = stored(db, "broken")
    assert failed is not None
    before = time.time()
    code, out, err = run_cli(["runs", "retry", "broken", "--sqlite", str(db)], capsys)
    assert (code, err) == (0, "")
    assert out == (
        "run 'broken' (workflow 'bill') is pending again, due now and unclaimed: a live "
        "process with a handler for 'bill' claims it at its next sweep and runs it as "
        "attempt 3\n"
    )
    retried = stored(db, "broken")
    assert retried is not None
    assert before <= retried.scheduled_at <= time.time()
    assert retried == failed.replace(
        state=RunState.PENDING,
        owner=None,
        epoch=0,
        scheduled_at=retried.scheduled_at,
        outcome=None,
        finished_at=None,
        token=failed.token + 1,
        version=failed.version + 1,
        revision=retried.revision,
    )
    again = run_cli(["runs", "retry", "broken", "--sqlite", str(db)], capsys)
    assert again == (
        1,
        "",
        "trio-debounce: error: run 'broken' not retried: it is pending, not failed\n",
    )


@pytest.mark.parametrize(
    ("run_id", "reason"),
    [
        ("later", "run 'later' not retried: it is pending, not failed"),
        ("busy", "run 'busy' not retried: it is started, not failed"),
        ("sent", "run 'sent' not retried: its outcome is 'ran', not 'failed'"),
        ("old", "run 'old' not retried: its outcome is 'expired', not 'failed'"),
        ("nobody", "no run 'nobody' in the store"),
    ],
)
def test_retry_refuses_what_did_not_fail(
    db: Path, capsys: pytest.CaptureFixture[str], run_id: str, reason: str
) -> None:
    before = stored(db, run_id)
    code, out, err = run_cli(["runs", "retry", run_id, "--sqlite", str(db)], capsys)
    assert (code, out, err) == (1, "", f"trio-debounce: error: {reason}\n")
    assert stored(db, run_id) == before


def test_retry_refuses_a_failed_run_past_its_expiry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "runs.db"

    async def fill() -> None:
        async with open_sqlite_run_store(path) as store:
            run = make_runs(time.time())[2].replace(run_id="stale", expires_at=time.time() - 1)
            assert await store.create_run(run) is not None

    trio.run(fill)
    code, out, err = run_cli(["runs", "retry", "stale", "--sqlite", str(path)], capsys)
    assert (code, out) == (1, "")
    assert "run 'stale' not retried: its expiry has passed" in err


# --- usage --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["runs"], "give exactly one of --backend URL and --sqlite PATH"),
        (["runs", "--sqlite", "a", "--backend", "nats://x"], "not allowed with argument"),
        (["runs", "--backend", "nats://x", "cancel", "r", "--sqlite", "a"], "exactly one"),
        (["runs", "--sqlite", "a", "--bucket", "b"], "--bucket needs --backend"),
        (["runs", "--sqlite", ""], "--sqlite must not be empty"),
        (["runs", "--sqlite", "a", "--workflow", ""], "--workflow must not be empty"),
        (["runs", "--sqlite", "a", "--state", "running"], "invalid choice: 'running'"),
        (["runs", "--sqlite", "a", "--outcome", "ok"], "invalid choice: 'ok'"),
        (["runs", "--sqlite", "a", "--state", "done", "cancel", "r"], "--state lists runs"),
        (["runs", "--sqlite", "a", "--format", "jsonl", "retry", "r"], "--format lists runs"),
        (["runs", "cancel", "--sqlite", "a"], "the following arguments are required: RUN_ID"),
        (["runs", "cancel", "", "--sqlite", "a"], "RUN_ID must be a non-empty str"),
        (["runs", "undo", "r"], "invalid choice: 'undo'"),
        (["runs", "--backend", "http://x"], "--backend URLs must start with nats:// or tls://"),
    ],
)
def test_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run_cli(args, capsys)
    assert (code, out) == (2, "")
    assert message in err
    assert "usage: trio-debounce runs" in err


# --- a live coordinator on the same file, the CLI in another process ---------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=child_env(NO_COLOR=""), timeout=60
    )


async def outcome(store: RunStore, run_id: str) -> str | None:
    run = await store.get_run(run_id)
    return None if run is None else run.outcome


async def until(read: Callable[[], Awaitable[object]], value: object) -> None:
    """Poll ``read()`` until it returns ``value`` (the caller bounds the wait)."""
    while True:
        if await read() == value:
            return
        await trio.sleep(0.05)


@pytest.mark.slow
@operator_long  # the library's side: tests/runs/test_runs_steer.py (MockClock)
async def test_steering_beside_a_live_coordinator(tmp_path: Path) -> None:
    """The live owner has "soon" armed when the CLI cancels it, and never runs it; its
    running handler's run is refused; the run it failed is retried, and its next sweep
    claims and runs it with its payload as attempt 2."""
    path = str(tmp_path / "runs.db")
    calls: list[tuple[str, int, Any]] = []
    release = trio.Event()

    async def handler(run: RunFire) -> None:
        calls.append((run.run_id, run.attempt, run.payload))
        if run.run_id == "busy":
            await release.wait()
        elif run.run_id == "broken" and run.attempt == 1:
            raise RuntimeError("the first attempt fails")

    async def steer(*args: str) -> subprocess.CompletedProcess[str]:
        command = functools.partial(cli, "runs", *args, "--sqlite", path)
        return await trio.to_thread.run_sync(command)

    options = RunOptions(process_id="owner-1", lease=3.0, heartbeat_interval=0.5, horizon=30.0)
    with trio.fail_after(60):
        async with (
            open_sqlite_run_store(path) as store,
            open_coordinator(run_handlers={"wf": handler}, run_store=store, run_options=options)
            as coordinator,
        ):  # fmt: skip
            await coordinator.schedule("wf", "busy", after=0.1, persist=True)
            await coordinator.schedule("wf", "broken", {"n": 1}, after=0.1, persist=True)
            soon = await coordinator.schedule("wf", "soon", after=5.0, persist=True)
            await until(lambda: outcome(store, "broken"), "failed")
            assert sorted(c[0] for c in calls) == ["broken", "busy"]
            assert coordinator.has_run("soon")  # armed by its live owner

            cancelled = await steer("cancel", "soon")
            assert cancelled.returncode == 0, cancelled.stderr
            assert cancelled.stdout.startswith("cancelled run 'soon'")
            refused = await steer("cancel", "busy")
            assert refused.returncode == 1
            assert "run 'busy' is started, not pending: not cancelled" in refused.stderr

            retried = await steer("retry", "broken")
            assert retried.returncode == 0, retried.stderr
            await until(lambda: outcome(store, "broken"), "ran")
            assert [c for c in calls if c[0] == "broken"] == [
                ("broken", 1, {"n": 1}),
                ("broken", 2, {"n": 1}),
            ]
            ran = await store.get_run("broken")
            assert ran is not None
            assert (ran.state, ran.outcome, ran.owner, ran.attempt) == (
                RunState.DONE, "ran", "owner-1", 2,
            )  # fmt: skip
            assert coordinator.statistics().runs.taken_over == 1  # claimed by its sweep

            listing = await steer("--format", "jsonl")
            assert listing.returncode == 0, listing.stderr
            docs = [json.loads(line) for line in listing.stdout.splitlines()]
            assert {doc["run_id"]: doc["state"] for doc in docs} == {
                "busy": "started",
                "broken": "done",
            }
            # Past the time "soon" was due, and a sweep more: never run.
            await trio.sleep(max(0.0, soon.scheduled_at - time.time()) + 1.5)
            assert [c for c in calls if c[0] == "soon"] == []
            release.set()


def test_a_table_escapes_control_characters_of_names() -> None:
    # Found by a review: a run id (or a key, a process id) from untrusted input could
    # colour the terminal, move the cursor, or break its row in two.
    now = time.time()
    run = StoredRun("evil \x1b[31mid\nFAKE ROW", "wf", "null", now + 60.0)
    out = io.StringIO()
    print_items("table", [run], _run_row, out)
    _header, row = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()
    assert row.startswith("evil \\x1b[31mid\\nFAKE ROW")
