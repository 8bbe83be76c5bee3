"""``trio-debounce windows --follow``: a shared bucket's windows as they change, one
line per change, through :meth:`~trio_debounce.abc.DebounceBackend.open_window_watch`
(see :doc:`/cli`, "Following a bucket")."""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TextIO

import trio

from .._backend import DebounceBackend, WindowChange
from .._errors import BackendError
from ._commands import EXIT_USAGE, _nats_backend, error
from ._inspect import NONE, STATE_COLOURS, printable, window_row
from ._live import EXIT_STOPPED, STOP_SIGNALS

#: The width of each column of the table (a longer value shifts the rest of its line:
#: rows cannot be aligned to the rows still to come).
_WIDTHS = {
    "TIME": 12,
    "CHANGE": 7,
    "WORKFLOW": 10,
    "KEY": 16,
    "MODE": 8,
    "STATE": 7,
    "OWNER": 12,
    "LEASE": 14,
    "FIRST PING": 10,
    "LAST PING": 10,
    "PINGS": 5,
    "DUE": 10,
    "CAP": 10,
    "BYTES": 5,
    "TOKEN": 0,
}


def key_prefix(pattern: str | None) -> str | None:
    """The literal start of the glob ``pattern`` (before its first ``*``, ``?`` or
    ``[``): the watch keeps only the keys that start with it. None if it has none."""
    if pattern is None:
        return None
    literal = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    return literal or None


def follow_windows(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce windows --follow`` until a signal; return the exit status:
    143 after SIGTERM or SIGHUP, 2 if the bucket cannot be read (or stops being
    readable). Ctrl-C raises :exc:`KeyboardInterrupt` (the CLI exits 130).

    Raises:
      OSError: writing stdout failed.
    """
    opener = _nats_backend(parser, args, create_bucket=False)
    if opener is None:
        return EXIT_USAGE
    try:
        return trio.run(_follow, opener, args, sys.stdout)
    except (BackendError, ValueError, TypeError) as exc:
        error(f"cannot follow the windows: {exc}")
        return EXIT_USAGE


async def _follow(
    opener: Callable[[], AbstractAsyncContextManager[DebounceBackend]],
    args: argparse.Namespace,
    out: TextIO,
) -> int:
    """Print each change until a stop signal (then :data:`EXIT_STOPPED`).

    Raises:
      BackendError, ValueError, TypeError: the bucket cannot be read.
      OSError: writing ``out`` failed.
    """
    # A signal that was ignored when the command started (nohup's SIGHUP) stays so.
    caught = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    stopped = False
    failure: Exception | None = None
    with contextlib.ExitStack() as stack:
        async with trio.open_nursery() as nursery:

            async def until_a_signal(signals: AsyncIterator[int]) -> None:
                nonlocal stopped
                async for _ in signals:
                    stopped = True
                    nursery.cancel_scope.cancel()

            if caught:
                signals = stack.enter_context(trio.open_signal_receiver(*caught))
                nursery.start_soon(until_a_signal, signals)
            try:
                await _print_changes(opener, args, out)
            except Exception as exc:
                # Raised below as itself, not inside the nursery's exception group.
                failure = exc
            nursery.cancel_scope.cancel()
    if stopped:
        return EXIT_STOPPED
    if failure is not None:
        raise failure
    return 0  # pragma: no cover (the watch never ends on its own)


async def _print_changes(
    opener: Callable[[], AbstractAsyncContextManager[DebounceBackend]],
    args: argparse.Namespace,
    out: TextIO,
) -> None:
    pattern: str | None = args.key
    colour = args.format == "table" and out.isatty() and not os.environ.get("NO_COLOR")
    async with (
        opener() as backend,
        backend.open_window_watch(args.workflow, key_prefix(pattern)) as changes,
    ):
        if args.format == "table":
            out.write(_table_line(list(_WIDTHS), colour=False) + "\n")
            out.flush()
        async for change in changes:
            if pattern is not None and not fnmatch.fnmatchcase(change.key, pattern):
                continue
            if args.format == "jsonl":
                line = json.dumps(change_json(change), separators=(",", ":"))
            else:
                line = _table_line(_change_cells(change), colour=colour)
            out.write(line + "\n")
            out.flush()


def change_json(change: WindowChange) -> dict[str, Any]:
    """One change as a JSON object: ``change`` and ``at`` (epoch seconds), then the
    window's fields (:class:`~trio_debounce.WindowInfo`, times as epoch seconds), or
    for ``closed`` only ``workflow``, ``key`` and ``run_id``."""
    doc: dict[str, Any] = {"change": change.change, "at": change.at}
    if change.window is None:
        doc.update(workflow=change.workflow, key=change.key, run_id=change.run_id)
        return doc
    window = change.window._asdict()
    window["mode"] = window["mode"].value
    doc.update(window)
    return doc


def _change_cells(change: WindowChange) -> list[str]:
    clock = time.strftime("%H:%M:%S", time.localtime(change.at))
    stamp = f"{clock}.{int(change.at * 1000) % 1000:03d}"
    if change.window is None:
        rest = [NONE] * (len(_WIDTHS) - 4)
        return [stamp, change.change, change.workflow, change.key, *rest]
    # Times relative to the change: as they were when it happened.
    return [stamp, change.change, *window_row(change.window, change.at).values()]


def _table_line(cells: list[str], *, colour: bool) -> str:
    cells = [printable(cell) for cell in cells]
    padded = [cell.ljust(width) for cell, width in zip(cells, _WIDTHS.values(), strict=True)]
    if colour:
        i = list(_WIDTHS).index("STATE")
        code = STATE_COLOURS.get(cells[i])
        if code is not None:
            padded[i] = f"\x1b[{code}m{padded[i]}\x1b[0m"
    return "  ".join(padded).rstrip()
