"""The run-store conformance suite on the in-memory fake (MockClock)."""

from __future__ import annotations

import pytest

from trio_debounce import DocumentTooLargeError
from trio_debounce.abc import StoredRun
from trio_debounce.testing import MemoryRunStore, MemoryStore, check_run_store


async def test_memory_run_store_conforms(autojump_clock: object) -> None:
    shared = MemoryStore()
    await check_run_store(MemoryRunStore(shared), other=MemoryRunStore(shared))


async def test_memory_run_store_conforms_alone(autojump_clock: object) -> None:
    await check_run_store(MemoryRunStore())


async def test_an_oversized_run_is_refused_before_sending(autojump_clock: object) -> None:
    shared = MemoryStore(max_value_bytes=10_000)
    store = MemoryRunStore(shared)
    run = StoredRun("big", "wf", '"' + "x" * 10_000 + '"', 1.0)
    with pytest.raises(DocumentTooLargeError, match="'big'"):
        await store.create_run(run)
    assert shared.requests["put"] == 0
