"""An operator's reading of a whole store: every window and every process lease, as
data (:meth:`KvDebounceBackend.inspect`, ``trio-debounce windows`` and ``processes``;
see :doc:`/cli`, "Inspecting a bucket"). Reads only: a read-only user can run it."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Literal

from .._backend import ProcessInfo, WindowInfo
from .._keys import parse_window_key, window_prefix
from ._documents import (
    FIRE_PREFIX,
    FireRecord,
    Lease,
    RunMarker,
    WindowDoc,
)
from ._leases import read_leases
from ._view import StoreView


async def read_records(view: StoreView) -> list[FireRecord]:
    """Every readable fire record of the store."""
    records: list[FireRecord] = []
    for entry in await view.entries(FIRE_PREFIX):
        if entry.value is None:
            continue
        with contextlib.suppress(ValueError, KeyError, TypeError):
            records.append(FireRecord.decode(entry.value))
    return records


async def list_windows(
    view: StoreView,
    now: float,
    skew: float,
    *,
    workflow: str | None = None,
    key_prefix: str | None = None,
) -> list[WindowInfo]:
    """The windows of the store at wall time ``now``: open ones, and fired ones whose
    fire record still exists (``firing``), sorted by workflow and key. ``workflow``
    is filtered by the store (its keys share a prefix); ``key_prefix`` after listing,
    on the decoded key (keys are stored encoded). Unreadable documents are skipped.

    Raises:
      TypeError, ValueError: ``workflow`` is not a valid workflow name.
      BackendError: the store failed.
    """
    entries = await view.entries(window_prefix(workflow))
    leases = await read_leases(view)
    firing = {(r.workflow, r.key, r.run_id) for r in await read_records(view)}
    windows: list[WindowInfo] = []
    for entry in entries:
        doc = view.parse(entry)
        if doc is None:
            continue
        try:
            wf, key = parse_window_key(entry.key)
        except ValueError:
            continue
        if key_prefix is not None and not key.startswith(key_prefix):
            continue
        state = _state(doc, (wf, key, doc.run_id) in firing, now, leases, skew)
        if state is None:
            continue
        lease = leases.get(doc.owner)
        windows.append(
            WindowInfo(
                wf,
                key,
                doc.run_id,
                doc.mode,
                state,
                doc.owner,
                None if lease is None or lease.epoch != doc.epoch else lease.expires - now,
                doc.first,
                doc.last,
                doc.count,
                doc.at,
                doc.cap,
                0 if doc.payload is None else len(doc.payload.encode("utf-8")),
                view.token(entry.revision),
                entry.revision,
            )
        )
    windows.sort(key=lambda w: (w.workflow, w.key))
    return windows


def _state(
    doc: WindowDoc, recorded: bool, now: float, leases: dict[str, Lease], skew: float
) -> Literal["open", "due", "waiting", "firing"] | None:
    if recorded:
        return "firing"
    if doc.fired:
        return None  # fired, and its handler (if any record) is done
    if doc.at > now:
        return "open"
    if doc.queue and doc.running is not None and _blocks(doc.running, leases, now, skew):
        return "waiting"
    return "due"


def _blocks(marker: RunMarker, leases: dict[str, Lease], now: float, skew: float) -> bool:
    """Does the ``queue-latest`` run ``marker`` still block its key (not timed out, and
    its process's lease of that epoch live)?"""
    if marker.until is not None and now >= marker.until:
        return False
    lease = leases.get(marker.process)
    return lease is not None and lease.epoch == marker.epoch and lease.live(now, skew)


async def list_processes(view: StoreView, now: float, skew: float) -> list[ProcessInfo]:
    """The process leases of the store at wall time ``now``, with the windows and fire
    records each holds, sorted by process id.

    Raises:
      BackendError: the store failed.
    """
    leases = await read_leases(view)
    owned: Counter[tuple[str, str]] = Counter()
    for entry in await view.entries(window_prefix(None)):
        doc = view.parse(entry)
        if doc is not None and not doc.fired:
            owned[doc.owner, doc.epoch] += 1
    held = Counter((r.owner, r.epoch) for r in await read_records(view))
    out = [
        ProcessInfo(
            lease.process,
            lease.epoch,
            lease.live(now, skew),
            lease.expires - now,
            lease.heartbeat,
            None if lease.seconds is None else now - (lease.expires - lease.seconds),
            lease.draining,
            lease.released,
            owned[lease.process, lease.epoch],
            held[lease.process, lease.epoch],
        )
        for lease in leases.values()
    ]
    out.sort(key=lambda p: p.process_id)
    return out
