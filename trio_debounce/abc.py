"""Abstract interfaces, as in :mod:`trio.abc`.

:class:`DebounceBackend` is what :func:`~trio_debounce.open_coordinator` talks to for
cross-process debouncing (see :doc:`/protocol`); :class:`RunStore` is where deferred
runs are kept (see :doc:`/runs`).
"""

from __future__ import annotations

from ._backend import DebounceBackend as DebounceBackend
from ._runs._store import Lease as Lease
from ._runs._store import RunState as RunState
from ._runs._store import RunStore as RunStore
from ._runs._store import StoredRun as StoredRun

for _obj in (DebounceBackend, Lease, RunState, RunStore, StoredRun):
    _obj.__module__ = __name__
del _obj
