"""One debouncing process of the chaos scenarios: random pings, every event logged.

Run as (``python -m tests.chaos.driver --help`` lists every option)::

    python -m tests.chaos.driver --url URL --bucket B --process-id p0 --name p0 \\
        --log p0.jsonl --keys 1000 --rate 20 --seconds 60 --seed 1

It opens the NATS backend and a coordinator (workflow ``"wf"``), then pings random keys
of ``k0 .. k<keys-1>`` at about ``--rate`` pings a second for ``--seconds`` seconds (or
until its standard input is closed), each ping in a task of its own (at most
``--concurrency`` at once). A key's mode (trailing, leading or both), delay and cap
(``max_delay``, or none) are drawn from the key's name, so every process pings a key
the same way. Then it keeps its coordinator
open until its standard input is closed (so that it takes over the windows of peers
that were killed), and leaves the block with ``on_exit="wait"``.

Every event is one JSON line in ``--log``, written with one ``write(2)`` on an
``O_APPEND`` descriptor (:class:`tests.runs.runs_driver.EventLog`: a line is whole or absent
after a ``SIGKILL``), with ``ev``, ``proc`` (``--name``), ``id`` (the process id),
``pid`` and ``t`` (:func:`time.time`, the host's real clock, whatever clock the backend
is given):

* ``ready``, once the coordinator is open; ``loaded`` when the pings end; ``exit``
  (``stats``) after the block exited; ``crash`` (``error``) if it raised;
* ``ping`` (``key``, ``payload``, ``mode``, ``run``, ``outcome``, ``count``,
  ``owner``, ``stored``, ``fail_open``, ``t0``: when the call began), when a ping
  returned; ``err`` (``key``, ``payload``, ``error``, ``t0``) when it raised;
* ``start`` (``key``, ``run``, ``payload``, ``count``, ``attempt``, ``token``,
  ``edge``) when the handler starts and ``end`` (same) when it returns: it sleeps
  ``--handler-time`` seconds in between, so that a kill can land inside it;
* ``block`` (``secs``) and ``unblock`` around a ``time.sleep`` that blocks the event
  loop (``--block-at``, ``--block-for``);
* ``clock`` (``offset``) whenever the wall-clock offset given to the backend changes
  (``--clock-offset``, ``--clock-steps``);
* ``sample`` (``rss_kb``, ``fds``) every ``--sample-every`` seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import hashlib
import logging
import os
import random
import signal
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import trio

from tests.runs.runs_driver import EventLog, read_lines
from trio_debounce import Coordinator, Fire, ModeName, open_coordinator
from trio_debounce.nats import NatsConfig, open_nats_backend

WORKFLOW = "wf"
MODES: tuple[ModeName, ...] = ("trailing", "leading", "both")


@dataclasses.dataclass(frozen=True)
class KeyShape:
    """How every process pings one key."""

    mode: ModeName
    delay: float
    max_delay: float | None


def key_shape(key: str, *, min_delay: float, max_delay: float) -> KeyShape:
    """The mode, delay and cap of ``key``: drawn from a hash of its name, so they are
    the same in every process (a shared window refuses a ping of another mode)."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    rng = random.Random(seed)
    mode = MODES[rng.randrange(3)]
    delay = round(rng.uniform(min_delay, max_delay), 3)
    cap = None if rng.random() < 0.5 else round(delay * rng.uniform(1.5, 4.0), 3)
    return KeyShape(mode, delay, cap)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="server URLs, comma-separated")
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--process-id", required=True)
    parser.add_argument("--name", required=True, help="this incarnation's name")
    parser.add_argument("--log", required=True, help="the JSON-lines event log")
    parser.add_argument(
        "--delivery", choices=("at-least-once", "at-most-once"), default="at-least-once"
    )
    parser.add_argument("--on-backend-error", choices=("fail-open", "raise"), default="fail-open")
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--skew", type=float, default=0.5)
    parser.add_argument("--op-timeout", type=float, default=5.0)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--key-prefix", default="k")
    parser.add_argument("--rate", type=float, default=20.0, help="pings a second")
    parser.add_argument("--seconds", type=float, default=30.0, help="of pinging")
    parser.add_argument("--concurrency", type=int, default=16, help="pings at once")
    parser.add_argument("--min-delay", type=float, default=0.2)
    parser.add_argument("--max-delay", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--payload-bytes", type=int, default=0, help="pad each payload to about this size"
    )
    parser.add_argument("--handler-time", type=float, default=0.05)
    parser.add_argument("--clock-offset", type=float, default=0.0, help="seconds")
    parser.add_argument(
        "--clock-steps",
        default="",
        help="'AT:DELTA,...': AT seconds after ready, add DELTA seconds to the offset",
    )
    parser.add_argument("--block-at", type=float, default=-1.0, help="seconds after ready")
    parser.add_argument("--block-for", type=float, default=0.0, help="seconds")
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--trace-memory", action="store_true")
    parser.add_argument("--log-level", default="WARNING")
    return parser.parse_args(argv)


def rss_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Clock:
    """The wall clock given to the backend: the real one plus a steppable offset."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def __call__(self) -> float:
        return time.time() + self.offset


def task_tree() -> str:
    """Every Trio task of this run with the frames it awaits in, indented by nursery."""
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        lines.append("  " * depth + f"task {task.name}")
        for frame, lineno in task.iter_await_frames():
            code = frame.f_code
            lines.append("  " * depth + f"  {code.co_filename}:{lineno} {code.co_name}")
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    root = trio.lowlevel.current_root_task()
    if root is not None:
        walk(root, 0)
    return "\n".join(lines) + "\n"


#: What the SIGUSR1 dump writes after the task tree: name -> a description of state.
STATE: dict[str, Callable[[], object]] = {}


async def dump_tasks_on_sigusr1() -> None:
    """A system task (it outlives the main task's exit): on ``SIGUSR1`` write every Trio
    task's awaited frames and every thread's stack to stderr. ``Fleet.shutdown`` sends
    it to a driver that hangs at exit, before its ``SIGKILL``."""
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        async for _ in signals:
            sys.stderr.write("=== SIGUSR1: Trio tasks ===\n" + task_tree())
            for name, describe in STATE.items():
                try:
                    sys.stderr.write(f"=== {name} ===\n{describe()}\n")
                except Exception as exc:  # a dump never raises
                    sys.stderr.write(f"=== {name}: {exc!r}\n")
            sys.stderr.write("=== threads ===\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


async def run(args: argparse.Namespace) -> None:
    trio.lowlevel.spawn_system_task(dump_tasks_on_sigusr1)
    log = EventLog(args.log, args.name, args.process_id)
    rng = random.Random(args.seed)
    clock = Clock(args.clock_offset)
    config = NatsConfig(
        servers=tuple(url for url in args.url.split(",") if url),
        bucket=args.bucket,
        process_lease=args.lease,
        max_clock_skew=args.skew,
        op_timeout=args.op_timeout,
        connect_timeout=10.0,
        ping_interval=1.0,
    )

    async def handler(fire: Fire) -> None:
        fields = {
            "key": fire.key,
            "run": fire.run_id,
            "payload": fire.payload,
            "count": fire.ping_count,
            "attempt": fire.attempt,
            "token": fire.fencing_token,
            "edge": fire.edge.value,
        }
        log.write("start", **fields)
        await trio.sleep(args.handler_time)
        log.write("end", **fields)

    async def ping(coordinator: Coordinator, key: str, payload: str) -> None:
        shape = key_shape(key, min_delay=args.min_delay, max_delay=args.max_delay)
        t0 = time.time()
        try:
            result = await coordinator.debounce(
                WORKFLOW,
                key,
                payload,
                delay=shape.delay,
                max_delay=shape.max_delay,
                mode=shape.mode,
            )
        except Exception as exc:
            log.write("err", key=key, payload=payload, error=repr(exc), t0=t0)
            return
        # No checkpoint since the call returned: a fail-open window is still listed.
        assert coordinator._shared is not None  # the driver always has a backend
        fail_open = result.active_run_id in coordinator._shared._fail_open_runs
        log.write(
            "ping",
            key=key,
            payload=payload,
            mode=shape.mode,
            run=result.active_run_id,
            outcome=result.outcome.value,
            count=result.ping_count,
            owner=result.owner,
            stored=result.stored,
            fail_open=fail_open,
            t0=t0,
        )

    closed = trio.Event()  # standard input was closed

    async def load(coordinator: Coordinator, nursery: trio.Nursery) -> None:
        # At most --concurrency pings in flight: when they are slow, the load waits
        # (closed loop) instead of piling up tasks, which would grow the driver's
        # memory and starve its heartbeat (what an open-loop load did on a loaded
        # machine: the soak's RSS trend measured the backlog, not the library).
        slots = trio.Semaphore(args.concurrency)
        end = trio.current_time() + args.seconds
        seq = 0
        waited = 0

        async def one(key: str, payload: str) -> None:
            try:
                await ping(coordinator, key, payload)
            finally:
                slots.release()

        while trio.current_time() < end and not closed.is_set():
            if slots.value == 0:
                waited += 1
            await slots.acquire()
            seq += 1
            key = f"{args.key_prefix}{rng.randrange(args.keys)}"
            payload = f"{args.name}:{seq}"
            if args.payload_bytes > len(payload):
                payload += ":" + "x" * (args.payload_bytes - len(payload) - 1)
            nursery.start_soon(one, key, payload)
            await trio.sleep(rng.expovariate(args.rate))
        log.write("loaded", pings=seq, waited_for_a_slot=waited)

    async def clock_steps() -> None:
        began = trio.current_time()
        for step in filter(None, args.clock_steps.split(",")):
            at, delta = (float(part) for part in step.split(":"))
            await trio.sleep_until(began + at)
            clock.offset += delta
            log.write("clock", offset=clock.offset)

    async def block() -> None:
        await trio.sleep(args.block_at)
        log.write("block", secs=args.block_for)
        time.sleep(args.block_for)  # noqa: ASYNC251 -- the point: a blocked event loop
        log.write("unblock")

    async def trace_growth() -> None:
        # --trace-memory: where this process's memory grew between a quarter of the
        # run and its end (tracemalloc's top lines, to stderr), to tell a leak from
        # fragmentation when the soak's RSS trend fails.
        tracemalloc.start(8)
        await trio.sleep(args.seconds / 4)
        before = tracemalloc.take_snapshot()
        await trio.sleep(args.seconds * 3 / 4)
        after = tracemalloc.take_snapshot()
        for stat in after.compare_to(before, "traceback")[:12]:
            lines = "\n  ".join(stat.traceback.format()[-8:])
            logging.getLogger("chaos.driver").warning("trace-memory: %s\n  %s", stat, lines)

    async def sample() -> None:
        while True:
            log.write("sample", rss_kb=rss_kb(), fds=len(os.listdir("/proc/self/fd")))
            await trio.sleep(args.sample_every)

    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with open_nats_backend(config, process_id=args.process_id, wall_time=clock) as backend:
        async with open_coordinator(
            handlers={WORKFLOW: handler},
            backend=backend,
            delivery=args.delivery,
            on_backend_error=args.on_backend_error,
        ) as coordinator:
            log.write("ready", clock=clock.offset)
            STATE["statistics"] = coordinator.statistics
            STATE["shared windows"] = lambda: vars(coordinator._shared)
            if clock.offset:
                log.write("clock", offset=clock.offset)

            async def read_stdin() -> None:
                async with stdin:
                    async for _ in read_lines(stdin):
                        pass
                closed.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample)
                if args.trace_memory:
                    nursery.start_soon(trace_growth)
                nursery.start_soon(clock_steps)
                nursery.start_soon(read_stdin)
                if args.block_at >= 0:
                    nursery.start_soon(block)
                async with trio.open_nursery() as pings:
                    await load(coordinator, pings)
                await closed.wait()
                nursery.cancel_scope.cancel()
        stats: dict[str, Any] = dataclasses.asdict(coordinator.statistics())
        log.write("exit", stats=stats)


def main() -> None:
    args = parse_args()
    # SIGUSR2: every thread's stack, written from the C signal handler, so it comes
    # even when the Trio loop is blocked (SIGUSR1's task tree needs a running loop).
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
    logging.basicConfig(
        stream=sys.stderr,
        format=f"%(asctime)s {args.name} %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger().handlers[0].setLevel(args.log_level)
    logging.getLogger("trio_debounce").setLevel(logging.INFO)
    try:
        trio.run(run, args)
    except BaseException as exc:
        EventLog(args.log, args.name, args.process_id).write("crash", error=repr(exc))
        raise


if __name__ == "__main__":
    main()
