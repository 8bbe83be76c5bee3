"""The thread host: nats-py's loop is a stdlib :class:`asyncio.SelectorEventLoop` run
by one thread of its own, per open store; it never imports trio-asyncio.

Trio → loop: :meth:`asyncio.AbstractEventLoop.call_soon_threadsafe` (in an empty
context, so no Trio context variable leaks into nats-py's tasks). Loop → Trio:
:meth:`trio.lowlevel.TrioToken.run_sync_soon`. The loop's thread never touches a Trio
object otherwise; both queues are FIFO, so a connection callback that precedes a call's
outcome on the loop's side precedes it on Trio's side too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from ._bridge import (
    CANCEL_GRACE,
    RECANCEL,
    Host,
    close_leftover_transports,
    closed_loop_error,
    log_asyncio_error,
)

logger = logging.getLogger("trio_debounce.nats")

#: The name of the loop's thread (one per open store).
THREAD_NAME = "trio_debounce-nats-asyncio"


class ThreadHost(Host):
    """A stdlib asyncio loop in a dedicated thread (see the module)."""

    name = "thread"

    def __init__(self, token: trio.lowlevel.TrioToken, secrets: tuple[str, ...]) -> None:
        self.loop = asyncio.SelectorEventLoop()
        self.loop.set_exception_handler(functools.partial(log_asyncio_error, secrets))
        self.pending = set()
        self._token = token
        self._context = contextvars.Context()
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._started = trio.Event()
        self._stopped = trio.Event()

    def to_loop(self, fn: Callable[..., object], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args, context=self._context)
        except RuntimeError:  # the loop is closed
            raise closed_loop_error() from None

    def to_trio(self, fn: Callable[..., object], *args: Any) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _run(self) -> None:
        """The loop's thread: run the loop until stopped, then finish what is left."""
        loop = self.loop
        try:
            loop.call_soon(self.to_trio, self._started.set)
            loop.run_forever()
            _finish(loop)
        except BaseException as exc:  # never lost: logged, the Trio side still told
            logger.error("the NATS asyncio thread failed: %r", exc)
        finally:
            loop.close()
            self.to_trio(self._stopped.set)

    async def start(self) -> None:
        """Start the thread and wait (shielded) until its loop runs."""
        self.thread.start()
        with trio.CancelScope(shield=True):
            await self._started.wait()

    async def stop(self) -> None:
        """Stop the loop, wait (shielded) for the thread to finish, and join it."""
        with trio.CancelScope(shield=True):
            with contextlib.suppress(RuntimeError):  # already closed
                self.loop.call_soon_threadsafe(self.loop.stop)
            await self._stopped.wait()
        self.thread.join()  # returns at once: the thread's last act set _stopped
        self.release_pending()


def _finish(loop: asyncio.AbstractEventLoop) -> None:
    """Finish what is left on the stopped ``loop`` before it closes (loop's thread).

    Whatever is left (a watcher's task, a call abandoned past its grace) is cancelled,
    and again every 0.05 s, as :func:`~._bridge.cross` does, for a task that swallowed
    the cancellation or was started meanwhile (nats-py starts a reconnect attempt from
    a connection's error path), within :data:`CANCEL_GRACE` seconds in all;
    then every socket still open on the loop is closed while the loop can still run
    its close callbacks. A task left pending after that is abandoned with its socket
    closed: collected after the loop has closed, it finds nothing left to close.
    """
    give_up = loop.time() + CANCEL_GRACE
    while (tasks := asyncio.all_tasks(loop)) and (left := give_up - loop.time()) > 0:
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.wait(tasks, timeout=min(left, RECANCEL)))
    loop.run_until_complete(close_leftover_transports())
    loop.run_until_complete(loop.shutdown_asyncgens())


@asynccontextmanager
async def open_thread_host(secrets: tuple[str, ...]) -> AsyncIterator[ThreadHost]:
    """Run a :class:`ThreadHost` for the block; its thread is joined on exit.

    Args:
      secrets: never shown in the loop's log lines.
    """
    host = ThreadHost(trio.lowlevel.current_trio_token(), secrets)
    await host.start()
    try:
        yield host
    finally:
        await host.stop()
