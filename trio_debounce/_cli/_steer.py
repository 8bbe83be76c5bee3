"""``trio-debounce cancel`` and ``flush``: steer one window of a shared bucket through
the protocol, as a coordinator would (see :doc:`/cli`, "Steering a window", and
:doc:`/protocol`, "Steering from outside")."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Final

import trio

from .. import _validate
from .._backend import DebounceBackend
from ._commands import EXIT_USAGE, _nats_backend, error
from ._inspect import run_on_store

#: The exit status when the window does not exist or has nothing to flush.
EXIT_NOT_FOUND: Final = 1
#: Seconds between the reads of ``flush --wait``.
WAIT_POLL: Final = 0.2
#: The exit status of ``flush --wait`` when the fire was not committed in time (as
#: ``timeout(1)``'s).
EXIT_TIMED_OUT: Final = 124


def _checked(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        _validate.name("WORKFLOW", args.workflow)
        _validate.name("KEY", args.key)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def cmd_cancel(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce cancel``; return the exit status: 0 cancelled, 1 no open
    window.

    Raises:
      BackendStartError: the bucket cannot be reached or written (exit status 2).
    """
    _checked(args, parser)
    opener = _nats_backend(parser, args, create_bucket=False)
    if opener is None:
        return EXIT_USAGE

    async def main() -> bool:
        async with opener() as backend:
            return await backend.cancel(args.workflow, args.key)

    cancelled = run_on_store(main, f"cannot cancel {args.workflow!r}/{args.key!r}")
    if not cancelled:
        error(f"no open window {args.workflow!r}/{args.key!r}")
        return EXIT_NOT_FOUND
    _say(f"cancelled {args.workflow!r}/{args.key!r}")
    return 0


def cmd_flush(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce flush``; return the exit status: 0 requested (with
    ``--wait``: fired), 1 no trailing fire pending, 124 not fired within ``--timeout``.

    Raises:
      BackendStartError: the bucket cannot be reached or written (exit status 2).
    """
    _checked(args, parser)
    opener = _nats_backend(parser, args, create_bucket=False)
    if opener is None:
        return EXIT_USAGE
    return run_on_store(
        functools.partial(_flush, args, opener), f"cannot flush {args.workflow!r}/{args.key!r}"
    )


async def _flush(
    args: argparse.Namespace, opener: Callable[[], AbstractAsyncContextManager[DebounceBackend]]
) -> int:
    workflow, key = args.workflow, args.key
    async with opener() as backend:
        status = await backend.request_flush(workflow, key)
        if status is None:
            error(f"nothing to flush: {workflow!r}/{key!r} has no trailing fire pending")
            return EXIT_NOT_FOUND
        who = (
            f"its owner {status.owner!r} (live by its lease) fires it at its next heartbeat"
            if status.owner_live
            else f"its owner {status.owner!r} is not live: a survivor fires it when it "
            "adopts the window"
        )
        _say(f"flush of {workflow!r}/{key!r} (run {status.run_id}) requested: {who}")
        if not args.wait:
            return 0
        started = time.monotonic()
        with trio.move_on_after(args.timeout) as waited:
            while True:
                now = await backend.window_status(workflow, key)
                if now is None or now.run_id != status.run_id:
                    break
                await trio.sleep(WAIT_POLL)
        if waited.cancelled_caught:
            error(
                f"run {status.run_id} of {workflow!r}/{key!r} not committed within "
                f"{args.timeout:g} s (its window is still open, owner {status.owner!r}: a "
                "dead owner's window is fired once its lease lapses, by a live process that "
                "handles its workflow)"
            )
            return EXIT_TIMED_OUT
        _say(
            f"run {status.run_id} of {workflow!r}/{key!r} committed after "
            f"{time.monotonic() - started:.1f} s"
        )
        return 0


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
