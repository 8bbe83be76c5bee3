"""Calling a user's handler: the one place that checks it returned an awaitable."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

from trio.lowlevel import disable_ki_protection

T = TypeVar("T")


@disable_ki_protection
async def invoke(handler: Callable[[T], object], arg: T) -> None:
    """Run ``handler(arg)`` and await what it returns, without the caller's KI
    protection (the coordinator's bookkeeping is protected, user code is not).

    Raises:
      TypeError: the handler returned something that is not awaitable (handlers are
        async functions; as in Trio, this is found only when it is called).
      Exception: whatever the handler raised.
    """
    result: object = handler(arg)
    if not inspect.isawaitable(result):
        raise TypeError(
            f"the handler {handler!r} returned {result!r}, not an awaitable: handlers are "
            "async functions (async def handler(arg): ...)"
        )
    await result
