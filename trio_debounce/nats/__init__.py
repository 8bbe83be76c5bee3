"""The NATS JetStream KV backend for cross-process debouncing.

Needs the ``nats`` extra (from a clone: ``pip install '.[nats]'``): nats-py, run on a
private asyncio loop (in a thread of its own, or on trio-asyncio where it imports:
``NatsConfig.asyncio_host``). This submodule is not imported by ``import
trio_debounce``, and imports trio-asyncio only when a store opens on that host.
"""

from __future__ import annotations

try:
    import nats as _nats  # noqa: F401
except ImportError as _exc:
    raise ImportError(
        "trio_debounce.nats needs the nats extra (nats-py): from a clone, "
        f"pip install '.[nats]' (missing: {_exc.name})",
        name=_exc.name,
    ) from _exc

from ._backend import open_nats_backend as open_nats_backend
from ._config import NatsConfig as NatsConfig
from ._runs import NatsKvRunStore as NatsKvRunStore
from ._runs import NatsRunStoreStatistics as NatsRunStoreStatistics
from ._runs import open_nats_run_store as open_nats_run_store

for _obj in (
    NatsConfig,
    NatsKvRunStore,
    NatsRunStoreStatistics,
    open_nats_backend,
    open_nats_run_store,
):
    _obj.__module__ = __name__
del _obj
