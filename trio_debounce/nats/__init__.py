"""The NATS JetStream KV backend for cross-process debouncing.

Needs the ``nats`` extra (``pip install 'trio-debounce[nats]'``): nats-py, driven
through trio-asyncio. This submodule is not imported by ``import trio_debounce``.
"""

from __future__ import annotations

from ._backend import open_nats_backend as open_nats_backend
from ._config import NatsConfig as NatsConfig

for _obj in (NatsConfig, open_nats_backend):
    _obj.__module__ = __name__
del _obj
