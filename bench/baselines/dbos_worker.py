"""The DBOS baseline (the hot-key and runs items): DBOS on SQLite in a process of its
own, launched once, driven through stdin and stdout so that its rounds alternate with
ours; :class:`DbosProcess` is the suite's side of it.

Commands, one a line: ``debounce N`` (N coalescing pings into one key's open window
through ``dbos.Debouncer``, sequential, one caller), ``enqueue N`` (N workflow
enqueues on a DBOS queue, each delayed by an hour); each answers with one JSON line
``{"seconds": ...}``.
``quit`` ends it. ``python bench/baselines/dbos_worker.py DIR`` keeps its SQLite file in DIR.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def main(directory: str) -> None:
    from dbos import DBOS, Debouncer, SetEnqueueOptions

    logging.getLogger("dbos").setLevel(logging.WARNING)
    DBOS(
        config={
            "name": "trio-debounce-bench",
            "system_database_url": f"sqlite:///{os.path.join(directory, 'dbos.sqlite')}",
        }
    )

    @DBOS.workflow()
    def job(value: int) -> int:
        return value

    DBOS.launch()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    queue = DBOS.register_queue("bench")
    debouncer = Debouncer.create(job)
    debouncer.debounce("hot", 3600.0, -1)  # the window every timed ping coalesces into
    n = 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, _, count = line.strip().partition(" ")
        if command == "quit":
            break
        calls = int(count)
        t0 = time.perf_counter()
        if command == "debounce":
            for i in range(calls):
                debouncer.debounce("hot", 3600.0, n + i)
        elif command == "enqueue":
            # Delayed by an hour, as the schedule(after=3600) it is compared with.
            with SetEnqueueOptions(delay_seconds=3600.0):
                for i in range(calls):
                    queue.enqueue(job, n + i)
        else:
            raise SystemExit(f"unknown command {command!r}")
        n += calls
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
    DBOS.destroy(destroy_registry=True)


class DbosProcess:
    """This script (DBOS on SQLite) as a child process."""

    def __init__(self, directory: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"DBOS worker: {ready!r}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the DBOS worker exited")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, command: str, count: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command} {count}\n")
        self.proc.stdin.flush()
        return float(self._read()["seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    main(sys.argv[1])
