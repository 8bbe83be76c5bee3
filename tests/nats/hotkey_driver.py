"""One process of the hot-key test (tests/nats/test_nats_hotkey.py).

Run as::

    python tests/nats/hotkey_driver.py --url URL --bucket B --process-id P \\
        --delivery at-least-once --start-at T --seconds 3 --tasks 25

It opens the NATS backend and a coordinator with a handler for workflow ``"wf"``; at
wall-clock time ``--start-at`` (without it: the time given on the first line of stdin,
which the test writes once every process is ready) it starts ``--tasks`` tasks that
ping key ``"hot"`` as fast as they can for ``--seconds`` (``delay`` and ``max_delay``
from the options, so the window fires every ``max_delay`` while the pings go on), then
leaves the block
(``on_exit="wait"``) after ``--settle`` seconds. It writes one JSON line per event to
stdout:

* ``["ready"]`` once the coordinator is open;
* ``["ack", run, count, seq, payload, stored]`` per acknowledged ping (``seq``: the
  order in which this process's pings entered ``debounce``);
* ``["error", payload, message]`` per ping that raised;
* ``["fire", run, count, payload, attempt]`` per fire that the handler ran;
* ``["rate", acknowledged pings per second of the ping phase]``;
* ``["exit", fail_open_windows]`` after the block has exited.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import trio

from trio_debounce import Fire, open_coordinator
from trio_debounce.nats import NatsConfig, open_nats_backend


def emit(*event: Any) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")


async def main(args: argparse.Namespace) -> None:
    config = NatsConfig(
        servers=(args.url,),
        bucket=args.bucket,
        process_lease=3.0,
        max_clock_skew=0.5,
        op_timeout=2.0,
        connect_timeout=10.0,
    )

    async def handler(fire: Fire) -> None:
        emit("fire", fire.run_id, fire.ping_count, fire.payload, fire.attempt)

    async with (
        open_nats_backend(config, process_id=args.process_id) as backend,
        open_coordinator(
            handlers={"wf": handler}, backend=backend, delivery=args.delivery
        ) as coordinator,
    ):
        emit("ready")
        sys.stdout.flush()
        start_at = args.start_at
        if start_at is None:
            start_at = float(await trio.to_thread.run_sync(sys.stdin.readline))
        await trio.sleep(max(0.0, start_at - time.time()))
        seq = 0
        acked = 0
        stop_at = trio.current_time() + args.seconds

        async def pinger(task: int) -> None:
            nonlocal seq, acked
            n = 0
            while trio.current_time() < stop_at:
                payload = f"{args.process_id}-{task}-{n}"
                n += 1
                seq += 1
                mine = seq
                try:
                    r = await coordinator.debounce(
                        "wf", "hot", payload, delay=args.delay, max_delay=args.max_delay
                    )
                except Exception as exc:
                    emit("error", payload, repr(exc))
                    continue
                acked += 1
                emit("ack", r.active_run_id, r.ping_count, mine, payload, r.stored)

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for task in range(args.tasks):
                nursery.start_soon(pinger, task)
        emit("rate", acked / (trio.current_time() - started))
        await trio.sleep(args.settle)
    emit("exit", coordinator.statistics().fail_open_windows)
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--process-id", required=True)
    parser.add_argument("--delivery", default="at-least-once")
    parser.add_argument("--start-at", type=float, help="wall-clock time (default: read from stdin)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--settle", type=float, default=1.5)
    parser.add_argument("--tasks", type=int, default=25)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--max-delay", type=float, default=0.5)
    trio.run(main, parser.parse_args())
