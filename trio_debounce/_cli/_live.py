"""``trio-debounce run``: debounce (or throttle, batch, rate-limit) a live stream of
lines from stdin on the real clock."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
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
from ._replay import FlowOptions, FlowPing, fire_line, refused_event

logger = logging.getLogger("trio_debounce.cli")
#: The NATS store's logger (trio_debounce.nats._store), gated by :class:`LogGate`.
_NATS_LOGGER = logging.getLogger("trio_debounce.nats")

_WORKFLOW = "run"
_READ_SIZE = 65536

#: The exit status after SIGTERM or SIGHUP (128 + SIGTERM, what a shell reports for a
#: process that SIGTERM killed).
EXIT_STOPPED = 143
#: The signals that stop a run gracefully (and ``windows --follow``). SIGINT (Ctrl-C)
#: stays Trio's KeyboardInterrupt: exit at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: Seconds between a command's SIGTERM and its SIGKILL.
_KILL_AFTER = 0.5


@dataclass(frozen=True)
class LiveOptions:
    """The options of ``trio-debounce run``, checked by the command line.

    Attributes:
      delay (float): seconds of quiet that end a window (>= 0).
      max_delay (float | None): seconds a window lasts at most from its first ping.
      mode (Mode): the edges that fire.
      (``delay``, ``max_delay`` and ``mode`` are ignored when ``flow`` is given.)
      key_field (str | None): lines are JSON objects keyed by this field; None: each
        line is its own key and payload.
      jobs (int): commands run at once (>= 1).
      command (Sequence[str]): the COMMAND run per fire; empty: print a fire line.
      open_backend: opens the backend that shares the windows, or None.
      stop_grace (float): seconds that running commands get after SIGTERM or SIGHUP.
    """

    delay: float
    max_delay: float | None
    mode: Mode
    key_field: str | None
    jobs: int
    command: Sequence[str]
    #: Opens the backend that shares the windows with other processes (for example
    #: ``functools.partial(open_nats_backend, config)``); None for in-memory windows.
    open_backend: Callable[[], AbstractAsyncContextManager[DebounceBackend]] | None = None
    #: On SIGTERM or SIGHUP: the seconds (float, >= 0) that running commands get to
    #: finish before their SIGTERM.
    stop_grace: float = 10.0
    #: A flow-control mode (throttle, audit, batch, rate limit) instead of debouncing
    #: (with a backend: shared across processes, as debounce windows are).
    flow: FlowOptions | None = None

    @property
    def batch(self) -> bool:
        """Does a fire carry a batch: the list of its events' payloads?"""
        return self.flow is not None and self.flow.mode == "batch"


class InputError(Exception):
    """Reading the input failed (not a bad line: the stream itself)."""


class OutputError(Exception):
    """Writing a fire to stdout failed, so the stream stopped.

    Attributes:
      error (OSError): the write's error (:exc:`BrokenPipeError` when the reader closed
        the pipe, as ``| head`` does).
      status (int): the exit status: 1, or 2 if a line had been rejected.
    """

    def __init__(self, error: OSError, status: int) -> None:
        super().__init__(f"cannot write output: {error.strerror or error}")
        self.error = error
        self.status = status


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


class LogGate(logging.Filter):
    """Holds the NATS store's log records while the backend starts (or while an
    inspection command opens and reads a store).

    If that fails, the CLI prints one line (the error, plus, for an unreachable
    server, the first connection error the store logged, such as a refused
    connection or a TLS failure: :meth:`reason`) instead of the store's reconnect
    chatter; if it succeeds, the held records are logged after all, and later ones
    pass.
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
        return self.reason("cannot start the backend", exc)

    def reason(self, failure: str, exc: BaseException) -> str:
        """``failure: exc`` on one line; for an unreachable store, with the first
        warning held."""
        message = f"{failure}: {exc}"
        if isinstance(exc, BackendUnavailableError):
            # "no server answered" says nothing of why: add the first reason logged.
            # (Refused credentials and bucket errors say it all.)
            for record in self._held:
                if record.levelno >= logging.WARNING:
                    message += f" ({record.getMessage()})"
                    break
        return " ".join(message.split())


def _fire_json(fire: Fire, wall: WallClock, *, batch: bool) -> str:
    return json.dumps(
        fire_line(
            fire.key,
            wall.from_trio(fire.fired_at),
            wall.from_trio(fire.first_ping_at),
            # A batch's items are the lines' payloads themselves (see _serve).
            fire.payload if batch else fire.payload["payload"],
            fire.ping_count,
            fire.edge.value,
            fire.reason.value,
        )
    )


def _command_input(fire: Fire, *, batch: bool) -> bytes:
    """A fire's COMMAND's stdin: its event line; for a batch, one line per event: the
    line itself without ``--key-field``, else its JSON object encoded again (the line's
    own spacing is not kept)."""
    if not batch:
        text: str = fire.payload["text"]
        return (text + "\n").encode("utf-8")
    return "".join(
        (item if isinstance(item, str) else json.dumps(item)) + "\n" for item in fire.payload
    ).encode("utf-8")


async def _kill_fast(process: trio.Process, notice: Callable[[str], None] | None = None) -> None:
    """Cancellation of a command: SIGTERM, then SIGKILL after half a second.

    ``notice`` (when given) is told of each signal sent, as a line without the prefix.
    """
    if notice is not None:
        notice("SIGTERM")
    process.terminate()
    with trio.move_on_after(_KILL_AFTER):
        await process.wait()
        return
    if notice is not None:
        notice(f"still running {_KILL_AFTER:g} s after SIGTERM: SIGKILL")
    process.kill()


def _show(key: str) -> str:
    """A key for an error message: its repr, cut short."""
    text = repr(key)
    return text if len(text) <= 80 else text[:77] + "..."


class _Stop:
    """The stop of a run on SIGTERM or SIGHUP.

    The first signal stops the reading of stdin. Without a backend the pending
    windows then fire at once (the coordinator's ``on_exit="flush"``) and their
    commands start as usual; with one they are handed off to the peers. Running
    commands get ``grace`` seconds to finish, then SIGTERM, then SIGKILL half a second
    later. A second signal ends the grace at once.

    How the grace ends depends on the exit. Without a backend each command runs in a
    cancel scope whose deadline is the end of the grace: a command stopped there is
    over, and the coordinator's exit waits for nothing else. With a backend the stop
    cancels the coordinator (:attr:`scope`) once no command runs, or at the end of the
    grace: a cancelled exit hands the windows off under at-least-once delivery, and
    the fire records of commands cut short stay in the store, so a peer runs them
    again. Fires that fall due meanwhile start no command here: they wait for that
    cancellation, and are left to the peers too.
    """

    def __init__(self, grace: float, *, hand_off: bool, notices: TextIO) -> None:
        self.grace = grace
        self.hand_off = hand_off
        self._notices = notices
        #: Whether a stop signal came.
        self.requested = False
        #: Cancelled by the first signal: the reading of stdin (and, without a backend,
        #: the wait for the last fires at the end of input).
        self.intake = trio.CancelScope()
        #: Around the backend and the coordinator; with a backend, cancelled to hand
        #: the windows off.
        self.scope = trio.CancelScope()
        #: The end of the grace, on Trio's clock.
        self._grace_ends = math.inf
        self._command_scopes: set[trio.CancelScope] = set()
        self._running = 0
        self._idle = trio.Event()
        self._idle.set()

    def notice(self, text: str) -> None:
        """Write ``trio-debounce: <text>`` on stderr (a closed stderr is no error)."""
        with contextlib.suppress(OSError):
            self._notices.write(f"trio-debounce: {text}\n")
            self._notices.flush()

    def may_start(self) -> bool:
        """Whether a fire may start its command now: with a backend, until the stop;
        without one, until the end of the grace."""
        if self.hand_off:
            return not self.requested
        return trio.current_time() < self._grace_ends

    @contextmanager
    def command(self) -> Iterator[trio.CancelScope]:
        """Around one running command: counts it and yields its cancel scope, which
        (without a backend) the end of the grace cancels."""
        scope = trio.CancelScope(deadline=math.inf if self.hand_off else self._grace_ends)
        self._command_scopes.add(scope)
        self._running += 1
        if self._running == 1:
            self._idle = trio.Event()
        try:
            with scope:
                yield scope
        finally:
            self._command_scopes.discard(scope)
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    def _end_grace_at(self, deadline: float) -> None:
        self._grace_ends = deadline
        if self.hand_off:
            self.scope.deadline = deadline
        else:
            for scope in self._command_scopes:
                scope.deadline = deadline

    async def _hand_off_once_no_command_runs(self) -> None:
        while self._running:
            await self._idle.wait()
        self.scope.cancel()

    async def watch(self, signals: AsyncIterator[int], *, commands: bool) -> None:
        """Act on each stop signal from ``signals`` until cancelled: the first stops the
        run, a later one ends the grace. ``commands``: whether the run has a COMMAND
        (for the notice)."""
        async with trio.open_nursery() as nursery:
            async for signum in signals:
                name = signal.Signals(signum).name
                if self.requested:
                    self.notice(f"{name} again: stopping now")
                    self._end_grace_at(-math.inf)
                    continue
                self.requested = True
                what = (
                    "pending windows are handed off"
                    if self.hand_off
                    else "pending windows fire now"
                )
                if commands:
                    what += f"; running commands have {self.grace:g} s to finish"
                self.notice(f"{name}: stopping: {what}")
                self.intake.cancel()
                self._end_grace_at(trio.current_time() + self.grace)
                if self.hand_off:
                    nursery.start_soon(self._hand_off_once_no_command_runs)


async def run_live(options: LiveOptions, stdin_fd: int, stdout: TextIO, stderr: TextIO) -> int:
    """Debounce lines read from ``stdin_fd`` until end of input, or until SIGTERM or
    SIGHUP; return the exit status.

    At the end of input the status is 2 if any line was rejected, else 1 if a command
    failed or could not start, else 0. After SIGTERM or SIGHUP (see :class:`_Stop`) it
    is :data:`EXIT_STOPPED`. A signal that was ignored when the run started (``nohup``
    ignores SIGHUP) stays ignored.

    Raises:
      OutputError: writing a fire to ``stdout`` failed; the stream stops at the first
        failure.
      InputError: reading ``stdin_fd`` failed.
      BackendStartError: ``options.open_backend`` was given and the backend could not
        be opened, or refused the coordinator's first lease (before any line is read).
    """
    stop = _Stop(options.stop_grace, hand_off=options.open_backend is not None, notices=stderr)
    caught = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    failure: Exception | None = None
    status = 0
    with contextlib.ExitStack() as signals:
        async with trio.open_nursery() as nursery:
            if caught:
                received = signals.enter_context(trio.open_signal_receiver(*caught))
                nursery.start_soon(
                    functools.partial(stop.watch, received, commands=bool(options.command))
                )
            try:
                status = await _serve(options, stdin_fd, stdout, stderr, stop)
            except Exception as exc:
                # Raised below as itself, not inside the nursery's exception group.
                failure = exc
            nursery.cancel_scope.cancel()  # the signal watcher
    if failure is not None:
        raise failure
    return status


async def _serve(
    options: LiveOptions, stdin_fd: int, stdout: TextIO, stderr: TextIO, stop: _Stop
) -> int:
    """The run of :func:`run_live`, under the watch of the stop signals."""
    rejected = 0
    failed = 0
    output_error: OSError | None = None
    wall = WallClock.now()
    limiter = trio.CapacityLimiter(options.jobs)

    batch = options.batch

    async def print_fire(fire: Fire) -> None:
        nonlocal output_error
        try:
            stdout.write(_fire_json(fire, wall, batch=batch) + "\n")
            stdout.flush()
        except OSError as exc:
            # The fires cannot be written (a closed pipe, a full disk): stop the
            # stream; the CLI exits 1 (quietly for a closed pipe).
            if output_error is None:
                output_error = exc
            stream_scope.cancel()

    async def run_command(fire: Fire) -> None:
        nonlocal failed
        stdin = _command_input(fire, batch=batch)
        env = dict(os.environ)
        env["TRIO_DEBOUNCE_KEY"] = fire.key
        env["TRIO_DEBOUNCE_PINGS"] = str(fire.ping_count)
        env["TRIO_DEBOUNCE_REASON"] = fire.reason.value
        key = _show(fire.key)

        def notice(text: str) -> None:
            if stop.requested:
                stop.notice(f"key {key}: stopping the command: {text}")

        async with limiter:
            if not stop.may_start():
                if stop.hand_off:
                    # Left to a peer: the hand-off's cancellation ends this wait, and
                    # the fire's record stays in the store.
                    await trio.sleep_forever()
                stop.notice(f"key {key}: command not started: stopping")
                return
            with stop.command() as scope:
                try:
                    result = await trio.run_process(
                        list(options.command),
                        stdin=stdin,
                        env=env,
                        check=False,
                        deliver_cancel=functools.partial(_kill_fast, notice=notice),
                    )
                except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the key
                    failed += 1
                    stderr.write(f"trio-debounce: key {key}: cannot run command: {exc}\n")
                    return
            if scope.cancelled_caught:
                return  # stopped at the end of the grace
        if result.returncode != 0:
            failed += 1
            stderr.write(
                f"trio-debounce: key {key}: command exited with status {result.returncode}\n"
            )

    handler = run_command if options.command else print_fire
    with stop.scope, trio.CancelScope() as stream_scope:
        async with AsyncExitStack() as stack:
            backend: DebounceBackend | None = None
            if options.open_backend is not None:
                gate = LogGate()
                stack.enter_context(gate.installed())
                try:
                    backend = await stack.enter_async_context(options.open_backend())
                    # on_exit="wait": at the end of input the process waits for its
                    # windows' fires, then releases them. A stop hands them off by
                    # cancelling the block (stop.scope).
                    coordinator = await stack.enter_async_context(
                        open_coordinator(handlers={_WORKFLOW: handler}, backend=backend)
                    )
                except BackendError as exc:
                    raise BackendStartError(gate.start_error(exc)) from exc
                gate.release()
            else:
                # on_exit="flush" is for a stop; at the end of input the block first
                # waits until no fire is pending (below), as on_exit="wait" would.
                coordinator = await stack.enter_async_context(
                    open_coordinator(handlers={_WORKFLOW: handler}, on_exit="flush")
                )
            flow_ping: FlowPing | None = None
            if options.flow is not None and backend is None:
                flow_ping = options.flow.pinger(coordinator)
            with stop.intake:
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
                    if options.flow is not None and backend is not None:
                        # A round trip, one at a time (each key's pings in input
                        # order); a flow window never fails open: a ping the backend
                        # did not take is reported and skipped.
                        try:
                            item = line["payload"] if batch else line
                            await options.flow.call(coordinator, _WORKFLOW, key, item)
                        except ValueError as exc:
                            rejected += 1
                            reason = refused_event(exc)
                            stderr.write(f"trio-debounce: line {number}: {reason}; skipped\n")
                        except BackendError as exc:
                            rejected += 1
                            stderr.write(
                                f"trio-debounce: line {number}: not taken by the backend "
                                f"({exc}); skipped\n"
                            )
                        continue
                    if flow_ping is not None:
                        try:
                            # A batch item is the line's payload alone, so that
                            # --max-bytes counts the event's own JSON.
                            flow_ping(_WORKFLOW, key, line["payload"] if batch else line, None)
                        except ValueError as exc:  # an event larger than --max-bytes
                            rejected += 1
                            reason = refused_event(exc)
                            stderr.write(f"trio-debounce: line {number}: {reason}; skipped\n")
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
                    # With a backend a ping is a round trip (debounce_nowait refuses
                    # it); one at a time, so each key's pings reach the backend in
                    # input order.
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
                if backend is None:
                    await coordinator.wait_idle()
    if stop.requested:
        return EXIT_STOPPED
    if output_error is not None:
        raise OutputError(output_error, 2 if rejected else 1)
    return 2 if rejected else 1 if failed else 0
