"""Abstract interfaces, as in :mod:`trio.abc`.

:class:`DebounceBackend` is what :func:`~trio_debounce.open_coordinator` talks to for
cross-process debouncing; see :doc:`/protocol`.
"""

from __future__ import annotations

from ._backend import DebounceBackend as DebounceBackend

DebounceBackend.__module__ = __name__
