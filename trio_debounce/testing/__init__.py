"""Helpers for testing code that uses trio_debounce, deterministically.

:class:`MemoryBackend` runs the real cross-process protocol on a shared in-memory
:class:`MemoryStore`, so several coordinators in one ``trio.run`` behave as separate
processes under :class:`trio.testing.MockClock`; :func:`check_debounce_backend` is the
conformance suite every :class:`~trio_debounce.abc.DebounceBackend` must pass.
"""

from __future__ import annotations

from .._kv import KvEntry as KvEntry
from .._kv import KvStore as KvStore
from ._conformance import check_debounce_backend as check_debounce_backend
from ._memory import MemoryBackend as MemoryBackend
from ._memory import MemoryRunStore as MemoryRunStore
from ._memory import MemoryStore as MemoryStore
from ._memory import StoreFaults as StoreFaults
from ._run_conformance import check_run_store as check_run_store

for _obj in (
    KvEntry,
    KvStore,
    MemoryBackend,
    MemoryRunStore,
    MemoryStore,
    StoreFaults,
    check_debounce_backend,
    check_run_store,
):
    _obj.__module__ = __name__
del _obj
