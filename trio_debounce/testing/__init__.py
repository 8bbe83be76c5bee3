"""Helpers for testing code that uses trio_debounce, deterministically.

:class:`MemoryBackend` runs the real cross-process protocol on a shared in-memory
:class:`MemoryStore`, so several coordinators in one ``trio.run`` behave as separate
processes under :class:`trio.testing.MockClock`; :func:`check_debounce_backend` is the
conformance suite every :class:`~trio_debounce.abc.DebounceBackend` must pass.
:class:`FireRecorder` and :class:`Processes` are what the pytest plugin's fixtures
(``trio_debounce_fires``, ``trio_debounce_processes``) hand out; this package never
imports pytest. :class:`NatsServer` runs a real ``nats-server -js`` (the
``trio_debounce_nats_server`` fixture's).
"""

from __future__ import annotations

# KvStore and KvEntry live in trio_debounce.abc; exported here too, as they were first.
from ..abc import KvEntry as KvEntry
from ..abc import KvStore as KvStore
from ._conformance import check_debounce_backend as check_debounce_backend
from ._fixtures import FireRecorder as FireRecorder
from ._fixtures import Process as Process
from ._fixtures import Processes as Processes
from ._memory import MemoryBackend as MemoryBackend
from ._memory import MemoryRunStore as MemoryRunStore
from ._memory import MemoryStore as MemoryStore
from ._memory import StoreFaults as StoreFaults
from ._nats_server import NatsServer as NatsServer
from ._run_conformance import check_run_store as check_run_store

for _obj in (
    FireRecorder,
    MemoryBackend,
    MemoryRunStore,
    MemoryStore,
    NatsServer,
    Process,
    Processes,
    StoreFaults,
    check_debounce_backend,
    check_run_store,
):
    _obj.__module__ = __name__
del _obj
