"""Small helpers with no home of their own (no Trio, no I/O)."""

from __future__ import annotations

from typing import Any, NoReturn


class NoPublicConstructor(type):
    """Metaclass that refuses ``Cls(...)``; the library builds instances via ``_create``
    (as Trio's own ``NoPublicConstructor`` does)."""

    def __call__(cls, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor; "
            "use trio_debounce.open_coordinator()"
        )

    def _create(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)
