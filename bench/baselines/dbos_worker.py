"""The DBOS baseline process (items 7 and 8): DBOS on SQLite, launched once, driven by
``bench/suite.py`` through stdin and stdout so that its rounds alternate with ours.

Commands, one a line: ``debounce N`` (N coalescing pings into one key's open window
through ``dbos.Debouncer``, sequential, one caller), ``enqueue N`` (N workflow
enqueues on a DBOS queue, each delayed by an hour); each answers with one JSON line
``{"seconds": ...}``.
``quit`` ends it. ``python bench/dbos_worker.py DIR`` keeps its SQLite file in DIR.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time


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


if __name__ == "__main__":
    main(sys.argv[1])
