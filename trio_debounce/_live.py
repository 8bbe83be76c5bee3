"""``trio-debounce run``: debounce a live stream of lines from stdin on the real clock."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, TextIO

import trio

from ._coordinator import open_coordinator
from ._events import EventError, event_key, parse_json_object
from ._replay import json_number
from ._types import Fire, Mode
from ._wallclock import trio_to_wall

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


@dataclass(frozen=True, slots=True)
class _Line:
    text: str
    payload: Any


async def _read_lines(stream: BinaryIO) -> AsyncIterator[tuple[int, bytes]]:
    """Yield (line number, text) from a blocking binary stream, without blocking Trio.

    Each read runs in a worker thread that is abandoned on cancellation, so Ctrl-C is
    seen at once even while the read blocks.
    """
    buffer = b""
    number = 0
    read = getattr(stream, "read1", stream.read)
    while True:
        chunk = await trio.to_thread.run_sync(read, _READ_SIZE, abandon_on_cancel=True)
        if not chunk:
            break
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            number += 1
            yield number, raw
    if buffer:
        yield number + 1, buffer


def _line_event(raw: bytes, number: int, key_field: str | None) -> tuple[str, _Line]:
    try:
        text = raw.decode("utf-8").removesuffix("\r")
    except UnicodeDecodeError as exc:
        raise EventError(number, f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if key_field is None:
        if not text:
            raise EventError(number, "empty line (the key would be empty)")
        return text, _Line(text, text)
    obj = parse_json_object(text, number)
    return event_key(obj, key_field, number), _Line(text, obj)


def _fire_json(fire: Fire) -> str:
    line: _Line = fire.payload
    return json.dumps(
        {
            "key": fire.key,
            "fired_at": json_number(trio_to_wall(fire.fired_at)),
            "first_ping_at": json_number(trio_to_wall(fire.first_ping_at)),
            "payload": line.payload,
            "pings": fire.ping_count,
            "edge": fire.edge.value,
        }
    )


async def _kill_fast(process: trio.Process) -> None:
    """Cancellation of a command: SIGTERM, then SIGKILL after half a second."""
    process.terminate()
    with trio.move_on_after(0.5):
        await process.wait()
        return
    process.kill()


async def run_live(options: LiveOptions, stdin: BinaryIO, stdout: TextIO, stderr: TextIO) -> int:
    """Debounce ``stdin`` until end of input; return the exit status (0, or 2)."""
    rejected = 0
    limiter = trio.CapacityLimiter(options.jobs)

    async def print_fire(fire: Fire) -> None:
        stdout.write(_fire_json(fire) + "\n")
        stdout.flush()

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
            except OSError as exc:
                stderr.write(f"trio-debounce: key {fire.key!r}: cannot run command: {exc}\n")
                return
        if result.returncode != 0:
            stderr.write(
                f"trio-debounce: key {fire.key!r}: command exited with status "
                f"{result.returncode}\n"
            )

    handler = run_command if options.command else print_fire
    async with open_coordinator(handlers={_WORKFLOW: handler}) as coordinator:
        async for number, raw in _read_lines(stdin):
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
    return 2 if rejected else 0

