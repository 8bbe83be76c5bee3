"""OpenTelemetry metrics and traces of a coordinator, from its event hook.

Needs the ``otel`` extra (``pip install 'trio-debounce[otel]'``, from a clone
``pip install '.[otel]'``): the ``opentelemetry-api`` package, which does nothing until
the application installs and configures an SDK (``opentelemetry-sdk``). This
submodule is not imported by ``import trio_debounce``. See :doc:`/observability`.
"""

from __future__ import annotations

try:
    import opentelemetry as _opentelemetry  # noqa: F401
except ImportError as _exc:
    raise ImportError(
        "trio_debounce.otel needs the otel extra (opentelemetry-api): "
        f"pip install 'trio-debounce[otel]' (missing: {_exc.name})",
        name=_exc.name,
    ) from _exc

from ._hook import OpenTelemetryHook as OpenTelemetryHook

OpenTelemetryHook.__module__ = __name__
