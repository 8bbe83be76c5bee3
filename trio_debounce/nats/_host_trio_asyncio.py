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
import importlib.metadata
import importlib.util
import sys
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any

from ._bridge import Host, closed_loop_error, log_asyncio_error


def import_trio_asyncio() -> ModuleType:
    """``import trio_asyncio``, without its known import-time warning.

    On Python 3.12 and 3.13 trio-asyncio's child watcher subclasses
    :class:`asyncio.AbstractChildWatcher`, which asyncio deprecates with a
    :exc:`DeprecationWarning` at import; that one (and only that one) is ignored, so
    users who turn warnings into errors can still open the store. On Python 3.14,
    where that class is gone, trio-asyncio 0.16 is not imported at all: its import
    fails half-way, after patching asyncio's loop functions process-wide.

    Returns:
      the ``trio_asyncio`` module.

    Raises:
      ImportError: trio-asyncio is not installed or cannot be imported here.
    """
    if "trio_asyncio" not in sys.modules:
        if importlib.util.find_spec("trio_asyncio") is None:
            raise ImportError("trio-asyncio is not installed", name="trio_asyncio")
        if sys.version_info >= (3, 14) and _installed_version() <= (0, 16):
            raise ImportError(
                "trio-asyncio 0.16 and older cannot be imported on Python 3.14 or later",
                name="trio_asyncio",
            )
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"'AbstractChildWatcher' is deprecated",
            category=DeprecationWarning,
        )
        try:
            return importlib.import_module("trio_asyncio")
        except ImportError:
            raise
        except Exception as exc:  # a failed import of a version this Python breaks
            raise ImportError(
                f"trio-asyncio failed to import: {type(exc).__name__}: {exc}",
                name="trio_asyncio",
            ) from exc


def _installed_version() -> tuple[int, ...]:
    """trio-asyncio's installed version, as ints (``(0,)`` when unknown)."""
    try:
        text = importlib.metadata.version("trio-asyncio")
    except importlib.metadata.PackageNotFoundError:
        return (0,)
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


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
