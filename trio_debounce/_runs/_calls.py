"""The scheduler's calls to its run store, each bounded by ``op_timeout``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from .._errors import BackendError, BackendUnavailableError
from ._store import RunStore

T = TypeVar("T")

#: The scheduler's counters, by :class:`~trio_debounce.RunStatistics` field name.
Counters = dict[str, int]


class StoreCalls:
    """A run store, called as ``await call(what, fn, *args)``: each call bounded by
    ``op_timeout`` seconds, and each failure counted (``store_errors``) and re-raised.

    Attributes:
      store (RunStore): the store itself, for the methods ``fn`` names.
    """

    def __init__(self, store: RunStore, op_timeout: float, stats: Counters) -> None:
        self.store = store
        self._op_timeout = op_timeout
        self._stats = stats

    async def __call__(
        self, what: str, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any
    ) -> T:
        """``await fn(*args, **kwargs)``; ``what`` names the call in the timeout's error.

        Raises:
          BackendUnavailableError: the store did not answer within ``op_timeout``.
          BackendError: as raised by the store.
        """
        try:
            with trio.fail_after(self._op_timeout):
                return await fn(*args, **kwargs)
        except trio.TooSlowError:
            self._stats["store_errors"] += 1
            raise BackendUnavailableError(
                f"the run store did not answer {what} within {self._op_timeout:g} s"
            ) from None
        except BackendError:
            self._stats["store_errors"] += 1
            raise
