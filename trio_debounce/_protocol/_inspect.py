"""An operator's reading of a whole store: every window and every process lease, as
data (:meth:`KvDebounceBackend.inspect`, ``trio-debounce windows`` and ``processes``;
see :doc:`/cli`, "Inspecting a bucket"). Reads only: a read-only user can run it."""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from typing import Literal

from .._backend import ProcessInfo, WindowInfo
from .._keys import RUN_PREFIX, parse_window_key, window_prefix
from .._runs._kv_store import decode_run
from .._runs._store import RunState
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
    records: defaultdict[tuple[str, str, str], list[FireRecord]] = defaultdict(list)
    for record in await read_records(view):
        records[record.workflow, record.key, record.run_id].append(record)
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
        info = window_info(
            wf,
            key,
            doc,
            entry.revision,
            view.token(entry.revision),
            payload_size(doc),
            firing=any(fire_committed(doc, r) for r in records.get((wf, key, doc.run_id), ())),
            now=now,
            leases=leases,
            skew=skew,
        )
        if info is not None:
            windows.append(info)
    windows.sort(key=lambda w: (w.workflow, w.key))
    return windows


def fire_committed(doc: WindowDoc, record: FireRecord) -> bool:
    """Is ``record`` (a fire record of ``doc``'s run) the record of a committed fire of
    the window, whose handler runs? Yes for a trailing fire once the window's
    tombstone names the record's write (the commit), and for a leading fire once the
    window's opening write is the one the record names. A record written before a
    commit that then lost its compare-and-swap (and is about to be taken back) is not;
    a record of a version that did not name its write is."""
    if record.write is None:
        return True
    if record.leading:
        return record.write == doc.opened_by
    return doc.fired and record.write == doc.write


def payload_size(doc: WindowDoc) -> int:
    """The size of ``doc``'s stored payload (serialized), bytes."""
    return 0 if doc.payload is None else len(doc.payload.encode("utf-8"))


def window_info(
    workflow: str,
    key: str,
    doc: WindowDoc,
    revision: int,
    token: int,
    payload_bytes: int,
    *,
    firing: bool,
    now: float,
    leases: dict[str, Lease],
    skew: float,
    due_grace: float = 0.0,
) -> WindowInfo | None:
    """The window ``doc`` (stored at ``revision``, fencing token ``token``) as an
    operator sees it at wall time ``now``, or None if it is not listed (fired, and no
    fire record of its run exists). ``firing``: a record of a committed fire of its
    run exists (:func:`fire_committed`).
    ``due_grace``: seconds past its due time that it still counts as ``open``."""
    state = _state(doc, firing, now, leases, skew, due_grace)
    if state is None:
        return None
    lease = leases.get(doc.owner)
    return WindowInfo(
        workflow,
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
        payload_bytes,
        token,
        revision,
    )


def _state(
    doc: WindowDoc,
    recorded: bool,
    now: float,
    leases: dict[str, Lease],
    skew: float,
    due_grace: float,
) -> Literal["open", "due", "waiting", "firing"] | None:
    if recorded:
        return "firing"
    if doc.fired:
        return None  # fired, and its handler (if any record) is done
    if doc.at + due_grace > now:
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
    runs = await _runs_held(view)
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
            runs[lease.process],
        )
        for lease in leases.values()
    ]
    out.sort(key=lambda p: p.process_id)
    return out


async def _runs_held(view: StoreView) -> Counter[str]:
    """The persisted runs (a run store's ``r.`` records in the same bucket) that each
    process holds, pending or started, by process id."""
    held: Counter[str] = Counter()
    for entry in await view.entries(RUN_PREFIX + "."):
        if entry.value is None:
            continue
        try:
            run = decode_run(entry.value, entry.revision, entry.key)
        except (ValueError, KeyError, TypeError):
            continue  # an unreadable record: the runs listing reports it
        if run.owner is not None and run.state is not RunState.DONE:
            held[run.owner] += 1
    return held
