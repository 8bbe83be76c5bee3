"""The one way across from Trio to nats-py's asyncio loop, whichever host runs it.

nats-py is an asyncio library. Its loop runs on a *host* (:class:`Host`): a stdlib
:class:`asyncio.SelectorEventLoop` in a thread of its own (``_host_thread``), or a
trio-asyncio loop in Trio's thread (``_host_trio_asyncio``). A host only moves a
callable to the other side (:meth:`Host.to_loop`, :meth:`Host.to_trio`); everything
that crosses (store calls, connect, bucket requests, watch batches, shutdown) goes
through :func:`cross`, and the connection's state callbacks through :func:`callback`.
So the cancellation contract is written once:

* a call is one asyncio task; its outcome is handed back to the waiting Trio task;
* a cancellation of the Trio side cancels the task, and again every 0.05 s for up to
  :data:`CANCEL_GRACE` seconds if nats-py swallowed the cancellation (some of its
  internals catch :exc:`asyncio.CancelledError`); then the task is abandoned (its
  outcome dropped) and the Trio side raises :exc:`trio.Cancelled`. A task that
  completes despite the cancellation hands back its result (a watch batch is never
  lost). A cancelled call never waits for nats-py's own, longer timeouts.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import outcome
import trio

from .._errors import BackendUnavailableError
from ._errors import redact

if TYPE_CHECKING:
    from nats.aio.client import Client

logger = logging.getLogger("trio_debounce.nats")

T = TypeVar("T")

#: After the Trio side cancels a call, how long (seconds) the asyncio side keeps
#: re-cancelling a nats-py coroutine that swallowed the cancellation.
CANCEL_GRACE = 1.0

#: Seconds between two cancellations of a task that swallowed one.
RECANCEL = 0.05

#: Seconds :func:`shutdown` waits for a socket it closed to report it closed.
_CLOSE_WAIT = 0.25


class Host(abc.ABC):
    """Where nats-py's asyncio loop runs, and how a callable gets to either side.

    Attributes:
      loop: the asyncio loop nats-py runs on (touch it only on the loop's side).
      name: ``"thread"`` or ``"trio-asyncio"``.
    """

    loop: asyncio.AbstractEventLoop
    name: str
    #: Trio side: how to release each call in flight (see :meth:`release_pending`).
    pending: set[Callable[[], None]]

    def release_pending(self) -> None:
        """Fail every call still in flight with :class:`BackendUnavailableError`
        (Trio side, once the loop has stopped: their tasks will never finish)."""
        for release in list(self.pending):
            release()

    @abc.abstractmethod
    def to_loop(self, fn: Callable[..., object], *args: Any) -> None:
        """Call ``fn(*args)`` on the loop's side, soon, in order (from Trio's side).

        Raises:
          BackendUnavailableError: the loop is closed (the store has exited).
        """

    @abc.abstractmethod
    def to_trio(self, fn: Callable[..., object], *args: Any) -> None:
        """Call ``fn(*args)`` on Trio's side, soon, in order (from the loop's side);
        dropped if the Trio run has ended."""


async def cross(host: Host, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await fn(*args)`` on the loop's side, as one asyncio task (Trio side).

    See the module for cancellation: a cancelled caller gets :exc:`trio.Cancelled`
    within about :data:`CANCEL_GRACE` seconds.

    Returns:
      what ``fn`` returned.

    Raises:
      whatever ``fn`` raised (nats-py's own exceptions: map them);
      asyncio.CancelledError: the task was cancelled by the loop (shutting down), not
        by the caller;
      BackendUnavailableError: the loop is closed, or closed with the call in flight.
    """
    waiter = trio.lowlevel.current_task()
    raise_cancel: Callable[[], NoReturn] | None = None
    settled = waiting = False
    early: outcome.Outcome[T] | None = None
    task: asyncio.Task[T] | None = None

    def settle(result: outcome.Outcome[T]) -> None:  # Trio side
        nonlocal settled, early
        if settled:
            return
        settled = True
        host.pending.discard(on_close)
        if waiting:
            trio.lowlevel.reschedule(waiter, result)
        else:  # a host that starts the task in the caller's thread failed to
            early = result

    def on_close() -> None:  # Trio side: the loop is gone and the task with it
        settle(outcome.Error(closed_loop_error()))

    def finished(result: outcome.Outcome[T] | None) -> None:  # Trio side
        if result is None:  # the task was cancelled
            if raise_cancel is not None:
                settle(outcome.capture(raise_cancel))
                return
            result = outcome.Error(asyncio.CancelledError())
        settle(result)

    def abandon() -> None:  # Trio side
        assert raise_cancel is not None
        settle(outcome.capture(raise_cancel))

    def done(future: asyncio.Task[T]) -> None:  # loop side
        # capture() retrieves the exception, so asyncio does not log it
        result = None if future.cancelled() else outcome.capture(future.result)
        host.to_trio(finished, result)

    def start() -> None:  # loop side
        nonlocal task
        try:
            task = host.loop.create_task(_as_coroutine(fn, *args))
        except BaseException as exc:
            host.to_trio(finished, outcome.Error(exc))
            return
        task.add_done_callback(done)

    def cancel(give_up: float | None) -> None:  # loop side
        if task is None or task.done():
            return
        now = host.loop.time()
        if give_up is None:
            give_up = now + CANCEL_GRACE
        elif now >= give_up:
            host.to_trio(abandon)
            return
        task.cancel()
        host.loop.call_later(RECANCEL, cancel, give_up)

    def abort(raise_cancel_arg: Callable[[], NoReturn]) -> trio.lowlevel.Abort:  # Trio side
        nonlocal raise_cancel
        raise_cancel = raise_cancel_arg
        with contextlib.suppress(BackendUnavailableError):  # closing: on_close settles
            host.to_loop(cancel, None)
        return trio.lowlevel.Abort.FAILED

    host.pending.add(on_close)
    try:
        host.to_loop(start)
    except BaseException:
        host.pending.discard(on_close)
        raise
    if early is not None:
        await trio.lowlevel.checkpoint()
        return early.unwrap()
    waiting = True
    result: T = await trio.lowlevel.wait_task_rescheduled(abort)
    return result


def _as_coroutine(fn: Callable[..., Awaitable[T]], *args: Any) -> Coroutine[Any, Any, T]:
    awaitable = fn(*args)
    if asyncio.iscoroutine(awaitable):
        return awaitable

    async def wrap() -> T:
        return await awaitable

    return wrap()


def callback(host: Host, fn: Callable[..., object]) -> Callable[..., Awaitable[None]]:
    """A nats-py connection callback (a coroutine function, loop side) that hands
    ``fn(*args)`` to Trio's side and returns at once."""

    async def on_loop(*args: Any) -> None:
        host.to_trio(fn, *args)

    return on_loop


def log_asyncio_error(
    secrets: tuple[str, ...], loop: asyncio.AbstractEventLoop, context: dict[str, Any]
) -> None:
    """The asyncio loop's exception handler (with ``secrets`` bound): nats-py's stray
    errors (such as "Task was destroyed but it is pending!" for a watcher
    subscription whose listing was cancelled) become log lines, without secrets."""
    exception = context.get("exception")
    detail = f" ({type(exception).__name__}: {exception})" if exception is not None else ""
    message = f"{context.get('message') or 'an error'}{detail}"
    logger.warning("asyncio reported: %s", redact(message, secrets))


async def stop_watcher(host: Host, watcher: Any, seconds: float) -> None:
    """Stop a nats-py KV watcher, within ``seconds``, even when cancelled (shielded);
    errors only logged. Trio side."""
    with trio.CancelScope(shield=True), trio.move_on_after(seconds):
        try:
            await cross(host, watcher.stop)
        except Exception as exc:
            logger.debug("stopping a NATS watch failed: %s", type(exc).__name__)


async def shutdown(host: Host, nc: Client, seconds: float) -> None:
    """Drain (if connected) and close ``nc``, within about ``2 * seconds``, even when
    cancelled (shielded); errors only logged. Trio side."""
    with trio.CancelScope(shield=True), trio.move_on_after(2 * seconds):
        try:
            await cross(host, _aio_shutdown, nc, seconds)
        except (Exception, asyncio.CancelledError) as exc:
            logger.debug("NATS shutdown failed: %s", type(exc).__name__)


async def _aio_shutdown(nc: Client, seconds: float) -> None:
    """Drain (if connected) and close ``nc``, within about ``seconds``; loop side."""
    try:
        if nc.is_connected and not nc.is_draining:
            await asyncio.wait_for(nc.drain(), seconds)
    except Exception as exc:
        logger.debug("NATS drain failed: %s", type(exc).__name__)
    finally:
        if not nc.is_closed:
            try:
                await asyncio.wait_for(nc.close(), seconds)
            except Exception as exc:
                logger.debug("NATS close failed: %s", type(exc).__name__)
        # A connect attempt cancelled inside nats-py's own cleanup (start-up timeout,
        # refused credentials) can leave the client marked closed with its socket
        # open; close the socket in any case (idempotent).
        transport = nc._transport
        if transport is not None:
            transport.close()  # type: ignore[no-untyped-call]
            # After a failed TLS upgrade the stream never reports its close (and
            # may report the wait's end as asyncio's CancelledError, not an
            # Exception): wait briefly, the socket is closed either way.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(
                    transport.wait_closed(),  # type: ignore[no-untyped-call]
                    min(seconds, _CLOSE_WAIT),
                )
        await close_leftover_transports()


async def close_leftover_transports() -> None:
    """Close every socket transport still open on this loop; loop side.

    Each store has a loop of its own, so whatever is left on it is a connection
    nats-py lost track of (a reconnect attempt replaced, or cut short by the
    shutdown, as :func:`asyncio.wait_for` on Python 3.11 can leave a connection it
    cancelled); closed here it cannot outlive the store (a socket collected after
    its loop closed, and a :exc:`ResourceWarning` then). Selector loops (both hosts'
    loops) list their transports in ``_transports``.
    """
    transports = getattr(asyncio.get_running_loop(), "_transports", None)
    if transports is None:
        return
    left = [t for t in list(transports.values()) if not t.is_closing()]
    for transport in left:
        transport.close()
    if left:
        logger.debug("closed %d NATS socket(s) nats-py had left open", len(left))
        await asyncio.sleep(0)  # the transports' connection_lost runs: the sockets close


def closed_loop_error() -> BackendUnavailableError:
    """The error of a call made after the store's loop was closed."""
    return BackendUnavailableError("the NATS store is closed (its asyncio loop has stopped)")
