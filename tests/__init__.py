"""The test suite of trio_debounce, and the drivers its real-process tests start.

One directory per layer of the package, and ``harness/`` for what several share:
``tests/README.md`` maps them.

``TRIO_DEBOUNCE_TEST_AUTO_HOST=trio-asyncio`` runs every NATS test, in the pytest
process and in every driver process (each is started as ``python -m tests.<dir>.<name>``,
which imports this package first), with ``NatsConfig(asyncio_host="auto")`` meaning
the trio-asyncio host instead of the thread host: the NATS tests parametrized over the
host, one run per host (.ci/run runs both on Python 3.11). Tests that name a host keep
it. The CLI's own processes read ``TRIO_DEBOUNCE_NATS_ASYNCIO_HOST`` instead, which
the same setting sets (see :mod:`tests.conftest`).
"""

from __future__ import annotations

import os

#: The environment variable that picks the host ``"auto"`` stands for in this run.
AUTO_HOST_ENV = "TRIO_DEBOUNCE_TEST_AUTO_HOST"


def _apply_auto_host() -> None:
    host = os.environ.get(AUTO_HOST_ENV, "")
    if not host:
        return
    if host not in ("thread", "trio-asyncio"):
        raise ValueError(f"{AUTO_HOST_ENV} must be 'thread' or 'trio-asyncio', got {host!r}")
    from trio_debounce.nats import _host_trio_asyncio, _hosts

    if host == "trio-asyncio":
        # A run that claims the trio-asyncio host must not fall back to the thread host.
        _host_trio_asyncio.import_trio_asyncio()
    _hosts.AUTO_WHERE_TRIO_ASYNCIO_IMPORTS = host


_apply_auto_host()
