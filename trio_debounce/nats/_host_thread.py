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

from ._bridge import CANCEL_GRACE, Host, closed_loop_error, log_asyncio_error

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
            # Whatever is left (a watcher's task, a call abandoned past its grace) is
            # cancelled and given the grace to finish.
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=CANCEL_GRACE))
            loop.run_until_complete(loop.shutdown_asyncgens())
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
