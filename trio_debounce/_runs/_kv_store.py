"""A :class:`~trio_debounce.abc.RunStore` on any revisioned key-value store.

Runs are JSON documents at ``r.<base64url(run id)>``, leases at
``rl.<base64url(process id)>`` (see ``_keys.py``), in the same bucket as debounce
windows if one is shared: the first key token keeps the kinds apart. Every write is a
compare-and-swap on the key's revision; a delete removes its marker at once
(revision-checked), so deleted runs leave nothing behind.

:meth:`KvRunStore.list_runs` and :meth:`KvRunStore.list_leases` list every entry under
the prefix; stores that must not scan per tick (NATS, ``trio_debounce.nats._runs``)
override them with an index kept from a watch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from .. import _validate
from .._codec import number, opt_number, opt_string, strict_loads, string
from .._errors import DocumentTooLargeError, RevisionConflict
from .._keys import (
    RUN_LEASE_PREFIX,
    RUN_PREFIX,
    parse_prefixed_key,
    run_key,
    run_lease_key,
)
from .._kv import KvEntry, KvStore
from ._store import ANY, Lease, RunState, RunStore, StoredRun, _Any

logger = logging.getLogger("trio_debounce.runs")

T = TypeVar("T")

#: The schema version of run and lease documents.
SCHEMA = 1

#: Bytes of a run document left for its own fields (ids, times, counters) when the
#: payload limit is derived from the store's value limit.
DOCUMENT_ALLOWANCE = 4096


def encode_run(run: StoredRun) -> bytes:
    """The document of ``run`` (without its revision)."""
    doc: dict[str, Any] = {
        "v": SCHEMA,
        "id": run.run_id,
        "wf": run.workflow,
        "payload": run.payload,
        "at": run.scheduled_at,
        "exp": run.expires_at,
        "state": run.state.value,
        "owner": run.owner,
        "epoch": run.epoch,
        "version": run.version,
        "attempt": run.attempt,
        "token": run.token,
        "created": run.created_at,
        "started": run.started_at,
        "finished": run.finished_at,
        "outcome": run.outcome,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()


def _load(value: bytes) -> dict[str, Any]:
    """The JSON object of a document of this schema version.

    Raises:
      ValueError: not JSON, not an object, or an unknown schema version.
    """
    try:
        doc = strict_loads(value)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("v") != SCHEMA:
        raise ValueError(f"unknown schema version {doc.get('v')!r}")
    return doc


def decode_run(value: bytes, revision: int, key: str | None = None) -> StoredRun:
    """The run in document ``value`` (read from ``key``, if given).

    Raises:
      ValueError: the document is not a run document of a known schema version, or
        it is of another run than the one ``key`` names.
    """
    doc = _load(value)
    if key is not None and key != run_key(string(doc, "id")):
        raise ValueError(f"the document is of another run, {string(doc, 'id')[:80]!r}")
    return StoredRun(
        run_id=string(doc, "id"),
        workflow=string(doc, "wf"),
        payload=string(doc, "payload"),
        scheduled_at=float(number(doc, "at")),
        expires_at=opt_number(doc, "exp"),
        state=RunState(string(doc, "state")),
        owner=opt_string(doc, "owner"),
        epoch=int(number(doc, "epoch")),
        version=int(number(doc, "version")),
        attempt=int(number(doc, "attempt")),
        token=int(number(doc, "token")),
        created_at=float(number(doc, "created")),
        started_at=opt_number(doc, "started"),
        finished_at=opt_number(doc, "finished"),
        outcome=opt_string(doc, "outcome"),
        revision=revision,
    )


def encode_lease(lease: Lease) -> bytes:
    """The document of ``lease`` (without its revision)."""
    doc = {
        "v": SCHEMA,
        "pid": lease.process_id,
        "epoch": lease.epoch,
        "exp": lease.expires_at,
        "released": lease.released,
    }
    if lease.heartbeat_interval is not None:
        doc["beat"] = lease.heartbeat_interval  # optional: older readers ignore it
    if lease.draining:
        doc["draining"] = True  # optional: older readers ignore it (they wait)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def decode_lease(value: bytes, revision: int, key: str | None = None) -> Lease:
    """The lease in document ``value`` (read from ``key``, if given).

    Raises:
      ValueError: the document is not a lease document of a known schema version, or
        it is of another process than the one ``key`` names.
    """
    doc = _load(value)
    if key is not None and key != run_lease_key(string(doc, "pid")):
        raise ValueError(f"the document is of another process, {string(doc, 'pid')[:80]!r}")
    released = doc.get("released")
    if not isinstance(released, bool):
        raise ValueError(f"field 'released' is not a bool: {released!r}")
    beat = doc.get("beat")
    draining = doc.get("draining", False)
    if not isinstance(draining, bool):
        raise ValueError(f"field 'draining' is not a bool: {draining!r}")
    return Lease(
        process_id=string(doc, "pid"),
        epoch=int(number(doc, "epoch")),
        expires_at=float(number(doc, "exp")),
        released=released,
        revision=revision,
        # Only advisory (how long a newcomer watches the lease): a value no interval
        # has is ignored, not an unreadable lease.
        heartbeat_interval=_validate.advisory_seconds(beat),
        draining=draining,
    )


def matches(
    run: StoredRun,
    *,
    states: Collection[RunState] | None,
    owner: str | _Any | None,
    workflow: str | None,
    due_before: float | None,
    finished_before: float | None,
) -> bool:
    """Whether ``run`` passes the filters of :meth:`RunStore.list_runs`."""
    if states is not None and run.state not in states:
        return False
    if owner is not ANY and run.owner != owner:
        return False
    if workflow is not None and run.workflow != workflow:
        return False
    if due_before is not None and not run.scheduled_at < due_before:
        return False
    return finished_before is None or (
        run.finished_at is not None and run.finished_at < finished_before
    )


def _decode(entry: KvEntry | None, decode: Callable[[bytes, int, str], T], kind: str) -> T | None:
    """The record in ``entry``; None for no entry, a delete marker, or a document no
    reader can use (logged as a warning)."""
    if entry is None or entry.value is None:
        return None
    try:
        return decode(entry.value, entry.revision, entry.key)
    except (ValueError, TypeError) as exc:
        logger.warning("ignoring the %s document at %s: %s", kind, entry.key[:80], exc)
        return None


class KvRunStore(RunStore):
    """Deferred runs on a :class:`~trio_debounce.testing.KvStore` (JetStream KV
    semantics); see the module docstring for the layout."""

    def __init__(self, kv: KvStore) -> None:
        self._kv = kv
        self.max_payload_bytes: int = max(0, kv.max_value_bytes - DOCUMENT_ALLOWANCE)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} on {self._kv!r}>"

    def _encode(self, run: StoredRun) -> bytes:
        value = encode_run(run)
        if len(value) > self._kv.max_value_bytes:
            raise DocumentTooLargeError(
                f"run {run.run_id!r}: its document is {len(value)} bytes, more than the "
                f"store's {self._kv.max_value_bytes}"
            )
        return value

    async def get_run(self, run_id: str) -> StoredRun | None:
        entry = await self._kv.get(run_key(run_id))
        return self._decode_entry(entry)

    async def get_run_current(self, run_id: str) -> StoredRun | None:
        # From the store's authority (a leader read, KvStore.get_current): a replica
        # that lags would show the record as a step whose answer was lost found it
        # ("not landed: write again"), each retry conflicting until it caught up.
        entry = await self._kv.get_current(run_key(run_id))
        return self._decode_entry(entry)

    def _decode_entry(self, entry: KvEntry | None) -> StoredRun | None:
        return _decode(entry, decode_run, "run")

    async def create_run(self, run: StoredRun) -> StoredRun | None:
        key = run_key(run.run_id)
        value = self._encode(run)
        last = 0
        for _ in range(2):
            try:
                revision = await self._kv.put(key, value, last=last)
            except RevisionConflict:
                entry = await self._kv.get(key)
                if entry is None:
                    last = 0
                    continue
                if entry.value is not None and self._decode_entry(entry) is not None:
                    return None
                # A delete marker, or a document no reader can use (get_run says None
                # for it too): create over it.
                last = entry.revision
                continue
            return run.replace(revision=revision)
        return None

    async def update_run(self, run: StoredRun) -> StoredRun | None:
        if run.revision <= 0:
            raise ValueError(f"run {run.run_id!r} has no revision to update against")
        try:
            revision = await self._kv.put(run_key(run.run_id), self._encode(run), last=run.revision)
        except RevisionConflict:
            return None
        return run.replace(revision=revision)

    async def delete_run(self, run_id: str, *, revision: int) -> bool:
        return await self._delete(run_key(run_id), revision)

    async def _delete(self, key: str, revision: int) -> bool:
        """Delete ``key`` at ``revision`` and remove its marker at once (both
        revision-checked); False if the key had moved on."""
        try:
            marker = await self._kv.delete(key, last=revision)
        except RevisionConflict:
            return False
        await self._kv.purge_marker(key, revision=marker)
        return True

    async def _scan(self, prefix: str) -> list[KvEntry]:
        """Every live entry under ``prefix`` (``"r."`` or ``"rl."``)."""
        return await self._kv.entries(prefix)

    async def list_runs(
        self,
        *,
        states: Collection[RunState] | None = None,
        owner: str | _Any | None = ANY,
        workflow: str | None = None,
        due_before: float | None = None,
        finished_before: float | None = None,
        limit: int | None = None,
    ) -> list[StoredRun]:
        found = []
        for entry in await self._scan(RUN_PREFIX + "."):
            run = self._decode_entry(entry)
            if run is None:
                continue
            if matches(
                run,
                states=states,
                owner=owner,
                workflow=workflow,
                due_before=due_before,
                finished_before=finished_before,
            ):
                found.append(run)
        found.sort(key=lambda r: (r.scheduled_at, r.run_id))
        return found if limit is None else found[:limit]

    async def get_lease(self, process_id: str) -> Lease | None:
        # From the store's authority: a claim confirms a lapsed lease with it, and a
        # replica that lags may still show a lease its process has renewed since.
        entry = await self._kv.get_current(run_lease_key(process_id))
        return self._decode_lease_entry(entry)

    def _decode_lease_entry(self, entry: KvEntry | None) -> Lease | None:
        return _decode(entry, decode_lease, "lease")

    async def put_lease(self, lease: Lease) -> Lease | None:
        key = run_lease_key(lease.process_id)
        last = lease.revision
        try:
            revision = await self._kv.put(key, encode_lease(lease), last=last)
        except RevisionConflict:
            if last != 0:
                return None
            # Creating: a delete marker (or an unreadable document) may be in the way.
            entry = await self._kv.get(key)
            if entry is None or (
                entry.value is not None and self._decode_lease_entry(entry) is not None
            ):
                return None
            try:
                revision = await self._kv.put(key, encode_lease(lease), last=entry.revision)
            except RevisionConflict:
                return None
        return lease.replace(revision=revision)

    async def delete_lease(self, process_id: str, *, revision: int) -> bool:
        return await self._delete(run_lease_key(process_id), revision)

    async def list_leases(self) -> list[Lease]:
        leases = []
        for entry in await self._scan(RUN_LEASE_PREFIX + "."):
            try:
                parse_prefixed_key(RUN_LEASE_PREFIX, entry.key)
            except ValueError:
                continue
            lease = self._decode_lease_entry(entry)
            if lease is not None:
                leases.append(lease)
        return leases
