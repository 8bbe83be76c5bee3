"""``trio-debounce run``: debounce a live stream of lines from stdin on the real clock."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, aclosing, contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

import trio

from .._backend import DebounceBackend
from .._coordinator import open_coordinator
from .._errors import BackendError, BackendUnavailableError
from .._types import Fire, Mode
from .._wallclock import WallClock
from ._events import EventError, decode_line, event_key, parse_json_object
from ._replay import fire_line

logger = logging.getLogger("trio_debounce.cli")
#: The NATS store's logger (trio_debounce.nats._store), gated by :class:`_LogGate`.
_NATS_LOGGER = logging.getLogger("trio_debounce.nats")

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
    #: Opens the backend that shares the windows with other processes (for example
    #: ``functools.partial(open_nats_backend, config)``); None for in-memory windows.
    open_backend: Callable[[], AbstractAsyncContextManager[DebounceBackend]] | None = None


class InputError(Exception):
    """Reading the input failed (not a bad line: the stream itself)."""


class BackendStartError(Exception):
    """The backend could not be opened (unreachable, refused credentials, a bucket
    with unusable settings); ``str()`` is a one-line reason."""


def _line(text: str, payload: Any) -> dict[str, Any]:
    """A line's payload as pinged: its text (for a command's stdin) and its parsed
    payload (for the fire line). A plain JSON object, so that a backend can store it
    and every process reads back the same."""
    return {"text": text, "payload": payload}


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


def _line_event(raw: bytes, number: int, key_field: str | None) -> tuple[str, dict[str, Any]]:
    text = decode_line(raw, number)
    if key_field is None:
        if not text:
            raise EventError(number, "empty line (the key would be empty)")
        return text, _line(text, text)
    obj = parse_json_object(text, number)
    return event_key(obj, key_field, number), _line(text, obj)


class _LogGate(logging.Filter):
    """Holds the NATS store's log records while the backend starts.

    If start-up fails, the CLI prints one line (the error, plus, for an unreachable
    server, the first connection error the store logged, such as a refused
    connection or a TLS failure) instead of the store's reconnect chatter; if it
    succeeds, the held records are logged after all, and later ones pass.
    """

    def __init__(self) -> None:
        super().__init__()
        self._passing = False
        self._held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if self._passing:
            return True
        self._held.append(record)
        return False

    @contextmanager
    def installed(self) -> Iterator[None]:
        _NATS_LOGGER.addFilter(self)
        try:
            yield
        finally:
            _NATS_LOGGER.removeFilter(self)

    def release(self) -> None:
        """Start-up succeeded: log the held records, and pass later ones."""
        self._passing = True
        held, self._held = self._held, []
        for record in held:
            _NATS_LOGGER.handle(record)

    def start_error(self, exc: BaseException) -> str:
        """The one-line reason why start-up failed."""
        message = f"cannot start the backend: {exc}"
        if isinstance(exc, BackendUnavailableError):
            # "no server answered" says nothing of why: add the first reason logged.
            # (Refused credentials and bucket errors say it all.)
            for record in self._held:
                if record.levelno >= logging.WARNING:
                    message += f" ({record.getMessage()})"
                    break
        return " ".join(message.split())


def _fire_json(fire: Fire, wall: WallClock) -> str:
    return json.dumps(
        fire_line(
            fire.key,
            wall.from_trio(fire.fired_at),
            wall.from_trio(fire.first_ping_at),
            fire.payload["payload"],
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
      BackendStartError: ``options.open_backend`` was given and the backend could not
        be opened, or refused the coordinator's first lease (before any line is read).
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
        text: str = fire.payload["text"]
        env = dict(os.environ)
        env["TRIO_DEBOUNCE_KEY"] = fire.key
        env["TRIO_DEBOUNCE_PINGS"] = str(fire.ping_count)
        async with limiter:
            try:
                result = await trio.run_process(
                    list(options.command),
                    stdin=(text + "\n").encode("utf-8"),
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
        async with AsyncExitStack() as stack:
            backend: DebounceBackend | None = None
            if options.open_backend is not None:
                gate = _LogGate()
                stack.enter_context(gate.installed())
                try:
                    backend = await stack.enter_async_context(options.open_backend())
                    coordinator = await stack.enter_async_context(
                        open_coordinator(handlers={_WORKFLOW: handler}, backend=backend)
                    )
                except BackendError as exc:
                    raise BackendStartError(gate.start_error(exc)) from exc
                gate.release()
            else:
                coordinator = await stack.enter_async_context(
                    open_coordinator(handlers={_WORKFLOW: handler})
                )
            # aclosing: the reader generator is closed here, not by the GC, if the
            # stream stops early (Trio's rule for async generators).
            lines = await stack.enter_async_context(aclosing(_read_lines(stdin_fd)))
            async for number, raw in lines:
                try:
                    key, line = _line_event(raw, number, options.key_field)
                except EventError as exc:
                    rejected += 1
                    stderr.write(f"trio-debounce: {exc}; skipped\n")
                    continue
                if backend is None:
                    coordinator.debounce_nowait(
                        _WORKFLOW,
                        key,
                        line,
                        delay=options.delay,
                        max_delay=options.max_delay,
                        mode=options.mode,
                    )
                    continue
                # With a backend a ping is a round trip (debounce_nowait refuses it);
                # one at a time, so each key's pings reach the backend in input order.
                try:
                    await coordinator.debounce(
                        _WORKFLOW,
                        key,
                        line,
                        delay=options.delay,
                        max_delay=options.max_delay,
                        mode=options.mode,
                    )
                except ValueError as exc:
                    # A key the backend cannot store (too long once encoded, or a
                    # lone surrogate from a JSON escape): a bad line, not an outage.
                    rejected += 1
                    stderr.write(f"trio-debounce: line {number}: {exc}; skipped\n")
    if output_error is not None:
        raise output_error
    return 2 if rejected else 0
