"""``trio-debounce runs``, ``runs cancel`` and ``runs retry``: the persisted deferred
runs of a run store (a NATS bucket, or an SQLite file) as an operator reads and
steers them (see :doc:`/cli`, "Persisted runs").

Listing opens the store without creating it (SQLite ``mode="ro"``; NATS
``create_bucket=False``, which reads only). Cancel and retry write through
:mod:`trio_debounce._runs._steer`, by compare-and-swap as a coordinator does, on a
store that is never created either (SQLite ``mode="rw"``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager

from .. import _validate
from .._runs._sqlite import open_sqlite_run_store
from .._runs._steer import Steered, cancel_pending_run, retry_failed_run, retry_refusal
from .._runs._store import RunState, RunStore, StoredRun
from ._commands import EXIT_USAGE, error, nats_config
from ._inspect import NONE, print_items, relative, run_on_store
from ._parser import check_run_store_options

#: The exit status of a run that does not exist, or whose state refuses the action.
EXIT_REFUSED = 1


def _store_opener(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, write: bool
) -> Callable[[], AbstractAsyncContextManager[RunStore]] | None:
    """The opener of the run store that the options name, never creating it (read-only
    unless ``write``). Bad options exit through ``parser.error``; None (after an error
    line) for a bad NATS environment or a missing nats extra."""
    check_run_store_options(parser, args)
    if args.sqlite is not None:
        return functools.partial(open_sqlite_run_store, args.sqlite, mode="rw" if write else "ro")
    config = nats_config(parser, args, create_bucket=False)
    if config is None:
        return None
    from ..nats import open_nats_run_store  # the extra is importable: nats_config checked

    return functools.partial(open_nats_run_store, config)


def cmd_runs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce runs``; return the exit status (0, or 2 after an error
    line for bad NATS settings).

    Raises:
      SystemExit: status 2 with the usage line, for a bad option.
      BackendStartError: the store cannot be opened or read (exit status 2).
      OSError: writing stdout failed.
    """
    if args.workflow == "":
        parser.error("--workflow must not be empty")
    opener = _store_opener(parser, args, write=False)
    if opener is None:
        return EXIT_USAGE
    states = None if args.state is None else {RunState(args.state)}

    async def fetch() -> list[StoredRun]:
        async with opener() as store:
            return await store.list_runs(states=states, workflow=args.workflow)

    runs = run_on_store(fetch, "cannot list the runs")
    if args.outcome is not None:
        runs = [run for run in runs if run.outcome == args.outcome]
    print_items(args.format or "table", runs, _run_row, sys.stdout)
    return 0


def cmd_runs_cancel(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce runs cancel RUN_ID``; return the exit status: 0 when the
    pending run was deleted, 1 when it does not exist or is not pending, 2 after an
    error line for bad NATS settings.

    Raises:
      SystemExit: status 2 with the usage line, for a bad option.
      BackendStartError: the store cannot be opened, or refused a call (exit status 2).
      OSError: writing stdout failed.
    """
    run_id = _run_id(parser, args)
    result = _steer(parser, args, "cancel", cancel_pending_run)
    if result is None:
        return EXIT_USAGE
    steered, wall = result
    run = steered.run
    if run is None:
        error(f"no run {run_id!r} in the store")
        return EXIT_REFUSED
    if not steered.done:
        outcome = "" if run.outcome is None else f" (outcome {run.outcome!r})"
        error(f"run {run_id!r} is {run.state.value}{outcome}, not pending: not cancelled")
        return EXIT_REFUSED
    holder = "unclaimed" if run.owner is None else f"held by {run.owner!r}"
    _say(
        f"cancelled run {run_id!r} (workflow {run.workflow!r}, pending, due "
        f"{relative(run.scheduled_at - wall)}, {holder})"
    )
    return 0


def cmd_runs_retry(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce runs retry RUN_ID``; return the exit status: 0 when the
    failed run is pending again, 1 when it does not exist or cannot be retried, 2
    after an error line for bad NATS settings.

    Raises:
      SystemExit: status 2 with the usage line, for a bad option.
      BackendStartError: the store cannot be opened, or refused a call (exit status 2).
      OSError: writing stdout failed.
    """
    run_id = _run_id(parser, args)
    result = _steer(parser, args, "retry", retry_failed_run)
    if result is None:
        return EXIT_USAGE
    steered, wall = result
    run = steered.run
    if run is None:
        error(f"no run {run_id!r} in the store")
        return EXIT_REFUSED
    if not steered.done:
        reason = retry_refusal(run, wall) or "it changed meanwhile"
        error(f"run {run_id!r} not retried: {reason}")
        return EXIT_REFUSED
    _say(
        f"run {run_id!r} (workflow {run.workflow!r}) is pending again, due now and "
        f"unclaimed: a live process with a handler for {run.workflow!r} claims it at its "
        f"next sweep and runs it as attempt {run.attempt + 1}"
    )
    return 0


def _run_id(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    try:
        return _validate.shareable("RUN_ID", _validate.name("RUN_ID", args.run_id))
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def _steer(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    what: str,
    step: Callable[[RunStore, str], Awaitable[Steered]],
) -> tuple[Steered, float] | None:
    """``step(store, RUN_ID)`` on the store the options name; what it did and the
    store's wall time after it. None (after an error line) for bad NATS settings.

    Raises:
      BackendStartError: the store cannot be opened, or refused a call.
    """
    opener = _store_opener(parser, args, write=True)
    if opener is None:
        return None

    async def main() -> tuple[Steered, float]:
        async with opener() as store:
            return await step(store, args.run_id), store.wall_time()

    return run_on_store(main, f"cannot {what} run {args.run_id!r}")


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _run_row(r: StoredRun, now: float) -> dict[str, str]:
    return {
        "RUN": r.run_id,
        "WORKFLOW": r.workflow,
        "STATE": r.state.value,
        "OUTCOME": NONE if r.outcome is None else r.outcome,
        "DUE": relative(r.scheduled_at - now),
        "EXPIRES": NONE if r.expires_at is None else relative(r.expires_at - now),
        "HOLDER": NONE if r.owner is None else r.owner,
        "ATTEMPTS": str(r.attempt),
        "TOKEN": str(r.token),
        "FINISHED": NONE if r.finished_at is None else relative(r.finished_at - now),
    }
