"""The choice of the asyncio host for nats-py's loop (``NatsConfig.asyncio_host``).

:mod:`._bridge` crosses between Trio and a host; the hosts are in ``_host_thread`` (a
stdlib loop in a thread of its own) and ``_host_trio_asyncio`` (trio-asyncio's loop in
Trio's thread), which this module picks from and imports only when chosen.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from .._errors import BackendConfigError
from ._bridge import Host
from ._config import ASYNCIO_HOSTS

logger = logging.getLogger("trio_debounce.nats")

#: The host ``"auto"`` prefers where trio-asyncio imports (elsewhere it is the thread
#: host anyway): the thread host. trio-asyncio would be preferred only if it were at
#: least 10 % faster at the owner ping; ``bench/nats_hosts.py`` found it 1.32x slower on
#: one machine and 0.82x on another (the figures and the reasoning: :doc:`/nats`).
AUTO_WHERE_TRIO_ASYNCIO_IMPORTS = "thread"


@asynccontextmanager
async def open_host(asyncio_host: str, secrets: tuple[str, ...]) -> AsyncIterator[Host]:
    """Start the host that ``NatsConfig.asyncio_host`` names and its loop, whose
    exception handler is :func:`log_asyncio_error`; stop it on exit (its thread, if
    any, is joined).

    ``"thread"`` and ``"trio-asyncio"`` name a host; ``"auto"`` is
    :data:`AUTO_WHERE_TRIO_ASYNCIO_IMPORTS` where trio-asyncio imports, else the
    thread host (see :doc:`/nats`, *The asyncio host*).

    Raises:
      BackendConfigError: ``"trio-asyncio"`` was asked for and trio-asyncio cannot be
        imported.
    """
    if asyncio_host not in ASYNCIO_HOSTS:
        raise BackendConfigError(
            f"asyncio_host must be one of {ASYNCIO_HOSTS}, got {asyncio_host!r}"
        )
    module = None
    if asyncio_host == "trio-asyncio" or (
        asyncio_host == "auto" and AUTO_WHERE_TRIO_ASYNCIO_IMPORTS == "trio-asyncio"
    ):
        from . import _host_trio_asyncio

        try:
            module = _host_trio_asyncio.import_trio_asyncio()
        except ImportError as exc:
            if asyncio_host == "trio-asyncio":
                version = ".".join(map(str, sys.version_info[:2]))
                raise BackendConfigError(
                    f"asyncio_host='trio-asyncio', but trio-asyncio cannot be imported on "
                    f"Python {version} ({exc}); use asyncio_host='thread' or 'auto'"
                ) from None
            logger.debug("trio-asyncio does not import (%s): using the thread host", exc)
    if module is None:
        from . import _host_thread

        async with _host_thread.open_thread_host(secrets) as host:
            yield host
    else:
        async with _host_trio_asyncio.open_trio_asyncio_host(module, secrets) as host:
            yield host
