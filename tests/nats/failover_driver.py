"""One debouncing process for the failover tests (tests/nats/test_nats_failover.py).

Run as::

    python tests/nats/failover_driver.py --url URL --bucket B --process-id P \\
        --delivery at-least-once --lease 1.0 --skew 0.2 --delay 0.6

It opens the NATS backend and a coordinator with a handler for workflow ``"wf"``, then
reads commands from stdin, one a line:

``ping <key> <payload>``
  ``await coordinator.debounce("wf", key, payload, delay=D, mode=key_mode(key))``
  (each ping runs in its own task, so a slow one does not hold up the next).

and writes one JSON object a line to stdout, flushed at once (``t`` is
:func:`time.time`, so lines of different processes on one host compare):

* ``{"ev": "ready", "proc": P, "pid": ..., "t": ...}`` once the coordinator is open;
* ``{"ev": "ack", "key", "payload", "run", "count", "seq", "owner", "stored",
  "outcome", "at", "t"}`` when a ping returns (``at``: the pending fire time, wall
  clock, or null; ``seq``: the order in which this process's pings entered
  ``debounce``, which orders the pings that one write carried, as they report one
  count);
* ``{"ev": "start", "key", "run", "payload", "count", "attempt", "token", "edge",
  "fired_at", "t"}`` when the handler starts, and ``{"ev": "done", ...same...}`` when
  it returns: it sleeps ``--handler-time`` seconds in between, so that a kill can land
  inside it;
* ``{"ev": "error", "key", "payload", "error", "t"}`` when a ping raised;
* ``{"ev": "exit", "stats": {...}, "t"}`` after the coordinator's block has exited.

End of input (stdin closed) leaves the coordinator's block normally, which then does
what ``--on-exit`` says (``wait`` by default; ``handoff`` leaves the open windows to a
peer or to the next process).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import trio

from trio_debounce import Coordinator, Fire, ModeName, open_coordinator
from trio_debounce.nats import NatsConfig, open_nats_backend

WORKFLOW = "wf"
#: The modes of a failover round's keys, by the key's index (see key_mode).
MODES: tuple[ModeName, ...] = ("trailing", "leading", "both")


def key_mode(key: str) -> ModeName:
    """The mode every process pings ``key`` with: a failover round's keys
    (``r<round>k<i>``) cycle through trailing, leading and both edges by ``i``; every
    other key is trailing."""
    head, sep, index = key.rpartition("k")
    if head.startswith("r") and head[1:].isdigit() and sep and index.isdigit():
        return MODES[int(index) % len(MODES)]
    return "trailing"


def emit(event: dict[str, Any]) -> None:
    """Write one JSON line to stdout and flush it (a short line is one atomic write)."""
    try:
        sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass  # the test is gone: nobody reads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the NATS server URL")
    parser.add_argument("--bucket", required=True, help="the KV bucket")
    parser.add_argument("--process-id", required=True, help="this process's id")
    parser.add_argument(
        "--delivery", choices=("at-least-once", "at-most-once"), default="at-least-once"
    )
    parser.add_argument("--on-exit", choices=("wait", "flush", "cancel", "handoff"), default="wait")
    parser.add_argument("--lease", type=float, default=1.0, help="process lease, seconds")
    parser.add_argument("--skew", type=float, default=0.2, help="max clock skew, seconds")
    parser.add_argument("--delay", type=float, default=0.6, help="debounce delay, seconds")
    parser.add_argument("--op-timeout", type=float, default=0.5, help="seconds")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds")
    parser.add_argument(
        "--handler-time", type=float, default=0.05, help="seconds the handler sleeps"
    )
    parser.add_argument("--log-level", default="WARNING", help="of the trio_debounce logger")
    return parser.parse_args(argv)


def wall(trio_time: float) -> float:
    """A time on Trio's clock, as wall-clock epoch seconds."""
    return trio_time - trio.current_time() + time.time()


async def read_lines(stream: trio.lowlevel.FdStream) -> AsyncIterator[str]:
    """Yield stdin's lines (without the newline) until end of input."""
    buffer = b""
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            if buffer:
                yield buffer.decode()
            return
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode()


#: The order in which this process's pings entered ``debounce`` (see "seq").
_arrivals = 0


async def ping(coordinator: Coordinator, key: str, payload: str, delay: float) -> None:
    global _arrivals
    _arrivals += 1
    seq = _arrivals
    try:
        result = await coordinator.debounce(WORKFLOW, key, payload, delay=delay, mode=key_mode(key))
    except Exception as exc:
        emit({"ev": "error", "key": key, "payload": payload, "error": repr(exc), "t": time.time()})
        return
    emit(
        {
            "ev": "ack",
            "key": key,
            "payload": payload,
            "run": result.active_run_id,
            "count": result.ping_count,
            "seq": seq,
            "owner": result.owner,
            "stored": result.stored,
            "outcome": result.outcome.value,
            "at": None if result.scheduled_at is None else wall(result.scheduled_at),
            "t": time.time(),
        }
    )


async def main(args: argparse.Namespace) -> None:
    config = NatsConfig(
        servers=(args.url,),
        bucket=args.bucket,
        process_lease=args.lease,
        max_clock_skew=args.skew,
        op_timeout=args.op_timeout,
        connect_timeout=args.connect_timeout,
        ping_interval=1.0,
    )

    async def handler(fire: Fire) -> None:
        event = {
            "key": fire.key,
            "run": fire.run_id,
            "payload": fire.payload,
            "count": fire.ping_count,
            "attempt": fire.attempt,
            "token": fire.fencing_token,
            "edge": fire.edge.value,
            "fired_at": wall(fire.fired_at),
        }
        emit({"ev": "start", **event, "t": time.time()})
        await trio.sleep(args.handler_time)
        emit({"ev": "done", **event, "t": time.time()})

    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with open_nats_backend(config, process_id=args.process_id) as backend:
        async with open_coordinator(
            handlers={WORKFLOW: handler},
            backend=backend,
            delivery=args.delivery,
            on_exit=args.on_exit,
        ) as coordinator:
            emit({"ev": "ready", "proc": args.process_id, "pid": os.getpid(), "t": time.time()})
            async with stdin, trio.open_nursery() as nursery:
                async for line in read_lines(stdin):
                    words = line.split(" ", 2)
                    if not words or not words[0]:
                        continue
                    if words[0] == "ping" and len(words) == 3:
                        nursery.start_soon(ping, coordinator, words[1], words[2], args.delay)
                    else:
                        emit({"ev": "bad-command", "line": line, "t": time.time()})
        emit(
            {"ev": "exit", "stats": dataclasses.asdict(coordinator.statistics()), "t": time.time()}
        )


if __name__ == "__main__":
    arguments = parse_args()
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format=f"%(asctime)s {arguments.process_id} %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("trio_debounce").setLevel(arguments.log_level)
    trio.run(main, arguments)
