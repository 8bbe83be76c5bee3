"""The trio-asyncio host: nats-py's loop is a trio-asyncio loop in Trio's own thread.

Imported only when this host is chosen; trio-asyncio itself is imported by
:func:`import_trio_asyncio` (it patches asyncio's loop functions process-wide, and
cannot be imported on Python 3.14). Both directions are plain calls: trio-asyncio runs
asyncio's callbacks inside a Trio task, in the same thread.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any

from ._bridge import Host, closed_loop_error, log_asyncio_error


def import_trio_asyncio() -> ModuleType:
    """``import trio_asyncio``, without its known import-time warning.

    On Python 3.12 and later trio-asyncio's child watcher subclasses
    :class:`asyncio.AbstractChildWatcher`, whose use asyncio deprecates with a
    :exc:`DeprecationWarning` at import; that one (and only that one) is ignored, so
    ``-W error`` users can still open the store.

    Raises:
      ImportError: trio-asyncio is not installed or cannot be imported here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*AbstractChildWatcher.*", category=DeprecationWarning
        )
        return importlib.import_module("trio_asyncio")


class TrioAsyncioHost(Host):
    """A trio-asyncio loop, in Trio's thread (see the module)."""

    name = "trio-asyncio"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending = set()

    def to_loop(self, fn: Callable[..., object], *args: Any) -> None:
        if self.loop.is_closed():
            raise closed_loop_error()
        fn(*args)

    def to_trio(self, fn: Callable[..., object], *args: Any) -> None:
        fn(*args)


@asynccontextmanager
async def open_trio_asyncio_host(
    trio_asyncio: ModuleType, secrets: tuple[str, ...]
) -> AsyncIterator[TrioAsyncioHost]:
    """Open a trio-asyncio loop for the block, as a :class:`TrioAsyncioHost`.

    trio-asyncio's loop runs its tasks in nurseries: an exception that leaves the
    block comes out wrapped in an exception group (the caller carries errors across).
    """
    host: TrioAsyncioHost | None = None
    try:
        async with trio_asyncio.open_loop() as loop:
            # trio-asyncio's default handler re-raises whatever asyncio reports, which
            # would take the whole backend (and its coordinator) down for nats-py's
            # own leftovers. Log them instead.
            loop.set_exception_handler(functools.partial(log_asyncio_error, secrets))
            host = TrioAsyncioHost(loop)
            yield host
    finally:
        if host is not None:
            host.release_pending()
