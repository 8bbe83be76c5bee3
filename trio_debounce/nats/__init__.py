"""The NATS JetStream KV backend for cross-process debouncing (work in progress).

This submodule is not imported by ``import trio_debounce``. So far it holds the
backend's configuration; the backend itself (``open_nats_backend``) lands with the
cross-process issue.
"""

from __future__ import annotations

from ._config import NatsConfig as NatsConfig

NatsConfig.__module__ = __name__
