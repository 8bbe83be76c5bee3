"""``trio-debounce windows`` and ``processes``: a shared bucket as an operator reads
it, through :meth:`~trio_debounce.abc.DebounceBackend.inspect` and ``processes``
(see :doc:`/cli`, "Inspecting a bucket"); ``windows --follow`` is in :mod:`._follow`.
And the output of every inspection command (:func:`print_items`: a table for people,
JSON lines for programs)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import fnmatch
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TextIO, TypeVar

import trio

from .._backend import DebounceBackend, ProcessInfo, WindowInfo
from .._errors import BackendError
from ._commands import EXIT_USAGE, _nats_backend
from ._live import BackendStartError, LogGate

T = TypeVar("T")

#: A table's cell for a value that is not recorded (an en dash).
NONE = "\N{EN DASH}"

#: The ANSI colour of each window state in a table on a terminal.
STATE_COLOURS = {"open": "32", "due": "33", "waiting": "36", "firing": "35"}

#: The ANSI colour of the values of these columns in a table on a terminal: window
#: states, run states and run outcomes.
_COLOURS: dict[str, dict[str, str]] = {
    "STATE": {**STATE_COLOURS, "pending": "36", "started": "35"},
    "OUTCOME": {"ran": "32", "failed": "31", "expired": "33", "misfired": "33"},
}


def cmd_windows(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce windows``; return the exit status (0, or 2).

    Raises:
      BackendStartError: the bucket cannot be read (exit status 2).
    """

    async def fetch(backend: DebounceBackend) -> list[WindowInfo]:
        windows = await backend.inspect(args.workflow)
        if args.key is None:
            return windows
        return [w for w in windows if fnmatch.fnmatchcase(w.key, args.key)]

    return _inspect(args, parser, "windows", fetch, window_row)


def cmd_processes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce processes``; return the exit status (0, or 2).

    Raises:
      BackendStartError: the bucket cannot be read (exit status 2).
    """

    async def fetch(backend: DebounceBackend) -> list[ProcessInfo]:
        return await backend.processes()

    return _inspect(args, parser, "processes", fetch, _process_row)


def _inspect(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    what: str,
    fetch: Callable[[DebounceBackend], Awaitable[Sequence[Any]]],
    row: Callable[[Any, float], dict[str, str]],
) -> int:
    """Open the bucket (never creating it), ``fetch`` from its backend, print the rows;
    the exit status (0, or 2 after an error line for bad NATS settings).

    Raises:
      BackendStartError: the bucket cannot be read (see :func:`run_on_store`).
    """
    opener = _nats_backend(parser, args, create_bucket=False)
    if opener is None:
        return EXIT_USAGE

    async def main() -> Sequence[Any]:
        async with opener() as backend:
            return await fetch(backend)

    items = run_on_store(main, f"cannot list the {what}")
    print_items(args.format, items, row, sys.stdout)
    return 0


def run_on_store(main: Callable[[], Awaitable[T]], failure: str) -> T:
    """``trio.run(main)``, where ``main`` opens a store (or backend) and reads or
    writes it; the NATS store's log records held meanwhile (:class:`~._live.LogGate`):
    logged after all if it returns, dropped if it fails, which is reported in one line.

    Raises:
      BackendStartError: ``main`` raised BackendError (the store cannot be opened,
        reached, or refused a call), ValueError or TypeError; its message is
        ``failure: reason`` (:func:`trio_debounce._cli.main` prints it and exits 2).
    """
    gate = LogGate()
    with gate.installed():
        try:
            result = trio.run(main)
        except (BackendError, ValueError, TypeError) as exc:
            raise BackendStartError(gate.reason(failure, exc)) from exc
        gate.release()
    return result


def _document(item: Any) -> dict[str, Any]:
    """The fields of ``item`` (a named tuple or a dataclass) as a JSON object, enums
    as their values."""
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        doc = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}
    else:
        doc = item._asdict()
    return {k: v.value if isinstance(v, enum.Enum) else v for k, v in doc.items()}


def printable(text: str) -> str:
    """``text`` for a table cell: each character that is not printable (a control
    character, an escape sequence's ESC, a newline) as its Python escape (``\\x1b``,
    ``\\n``), so that a key from untrusted input can neither move the cursor, nor
    colour the terminal, nor break a row in two."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def print_items(
    form: str, items: Sequence[Any], row: Callable[[Any, float], dict[str, str]], out: TextIO
) -> None:
    """``items`` (named tuples or dataclasses) as JSON lines of their fields (times as
    epoch seconds), or as an aligned table of ``row(item, now)``: ``(none)`` when there
    are none, colours on a terminal unless ``NO_COLOR`` is set to a non-empty value."""
    if form == "jsonl":
        for item in items:
            out.write(json.dumps(_document(item), separators=(",", ":")) + "\n")
        out.flush()
        return
    colour = out.isatty() and not os.environ.get("NO_COLOR")
    now = time.time()
    rows = [row(item, now) for item in items]
    if not rows:
        out.write("(none)\n")
        out.flush()
        return
    header = list(rows[0])
    table = [header] + [[printable(str(v)) for v in r.values()] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    coloured = [(i, _COLOURS[name]) for i, name in enumerate(header) if name in _COLOURS]
    for n, line in enumerate(table):
        cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=True)]
        for i, codes in coloured if colour and n else ():
            code = codes.get(line[i])
            if code is not None:
                cells[i] = f"\x1b[{code}m{cells[i]}\x1b[0m"
        out.write("  ".join(cells).rstrip() + "\n")
    out.flush()


def window_row(w: WindowInfo, now: float) -> dict[str, str]:
    """The cells of ``w``'s row, by column, with times relative to ``now`` (wall
    clock, epoch seconds)."""
    return {
        "WORKFLOW": w.workflow,
        "KEY": w.key,
        "MODE": w.mode.value,
        "STATE": w.state,
        "OWNER": w.owner,
        "LEASE": _left(w.owner_lease_left),
        "FIRST PING": relative(w.first_ping_at - now),
        "LAST PING": relative(w.last_ping_at - now),
        "PINGS": str(w.ping_count),
        "DUE": relative(w.due_at - now),
        "CAP": NONE if w.cap_at is None else relative(w.cap_at - now),
        "BYTES": str(w.payload_bytes),
        "TOKEN": str(w.fencing_token),
    }


def _process_row(p: ProcessInfo, now: float) -> dict[str, str]:
    state = (
        "released" if p.released else "draining" if p.draining else "live" if p.live else "lapsed"
    )
    return {
        "PROCESS": p.process_id,
        "EPOCH": p.epoch[:8],
        "STATE": state,
        "LEASE": _left(p.expires_in),
        "HEARTBEAT": NONE if p.heartbeat_interval is None else f"{p.heartbeat_interval:.3g} s",
        "LAST BEAT": NONE if p.last_beat_age is None else f"{p.last_beat_age:.1f} s ago",
        "WINDOWS": str(p.windows),
        "FIRE RECORDS": str(p.fire_records),
        "RUNS": str(p.runs),
    }


def relative(seconds: float) -> str:
    """A time ``seconds`` from now, for people: ``in 3.2 s``, ``3.2 s ago``, ``now``."""
    if abs(seconds) < 0.05:
        return "now"
    return f"in {seconds:.1f} s" if seconds > 0 else f"{-seconds:.1f} s ago"


def _left(seconds: float | None) -> str:
    """A lease's time left: ``4.1 s left``, ``lapsed 2.0 s ago``, or an en dash (none)."""
    if seconds is None:
        return NONE
    return f"{seconds:.1f} s left" if seconds >= 0 else f"lapsed {-seconds:.1f} s ago"
