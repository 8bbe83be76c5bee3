"""Abstract interfaces, as in :mod:`trio.abc`.

:class:`DebounceBackend` is what :func:`~trio_debounce.open_coordinator` talks to for
cross-process debouncing (see :doc:`/protocol`); :class:`RunStore` is where deferred
runs are kept (see :doc:`/runs`); :class:`KvStore` is the key-value store the shared
protocol runs over (see :doc:`/protocol`), :class:`KvEntry` one of its entries, and
:class:`KvWatch` its optional watch.
"""

from __future__ import annotations

from ._backend import DebounceBackend as DebounceBackend
from ._kv import KvEntry as KvEntry
from ._kv import KvStore as KvStore
from ._kv import KvWatch as KvWatch
from ._runs._store import Lease as Lease
from ._runs._store import RunState as RunState
from ._runs._store import RunStore as RunStore
from ._runs._store import StoredRun as StoredRun

for _obj in (DebounceBackend, KvEntry, KvStore, KvWatch, Lease, RunState, RunStore, StoredRun):
    _obj.__module__ = __name__
del _obj
