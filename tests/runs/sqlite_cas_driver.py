"""One process of the multi-process SQLite run-store tests (tests/runs/test_run_store_sqlite.py).

Run as::

    python -m tests.runs.sqlite_cas_driver cas PATH RUN_ID ATTEMPTS

It opens a :class:`~trio_debounce.SqliteRunStore` on ``PATH``, prints ``ready`` and
waits for a line on stdin (so that every process starts at once), then makes
``ATTEMPTS`` read-modify-write attempts on run ``RUN_ID``: ``get_run``, then
``update_run`` with the payload's counter ``n`` plus one, against the revision read.
It prints one JSON line, ``{"ok": <updates that won>, "lost": <updates that lost>,
"errors": [<exceptions, as text>], "backwards": <reads whose revision went down>}``.

::

    python -m tests.runs.sqlite_cas_driver bench PATH

measures the store on this machine (the durability figures of ``SqliteRunStore``'s
docstring): raw SQLite write transactions per second with ``synchronous=FULL`` and
``NORMAL``, and the store's ``get_run`` + ``update_run`` round trip, with the lease
write (``NORMAL``) for comparison.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time

import trio

from trio_debounce import BackendError
from trio_debounce._runs._sqlite import open_sqlite_run_store
from trio_debounce.abc import Lease, StoredRun


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def cas(path: str, run_id: str, attempts: int) -> dict[str, object]:
    """The read-modify-write loop of one process; returns its summary."""
    ok = lost = backwards = 0
    errors: list[str] = []
    async with open_sqlite_run_store(path, timeout=10.0) as store:
        _emit("ready")
        await trio.to_thread.run_sync(sys.stdin.readline)
        last_revision = 0
        for _ in range(attempts):
            try:
                run = await store.get_run(run_id)
                if run is None:
                    errors.append("the run is gone")
                    continue
                if run.revision < last_revision:
                    backwards += 1
                last_revision = run.revision
                n = json.loads(run.payload)["n"]
                written = await store.update_run(run.replace(payload=json.dumps({"n": n + 1})))
            except BackendError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if written is None:
                lost += 1
            else:
                ok += 1
                last_revision = written.revision
    return {"ok": ok, "lost": lost, "errors": errors, "backwards": backwards}


def _raw_writes_per_second(path: str, synchronous: str, seconds: float = 1.0) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE IF NOT EXISTS bench (k INTEGER PRIMARY KEY, v INTEGER)")
        conn.execute("INSERT OR IGNORE INTO bench VALUES (1, 0)")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        n = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("UPDATE bench SET v = v + 1 WHERE k = 1")
            conn.execute("COMMIT")
            n += 1
        return n / (time.perf_counter() - start)
    finally:
        conn.close()


async def bench(directory: str) -> dict[str, float]:
    """The figures of the durability decision, measured on this machine."""
    figures: dict[str, float] = {}
    raw = os.path.join(directory, "raw.db")
    for level in ("FULL", "NORMAL", "FULL", "NORMAL"):  # twice: the second pass counts
        figures[f"raw_writes_per_s_{level}"] = round(_raw_writes_per_second(raw, level))
    async with open_sqlite_run_store(os.path.join(directory, "store.db")) as store:
        run = await store.create_run(StoredRun("bench", "wf", '{"n": 0}', 1.0))
        assert run is not None
        rounds = 500
        start = time.perf_counter()
        for i in range(rounds):
            read = await store.get_run("bench")
            assert read is not None
            written = await store.update_run(read.replace(payload=json.dumps({"n": i})))
            assert written is not None
        figures["store_get_update_us_FULL"] = round((time.perf_counter() - start) / rounds * 1e6)
        start = time.perf_counter()
        for _ in range(rounds):
            read = await store.get_run("bench")
            assert read is not None
        figures["store_get_us"] = round((time.perf_counter() - start) / rounds * 1e6)
        lease = await store.put_lease(Lease("bench", 1, 0.0))
        assert lease is not None
        start = time.perf_counter()
        for i in range(rounds):
            lease = await store.put_lease(Lease("bench", 1, float(i), revision=lease.revision))
            assert lease is not None
        figures["store_lease_put_us_NORMAL"] = round((time.perf_counter() - start) / rounds * 1e6)
    return figures


def main(argv: list[str]) -> None:
    """``cas PATH RUN_ID ATTEMPTS`` or ``bench DIRECTORY``."""
    if argv[:1] == ["cas"] and len(argv) == 4:
        result = trio.run(cas, argv[1], argv[2], int(argv[3]))
    elif argv[:1] == ["bench"] and len(argv) == 2:
        result = dict(trio.run(bench, argv[1]))
    else:
        raise SystemExit(__doc__)
    _emit(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
