"""``trio-debounce run``: debounce a live stream of lines from stdin on the real clock."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TextIO

import trio

from ._coordinator import open_coordinator
from ._events import EventError, decode_line, event_key, parse_json_object
from ._replay import fire_line
from ._types import Fire, Mode
from ._wallclock import WallClock

logger = logging.getLogger("trio_debounce.cli")

_WORKFLOW = "run"
_READ_SIZE = 65536


@dataclass(frozen=True)
class LiveOptions:
    delay: float
    max_delay: float | None
    mode: Mode
    key_field: str | None
    jobs: int
    command: Sequence[str]


class InputError(Exception):
    """Reading the input failed (not a bad line: the stream itself)."""


@dataclass(frozen=True, slots=True)
class _Line:
    text: str
    payload: Any


async def _read_lines(fd: int) -> AsyncGenerator[tuple[int, bytes], None]:
    """Yield (line number, raw line) from a blocking file descriptor, without blocking Trio.

    Each ``os.read`` runs in a worker thread that is abandoned on cancellation, so
    Ctrl-C is seen at once even while the read blocks. (``os.read`` on the descriptor,
    not ``sys.stdin.buffer.read``: an abandoned thread blocked inside the buffered
    reader would hold its lock and abort the interpreter at exit. Trio's ``FdStream``
    is no option either: it makes the descriptor non-blocking, which would leak into
    the terminal or pipe that the process shares with its parent.)
    """
    partial: list[bytes] = []  # pieces of a line not yet ended; joined once, so linear
    number = 0
    while True:
        try:
            chunk = await trio.to_thread.run_sync(os.read, fd, _READ_SIZE, abandon_on_cancel=True)
        except BlockingIOError:
            # A parent left the descriptor non-blocking: wait until it has data.
            await trio.lowlevel.wait_readable(fd)
            continue
        except OSError as exc:
            raise InputError(f"cannot read stdin: {exc.strerror or exc}") from exc
        if not chunk:
            break
        pieces = chunk.split(b"\n")
        if len(pieces) == 1:
            partial.append(chunk)
            continue
        partial.append(pieces[0])
        number += 1
        yield number, b"".join(partial)
        for raw in pieces[1:-1]:
            number += 1
            yield number, raw
        partial = [pieces[-1]] if pieces[-1] else []
    if partial:
        yield number + 1, b"".join(partial)


def _line_event(raw: bytes, number: int, key_field: str | None) -> tuple[str, _Line]:
    text = decode_line(raw, number)
    if key_field is None:
        if not text:
            raise EventError(number, "empty line (the key would be empty)")
        return text, _Line(text, text)
    obj = parse_json_object(text, number)
    return event_key(obj, key_field, number), _Line(text, obj)


def _fire_json(fire: Fire, wall: WallClock) -> str:
    line: _Line = fire.payload
    return json.dumps(
        fire_line(
            fire.key,
            wall.from_trio(fire.fired_at),
            wall.from_trio(fire.first_ping_at),
            line.payload,
            fire.ping_count,
            fire.edge.value,
        )
    )


async def _kill_fast(process: trio.Process) -> None:
    """Cancellation of a command: SIGTERM, then SIGKILL after half a second."""
    process.terminate()
    with trio.move_on_after(0.5):
        await process.wait()
        return
    process.kill()


def _show(key: str) -> str:
    """A key for an error message: its repr, cut short."""
    text = repr(key)
    return text if len(text) <= 80 else text[:77] + "..."


async def run_live(options: LiveOptions, stdin_fd: int, stdout: TextIO, stderr: TextIO) -> int:
    """Debounce lines read from ``stdin_fd`` until end of input; return the exit status.

    The status is 0, or 2 if any line was rejected.

    Raises:
      OSError: writing a fire to ``stdout`` failed (``BrokenPipeError`` when its reader
        closed it, as ``| head`` does); the stream stops at the first failure.
      InputError: reading ``stdin_fd`` failed.
    """
    rejected = 0
    output_error: OSError | None = None
    wall = WallClock.now()
    limiter = trio.CapacityLimiter(options.jobs)

    async def print_fire(fire: Fire) -> None:
        nonlocal output_error
        try:
            stdout.write(_fire_json(fire, wall) + "\n")
            stdout.flush()
        except OSError as exc:
            # The fires cannot be written (a closed pipe, a full disk): stop the
            # stream; the CLI exits 1 (quietly for a closed pipe).
            if output_error is None:
                output_error = exc
            stream_scope.cancel()

    async def run_command(fire: Fire) -> None:
        line: _Line = fire.payload
        env = dict(os.environ)
        env["TRIO_DEBOUNCE_KEY"] = fire.key
        env["TRIO_DEBOUNCE_PINGS"] = str(fire.ping_count)
        async with limiter:
            try:
                result = await trio.run_process(
                    list(options.command),
                    stdin=(line.text + "\n").encode("utf-8"),
                    env=env,
                    check=False,
                    deliver_cancel=_kill_fast,
                )
            except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the key
                stderr.write(f"trio-debounce: key {_show(fire.key)}: cannot run command: {exc}\n")
                return
        if result.returncode != 0:
            stderr.write(
                f"trio-debounce: key {_show(fire.key)}: command exited with status "
                f"{result.returncode}\n"
            )

    handler = run_command if options.command else print_fire
    with trio.CancelScope() as stream_scope:
        # aclosing: the reader generator is closed here, not by the GC, if the stream
        # stops early (Trio's rule for async generators).
        async with (
            open_coordinator(handlers={_WORKFLOW: handler}) as coordinator,
            aclosing(_read_lines(stdin_fd)) as lines,
        ):
            async for number, raw in lines:
                try:
                    key, line = _line_event(raw, number, options.key_field)
                except EventError as exc:
                    rejected += 1
                    stderr.write(f"trio-debounce: {exc}; skipped\n")
                    continue
                coordinator.debounce_nowait(
                    _WORKFLOW,
                    key,
                    line,
                    delay=options.delay,
                    max_delay=options.max_delay,
                    mode=options.mode,
                )
    if output_error is not None:
        raise output_error
    return 2 if rejected else 0
