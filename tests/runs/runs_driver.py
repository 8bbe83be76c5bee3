"""One process of the deferred-run fault tests (tests/runs/test_runs_processes.py).

Run as::

    python tests/runs/runs_driver.py --store sqlite --path runs.db --process-id p0 \\
        --name i0 --log i0.log --delivery at-least-once --lease 1.0

It opens a run store (``--store sqlite``: :func:`trio_debounce.open_sqlite_run_store`
on ``--path``; ``--store nats``: :func:`trio_debounce.nats.open_nats_run_store` on
``--url`` and ``--bucket``) and a coordinator with process id ``--process-id`` and a
run handler for workflow ``"job"``, then reads commands from stdin, one a line:

``s <run_id> <due>``
  ``await coordinator.schedule("job", run_id, at=due, persist=True)`` (``due``: wall
  epoch seconds), in a task of its own (at most ``--schedulers`` at once).

With ``--standby`` it opens the run store, then waits for a first line ``go
<process_id>`` before it opens the coordinator under that id (the tests keep warm
spares, so that a restart after a kill waits neither for the interpreter's start nor for
the store's connection on a loaded host); end of input before that line exits at once.

End of input (stdin closed) leaves the coordinator's block normally (``on_exit``
default): running handlers finish, the claims are released.

The events go to the ``--log`` file, one JSON object a line, each line written with a
single ``write(2)`` on a descriptor opened with ``O_APPEND`` (so a line is whole or
absent after a ``SIGKILL``; no fsync: the page cache outlives the process). Every line
has ``ev``, ``proc`` (``--name``, the incarnation), ``id`` (the process id), ``pid``
and ``t`` (:func:`time.time`):

* ``ack`` (``run``, ``due``, ``owner``, ``outcome``) when ``schedule`` returned, or
  ``err`` (``run``, ``error``) when it raised;
* ``start`` (``run``, ``attempt``, ``token``, ``scheduled``) when the handler starts,
  ``end`` (same) when it returns: it sleeps ``--handler-time`` seconds in between, so
  that a kill can land inside it;
* ``claim`` (``run``, ``from``): this process took the run over (the scheduler's
  ``took over`` log record);
* ``w0`` (``run``, ``state``, ``outcome``, ``token``) just before a write that makes
  the run a tombstone (the start under at-most-once, the finish under at-least-once),
  and ``w1`` (same, ``ok``) when that write returned: a kill between the two leaves
  the write's fate unknown, and the test treats it as inside the handler.

On stdout: ``{"ev": "standby", ...}`` once a standby's store is open,
``{"ev": "ready", ...}`` once the coordinator is open and
``{"ev": "exit", "stats": {...}}`` after its block exited.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Collection
from contextlib import AsyncExitStack, aclosing
from typing import Any

import trio

from trio_debounce import RunFire, RunOptions, open_coordinator, open_sqlite_run_store
from trio_debounce._runs._store import ANY, _Any
from trio_debounce.abc import Lease, RunState, RunStore, StoredRun

WORKFLOW = "job"


class EventLog:
    """One JSON line per event, one ``write(2)`` each, on an ``O_APPEND`` descriptor."""

    def __init__(self, path: str, name: str, process_id: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._base = {"proc": name, "id": process_id, "pid": os.getpid()}

    def write(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, **fields, **self._base, "t": time.time()})
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class TracingStore(RunStore):
    """A run store that logs the writes making a run a tombstone, around the call."""

    def __init__(self, inner: RunStore, log: EventLog) -> None:
        self._inner = inner
        self._log = log
        self.max_payload_bytes = inner.max_payload_bytes

    def wall_time(self) -> float:
        return self._inner.wall_time()

    async def get_run(self, run_id: str) -> StoredRun | None:
        return await self._inner.get_run(run_id)

    async def create_run(self, run: StoredRun) -> StoredRun | None:
        return await self._inner.create_run(run)

    async def update_run(self, run: StoredRun) -> StoredRun | None:
        if run.state is not RunState.DONE:
            begin = time.monotonic()
            written = await self._inner.update_run(run)
            if written is None:
                self._log.write(
                    "lost-cas",
                    run=run.run_id,
                    owner=run.owner,
                    state=str(run.state),
                    secs=round(time.monotonic() - begin, 4),
                )
            return written
        fields = {
            "run": run.run_id,
            "outcome": run.outcome,
            "token": run.token,
            "attempt": run.attempt,
        }
        self._log.write("w0", **fields)
        written = await self._inner.update_run(run)
        self._log.write("w1", ok=written is not None, **fields)
        return written

    async def delete_run(self, run_id: str, *, revision: int) -> bool:
        return await self._inner.delete_run(run_id, revision=revision)

    async def list_runs(
        self,
        *,
        states: Collection[RunState] | None = None,
        owner: str | _Any | None = ANY,
        workflow: str | None = None,
        due_before: float | None = None,
        finished_before: float | None = None,
        limit: int | None = None,
    ) -> list[StoredRun]:
        begin = time.monotonic()
        runs = await self._inner.list_runs(
            states=states,
            owner=owner,
            workflow=workflow,
            due_before=due_before,
            finished_before=finished_before,
            limit=limit,
        )
        if due_before is not None:  # the claim sweep's listing
            self._log.write("list", n=len(runs), secs=round(time.monotonic() - begin, 4))
        return runs

    async def get_lease(self, process_id: str) -> Lease | None:
        return await self._inner.get_lease(process_id)

    async def put_lease(self, lease: Lease) -> Lease | None:
        return await self._inner.put_lease(lease)

    async def delete_lease(self, process_id: str, *, revision: int) -> bool:
        return await self._inner.delete_lease(process_id, revision=revision)

    async def list_leases(self) -> list[Lease]:
        return await self._inner.list_leases()


class ClaimLogger(logging.Handler):
    """Turns the scheduler's ``took over`` records into ``claim`` events."""

    def __init__(self, log: EventLog) -> None:
        super().__init__(logging.INFO)
        self._log = log

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("process %r took over run") and isinstance(record.args, tuple):
            _, run_id, old_owner = record.args
            self._log.write("claim", run=run_id, **{"from": old_owner})


def emit(event: dict[str, Any]) -> None:
    try:
        sys.stdout.write(json.dumps({**event, "t": time.time()}) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("sqlite", "nats"), required=True)
    parser.add_argument("--path", help="the SQLite database (--store sqlite)")
    parser.add_argument("--url", help="the NATS server URL (--store nats)")
    parser.add_argument("--bucket", help="the KV bucket (--store nats)")
    parser.add_argument("--process-id", help="RunOptions.process_id (or --standby)")
    parser.add_argument(
        "--standby",
        action="store_true",
        help="open the store, then wait for a first stdin line 'go <process-id>'",
    )
    parser.add_argument("--name", required=True, help="this incarnation's name")
    parser.add_argument("--log", required=True, help="the event log file")
    parser.add_argument(
        "--delivery", choices=("at-least-once", "at-most-once"), default="at-least-once"
    )
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--heartbeat", type=float, default=0.25)
    parser.add_argument("--skew", type=float, default=0.1)
    parser.add_argument("--horizon", type=float, default=2.0)
    parser.add_argument("--op-timeout", type=float, default=2.0)
    parser.add_argument("--handler-time", type=float, default=0.004)
    parser.add_argument("--schedulers", type=int, default=8, help="schedule calls at once")
    parser.add_argument("--log-level", default="WARNING", help="of stderr's log handler")
    parser.add_argument(
        "--watch-lag",
        type=float,
        default=0.0,
        help="seconds the NATS store's watch of the lease keys waits before each batch "
        "(a slow consumer; the chaos scenario 'slow-lease-watch')",
    )
    return parser.parse_args(argv)


def slow_lease_watch(lag: float) -> None:
    """Make the NATS run store's watch of the lease keys (``rl.``) a slow consumer:
    each batch is taken ``lag`` seconds late, so its index of leases lags behind."""
    from trio_debounce._keys import RUN_LEASE_PREFIX
    from trio_debounce.nats._store import NatsKvWatch

    receive_batch = NatsKvWatch.receive_batch

    async def lagging(self: NatsKvWatch, max_entries: int = 512) -> Any:
        if self.prefix.startswith(RUN_LEASE_PREFIX):
            await trio.sleep(lag)
        return await receive_batch(self, max_entries)

    NatsKvWatch.receive_batch = lagging  # type: ignore[method-assign]


async def read_lines(stream: trio.lowlevel.FdStream) -> AsyncGenerator[str, None]:
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


async def main(args: argparse.Namespace) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stdin, aclosing(read_lines(stdin)) as lines, AsyncExitStack() as stack:
        inner: RunStore
        if args.store == "sqlite":
            inner = await stack.enter_async_context(open_sqlite_run_store(args.path))
        else:
            from trio_debounce.nats import NatsConfig, open_nats_run_store

            if args.watch_lag > 0:
                slow_lease_watch(args.watch_lag)

            config = NatsConfig(
                servers=(args.url,),
                bucket=args.bucket,
                op_timeout=args.op_timeout,
                connect_timeout=5.0,
                ping_interval=1.0,
            )
            inner = await stack.enter_async_context(open_nats_run_store(config))
        if args.standby:
            # The store is open: taking over a process id costs only the coordinator's
            # start, however loaded the host is.
            emit({"ev": "standby", "proc": args.name, "pid": os.getpid()})
            first = await anext(lines, None)
            if first is None:
                return  # closed before it was needed
            words = first.split()
            if len(words) != 2 or words[0] != "go":
                raise SystemExit(f"expected 'go <process-id>', got {first!r}")
            args.process_id = words[1]
        await serve(args, inner, lines)


async def serve(args: argparse.Namespace, inner: RunStore, lines: AsyncIterator[str]) -> None:
    """Open the coordinator as ``args.process_id`` and obey the commands in ``lines``."""
    log = EventLog(args.log, args.name, args.process_id)
    logging.getLogger("trio_debounce.runs").addHandler(ClaimLogger(log))

    async def handler(run: RunFire) -> None:
        fields = {
            "run": run.run_id,
            "attempt": run.attempt,
            "token": run.fencing_token,
            "scheduled": run.scheduled_at,
        }
        log.write("start", **fields)
        await trio.sleep(args.handler_time)
        log.write("end", **fields)

    options = RunOptions(
        process_id=args.process_id,
        lease=args.lease,
        heartbeat_interval=args.heartbeat,
        max_clock_skew=args.skew,
        horizon=args.horizon,
        op_timeout=args.op_timeout,
    )
    limiter = trio.CapacityLimiter(args.schedulers)
    store = TracingStore(inner, log)
    async with open_coordinator(
        run_handlers={WORKFLOW: handler},
        run_store=store,
        run_options=options,
        delivery=args.delivery,
    ) as coordinator:

        async def schedule(run_id: str, due: float) -> None:
            async with limiter:
                try:
                    result = await coordinator.schedule(WORKFLOW, run_id, at=due, persist=True)
                except Exception as exc:
                    log.write("err", run=run_id, error=repr(exc))
                    return
            log.write("ack", run=run_id, due=due, owner=result.owner, outcome=result.outcome)

        emit({"ev": "ready", "proc": args.name, "pid": os.getpid()})
        async with trio.open_nursery() as nursery:
            async for line in lines:
                words = line.split()
                if len(words) == 3 and words[0] == "s":
                    nursery.start_soon(schedule, words[1], float(words[2]))
                elif words:
                    log.write("bad-command", line=line)
    emit({"ev": "exit", "stats": dataclasses.asdict(coordinator.statistics())})
    log.close()


if __name__ == "__main__":
    arguments = parse_args()
    if not (arguments.process_id or arguments.standby):
        raise SystemExit("--process-id or --standby is required")
    logging.basicConfig(
        stream=sys.stderr,
        format=f"%(asctime)s {arguments.name} %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger().handlers[0].setLevel(arguments.log_level)
    logging.getLogger("trio_debounce").setLevel(logging.INFO)
    trio.run(main, arguments)
