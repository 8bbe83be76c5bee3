"""The cross-process debounce protocol over a revisioned key-value store.

:class:`KvDebounceBackend` implements :class:`~trio_debounce.abc.DebounceBackend` on
any :class:`~trio_debounce._kv.KvStore`: NATS JetStream KV in production, the
in-memory fake in tests. The rules are in :doc:`/protocol`; in short:

* One JSON document per window (``w.<workflow>.<key>``), one lease per process
  (``p.<process>``), one sweeper lock (``s.sweeper``).
* Every change is a compare-and-swap on the revision this process last read or wrote
  (remembered per key, so an owner's ping is one request); a conflict re-reads,
  re-applies the ping and retries with jittered backoff until the operation deadline.
* Pings of one key that arrive while its write is in flight are merged, in arrival
  order, into the next single write (group commit; ``_apply_ping`` applied per ping).
* A window is owned by a live process while that process's lease (read through a
  local table, so checking a known live owner costs no request) has not expired, give
  or take ``max_clock_skew``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from .. import _engine, _validate
from .._backend import (
    DebounceBackend,
    Delivery,
    Finalization,
    Finalized,
    OrphanFire,
    Orphans,
    OwnedWindow,
    Registered,
    Registration,
    WindowStatus,
)
from .._errors import (
    BackendError,
    BackendUnavailableError,
    DocumentTooLargeError,
    LeaseLapsedError,
    ProcessIdTakenError,
    RevisionConflict,
)
from .._keys import WINDOW_PREFIX, parse_window_key, process_key, window_key
from .._kv import KvEntry, KvStore
from .._options import DEFAULT, InitialFactory, Reducer, WindowOptions
from .._payload import JsonSerializer, PayloadSerializer
from .._types import Mode
from .._wallclock import wall_to_trio

logger = logging.getLogger("trio_debounce.backend")

SCHEMA_VERSION = 1
#: The version of a window document that uses issue 8's options (``max_count``,
#: ``payload_policy="first"``, order keys); documents without them stay version 1, so
#: processes that predate them keep reading those. Readers accept both.
WINDOW_SCHEMA_OPTIONS = 2
#: The version of a window document that needs the later options: a named reducer,
#: ``overflow="fire-early"``, ``overlap="queue-latest"`` (and the running state of its
#: runs), or the last fired order key that ``drop_stale`` reads. A version-2 reader
#: would misread those, so they are written as version 3; readers take 1, 2 and 3.
WINDOW_SCHEMA_RUNS = 3
_BUILTIN_POLICIES = ("last", "first", "collect")
SWEEPER_KEY = "s.sweeper"
_LEASE_PREFIX = "p."
_WINDOW_PREFIX = WINDOW_PREFIX + "."
_FIRE_PREFIX = "f."
#: A tombstone that keeps a key's last fired order key (for ``drop_stale``) is swept
#: this many process leases after the key's last ping.
_ORDER_LEASES = 10
#: Looks at a live lease of our process id (another epoch) while it is watched for a
#: renewal at start, besides the first (the KV interface has no watch to wait on).
_TWIN_LOOKS = 4
#: Fencing tokens are ``(bucket creation time in ms) << _TOKEN_SHIFT | revision``.
_TOKEN_SHIFT = 40
#: How many tombstones before it a window names in ``after``.
_AFTER_KEEP = 4


@dataclass(frozen=True, slots=True)
class RunMarker:
    """A ``queue-latest`` run in progress, kept in its key's document: it blocks the
    key's next fire until its process ends it (:meth:`KvDebounceBackend.end_run`), until
    ``until`` (wall clock: the fire time plus ``run_timeout``), or until the lease of
    ``process`` (in its opening ``epoch``) lapses."""

    process: str
    epoch: str
    run_id: str
    until: float | None


@dataclass(frozen=True, slots=True)
class WindowDoc:
    """The shared document of one window (schema version 1, 2 or 3, by the options it
    uses); times are wall clock."""

    owner: str
    epoch: str
    run_id: str
    mode: Mode
    delay: float
    max_delay: float | None
    first: float
    last: float
    at: float
    cap: float | None
    armed: float
    count: int
    write: str
    #: The write id of the write that opened the window (kept by every later write).
    opened_by: str
    #: The latest payload, serialized (None: no ping stored one).
    payload: str | None = None
    #: True once the window has fired under at-most-once delivery: a tombstone that
    #: proves the fire, which the next ping opens a new window over.
    fired: bool = False
    #: The window's max_count (version 2 documents only): the ping that brings
    #: ``count`` to it makes the window due at once.
    max_count: int | None = None
    #: ``"last"``, ``"first"`` or ``"collect"`` (version 2 documents only when not
    #: ``"last"``). Under ``"collect"``, ``payload`` is the serialized list of the
    #: window's payloads, and ``ranks`` their ``[order key, arrival]`` pairs.
    payload_policy: str = "last"
    max_items: int | None = None
    ranks: tuple[tuple[float, int], ...] = ()
    #: True when the window's pings carry order keys (version 2 only); ``order`` is
    #: then the order key of the stored ``payload``.
    ordered: bool = False
    order: float | None = None
    #: ``"fire-early"`` or ``"drop-oldest"`` with ``"collect"`` or a reducer (a
    #: version-2 ``"collect"`` document means ``"drop-oldest"``).
    overflow: str | None = None
    #: Payloads a reducer has folded in (version 3); ``"collect"`` counts its ``ranks``.
    held: int = 0
    #: ``overlap="queue-latest"`` (version 3), and its ``run_timeout`` in seconds.
    queue: bool = False
    run_timeout: float | None = None
    #: The key's ``queue-latest`` run in progress, carried from window to window.
    running: RunMarker | None = None
    #: The highest order key of the window's pings (with ``ordered``).
    max_order: float | None = None
    #: The highest order key fired for the key, carried from window to window (and
    #: kept in the tombstone after the last one) for ``drop_stale``.
    fired_order: float | None = None
    #: ``(run id, write id)`` of the tombstones this window's key had before it, the
    #: latest first (at most ``_AFTER_KEEP``): the proof of how each of those runs was
    #: committed, kept (in this window's tombstone too) so that a fire record of such
    #: a run is decided by it after its tombstone is gone (see ``_commit_landed``).
    #: Any schema version; older readers ignore it.
    after: tuple[tuple[str, str], ...] = ()

    @property
    def has_options(self) -> bool:
        return self.max_count is not None or self.payload_policy != "last" or self.ordered

    @property
    def needs_v3(self) -> bool:
        return (
            self.payload_policy not in _BUILTIN_POLICIES
            or self.overflow == "fire-early"
            or self.queue
            or self.running is not None
            or self.fired_order is not None
        )

    @property
    def accumulates(self) -> bool:
        return self.payload_policy not in ("last", "first")

    @property
    def items(self) -> int:
        """Payloads held, for ``max_items`` (``"collect"`` or a reducer)."""
        return len(self.ranks) if self.payload_policy == "collect" else self.held

    @property
    def keeps_tombstone(self) -> bool:
        """Does a commit (or cancel) of this window leave a tombstone rather than
        delete it? Yes when the key's state must outlive the window: the running
        state of a ``queue-latest`` run, the last fired order key, or the proof of
        the commit of the run before (``after``)."""
        return self.running is not None or self.fired_order is not None or bool(self.after)

    def closed(self) -> WindowDoc | None:
        """What closing this window without a fire (cancel, release) writes: its
        tombstone if it keeps one, else None (a delete)."""
        if not self.keeps_tombstone:
            return None
        return replace(self, fired=True, write=uuid.uuid4().hex)

    def encode(self) -> bytes:
        extra: dict[str, Any] = {}
        if self.max_count is not None:
            extra["max_count"] = self.max_count
        if self.payload_policy != "last":
            extra["policy"] = self.payload_policy
        v3 = self.needs_v3
        if self.accumulates:
            extra["max_items"] = self.max_items
            if v3:
                extra["overflow"] = self.overflow
        if self.payload_policy == "collect":
            extra["ranks"] = [list(rank) for rank in self.ranks]
        elif self.accumulates:
            extra["held"] = self.held
        if self.ordered:
            extra["ordered"] = True
            extra["order"] = self.order
            if self.max_order is not None:
                extra["max_order"] = self.max_order
        if self.queue:
            extra["queue"] = True
            extra["run_timeout"] = self.run_timeout
        if self.running is not None:
            marker = self.running
            extra["running"] = {
                "process": marker.process,
                "epoch": marker.epoch,
                "run": marker.run_id,
                "until": marker.until,
            }
        if self.fired_order is not None:
            extra["fired_order"] = self.fired_order
        if self.after:
            extra["after"] = [list(proof) for proof in self.after]
        if v3:
            version = WINDOW_SCHEMA_RUNS
        elif self.has_options:
            version = WINDOW_SCHEMA_OPTIONS
        else:
            version = SCHEMA_VERSION
        return json.dumps(
            {
                "v": version,
                "owner": self.owner,
                "epoch": self.epoch,
                "run": self.run_id,
                "mode": self.mode.value,
                "delay": self.delay,
                "max_delay": self.max_delay,
                "first": self.first,
                "last": self.last,
                "at": self.at,
                "cap": self.cap,
                "armed": self.armed,
                "count": self.count,
                "write": self.write,
                "open": self.opened_by,
                "payload": self.payload,
                "fired": self.fired,
                **extra,
            },
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes) -> WindowDoc:
        """Parse a document; raises ValueError for anything but a valid version 1, 2 or 3."""
        obj = _loads(raw)
        versions = (SCHEMA_VERSION, WINDOW_SCHEMA_OPTIONS, WINDOW_SCHEMA_RUNS)
        if not isinstance(obj, dict) or obj.get("v") not in versions:
            raise ValueError("not a version 1, 2 or 3 window document")
        max_count = None
        policy = "last"
        ordered = False
        order = None
        max_items = None
        ranks: tuple[tuple[float, int], ...] = ()
        extra: dict[str, Any] = {}
        if obj["v"] >= WINDOW_SCHEMA_OPTIONS:
            v3 = obj["v"] == WINDOW_SCHEMA_RUNS
            max_count = obj.get("max_count")
            if max_count is not None and (
                isinstance(max_count, bool) or not isinstance(max_count, int) or max_count < 1
            ):
                raise ValueError(f"bad max_count {max_count!r}")
            policy = obj.get("policy", "last")
            if not isinstance(policy, str) or not (policy in _BUILTIN_POLICIES or (v3 and policy)):
                raise ValueError(f"bad payload policy {policy!r}")
            if policy not in ("last", "first"):
                max_items = obj["max_items"]
                if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
                    raise ValueError(f"bad max_items {max_items!r}")
                overflow = obj.get("overflow", "drop-oldest") if v3 else "drop-oldest"
                if overflow not in ("fire-early", "drop-oldest") or (
                    overflow == "drop-oldest" and policy != "collect"
                ):
                    raise ValueError(f"bad overflow {overflow!r}")
                extra["overflow"] = overflow
                if policy == "collect":
                    ranks = tuple((_float(o), int(n)) for o, n in obj["ranks"])
                else:
                    extra["held"] = int(obj["held"])
            ordered = obj.get("ordered", False) is True
            if ordered:
                order = _order(obj.get("order"))
                if obj.get("max_order") is not None:
                    extra["max_order"] = _order(obj["max_order"])
            if v3:
                if obj.get("queue", False) is True:
                    extra["queue"] = True
                    timeout = obj.get("run_timeout")
                    extra["run_timeout"] = None if timeout is None else _num(obj, "run_timeout")
                running = obj.get("running")
                if running is not None:
                    if not isinstance(running, dict):
                        raise ValueError("running is not an object")
                    until = running.get("until")
                    extra["running"] = RunMarker(
                        _str(running, "process"),
                        _str(running, "epoch"),
                        _str(running, "run"),
                        None if until is None else _num(running, "until"),
                    )
                if obj.get("fired_order") is not None:
                    extra["fired_order"] = _order(obj["fired_order"])
        after = obj.get("after")
        if after is not None:
            if not isinstance(after, list) or not 0 < len(after) <= _AFTER_KEEP:
                raise ValueError(f"bad after {after!r}")
            proofs = []
            for proof in after:
                if (
                    not isinstance(proof, list)
                    or len(proof) != 2
                    or not all(isinstance(part, str) for part in proof)
                ):
                    raise ValueError(f"bad after {after!r}")
                proofs.append((_utf8("after", proof[0]), _utf8("after", proof[1])))
            extra["after"] = tuple(proofs)
        doc = cls(
            owner=_str(obj, "owner"),
            epoch=_str(obj, "epoch"),
            run_id=_str(obj, "run"),
            mode=Mode(obj["mode"]),
            delay=_num(obj, "delay"),
            max_delay=None if obj.get("max_delay") is None else _num(obj, "max_delay"),
            first=_num(obj, "first"),
            last=_num(obj, "last"),
            at=_num(obj, "at"),
            cap=None if obj.get("cap") is None else _num(obj, "cap"),
            armed=_num(obj, "armed"),
            count=int(obj["count"]),
            write=_str(obj, "write"),
            opened_by=_str(obj, "open"),
            payload=_opt_str(obj, "payload"),
            fired=obj.get("fired", False) is True,
            max_count=max_count,
            payload_policy=policy,
            ordered=ordered,
            order=order,
            max_items=max_items,
            ranks=ranks,
            **extra,
        )
        if doc.count < 1:
            raise ValueError("count < 1")
        return doc


def _reject(text: str) -> float:
    raise ValueError(f"not a finite number: {text[:40]}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _reject(text)
    return value


def _loads(raw: bytes) -> Any:
    """JSON of a stored document: NaN, infinities and nesting too deep to parse are
    refused with ValueError like any other unreadable document, so that every decoder
    raises only ValueError, KeyError or TypeError (what their callers catch)."""
    try:
        return json.loads(raw, parse_constant=_reject, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("a document nested too deeply") from None


def _order(value: Any) -> float:
    """An order key as stored (an int or a finite float, kept as it is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"bad order key {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"bad order key {value!r}")
    return value


def _float(value: Any) -> float:
    """``float(value)``, with an int beyond the float range refused as ValueError."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError("a number beyond the float range") from None


def _str(obj: dict[str, Any], name: str) -> str:
    value = obj[name]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} is not a non-empty string")
    return _utf8(name, value)


def _opt_str(obj: dict[str, Any], name: str) -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} is not a string")
    return value if value is None else _utf8(name, value)


def _utf8(name: str, value: str) -> str:
    # A "\ud800" escape parses to a lone surrogate, which no document can be
    # written back with (the encoders write UTF-8).
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} holds a lone surrogate") from None
    return value


def _num(obj: dict[str, Any], name: str) -> float:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} is not a number")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} is not finite")
    return value


def _stale(order_key: float | None, fired_order: float | None) -> bool:
    """Is a ping with ``order_key`` stale: not above the key's last fired order key?"""
    return order_key is not None and _engine.is_stale(order_key, fired_order)


def _options_of(doc: WindowDoc) -> WindowOptions | None:
    """The window options a document holds, as the engine takes them (None: plain)."""
    opts = WindowOptions(
        max_count=doc.max_count,
        payload_policy=doc.payload_policy,
        max_items=doc.max_items,
        overflow=doc.overflow,
        overlap="queue-latest" if doc.queue else "allow",
        run_timeout=doc.run_timeout,
        ordered=doc.ordered,
    )
    return None if opts == DEFAULT else opts


class WindowFull(Exception):
    """Raised by a ping into a window that holds ``max_items`` under
    ``overflow="fire-early"``: the window fires first (see :class:`Registration`)."""

    def __init__(self, doc: WindowDoc) -> None:
        super().__init__(f"window {doc.run_id} is full")
        self.doc = doc


@dataclass(frozen=True, slots=True)
class _Lease:
    process: str
    epoch: str
    expires: float
    #: Handed off: the process left, its windows are for peers to take at once.
    released: bool = False
    #: The holder's heartbeat interval, seconds: how long a newcomer with the same
    #: process id watches this lease for a renewal. None in leases written before
    #: it was recorded (or holding no usable value): the reader uses its own.
    heartbeat: float | None = None

    def live(self, now: float, skew: float) -> bool:
        return not self.released and now <= self.expires + skew


def _decode_lease(raw: bytes) -> _Lease:
    obj = _loads(raw)
    if not isinstance(obj, dict) or obj.get("v") != SCHEMA_VERSION:
        raise ValueError("not a version 1 lease")
    heartbeat = _validate.advisory_seconds(obj.get("beat"))
    return _Lease(
        _str(obj, "process"),
        _str(obj, "epoch"),
        _num(obj, "expires"),
        obj.get("released", False) is True,
        heartbeat,
    )


def _encode_lease(lease: _Lease) -> bytes:
    doc: dict[str, object] = {
        "v": SCHEMA_VERSION,
        "process": lease.process,
        "epoch": lease.epoch,
        "expires": lease.expires,
        "released": lease.released,
    }
    if lease.heartbeat is not None:
        doc["beat"] = lease.heartbeat  # optional: older readers ignore it
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


@dataclass(slots=True)
class _TwinWatch:
    """A live lease of another epoch of our process id, watched before this opening's
    first lease write: renewed within ``until`` (Trio time), it is a live twin."""

    epoch: str
    revision: int
    expires: float
    until: float
    #: Seconds between two looks at the lease.
    step: float


@dataclass(frozen=True, slots=True)
class _FireRecord:
    """An at-least-once fire in progress (``f.<id>``): outlives its window's document
    until the handler returns, so a survivor can run it again."""

    owner: str
    epoch: str
    workflow: str
    key: str
    run_id: str
    payload: str | None
    count: int
    first: float
    at: float
    attempt: int
    #: The write id of the commit this record belongs to (its tombstone names it);
    #: None in records of older versions.
    write: str | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "v": SCHEMA_VERSION,
                "owner": self.owner,
                "epoch": self.epoch,
                "workflow": self.workflow,
                "key": self.key,
                "run": self.run_id,
                "payload": self.payload,
                "count": self.count,
                "first": self.first,
                "at": self.at,
                "attempt": self.attempt,
                **({} if self.write is None else {"write": self.write}),
            },
            separators=(",", ":"),
        ).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes) -> _FireRecord:
        obj = _loads(raw)
        if not isinstance(obj, dict) or obj.get("v") != SCHEMA_VERSION:
            raise ValueError("not a version 1 fire record")
        return cls(
            owner=_str(obj, "owner"),
            epoch=_str(obj, "epoch"),
            workflow=_str(obj, "workflow"),
            key=_str(obj, "key"),
            run_id=_str(obj, "run"),
            payload=_opt_str(obj, "payload"),
            count=int(obj["count"]),
            first=_num(obj, "first"),
            at=_num(obj, "at"),
            attempt=int(obj["attempt"]),
            write=_opt_str(obj, "write"),
        )


@dataclass(slots=True)
class _QueuedDelete:
    key: str
    run_id: str
    fired_at: float
    #: A fire record the failed finalize may have written.
    fire_id: str | None = None
    #: The window's ping count as last returned to the owner (0: unknown). The
    #: owner's unconfirmed fire ran a trailing edge only if this count called for one.
    known_count: int = 0


@dataclass(slots=True)
class _Unproven:
    """An at-least-once fire commit whose answer was lost, that no one ran: a taker's,
    or an owner's whose lease had lapsed (it must not fire unconfirmed). Proven and
    fired, or taken back, by the next finalize of its run or by ``adopt_orphans``."""

    workflow: str
    key: str
    window: WindowDoc
    write: str
    fired_at: float
    fire_id: str


#: How many keys' last known (revision, document) a backend keeps (least recently used
#: first out); a key not kept costs one read before its next write.
_KNOWN_LIMIT = 10_000

#: Payload types that JSON gives back as they are (exact types: not subclasses).
_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


@dataclass(slots=True, eq=False)
class _Ping:
    """One register call, waiting to be written (alone, or merged into a batch)."""

    mode: Mode
    delay: float
    max_delay: float | None
    run_id: str
    text: str
    own: Any
    max_count: int | None
    payload_policy: str
    order_key: float | None
    max_items: int | None
    #: Trio time by which the call must be answered (its arrival + op_timeout).
    deadline: float
    overflow: str | None = None
    reducer: tuple[Reducer, InitialFactory | None] | None = None
    #: ``overlap="queue-latest"``.
    queue: bool = False
    run_timeout: float | None = None
    drop_stale: bool = False
    #: Written in a batch of its own (its document was too large in a merged one).
    alone: bool = False
    #: The ping's time: the backend's wall clock when the call was made, kept through
    #: group commit, conflicts and retries (None: the time the batch is applied at).
    now: float | None = None
    #: Joins a due window instead of taking its fire: the fire could not be written
    #: (its record would be too large for the store), so this ping does as pings did
    #: before the due-time rule, rather than fail.
    joins_due: bool = False
    #: No window option beyond mode, delay and max_delay: merged by _fold_plain.
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        self.plain = (
            self.payload_policy == "last"
            and self.order_key is None
            and self.reducer is None
            and self.max_count is None
            and self.max_items is None
            and self.overflow is None
            and not self.queue
            and self.run_timeout is None
            and not self.drop_stale
        )

    result: Registration | BaseException | None = None
    #: The call's task while it waits (parked by :func:`_park`), else None.
    task: trio.lowlevel.Task | None = None
    #: The fires of due windows this ping took before it was applied (returned in
    #: its Registration when no coordinator's hook took them at once).
    taken: list[Finalization] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _KeyQueue:
    """The pings of one key that wait for the write in flight (group commit)."""

    writing: bool = False
    waiting: list[_Ping] = field(default_factory=list)
    #: Finalizes waiting for the key's turn; they go before the next batch of pings.
    finalizers: list[trio.Event] = field(default_factory=list)


def _commit_landed(doc: WindowDoc | None, run_id: str, write: str) -> bool | None:
    """Did the commit of write ``write`` (a fire record's) close run ``run_id``, judged by
    its key's document ``doc`` as read now?

    True or False where the document proves it; None while the run's window is still
    open (its owner fires it). The proof is the run's tombstone (``fired``, naming the
    write that committed) or, once pings have opened newer windows over it, their
    ``after``, read the same way. The sweeper keeps a key's tombstone while any fire
    record of the key exists, so a gone document means the record's commit never
    landed (the record itself landed after the tombstone was swept), as does a run
    missing from a newer window's ``after`` that holds fewer than ``_AFTER_KEEP``
    runs (the key had no tombstone before them). A full ``after`` without the run
    has lost the proof: the record is taken to have committed, and runs
    (at-least-once; see docs/protocol.rst, "Fire records and their proof").
    """
    if doc is None:
        return False
    if doc.run_id == run_id:
        return doc.write == write if doc.fired else None
    for proof_run, proof_write in doc.after:
        if proof_run == run_id:
            return proof_write == write
    return len(doc.after) >= _AFTER_KEEP


def _due_at(doc: WindowDoc | None, now: float, blocked: float | None) -> bool:
    """Is ``doc`` an open window that is due at ``now`` (its ``at`` has come: its
    deadline, its cap, or the time of the ping that reached its ``max_count``), so that
    a ping at ``now`` must not join it? A ``queue-latest`` window that waits for its
    key's run (``blocked``) is not: pings join it."""
    return (
        doc is not None
        and not doc.fired
        and not _engine.joins(doc.at, now, doc.queue and blocked is not None)
    )


def _refuse_abort(raise_cancel: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


async def _park(ping: _Ping) -> None:
    """Wait until :func:`_wake` (``ping``'s result, or its turn to lead a write).

    The wait refuses cancellation, like a shielded one (a merged ping cannot be
    withdrawn), without a cancel scope per ping; a cancellation of the call is
    delivered at its next checkpoint after it returns.
    """
    ping.task = trio.lowlevel.current_task()
    await trio.lowlevel.wait_task_rescheduled(_refuse_abort)


def _wake(ping: _Ping) -> None:
    """Wake ``ping``'s call if it is parked (once: a second wake is a no-op)."""
    task = ping.task
    if task is not None:
        ping.task = None
        trio.lowlevel.reschedule(task)


def _plain_window(doc: WindowDoc | None, mode: Mode) -> bool:
    """Is ``doc`` an open window of ``mode`` with no option beyond mode, delay and
    max_delay (what a run of plain pings can be folded into)?"""
    return (
        doc is not None
        and not doc.fired
        and doc.mode is mode
        and doc.payload_policy == "last"
        and not doc.ordered
        and doc.max_count is None
        and doc.max_items is None
        and doc.overflow is None
        and not doc.queue
        and doc.run_timeout is None
    )


def _settle(ping: _Ping, result: Registration | BaseException) -> None:
    """Give ``ping`` its result and wake its call."""
    ping.result = result
    _wake(ping)


class KvDebounceBackend(DebounceBackend):
    """The debounce protocol over a :class:`~trio_debounce._kv.KvStore`.

    Args:
      store: the shared store.
      process_id (str | None): this process's id; a uuid4 hex when None. Two live
        coordinators must never share one.
      process_lease (float): seconds this process's lease lasts unrenewed (> 0).
      op_timeout (float): seconds a register or finalize may take, retries included.
      max_clock_skew (float): the largest wall-clock difference between hosts that the
        lease arithmetic tolerates, seconds: an owner is dead only once its lease
        expired more than this long ago.
      wall_time: the wall clock, ``() -> float`` epoch seconds (:func:`time.time`).
      serializer (PayloadSerializer | None): how payloads are stored
        (:class:`~trio_debounce.JsonSerializer` when None); every process sharing the
        store must use the same one.
    """

    _register_uncancellable = True

    def __init__(
        self,
        store: KvStore,
        *,
        process_id: str | None = None,
        process_lease: float = 60.0,
        op_timeout: float = 2.0,
        max_clock_skew: float = 1.0,
        wall_time: Callable[[], float] = time.time,
        serializer: PayloadSerializer | None = None,
    ) -> None:
        if process_id is None:
            process_id = uuid.uuid4().hex
        if not isinstance(process_id, str) or not process_id:
            raise ValueError(f"process_id must be a non-empty str, got {process_id!r}")
        self._store = store
        self._serializer: PayloadSerializer = JsonSerializer() if serializer is None else serializer
        self._token_base = int(store.created * 1000) << _TOKEN_SHIFT
        self._process_id = process_id
        self._process_key = process_key(process_id)
        self._epoch = uuid.uuid4().hex
        self._lease = _validate.positive_duration("process_lease", process_lease)
        self._op_timeout = _validate.positive_duration("op_timeout", op_timeout)
        self._skew = _validate.positive_duration("max_clock_skew", max_clock_skew)
        self._wall = wall_time
        self._lease_revision = 0
        self._refreshes = 0
        #: process id -> its lease as last read (the local lease table).
        self._leases: dict[str, _Lease] = {}
        #: (process, epoch) of the leases that were live at the last reload.
        self._live_at_last_look: set[tuple[str, str]] = set()
        self._seen_released: set[tuple[str, str]] = set()
        #: KV key -> run id of the windows this process owns, as far as it knows.
        self._owned: dict[str, str] = {}
        self._queued_deletes: dict[str, _QueuedDelete] = {}
        #: KV key -> the at-least-once commits of it whose answers were lost and that
        #: no one ran (see _Unproven).
        self._unproven: dict[str, list[_Unproven]] = {}
        #: KV key -> (revision, window document or None) as this process last read or
        #: wrote it: a write against it needs no read first (the compare-and-swap
        #: proves it current); a conflict or an error forgets it.
        self._known: dict[str, tuple[int, WindowDoc | None]] = {}
        #: KV keys that peers write too (a compare-and-swap lost to them, or a read
        #: found a revision this process did not know): read before every write.
        self._contended: set[str] = set()
        #: KV key -> the pings waiting to be merged into its next write.
        self._queues: dict[str, _KeyQueue] = {}
        #: KV keys whose last register write was answered since a ping next led one.
        self._answered: set[str] = set()
        #: (workflow, key) -> KV key, for the keys pinged lately (at most _KNOWN_LIMIT).
        self._window_keys: dict[tuple[str, str], str] = {}
        #: The default serializer: a scalar payload is what it reads back.
        self._json = type(self._serializer) is JsonSerializer
        #: KV key -> (run id, the highest ping count returned to the coordinator for
        #: it): what the owner knows if its finalize fails; kept with ``_owned``.
        self._known_counts: dict[str, tuple[str, int]] = {}
        #: Fire records this process wrote or adopted: id -> revision.
        self._fire_records: dict[str, int] = {}
        #: Fire records whose delete could not reach the store: retried by heartbeats.
        self._queued_completions: set[str] = set()
        #: Fire records of queued deletes that a later one for the same key replaced.
        self._queued_record_deletes: set[str] = set()
        #: queue-latest runs of this process whose handlers returned, while their end
        #: is not yet recorded in the store (they block nothing here), and the end
        #: records that could not reach the store, by KV key.
        self._ended_runs: set[str] = set()
        self._queued_end_runs: dict[str, str] = {}
        self._lease_expires = -math.inf
        #: The lease of the coordinator that took our process id (we are fenced).
        self._taken_by: _Lease | None = None
        #: The lease of another epoch of our process id that our first write replaced:
        #: until it lapses, that coordinator may still run a fire (a stalled holder is
        #: fenced only at its next heartbeat), so its fire records are not adopted.
        self._replaced: _Lease | None = None
        #: Before this opening's first lease write: the live lease of another epoch
        #: of our process id being watched for a renewal (a live twin), if any.
        self._twin_watch: _TwinWatch | None = None
        #: The process id was found free (no live lease of another epoch, or one not
        #: renewed for its holder's heartbeat interval plus the skew margin).
        self._id_cleared = False
        #: One lease refresh at a time: concurrent ones (the heartbeat and finalizes
        #: after a stall) would lose compare-and-swaps to each other.
        self._lease_lock = trio.Lock()
        #: Lease writes that landed; deaths found by refreshes not yet returned.
        self._lease_writes = 0
        self._dead_unreported: set[str] = set()
        self._in_outage = False
        #: Trio time before which no takeover happens (after an outage).
        self._takeover_after = -math.inf
        self._rng = random.Random()
        self._released = False
        # Counters, see statistics().
        self.conflicts = 0
        self.unstored_coalesces = 0
        self.requests = 0
        self.takeovers = 0
        self.adopted_fires = 0
        #: Fires of due windows taken by pings (see _take_due).
        self.taken_fires = 0

    # ----------------------------------------------------------------- basics

    @property
    def process_id(self) -> str:
        return self._process_id

    @property
    def epoch(self) -> str:
        """This opening's epoch: a fresh uuid4 hex, so a restart under the same
        process id does not inherit its predecessor's windows."""
        return self._epoch

    @property
    def heartbeat_interval(self) -> float:
        return self._lease / 3

    def wall_time(self) -> float:
        return self._wall()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} process={self._process_id!r} store={self._store!r}>"

    # ------------------------------------------------------------ store calls

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One store request; tracks outages (and the takeover grace after them)."""
        self.requests += 1
        try:
            result = await fn(*args, **kwargs)
        except BackendUnavailableError:
            self._in_outage = True
            raise
        if self._in_outage:
            self._in_outage = False
            # Let live peers refresh their leases before anything is taken over.
            self._takeover_after = trio.current_time() + self.heartbeat_interval + self._skew
            logger.info(
                "backend answers again; no takeover for %.3g s",
                self.heartbeat_interval + self._skew,
            )
        return result

    async def _get(self, key: str) -> KvEntry | None:
        entry: KvEntry | None = await self._call(self._store.get, key)
        return entry

    async def _read(self, kv_key: str) -> tuple[KvEntry | None, int, WindowDoc | None]:
        """Read window ``kv_key``: its entry, revision (0: none) and document (None:
        absent, a delete marker or unreadable), remembered for the next write."""
        entry = await self._get(kv_key)
        doc = self._parse(entry)
        revision = 0 if entry is None else entry.revision
        known = self._known.get(kv_key)
        if known is not None and known[0] != revision:
            self._contend(kv_key)  # written by someone else since
        self._remember(kv_key, revision, doc)
        return entry, revision, doc

    def _cached(self, kv_key: str) -> tuple[int, WindowDoc | None] | None:
        """The revision and document to write ``kv_key`` against without a read, if
        this process knows them and the key is not contended."""
        if kv_key in self._contended:
            return None
        return self._known.get(kv_key)

    def _contend(self, kv_key: str) -> None:
        self._forget(kv_key)
        if len(self._contended) >= _KNOWN_LIMIT:
            self._contended.clear()
        self._contended.add(kv_key)

    def _remember(self, kv_key: str, revision: int, doc: WindowDoc | None) -> None:
        known = self._known
        known.pop(kv_key, None)
        known[kv_key] = (revision, doc)
        if len(known) > _KNOWN_LIMIT:
            del known[next(iter(known))]

    def _forget(self, kv_key: str) -> None:
        self._known.pop(kv_key, None)

    def _parse(self, entry: KvEntry | None) -> WindowDoc | None:
        if entry is None or entry.value is None:
            return None
        try:
            return WindowDoc.decode(entry.value)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            logger.warning(
                "window document %s (revision %d) is unreadable; treating it as absent",
                entry.key,
                entry.revision,
            )
            return None

    async def _backoff(self, attempt: int) -> None:
        # Full jitter, capped: contention clears in a few rounds.
        await trio.sleep(self._rng.uniform(0, min(0.2, 0.005 * 2**attempt)))

    # ------------------------------------------------------------------ leases

    def _mine(self, doc: WindowDoc) -> bool:
        return doc.owner == self._process_id and doc.epoch == self._epoch

    async def _owner_live(self, doc: WindowDoc, now: float) -> bool:
        """Is the document's owner process live? Known live owners cost no request."""
        return await self._live(doc.owner, doc.epoch, now)

    async def _live(self, owner: str, epoch: str, now: float) -> bool:
        """Is process ``owner`` in its opening ``epoch`` live, by its lease?"""
        if owner == self._process_id and epoch == self._epoch:
            return True
        lease = self._leases.get(owner)
        if lease is not None and lease.epoch == epoch and lease.live(now, self._skew):
            return True
        # Unknown, another epoch, or expired in the table: read the lease itself, from
        # the store's authority. The table and a plain get may come from a replica that
        # lags (docs/protocol.rst, "Stale reads"): a lease that looks lapsed there may
        # have been renewed, and counting its process dead would take its windows over.
        entry: KvEntry | None = await self._call(self._store.get_current, process_key(owner))
        lease = None
        if entry is not None and entry.value is not None:
            try:
                lease = _decode_lease(entry.value)
            except (ValueError, KeyError, TypeError):
                logger.warning("lease %s is unreadable; its process counts as dead", entry.key)
        if lease is None:
            self._leases.pop(owner, None)
            return False
        self._leases[owner] = lease
        return lease.epoch == epoch and lease.live(now, self._skew)

    def _can_take_over(self) -> bool:
        return trio.current_time() >= self._takeover_after

    def lease_held(self) -> bool:
        """Is this process's own lease still live, by its own clock, with the skew
        margin? If not, a peer may have taken its windows over."""
        return self._taken_by is None and self._wall() < self._lease_expires - self._skew

    def _check_not_taken(self) -> None:
        """Raise :exc:`ProcessIdTakenError` once another coordinator took our id."""
        if self._taken_by is not None:
            raise ProcessIdTakenError(
                f"process id {self._process_id!r} was taken by another coordinator "
                f"(epoch {self._taken_by.epoch}); this one (epoch {self._epoch}) is fenced: "
                f"two live coordinators must never share a process id"
            )

    def _foreign_lease(self, entry: KvEntry | None) -> _Lease | None:
        """The lease in ``entry`` if it is another epoch's (of our process id)."""
        if entry is None or entry.value is None:
            return None
        try:
            lease = _decode_lease(entry.value)
        except (ValueError, KeyError, TypeError):
            return None
        return lease if lease.epoch != self._epoch else None

    def _twin_wait(self, holder: _Lease) -> float:
        """Seconds to watch ``holder`` (a live lease of another epoch of our process
        id) for a renewal: its heartbeat interval (ours if it did not record one,
        capped at our lease) plus the skew margin."""
        beat = self.heartbeat_interval if holder.heartbeat is None else holder.heartbeat
        return min(beat, self._lease) + self._skew

    async def _check_twin(self) -> bool:
        """Before this opening's first lease write: may it write now?

        True when the process id is free: no lease, a released or lapsed one, or a
        live one of another epoch that was not renewed while watched for its holder's
        heartbeat interval plus the skew margin (a crashed or stalled predecessor; a
        stalled one is fenced at its next heartbeat). False while the watch goes on
        (the first call starts it; each call re-reads the lease once).

        Raises:
          ProcessIdTakenError: the watched lease was renewed (its revision moved): a
            live coordinator holds the process id. Nothing was written; this backend
            stays fenced.
          BackendError: the store failed the read.
        """
        self._check_not_taken()
        if self._id_cleared:
            return True
        entry = await self._get(self._process_key)
        foreign = self._foreign_lease(entry)
        wall = self._wall()
        now = trio.current_time()
        if entry is None or foreign is None or not foreign.live(wall, self._skew):
            self._twin_watch = None
            self._id_cleared = True
            return True
        watch = self._twin_watch
        if watch is None:
            # A live lease of another epoch: a live twin, or a predecessor that crashed
            # (or stalls) before its lease lapsed. Only a renewal tells them apart.
            until = min(
                now + self._twin_wait(foreign),
                # Lapsed (beyond the skew) before then: dead, whatever its interval.
                wall_to_trio(foreign.expires + self._skew, wall_now=wall, trio_now=now),
            )
            self._twin_watch = _TwinWatch(
                foreign.epoch,
                entry.revision,
                foreign.expires,
                until,
                max((until - now) / _TWIN_LOOKS, 1e-3),
            )
            logger.info(
                "process id %r: the lease of epoch %s is live; watching it for %.3g s for "
                "a renewal before this opening (epoch %s) starts",
                self._process_id,
                foreign.epoch,
                until - now,
                self._epoch,
            )
            return False
        if entry.revision != watch.revision or foreign.expires != watch.expires:
            self._twin_watch = None
            self._taken_by = foreign
            logger.error(
                "process id %r is held by a live coordinator (epoch %s renewed its lease): "
                "this one (epoch %s) is refused; two live coordinators must never share a "
                "process id",
                self._process_id,
                foreign.epoch,
                self._epoch,
            )
            raise ProcessIdTakenError(
                f"process id {self._process_id!r} is held by a live coordinator (epoch "
                f"{foreign.epoch}, whose lease was renewed while this one watched it); "
                f"this one (epoch {self._epoch}) is refused and wrote nothing: two live "
                f"coordinators must never share a process id"
            )
        if now < watch.until:
            return False
        logger.warning(
            "process id %r: the lease of epoch %s was not renewed for %.3g s; taking the "
            "process id over (that coordinator crashed or stalls; if it resumes, it is "
            "fenced at its next heartbeat)",
            self._process_id,
            watch.epoch,
            self._twin_wait(foreign),
        )
        self._twin_watch = None
        self._id_cleared = True
        return True

    async def wait_process_id_free(self) -> None:
        self._check_not_taken()
        while not await self._check_twin():
            watch = self._twin_watch
            assert watch is not None
            # A few looks during the watch, so a live twin is refused at its renewal
            # rather than at the end of the watch (the store has no watch to wait on).
            await trio.sleep_until(min(watch.until, trio.current_time() + watch.step))
        await trio.lowlevel.checkpoint()

    async def refresh_lease(self) -> set[str]:
        self._check_not_taken()
        seen = self._lease_writes
        async with self._lease_lock:
            if self._lease_writes != seen and self.lease_held():
                # Renewed by another caller while this one waited: that is enough.
                dead, self._dead_unreported = self._dead_unreported, set()
                return dead
            self._dead_unreported |= await self._refresh_lease()
            dead, self._dead_unreported = self._dead_unreported, set()
            return dead

    async def _refresh_lease(self) -> set[str]:
        """Write our lease (see :meth:`refresh_lease`); holds ``_lease_lock``."""
        self._check_not_taken()
        if not math.isfinite(self._lease_expires) and not await self._check_twin():
            # Never written in this opening, and a live lease of another epoch is being
            # watched (the start could not wait: the store did not answer then).
            assert self._twin_watch is not None
            raise BackendUnavailableError(
                f"process id {self._process_id!r}: the live lease of epoch "
                f"{self._twin_watch.epoch} is watched for a renewal for "
                f"{max(self._twin_watch.until - trio.current_time(), 0.0):.3g} s more "
                f"before this opening writes its own"
            )
        now = self._wall()
        lease = _Lease(
            self._process_id, self._epoch, now + self._lease, heartbeat=self.heartbeat_interval
        )
        value = _encode_lease(lease)
        for attempt in range(5):
            try:
                self._lease_revision = await self._call(
                    self._store.put, self._process_key, value, last=self._lease_revision
                )
                break
            except RevisionConflict:
                # Swept (absent), our own write whose answer was lost, or another
                # epoch's lease: a predecessor's (before our first write landed) or,
                # once one had, a later coordinator started with our id: we are fenced.
                entry = await self._get(self._process_key)
                foreign = self._foreign_lease(entry)
                if foreign is not None and math.isfinite(self._lease_expires):
                    self._taken_by = foreign
                    logger.error(
                        "process id %r was taken by another coordinator (epoch %s): this "
                        "one (epoch %s) is fenced and refuses pings; two live coordinators "
                        "must never share a process id",
                        self._process_id,
                        foreign.epoch,
                        self._epoch,
                    )
                    self._check_not_taken()
                if foreign is not None and (
                    self._replaced is None or foreign.expires > self._replaced.expires
                ):
                    self._replaced = foreign
                if foreign is not None and foreign.live(now, self._skew):
                    logger.warning(
                        "process id %r: replacing the live lease of epoch %s (a restart "
                        "before its lease lapsed; if that coordinator still runs, it is "
                        "fenced at its next heartbeat)",
                        self._process_id,
                        foreign.epoch,
                    )
                self._lease_revision = 0 if entry is None else entry.revision
                await self._backoff(attempt)
        else:
            raise BackendError(f"could not renew the lease of process {self._process_id!r}")
        self._lease_expires = lease.expires
        self._lease_writes += 1
        dead = await self.reload_leases()
        self._leases[self._process_id] = lease
        await self._apply_queued_deletes()
        return dead

    async def reload_leases(self) -> set[str]:
        """Re-read every process lease into the local table.

        Returns the processes that were live in the previous table and are now gone or
        lapsed (beyond the skew).
        """
        now = self._wall()
        table: dict[str, _Lease] = {}
        for entry in await self._call(self._store.entries, _LEASE_PREFIX):
            if entry.value is None:
                continue
            try:
                lease = _decode_lease(entry.value)
            except (ValueError, KeyError, TypeError):
                continue
            if entry.key != process_key(lease.process):
                continue  # another process's lease under this key: not evidence of either
            table[lease.process] = lease
        live = {
            (lease.process, lease.epoch) for lease in table.values() if lease.live(now, self._skew)
        }
        released = {(lease.process, lease.epoch) for lease in table.values() if lease.released}
        # Dead since the last look: lapsed or gone, or handed off (a process may have
        # come and gone between two looks: its released lease still says so).
        dead = {
            process
            for process, _ in (self._live_at_last_look - live) | (released - self._seen_released)
        }
        self._live_at_last_look = live
        self._seen_released = released
        self._leases = table
        return dead

    # ---------------------------------------------------------------- register

    def _window_state(self, doc: WindowDoc, waiting: bool) -> _engine.WindowState:
        """The engine's view of an open window's document: its times, count and
        accumulation, payloads deserialized ("last" and "first" keep the stored text)."""
        opts = _options_of(doc)
        trailing = doc.mode is Mode.TRAILING or (doc.mode is Mode.BOTH and doc.count > 1)
        cap = _engine.INF if doc.cap is None else doc.cap
        state = _engine.WindowState(doc.mode, doc.first, doc.at, cap, doc.payload, trailing, opts)
        state.count = doc.count
        state.waiting = waiting
        if opts is not None:
            state.best = doc.order
            state.max_order = doc.max_order
            state.held = doc.held
            if opts.payload_policy == "collect":
                values = self._load(doc.payload) or []
                state.acc = [(o, n, v) for (o, n), v in zip(doc.ranks, values, strict=True)]
                state.held = len(state.acc)
            elif opts.reducer:
                state.acc = self._load(doc.payload)
        return state

    def _apply_ping(
        self,
        doc: WindowDoc | None,
        owner_live: bool,
        now: float,
        mode: Mode,
        delay: float,
        max_delay: float | None,
        run_id: str,
        write: str,
        payload: str,
        max_count: int | None = None,
        payload_policy: str = "last",
        order_key: float | None = None,
        max_items: int | None = None,
        overflow: str | None = None,
        reducer: tuple[Reducer, InitialFactory | None] | None = None,
        queue: bool = False,
        run_timeout: float | None = None,
        drop_stale: bool = False,
        blocked_until: float | None = None,
    ) -> tuple[Registered, WindowDoc, float | None]:
        """Apply one ping to a window's document, as read (no I/O).

        Returns the outcome, the document to write (for ``stale``, the document as
        read: nothing is written) and, for a ``coalesced`` ping that moved the fire
        earlier than the owner armed, when to take it. ``blocked_until``: when the
        key's ``queue-latest`` run (``doc.running``) stops blocking for sure, or None
        if it does not block now (the caller reads its process's lease).

        Raises:
          ValueError: the ping's options differ from the open window's.
          WindowFull: the window holds ``max_items`` (or as much as the store takes)
            under ``overflow="fire-early"``: nothing to write; it fires first.
          Exception: whatever the reducer or the serializer raise.
        """
        if doc is None or doc.fired:
            running = None if doc is None or blocked_until is None else doc.running
            fired_order = None if doc is None else doc.fired_order
            if drop_stale and _stale(order_key, fired_order):
                assert doc is not None
                return Registered.STALE, doc, None
            window_opts = WindowOptions(
                max_count=max_count,
                payload_policy=payload_policy,
                max_items=max_items,
                overflow=overflow,
                overlap="queue-latest" if queue else "allow",
                run_timeout=run_timeout,
                ordered=order_key is not None,
            )
            # The engine decides the window's times and what it holds; the document
            # keeps the payloads serialized.
            first: Any = payload
            value: Any = None
            if payload_policy == "collect":
                first = self._serializer.loads(payload)
            elif reducer is not None:
                value = _engine.first_value(reducer, self._serializer.loads(payload))
            state = _engine.open_window(
                now,
                first,
                delay=delay,
                max_delay=max_delay,
                mode=mode,
                opts=None if window_opts == DEFAULT else window_opts,
                order=order_key,
                value=value,
            )
            ranks: tuple[tuple[float, int], ...] = ()
            held = 0
            if payload_policy == "collect":
                ranks = tuple((float(o), n) for o, n, _ in state.acc)
                payload = self._serializer.dumps([item[2] for item in state.acc])
            elif reducer is not None:
                payload = self._serializer.dumps(state.acc)
                held = state.held
            if _engine.leading(mode):
                # The leading fire happens with this write: its order key is fired.
                fired_order = _engine.fired_order_after(fired_order, order_key)
            at = state.deadline
            cap = None if state.cap == _engine.INF else state.cap
            new = WindowDoc(
                self._process_id,
                self._epoch,
                run_id,
                mode,
                delay,
                max_delay,
                now,
                now,
                at,
                cap,
                at,
                1,
                write,
                write,
                payload,
                max_count=max_count,
                payload_policy=payload_policy,
                ordered=order_key is not None,
                order=order_key,
                max_items=max_items,
                ranks=ranks,
                overflow=overflow,
                held=held,
                queue=queue,
                run_timeout=run_timeout,
                running=running,
                max_order=order_key,
                fired_order=fired_order,
                after=() if doc is None else ((doc.run_id, doc.write), *doc.after)[:_AFTER_KEEP],
            )
            return Registered.OPENED, new, None
        if doc.mode is not mode:
            raise ValueError(
                f"mode {mode.value!r} differs from the mode {doc.mode.value!r} of the open "
                f"window (run {doc.run_id})"
            )
        if doc.max_count != max_count:
            raise ValueError(
                f"max_count {max_count!r} differs from the max_count {doc.max_count!r} of the "
                f"open window (run {doc.run_id})"
            )
        if doc.payload_policy != payload_policy:
            raise ValueError(
                f"payload_policy {payload_policy!r} differs from the payload_policy "
                f"{doc.payload_policy!r} of the open window (run {doc.run_id})"
            )
        if doc.ordered != (order_key is not None):
            raise ValueError(
                f"the open window (run {doc.run_id}) was opened "
                + ("with an order_key: every ping of it needs one" if doc.ordered else
                   "without an order_key: its pings cannot carry one")
            )  # fmt: skip
        overlaps = ("allow", "queue-latest")
        for name, mine, theirs in (
            ("max_items", max_items, doc.max_items),
            ("overflow", overflow, doc.overflow),
            ("overlap", overlaps[queue], overlaps[doc.queue]),
            ("run_timeout", run_timeout, doc.run_timeout),
        ):
            if mine != theirs:
                raise ValueError(
                    f"{name} {mine!r} differs from the {name} {theirs!r} of the open window "
                    f"(run {doc.run_id})"
                )
        if drop_stale and _stale(order_key, doc.fired_order):
            return Registered.STALE, doc, None
        if doc.overflow == "fire-early" and doc.items >= (doc.max_items or 0):
            raise WindowFull(doc)
        # Waiting: due while the key's run blocks; pings join it and leave its time alone.
        waiting = doc.queue and blocked_until is not None and doc.at <= now
        # The engine applies the ping (its times, count and payload policy) to the
        # document's window, payloads deserialized; the document stores them serialized.
        state = self._window_state(doc, waiting)
        opts = state.opts
        policy_value: Any = payload  # "last" and "first" keep the stored text
        folded: Any = None
        if opts is not None and opts.payload_policy == "collect":
            policy_value = self._load(payload)
        elif reducer is not None:
            folded = reducer[0](state.acc, self._serializer.loads(payload))
        # A ping older than the window's latest (its write landed late) leaves the
        # latest ping's time standing, as if the pings had landed in time order; the
        # max_count ping makes the window due at the latest ping's time, and the next
        # ping, at that time or later, takes its fire and opens the next window.
        _engine.absorb(
            state, now, policy_value, delay=delay, order=order_key, value=folded, latest=doc.last
        )
        ranks = doc.ranks
        held = doc.held
        if opts is not None and opts.payload_policy == "collect":
            ranks = tuple((float(o), n) for o, n, _ in state.acc)
            payload = self._serializer.dumps([item[2] for item in state.acc])
        elif reducer is not None:
            payload = self._serializer.dumps(state.acc)
            held = state.held
        else:
            # A window whose stored payload is missing takes this ping's.
            payload = state.payload if state.payload is not None else payload
        at = state.deadline
        changes: dict[str, Any] = {
            "last": max(now, doc.last),
            "at": at,
            "count": state.count,
            "write": write,
            "payload": payload,
            "order": state.best if opts is not None else doc.order,
            "ranks": ranks,
            "held": held,
            "max_order": state.max_order if opts is not None else doc.max_order,
            "running": doc.running if blocked_until is not None else None,
        }
        if doc.accumulates:
            # Bounded by the store's size limit too: "fire-early" fires what the window
            # holds, "drop-oldest" drops more of the lowest items.
            limit = self._store.max_value_bytes
            items = state.acc
            while len(replace(doc, **changes).encode()) > limit:
                if doc.overflow == "fire-early":
                    raise WindowFull(doc)
                if len(items) <= 1:
                    break  # this payload alone is too large: the write refuses it
                del items[0]
                changes["ranks"] = tuple((float(o), n) for o, n, _ in items)
                changes["payload"] = self._serializer.dumps([item[2] for item in items])
        if self._mine(doc):
            return Registered.EXTENDED, replace(doc, armed=at, **changes), None
        if owner_live or not self._can_take_over():
            take_at = at if at < doc.armed and not waiting else None
            return Registered.COALESCED, replace(doc, **changes), take_at
        new = replace(doc, owner=self._process_id, epoch=self._epoch, armed=at, **changes)
        return Registered.TOOK_OVER, new, None

    async def register(
        self,
        workflow: str,
        key: str,
        *,
        mode: Mode,
        delay: float,
        max_delay: float | None,
        run_id: str,
        payload: Any = None,
        max_count: int | None = None,
        payload_policy: str = "last",
        order_key: float | None = None,
        max_items: int | None = None,
        overflow: str | None = None,
        reducer: tuple[Reducer, InitialFactory | None] | None = None,
        overlap: str = "allow",
        run_timeout: float | None = None,
        drop_stale: bool = False,
    ) -> Registration:
        self._check_not_taken()
        now = self._wall()  # the ping's time, kept through merges and retries
        try:
            kv_key = self._window_keys[workflow, key]
        except (KeyError, TypeError):  # TypeError: unhashable, window_key names it
            kv_key = window_key(workflow, key)
            if len(self._window_keys) >= _KNOWN_LIMIT:
                self._window_keys.clear()
            self._window_keys[workflow, key] = kv_key
        text = self._serializer.dumps(payload)
        limit = self._store.max_value_bytes
        if len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
            # Refused before anything is sent, naming the payload (the store's own
            # check would name only the document's key, and only after the fold).
            raise DocumentTooLargeError(
                f"payload of {workflow!r}/{key!r} is {len(text.encode('utf-8', 'surrogatepass'))}"
                f" bytes serialized, more than the {limit} bytes a window's document may hold"
            )
        if self._json and type(payload) in _JSON_SCALARS:
            own = payload  # what JSON gives back, without parsing it again
        else:
            own = self._serializer.loads(text)
        deadline = trio.current_time() + self._op_timeout
        if not self._lease_revision:
            # Peers must see our lease before a document names us as owner.
            with trio.CancelScope(shield=True), trio.move_on_at(deadline):
                await self.refresh_lease()
            if not self._lease_revision:
                raise BackendUnavailableError(
                    f"could not write the lease of process {self._process_id!r} within "
                    f"{self._op_timeout} s"
                )
        ping = _Ping(
            mode,
            delay,
            max_delay,
            run_id,
            text,
            own,
            max_count,
            payload_policy,
            order_key,
            max_items,
            deadline,
            overflow,
            reducer,
            overlap == "queue-latest",
            run_timeout,
            drop_stale,
            now=now,
        )
        # Group commit: the pings of a key that arrive while a write of it is in flight
        # wait for it, then go out together, in arrival order, in the next write (led
        # by whichever of their calls runs first).
        queue = self._queues.get(kv_key)
        if queue is None:
            queue = self._queues[kv_key] = _KeyQueue()
        queue.waiting.append(ping)
        # Merged, the ping cannot be withdrawn: its write may be in flight. Its waits
        # refuse cancellation (_park), and a write goes out under a shield.
        while ping.result is None:
            if queue.writing:
                await _park(ping)
                continue
            queue.writing = True
            batch: list[_Ping] = []
            with trio.CancelScope(shield=True):
                try:
                    if kv_key in self._answered:
                        # Right after a write of the key: two scheduling rounds first
                        # (no timer), so that the calls it answered that ping again
                        # join this write instead of waiting for the next one. They
                        # run in the round after their answer, maybe after this task.
                        self._answered.discard(kv_key)
                        await trio.lowlevel.cancel_shielded_checkpoint()
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    batch, queue.waiting = queue.waiting, []
                    queue.waiting[:0] = await self._commit(workflow, key, kv_key, batch)
                except BaseException as exc:
                    for other in batch:
                        if other.result is None:
                            _settle(other, exc)
                    raise
                finally:
                    self._release_turn(kv_key, queue)
                    if len(self._answered) >= _KNOWN_LIMIT:
                        self._answered.clear()
                    self._answered.add(kv_key)
        result = ping.result
        if isinstance(result, BaseException):
            if ping.taken:
                # The fires it took are committed: never lost with the ping. Without a
                # coordinator's hook, they are logged for the caller to find in the
                # store (a fire record it holds, under at-least-once).
                logger.warning(
                    "register %s failed after taking %d due fire(s): %s",
                    kv_key,
                    len(ping.taken),
                    result,
                )
            raise result
        assert result is not None
        return result

    async def _commit(
        self, workflow: str, key: str, kv_key: str, batch: list[_Ping]
    ) -> list[_Ping]:
        """Write the pings of ``batch`` (one key, arrival order) by one compare-and-swap.

        Settles each ping it writes or refuses (its ``result``: a Registration or the
        exception its call raises) and returns the pings left for the next write. The
        batch is bounded by its oldest ping's deadline; a write whose answer was lost
        then gets one more ``op_timeout`` to be recognised by a re-read of its write id
        (see :doc:`/protocol`, "Group commit").
        """
        write = uuid.uuid4().hex
        deadline = batch[0].deadline
        last_doc: WindowDoc | None = None
        last_live = False
        error: BackendError | None = None
        rest: list[_Ping] = []
        #: The pings of the write whose answer was lost, their outcomes, its take time,
        #: and until when the window it wrote waits for its key's queue-latest run.
        sent: tuple[list[tuple[_Ping, Registered]], float | None, float | None] | None = None
        base = -1  # the revision that write expected
        in_flight = ambiguous = resolving = False
        while True:
            with trio.move_on_at(deadline):
                attempt = 0
                while True:
                    try:
                        known = None if ambiguous else self._cached(kv_key)
                        if known is None:
                            _, revision, doc = await self._read(kv_key)
                            if ambiguous:
                                ambiguous = False
                                assert sent is not None
                                if doc is not None and (
                                    write == doc.opened_by or (not doc.fired and write == doc.write)
                                ):
                                    # The write had landed (the window it opened, even
                                    # if peers have written since, or fired it: its
                                    # pings are in that fire; or its revision). Writing
                                    # again would open a second window of the run.
                                    self._settle_batch(
                                        kv_key, sent[0], doc, sent[1], revision, sent[2]
                                    )
                                    return rest
                                if resolving and revision == base:
                                    break  # it did not land, and the deadline has passed
                        else:
                            revision, doc = known
                        now = self._wall()
                        live = (
                            doc is not None and not doc.fired and await self._owner_live(doc, now)
                        )
                        last_doc, last_live = doc, live
                        # Until when the key's queue-latest run blocks its next fire.
                        blocked = None
                        if doc is not None and doc.running is not None:
                            blocked = await self._blocked_until(doc.running, now)
                        applied = self._apply_batch(
                            doc, live, now, batch, write, known is not None, blocked
                        )
                        if applied is None:
                            # Refused, stale or full on a remembered document: re-read.
                            self._forget(kv_key)
                            continue
                        pings, new, take_at, rest = applied
                        if not pings and rest:
                            # The first ping is at or after the window's due time: it
                            # never joins it. Take its fire (a compare-and-swap, as a
                            # taker), then apply the pings again: they open the next
                            # window (or, if the take lost, meet what a peer wrote).
                            assert new is not None
                            taker, rest = rest[0], []
                            await self._take_due(
                                workflow, key, kv_key, new, revision, taker, deadline
                            )
                            continue
                        if not pings:
                            return rest  # every ping was refused, dropped or overflowed
                        assert new is not None
                        waits = None
                        if blocked is not None and new.queue and new.at <= now:
                            waits = blocked  # the owner looks again then
                        sent, base = (pings, take_at, waits), revision
                        in_flight = True
                        new_revision = await self._call(
                            self._store.put, kv_key, new.encode(), last=revision
                        )
                        in_flight = False
                    except RevisionConflict:
                        in_flight = False
                        self._contend(kv_key)
                        self.conflicts += 1
                        logger.debug("register %s: revision conflict, retrying", kv_key)
                    except DocumentTooLargeError as exc:
                        in_flight = False
                        assert sent is not None
                        if len(sent[0]) == 1:
                            _settle(sent[0][0][0], exc)
                            return rest
                        # Too large merged: write its pings one at a time.
                        for ping, _ in sent[0]:
                            ping.alone = True
                        return [ping for ping, _ in sent[0]] + rest
                    except BackendUnavailableError as exc:
                        self._forget(kv_key)
                        ambiguous = ambiguous or in_flight  # the write may have landed
                        in_flight = False
                        error = exc
                    except BackendError as exc:
                        # Refused permissions, a misconfigured store: every ping raises it.
                        for ping in batch:
                            if ping.result is None:
                                _settle(ping, exc)
                        return rest
                    else:
                        self._remember(kv_key, new_revision, new)
                        self._settle_batch(kv_key, pings, new, take_at, new_revision, waits)
                        return rest
                    await self._backoff(attempt)
                    attempt += 1
            if in_flight:  # the deadline cut the write short: it may have landed
                in_flight = False
                ambiguous = True
                self._forget(kv_key)
            if ambiguous and not resolving:
                # Never fail open beside a write that may have landed: re-read first.
                resolving = True
                deadline = trio.current_time() + self._op_timeout
                continue
            break
        waiting = [ping for ping in batch if ping.result is None and ping not in rest]
        if (
            last_doc is not None
            and not last_doc.fired
            and last_live
            and not self._mine(last_doc)
            and last_doc.mode is not Mode.LEADING
            and not last_doc.accumulates
            and error is None
            and all(ping.now is None or ping.now < last_doc.at for ping in waiting)
        ):
            # Contention until the deadline, but a live owner has a fire pending that
            # comes after these pings' arrival: absorbed without a write.
            self.unstored_coalesces += len(waiting)
            logger.warning(
                "register %s: no write won within %.3g s; coalesced %d pings into the live "
                "window of process %s without storing them",
                kv_key,
                self._op_timeout,
                len(waiting),
                last_doc.owner,
            )
            for ping in waiting:
                _settle(
                    ping,
                    Registration(
                        Registered.COALESCED,
                        last_doc.run_id,
                        last_doc.mode,
                        last_doc.at,
                        last_doc.first,
                        last_doc.count,
                        stored=False,
                        payload=ping.own,
                    ),
                )
            return rest
        for ping in waiting:
            _settle(
                ping,
                BackendUnavailableError(
                    f"register of {workflow!r}/{key!r} did not complete within "
                    f"{self._op_timeout} s" + (f": {error}" if error is not None else "")
                ),
            )
        return rest

    async def _take_due(
        self,
        workflow: str,
        key: str,
        kv_key: str,
        doc: WindowDoc,
        revision: int,
        ping: _Ping,
        deadline: float,
    ) -> bool:
        """Take the fire of ``doc``, a window that ``ping`` found due at its time (see
        :doc:`/protocol`, "A ping at or after the due time"), while this call holds
        the key's turn: the finalize of a taker (fire record first under
        at-least-once, then the tombstone, each a compare-and-swap), bounded by the
        batch's ``deadline``. A fire it commits goes to the coordinator's hook at once
        (else into ``ping.taken``). Returns True if it fired; False if the window was
        gone or changed (the caller re-reads and applies the pings again).

        Raises:
          BackendUnavailableError: the store did not answer in time (a commit whose
            answer was lost is proven or taken back later, see ``_Unproven``).
          BackendError: any other failure of the store.
        """
        # Shielded from the batch's deadline scope: the finalize keeps its own (the
        # same deadline), so that a commit cut short is recorded as unproven.
        try:
            with trio.CancelScope(shield=True):
                result = await self._finalize(
                    workflow,
                    key,
                    kv_key,
                    doc.run_id,
                    True,
                    False,
                    self._ping_delivery,
                    False,
                    deadline=deadline,
                    read=(revision, doc),
                )
        except DocumentTooLargeError as exc:
            # Its fire record cannot be stored (a window written by something else, or
            # a payload near the store's limit): no one can commit this fire, so the
            # ping joins the window (as its owner or a takeover) instead of failing.
            logger.warning("register %s: cannot take the due fire (%s); joining it", kv_key, exc)
            ping.joins_due = True
            self._forget(kv_key)
            return False
        if result.outcome is not Finalized.FIRE:
            self._forget(kv_key)
            return False
        self.taken_fires += 1
        hook = self._taken_hook
        if hook is not None:
            hook(workflow, key, result)
        else:
            ping.taken.append(result)
        return True

    def _release_turn(self, kv_key: str, queue: _KeyQueue) -> None:
        """End a write of ``kv_key``: hand the key's turn to a waiting finalize (it stays
        taken), else to the next batch of pings."""
        if queue.finalizers:
            queue.finalizers.pop(0).set()
            return
        queue.writing = False
        if queue.waiting:
            _wake(queue.waiting[0])  # it leads the next write
        elif self._queues.get(kv_key) is queue:
            del self._queues[kv_key]

    @contextlib.asynccontextmanager
    async def _turn(self, kv_key: str) -> AsyncIterator[None]:
        """Take ``kv_key``'s turn to write (for a finalize): this process's pings of the
        key wait meanwhile, so they never make its commit conflict."""
        queue = self._queues.get(kv_key)
        if queue is None:
            queue = self._queues[kv_key] = _KeyQueue()
        if queue.writing:
            turn = trio.Event()
            queue.finalizers.append(turn)
            try:
                await turn.wait()  # handed over by the write before
            except BaseException:
                if turn.is_set():
                    self._release_turn(kv_key, queue)
                else:
                    queue.finalizers.remove(turn)
                raise
        else:
            queue.writing = True
        try:
            yield
        finally:
            self._release_turn(kv_key, queue)

    def _apply_batch(
        self,
        doc: WindowDoc | None,
        live: bool,
        now: float,
        batch: list[_Ping],
        write: str,
        remembered: bool,
        blocked: float | None = None,
    ) -> tuple[list[tuple[_Ping, Registered]], WindowDoc | None, float | None, list[_Ping]] | None:
        """Apply the unsettled pings of ``batch`` to ``doc`` in order (``_apply_ping``
        each, as if written one after the other; ``blocked`` as it takes it).

        Returns the pings applied with their outcomes, the document to write, the take
        time, and the pings left for the next write: a ping that opens a leading or
        both-edges window goes alone (its leading fire carries its own payload), and so
        does one marked ``alone``. A ping that writes nothing is settled on its own,
        the others go on: refused (ValueError, or whatever its reducer or the
        serializer raise) with the error; ``drop_stale`` and stale with its ``stale``
        registration; into a full ``fire-early`` window with an ``overflowed`` one (or,
        after pings of this write, left for the next write, so that the window it fires
        holds them). Each of these decisions is made on a fresh read: on a
        ``remembered`` document (it may be stale) the result is None instead.

        Each ping is applied at its own time (``ping.now``; ``now`` for a ping without
        one). A ping at or after the due time of the window as the pings before it
        left it never joins that window: the pings before it are written, and it and
        the rest are left for the next write; if it is the first, nothing is applied
        and the result is ``([], doc, None, rest)`` with that due ``doc``: the caller
        takes its fire, then applies the rest to what that leaves.
        """
        applied: list[tuple[_Ping, Registered]] = []
        take_at: float | None = None
        pending = [ping for ping in batch if ping.result is None]
        fold = 0  # pending[:fold] are applied already (by _fold_plain)
        for index, ping in enumerate(pending):
            if index < fold:
                continue
            at = now if ping.now is None else ping.now
            if not ping.joins_due and _due_at(doc, at, blocked):
                return applied, doc, take_at, pending[index:]
            if applied and ping.alone:
                return applied, doc, take_at, pending[index:]
            if ping.plain and not ping.alone and _plain_window(doc, ping.mode):
                assert doc is not None
                folded = self._fold_plain(doc, live, now, pending, index, write, blocked)
                if folded is not None:
                    fold, doc, take_at, outcome = folded
                    applied.extend((other, outcome) for other in pending[index:fold])
                    if outcome is not Registered.COALESCED:
                        live = True
                    continue
            try:
                outcome, new, take = self._apply_ping(
                    doc,
                    live,
                    at,
                    ping.mode,
                    ping.delay,
                    ping.max_delay,
                    ping.run_id,
                    write,
                    ping.text,
                    ping.max_count,
                    ping.payload_policy,
                    ping.order_key,
                    ping.max_items,
                    ping.overflow,
                    ping.reducer,
                    ping.queue,
                    ping.run_timeout,
                    ping.drop_stale,
                    blocked,
                )
            except WindowFull as full:
                if remembered:
                    return None
                if applied:
                    return applied, doc, take_at, pending[index:]
                # Nothing written: the caller fires the full window, then pings again.
                _settle(
                    ping,
                    Registration(
                        Registered.COALESCED,
                        full.doc.run_id,
                        full.doc.mode,
                        full.doc.at,
                        full.doc.first,
                        full.doc.count,
                        stored=False,
                        overflowed=True,
                    ),
                )
                continue
            except Exception as exc:  # options that differ, a reducer that raises
                if remembered:
                    return None
                _settle(ping, exc)
                continue
            if outcome is Registered.STALE:
                if remembered:
                    return None
                _settle(ping, self._stale_registration(new, blocked, at))
                continue
            applied.append((ping, outcome))
            doc, take_at = new, take
            if outcome is not Registered.COALESCED:
                live = True  # ours from now on
            if ping.alone or (outcome is Registered.OPENED and ping.mode is not Mode.TRAILING):
                return applied, doc, take_at, pending[index + 1 :]
        return applied, doc, take_at, []

    def _fold_plain(
        self,
        doc: WindowDoc,
        live: bool,
        now: float,
        pending: list[_Ping],
        start: int,
        write: str,
        blocked: float | None,
    ) -> tuple[int, WindowDoc, float | None, Registered] | None:
        """Apply the plain pings ``pending[start:end]`` (a run of them, up to the first
        ping that is not plain or has another mode) to the open plain window ``doc``
        at once: one document instead of one per ping, the same as ``_apply_ping``
        for each in turn (tests/test_group_commit.py checks it against that).

        Returns ``end``, the document, the take time (as the run's last ping left it)
        and the outcome every ping of the run gets; None if the run would take the
        window over (``_apply_ping`` takes that ping alone, then the run is ours).
        """
        mine = self._mine(doc)
        if not mine and not live and self._can_take_over():
            return None
        end = start
        mode = doc.mode
        state = self._window_state(doc, False)
        latest = doc.last
        while end < len(pending):
            ping = pending[end]
            if not ping.plain or ping.alone or ping.mode is not mode:
                break
            t = now if ping.now is None else ping.now
            if not _engine.absorbs(state, t):
                break  # due at its time (the first ping was checked by the caller)
            # An older ping (landed late) leaves the latest one's time alone.
            _engine.absorb(state, t, ping.text, delay=ping.delay, latest=latest)
            latest = max(latest, t)
            end += 1
        at = state.deadline
        changes: dict[str, Any] = {
            "last": latest,
            "at": at,
            "count": state.count,
            "write": write,
            "payload": state.payload,
            "order": None,
            "running": doc.running if blocked is not None else None,
        }
        if mine:
            return end, replace(doc, armed=at, **changes), None, Registered.EXTENDED
        take_at = at if at < doc.armed else None
        return end, replace(doc, **changes), take_at, Registered.COALESCED

    def _stale_registration(
        self, doc: WindowDoc, blocked: float | None, now: float
    ) -> Registration:
        """The result of a ``drop_stale`` ping that was dropped (nothing written)."""
        if doc.fired:
            return Registration(Registered.STALE, "", doc.mode, doc.at, doc.first, 0)
        waiting = blocked is not None and doc.queue and doc.at <= now
        return Registration(
            Registered.STALE,
            doc.run_id,
            doc.mode,
            blocked if waiting and blocked is not None else doc.at,
            doc.first,
            doc.count,
            waiting=waiting,
        )

    async def _blocked_until(self, marker: RunMarker, now: float) -> float | None:
        """Until when (wall clock) the ``queue-latest`` run ``marker`` surely blocks its
        key's next fire: its ``until``, or its process's lease expiry (plus the skew)
        if that comes first, when it is looked at again; None if it blocks no more
        (timed out, or its process is dead)."""
        if marker.until is not None and now >= marker.until:
            return None
        mine = marker.process == self._process_id and marker.epoch == self._epoch
        if mine and marker.run_id in self._ended_runs:
            return None
        if not await self._live(marker.process, marker.epoch, now):
            return None
        if marker.process == self._process_id and marker.epoch == self._epoch:
            expires = self._lease_expires
        else:
            lease = self._leases.get(marker.process)
            expires = now if lease is None else lease.expires
        # A live runner renews its lease every heartbeat: look no sooner than that.
        look = max(expires + self._skew, now + self.heartbeat_interval)
        return look if marker.until is None else min(marker.until, look)

    def _disown(self, kv_key: str, run_id: str) -> None:
        """Forget that this process owns window ``kv_key`` under ``run_id`` (and only
        under that run: a stale task's finalize must not forget a newer window)."""
        if self._owned.get(kv_key) == run_id:
            del self._owned[kv_key]
        if self._known_counts.get(kv_key, ("",))[0] == run_id:
            del self._known_counts[kv_key]

    def _know_count(self, kv_key: str, run_id: str, count: int) -> None:
        """Record that the coordinator was told window ``kv_key`` (``run_id``) holds
        ``count`` pings."""
        known = self._known_counts.get(kv_key)
        if known is None or known[0] != run_id or known[1] < count:
            self._known_counts[kv_key] = (run_id, count)

    def _settle_batch(
        self,
        kv_key: str,
        pings: list[tuple[_Ping, Registered]],
        doc: WindowDoc,
        take_at: float | None,
        revision: int,
        waits: float | None = None,
    ) -> None:
        """Answer the pings of a write that landed; tracks what this process owns.

        Every ping of the write reports the window as that write left it (count, due
        time, payload), whatever order their tasks wake in; each its own outcome. A
        window that ``waits`` for its key's ``queue-latest`` run reports ``waiting``,
        and that time as ``scheduled_at`` (when the owner looks again).
        """
        if doc.payload_policy != "last" or doc.ordered:
            payload = self._load(doc.payload)  # the window's payload, not a ping's
        else:
            payload = pings[-1][0].own  # the last ping's: the one stored
        if self._mine(doc):
            self._owned[kv_key] = doc.run_id
            self._know_count(kv_key, doc.run_id, doc.count)
        else:
            self._disown(kv_key, doc.run_id)
        token = self._token(revision)
        # The pings of one outcome share one (immutable) result: the coordinator
        # recognises a merged ping's by it and skips repeating its local bookkeeping.
        results: dict[Registered, Registration] = {}
        for ping, outcome in pings:
            if outcome is Registered.TOOK_OVER:
                self.takeovers += 1
            result = results.get(outcome)
            if result is None:
                result = results[outcome] = Registration(
                    outcome,
                    doc.run_id,
                    doc.mode,
                    doc.at if waits is None else waits,
                    doc.first,
                    doc.count,
                    True,
                    take_at if outcome is Registered.COALESCED else None,
                    payload,
                    token,
                    waiting=waits is not None,
                )
            if ping.taken:
                # Its own result: the fires it took are the caller's to run.
                _settle(ping, result._replace(taken=tuple(ping.taken)))
                continue
            _settle(ping, result)

    def _load(self, text: str | None) -> Any:
        """A stored payload, deserialized (None if none was stored, or if it cannot be
        deserialized: written by something else, or by another serializer; logged)."""
        if text is None:
            return None
        try:
            return self._serializer.loads(text)
        except (Exception, RecursionError) as exc:
            logger.warning(
                "a stored payload (%d chars) cannot be deserialized (%s: %.80s); "
                "the handler gets None",
                len(text),
                type(exc).__name__,
                exc,
            )
            return None

    def _token(self, revision: int) -> int:
        """The fencing token of a step that committed at ``revision``."""
        return self._token_base | revision

    # ---------------------------------------------------------------- finalize

    def _commits(
        self, doc: WindowDoc | None, run_id: str, take: bool, force: bool, early: bool
    ) -> bool:
        """Would a finalize of ``run_id`` commit a fire on ``doc`` as it is? (Not sure
        while the key's ``queue-latest`` run may block it: that is read afresh.)"""
        return (
            doc is not None
            and not doc.fired
            and doc.run_id == run_id
            and (take or self._mine(doc))
            and (force or doc.at <= self._wall())
            and (early or not doc.queue or doc.running is None)
        )

    async def finalize(
        self,
        workflow: str,
        key: str,
        run_id: str,
        *,
        take: bool = False,
        force: bool = False,
        delivery: Delivery = "at-least-once",
        early: bool = False,
    ) -> Finalization:
        kv_key = window_key(workflow, key)
        async with self._turn(kv_key):
            return await self._finalize(workflow, key, kv_key, run_id, take, force, delivery, early)

    async def _finalize(
        self,
        workflow: str,
        key: str,
        kv_key: str,
        run_id: str,
        take: bool,
        force: bool,
        delivery: Delivery,
        early: bool,
        deadline: float = math.inf,
        read: tuple[int, WindowDoc | None] | None = None,
    ) -> Finalization:
        error: BackendError | None = None
        if self._taken_by is not None:
            # Fenced (a later coordinator took our process id): never fire on a window
            # remembered from before; the live coordinator adopts it as a dead one's.
            self._disown(kv_key, run_id)
            return Finalization(Finalized.ABANDONED)
        # The commit in flight, in case its answer is lost: (window, write id, time,
        # fire record id). Each attempt has its own ids: a record taken back after a
        # conflict leaves a delete marker that a second create would conflict with.
        committing: tuple[WindowDoc, str, float, str] | None = None
        if delivery == "at-least-once":
            # A commit of this run whose answer was lost before: prove it first.
            committing = self._take_unproven(kv_key, run_id)
        fired_at = self._wall()
        with trio.move_on_at(min(trio.current_time() + self._op_timeout, deadline)):
            attempt = 0
            while True:
                try:
                    # Commit against the revision this process last read or wrote when
                    # it has one (the compare-and-swap proves it current); any other
                    # decision is made on a fresh read.
                    known = None if committing is not None else self._cached(kv_key)
                    if read is not None:
                        # The register that takes this fire has just read the document
                        # (a contended key is not cached): commit against that.
                        known, read = (read if committing is None else None), None
                    if known is not None:
                        revision, doc = known
                        if not self._commits(doc, run_id, take, force, early):
                            known = None
                    if known is None:
                        entry, revision, doc = await self._read(kv_key)
                        if committing is not None:
                            proven = await self._proven(kv_key, entry, doc, committing, delivery)
                            if proven is not None:
                                return proven
                            committing = None
                    if doc is None or doc.fired or doc.run_id != run_id:
                        self._disown(kv_key, run_id)
                        return Finalization(Finalized.ABANDONED)
                    if not take and not self._mine(doc):
                        self._disown(kv_key, run_id)
                        return Finalization(Finalized.ABANDONED)
                    now = self._wall()
                    if doc.queue and doc.running is not None and not early:
                        blocked = await self._blocked_until(doc.running, now)
                        if blocked is not None and (force or doc.at <= now):
                            # Due (or flushed) while its key's run blocks: it waits,
                            # and is looked at again when the run may have stopped.
                            if doc.at > now:
                                due = replace(doc, at=now, armed=now)
                                self._remember(
                                    kv_key,
                                    await self._call(
                                        self._store.put, kv_key, due.encode(), last=revision
                                    ),
                                    due,
                                )
                            return Finalization(
                                Finalized.RESCHEDULE, blocked, doc.count, doc.first, doc.mode
                            )
                    if not force and doc.at > now:
                        if take:
                            if doc.at >= doc.armed:
                                return Finalization(Finalized.ABANDONED)  # the owner wakes
                            self._know_count(kv_key, run_id, doc.count)
                            return Finalization(
                                Finalized.RESCHEDULE, doc.at, doc.count, doc.first, doc.mode
                            )
                        if doc.armed != doc.at:
                            # Record when we wake, so a ping that moves the fire earlier
                            # than that knows to take it.
                            armed = replace(doc, armed=doc.at)
                            self._remember(
                                kv_key,
                                await self._call(
                                    self._store.put, kv_key, armed.encode(), last=revision
                                ),
                                armed,
                            )
                        self._know_count(kv_key, run_id, doc.count)
                        return Finalization(
                            Finalized.RESCHEDULE, doc.at, doc.count, doc.first, doc.mode
                        )
                    if not take and not self.lease_held():
                        # Paused past our own lease: a peer may have taken the window
                        # over. The compare-and-swap below would catch that, but renew
                        # first so that peers stop treating us as dead.
                        await self.refresh_lease()
                        self._forget(kv_key)
                        continue
                    fired_at = now if force else doc.at
                    if not force and doc.queue:
                        # It may have waited for a run: one that timed out (at its
                        # `until`), or whose process died or whose end was recorded late
                        # (noticed now).
                        marker = doc.running
                        released = now
                        if marker is not None and marker.until is not None:
                            released = min(now, marker.until)
                        fired_at = max(doc.at, released)
                    write = uuid.uuid4().hex
                    fire_id = _FIRE_PREFIX + write
                    committing = (doc, write, fired_at, fire_id)
                    tombstone = self._tombstone(doc, write, fired_at)
                    if tombstone is None:
                        # Both modes leave a tombstone naming this commit's write id
                        # (the sweeper removes it a lease later), so a commit whose
                        # answer was lost is proven by a read, never guessed from a
                        # gone window (a peer's fire would look the same).
                        tombstone = replace(doc, fired=True, write=write)
                    if delivery == "at-most-once":
                        revision = await self._call(
                            self._store.put, kv_key, tombstone.encode(), last=revision
                        )
                        self._remember(kv_key, revision, tombstone)
                        return self._fire(kv_key, doc, fired_at, self._token(revision), None)
                    record = self._fire_record(workflow, key, doc, fired_at, 1, write)
                    record_revision = await self._call(
                        self._store.put, fire_id, record.encode(), last=0
                    )
                    self._fire_records[fire_id] = record_revision
                    try:
                        closed = await self._commit_window(kv_key, tombstone, revision)
                    except RevisionConflict:
                        # A ping landed after our read: take the record back, re-read.
                        await self._drop_record(fire_id)
                        raise
                    self._remember(kv_key, closed, tombstone)
                    # The token of the commit: the record's revision, later than every
                    # write of the window (its leading fire's included).
                    return self._fire(kv_key, doc, fired_at, self._token(record_revision), fire_id)
                except RevisionConflict:
                    self._contend(kv_key)
                    self.conflicts += 1
                    committing = None
                except BackendUnavailableError as exc:
                    self._forget(kv_key)
                    error = exc
                await self._backoff(attempt)
                attempt += 1
        if delivery == "at-most-once":
            # Not ours to delete at exit any more: the window stays in the store for
            # our reconcile (or, once we are gone, a peer) unless the fire committed.
            self._disown(kv_key, run_id)
            raise BackendUnavailableError(
                f"finalize of {workflow!r}/{key!r} (run {run_id}) could not prove its fire "
                f"within {self._op_timeout} s" + (f": {error}" if error is not None else "")
            )
        lapsed = not take and not self.lease_held()
        told = self._known_counts.get(kv_key)
        known_count = told[1] if told is not None and told[0] == run_id else 0
        # A both-edges window that the owner knew with one ping: its unconfirmed fire
        # has no trailing edge, but the commit, if it landed, fired one (peers' pings
        # landed): that fire is the record's to run, not to delete.
        missed_trailing = (
            committing is not None
            and committing[0].mode is Mode.BOTH
            and known_count < 2 <= committing[0].count
        )
        unproven = committing is not None and (take or lapsed or missed_trailing)
        if committing is not None and unproven:
            # No one fires this commit now: it is proven (and fired) or taken back by
            # the next finalize of this run, or by the next adopt_orphans.
            window, write, at, fire_id = committing
            self._unproven.setdefault(kv_key, []).append(
                _Unproven(workflow, key, window, write, at, fire_id)
            )
        if lapsed:
            raise LeaseLapsedError(
                f"finalize of {workflow!r}/{key!r} (run {run_id}) did not complete within "
                f"{self._op_timeout} s and this process's lease has lapsed: not fired "
                "on its own view" + (f": {error}" if error is not None else "")
            )
        if not take:
            # The owner fires unconfirmed; once the store answers, delete the window
            # (unless pings landed since) and the fire record this call may have left
            # (unless it is the proof of a fire the unconfirmed one did not run).
            replaced = self._queued_deletes.get(kv_key)
            if replaced is not None and replaced.fire_id is not None:
                # Its record still goes, with the next heartbeat's deletes.
                self._queued_record_deletes.add(replaced.fire_id)
            self._queued_deletes[kv_key] = _QueuedDelete(
                kv_key,
                run_id,
                fired_at,
                committing[3] if committing is not None and not unproven else None,
                known_count,
            )
        raise BackendUnavailableError(
            f"finalize of {workflow!r}/{key!r} (run {run_id}) did not complete within "
            f"{self._op_timeout} s" + (f": {error}" if error is not None else "")
        )

    def _take_unproven(self, kv_key: str, run_id: str) -> tuple[WindowDoc, str, float, str] | None:
        """Remove and return the lost commit of run ``run_id`` of ``kv_key``, if any."""
        pending = self._unproven.get(kv_key)
        if not pending:
            return None
        for i, unproven in enumerate(pending):
            if unproven.window.run_id == run_id:
                del pending[i]
                if not pending:
                    del self._unproven[kv_key]
                return unproven.window, unproven.write, unproven.fired_at, unproven.fire_id
        return None

    async def _settle_unproven(self) -> list[OrphanFire]:
        """Decide the lost commits that no finalize proved since (see _Unproven): a
        fire whose record is still this process's and whose window is gone (or is our
        tombstone) committed, and is returned to be run (its first attempt); a window
        still open, or fired by another write, means it did not: the record is taken
        back. Skipped while our lease has lapsed (a peer may adopt the records)."""
        fires: list[OrphanFire] = []
        if not self._unproven or not self.lease_held():
            return fires
        for kv_key in list(self._unproven):
            # The key's turn: a finalize of it cannot commit between our two reads.
            async with self._turn(kv_key):
                while self._unproven.get(kv_key):
                    unproven = self._unproven[kv_key].pop(0)
                    try:
                        fire = await self._settle_one(kv_key, unproven)
                    except BaseException:
                        self._unproven.setdefault(kv_key, []).insert(0, unproven)
                        raise
                    if fire is not None:
                        fires.append(fire)
                if kv_key in self._unproven and not self._unproven[kv_key]:
                    del self._unproven[kv_key]
        return fires

    def _orphan(self, fire_id: str, record: _FireRecord, attempt: int, revision: int) -> OrphanFire:
        """Fire record ``fire_id`` as a fire to run (``attempt``), whose fencing token
        is the record's write at ``revision``."""
        return OrphanFire(
            fire_id,
            record.workflow,
            record.key,
            record.run_id,
            self._load(record.payload),
            record.count,
            record.first,
            record.at,
            attempt,
            self._token(revision),
        )

    async def _settle_one(self, kv_key: str, unproven: _Unproven) -> OrphanFire | None:
        read = await self._read_record(unproven.fire_id)
        if read is None:
            return None  # the record never landed (nor, then, the commit)
        entry, record = read
        if not self._own_record(record):
            return None  # a peer took us for dead and adopted it: it runs it
        doc = self._parse(await self._get(kv_key))
        run_id = unproven.window.run_id
        if not _commit_landed(doc, run_id, unproven.write):
            # Still open (its owner fires it), or closed by another write.
            with contextlib.suppress(RevisionConflict):
                await self._remove_record(unproven.fire_id, entry.revision)
            return None
        self._fire_records[unproven.fire_id] = entry.revision
        logger.info(
            "fire %s of %s (run %s) committed though its answer was lost; running it",
            unproven.fire_id,
            kv_key,
            run_id,
        )
        return self._orphan(unproven.fire_id, record, record.attempt, entry.revision)

    async def _proven(
        self,
        kv_key: str,
        entry: KvEntry | None,
        doc: WindowDoc | None,
        committing: tuple[WindowDoc, str, float, str],
        delivery: Delivery,
    ) -> Finalization | None:
        """After a commit whose answer was lost: the fire, if the re-read proves it."""
        window, write, fired_at, fire_id = committing
        if delivery == "at-most-once":
            if entry is not None and doc is not None and doc.fired and doc.write == write:
                return self._fire(kv_key, window, fired_at, self._token(entry.revision), None)
            return None  # not proven: never fire on a guess (the caller re-reads)
        # at-least-once: our fire record decides.
        read = await self._read_record(fire_id)
        if read is None:
            return None  # the record never landed: start over
        record, mine = read
        if not self._own_record(mine):
            # A peer took us for dead and adopted the record: it runs the fire.
            return Finalization(Finalized.ABANDONED)
        self._fire_records[fire_id] = record.revision
        landed = _commit_landed(doc, window.run_id, write)
        if landed is False:
            # The run was closed by another write (a peer took the fire; its tombstone
            # or a newer window's after names it, or the tombstone is gone): ours
            # never landed.
            await self._drop_record(fire_id)
            return None
        if landed is None:
            assert doc is not None  # the run's window, still open
            if doc.write != window.write:
                # A ping landed after our read, so our commit cannot have: take the
                # record back and decide again.
                await self._drop_record(fire_id)
                return None
            assert entry is not None
            self._forget(kv_key)
            tombstone = self._tombstone(window, write, fired_at) or replace(
                window, fired=True, write=write
            )
            try:  # the record landed, the window's commit did not: finish it
                closed = await self._commit_window(kv_key, tombstone, entry.revision)
            except RevisionConflict:
                await self._drop_record(fire_id)
                return None
            self._remember(kv_key, closed, tombstone)
        return self._fire(kv_key, window, fired_at, self._token(record.revision), fire_id)

    def _tombstone(self, doc: WindowDoc, write: str, fired_at: float) -> WindowDoc | None:
        """The document that commits ``doc``'s fire when the key's state must outlive
        the window (None: the window is deleted): a tombstone (``fired``) with the
        running state of this fire's ``queue-latest`` run, and the highest order key
        fired for the key."""
        pending = doc.mode is Mode.TRAILING or (doc.mode is Mode.BOTH and doc.count >= 2)
        fired_order = doc.fired_order
        top = doc.max_order if doc.max_order is not None else doc.order
        if pending and top is not None:
            fired_order = top if fired_order is None else max(fired_order, top)
        running = doc.running
        if doc.queue and pending:
            until = None if doc.run_timeout is None else fired_at + doc.run_timeout
            running = RunMarker(self._process_id, self._epoch, doc.run_id, until)
        if running is None and fired_order is None:
            return None
        return replace(doc, fired=True, write=write, running=running, fired_order=fired_order)

    async def _commit_window(self, kv_key: str, tombstone: WindowDoc | None, last: int) -> int:
        """Close a window by a revision-checked delete, or by writing its tombstone;
        returns the revision written (the delete marker's, or the tombstone's)."""
        if tombstone is None:
            revision: int = await self._call(self._store.delete, kv_key, last=last)
        else:
            revision = await self._call(self._store.put, kv_key, tombstone.encode(), last=last)
        return revision

    def _fire_record(
        self, workflow: str, key: str, doc: WindowDoc, fired_at: float, attempt: int, write: str
    ) -> _FireRecord:
        return _FireRecord(
            self._process_id,
            self._epoch,
            workflow,
            key,
            doc.run_id,
            doc.payload,
            doc.count,
            doc.first,
            fired_at,
            attempt,
            write,
        )

    async def _read_record(self, fire_id: str) -> tuple[KvEntry, _FireRecord] | None:
        """Fire record ``fire_id`` as stored, or None if it is gone or unreadable."""
        entry = await self._get(fire_id)
        if entry is None or entry.value is None:
            return None
        try:
            return entry, _FireRecord.decode(entry.value)
        except (ValueError, KeyError, TypeError):
            return None

    def _own_record(self, record: _FireRecord) -> bool:
        """Is ``record`` this process's, in this opening (not adopted by a peer)?"""
        return record.owner == self._process_id and record.epoch == self._epoch

    async def _remove_record(self, fire_id: str, revision: int) -> None:
        """Remove fire record ``fire_id`` at ``revision``, leaving no delete marker:
        fire ids are never reused, so markers would only pile up in the bucket.

        Raises:
          RevisionConflict: the record had moved on (a peer adopted it) or was gone.
        """
        if not await self._call(self._store.purge, fire_id, last=revision):
            raise RevisionConflict(f"fire record {fire_id} is no longer at revision {revision}")

    async def _drop_record(self, fire_id: str) -> None:
        revision = self._fire_records.pop(fire_id, None)
        if revision is not None:
            with contextlib.suppress(RevisionConflict):
                await self._remove_record(fire_id, revision)

    def _fire(
        self,
        kv_key: str,
        doc: WindowDoc,
        fired_at: float,
        token: int,
        fire_id: str | None,
    ) -> Finalization:
        self._disown(kv_key, doc.run_id)
        return Finalization(
            Finalized.FIRE,
            fired_at,
            doc.count,
            doc.first,
            doc.mode,
            doc.last,
            self._load(doc.payload),
            token,
            fire_id,
            doc.queue,
            doc.run_id,
        )

    async def end_run(self, workflow: str, key: str, run_id: str) -> str | None:
        kv_key = window_key(workflow, key)
        self._ended_runs.add(run_id)
        try:
            with trio.move_on_after(self._op_timeout):
                # This process's pings of the key wait meanwhile (they would make the
                # compare-and-swap conflict).
                async with self._turn(kv_key):
                    attempt = 0
                    while True:
                        try:
                            return await self._end_run(kv_key, run_id)
                        except RevisionConflict:
                            self._contend(kv_key)
                            self.conflicts += 1
                        except BackendUnavailableError:
                            self._forget(kv_key)
                        await self._backoff(attempt)
                        attempt += 1
        except BackendError:
            self._forget(kv_key)
        # Retried by heartbeats; meanwhile peers see the run blocking until its
        # run_timeout or until they look again (see docs/protocol.rst).
        self._queued_end_runs[kv_key] = run_id
        logger.warning("could not record the end of run %s of %s; retrying", run_id, kv_key)
        return None

    async def _end_run(self, kv_key: str, run_id: str) -> str | None:
        # Written against the remembered document when it names this run (the
        # compare-and-swap proves it current); any other decision on a fresh read.
        known = self._cached(kv_key)
        if known is None or not self._names_run(known[1], run_id):
            _, revision, doc = await self._read(kv_key)
        else:
            revision, doc = known
        if doc is None or not self._names_run(doc, run_id):
            self._ended_runs.discard(run_id)
            return None
        ended: WindowDoc | None = None
        if not doc.fired or doc.fired_order is not None or doc.after:
            ended = replace(doc, running=None)
        self._remember(kv_key, await self._commit_window(kv_key, ended, revision), ended)
        self._ended_runs.discard(run_id)
        if not doc.fired and doc.queue and doc.at <= self._wall():
            return doc.run_id  # waiting for this run: it fires now
        return None

    def _names_run(self, doc: WindowDoc | None, run_id: str) -> bool:
        """Does ``doc`` hold ``run_id`` as its key's ``queue-latest`` run of this process?"""
        marker = None if doc is None else doc.running
        return (
            marker is not None
            and marker.run_id == run_id
            and (marker.process, marker.epoch) == (self._process_id, self._epoch)
        )

    async def _delete_own_record(self, fire_id: str) -> None:
        """Delete fire record ``fire_id`` if it exists and is still this process's."""
        read = await self._read_record(fire_id)
        if read is None:
            return
        entry, record = read
        if self._own_record(record):
            with contextlib.suppress(RevisionConflict):
                await self._remove_record(fire_id, entry.revision)
        self._fire_records.pop(fire_id, None)

    async def complete(self, fire_id: str) -> None:
        revision = self._fire_records.get(fire_id)
        if revision is None:
            return
        try:
            with trio.move_on_after(self._op_timeout) as scope:
                await self._remove_record(fire_id, revision)
        except RevisionConflict:
            # Adopted by a peer that thought us dead: it runs the fire again (documented).
            logger.warning("fire record %s was taken over before its handler finished", fire_id)
        except BackendUnavailableError:
            self._queued_completions.add(fire_id)
            return
        else:
            if scope.cancelled_caught:
                self._queued_completions.add(fire_id)
                return
        self._fire_records.pop(fire_id, None)
        self._queued_completions.discard(fire_id)

    async def _apply_queued_deletes(self) -> None:
        """Apply deletes queued by finalizes that could not reach the store.

        Several calls may run at once (the heartbeat's, and those of finalizes that
        renew a lapsed lease): each entry is dropped only by the call that finds it
        still queued, and never when a newer finalize has queued another delete for
        the same key meanwhile."""
        for kv_key, queued in list(self._queued_deletes.items()):
            if self._queued_deletes.get(kv_key) is not queued:
                continue  # applied by a concurrent call, or replaced
            entry = await self._get(kv_key)
            doc = self._parse(entry)
            if (
                doc is not None
                and not doc.fired
                and doc.run_id == queued.run_id
                and self._mine(doc)
            ):
                assert entry is not None
                # A both-edges window that the owner knew with one ping had no
                # trailing fire; if peers' pings landed, it still needs one.
                missed_trailing = doc.mode is Mode.BOTH and queued.known_count < 2 <= doc.count
                if doc.last <= queued.fired_at and not missed_trailing:
                    self._forget(kv_key)
                    try:
                        await self._commit_window(kv_key, doc.closed(), entry.revision)
                    except RevisionConflict:
                        continue  # a ping landed: try again next heartbeat
                    logger.info("applied the queued delete of %s (run %s)", kv_key, queued.run_id)
                # else: pings landed after the unconfirmed fire (or a trailing fire
                # was missed); the window stays and the owner's reconcile re-arms it,
                # so they are not lost.
            if queued.fire_id is not None:
                await self._delete_own_record(queued.fire_id)
            if self._queued_deletes.get(kv_key) is queued:
                del self._queued_deletes[kv_key]
        for fire_id in list(self._queued_record_deletes):
            await self._delete_own_record(fire_id)
            self._queued_record_deletes.discard(fire_id)
        for fire_id in list(self._queued_completions):
            await self.complete(fire_id)
        for kv_key, run_id in list(self._queued_end_runs.items()):
            # Read first: the heartbeat does not take the key's turn.
            self._forget(kv_key)
            try:
                await self._end_run(kv_key, run_id)
            except RevisionConflict:
                self._forget(kv_key)
                continue
            del self._queued_end_runs[kv_key]

    # ---------------------------------------------------------- cancel & co

    async def cancel(self, workflow: str, key: str) -> bool:
        kv_key = window_key(workflow, key)
        with trio.move_on_after(self._op_timeout):
            attempt = 0
            while True:
                entry = await self._get(kv_key)
                doc = self._parse(entry)
                if entry is None or entry.value is None or (doc is not None and doc.fired):
                    return False
                self._forget(kv_key)
                try:
                    tombstone = None if doc is None else doc.closed()
                    await self._commit_window(kv_key, tombstone, entry.revision)
                except RevisionConflict:
                    self.conflicts += 1
                    await self._backoff(attempt)
                    attempt += 1
                    continue
                self._owned.pop(kv_key, None)
                return True
        raise BackendUnavailableError(
            f"cancel of {workflow!r}/{key!r} did not complete within {self._op_timeout} s"
        )

    async def owned_windows(self) -> list[OwnedWindow]:
        owned = []
        for entry in await self._call(self._store.entries, _WINDOW_PREFIX):
            doc = self._parse(entry)
            if doc is None or doc.fired or not self._mine(doc):
                continue
            try:
                workflow, key = parse_window_key(entry.key)
            except ValueError:
                continue
            self._owned[entry.key] = doc.run_id
            self._remember(entry.key, entry.revision, doc)
            owned.append(
                OwnedWindow(workflow, key, doc.run_id, doc.mode, doc.at, doc.first, doc.count)
            )
        return owned

    async def _proves_a_record(self, doc: WindowDoc) -> bool:
        """Does a fire record whose commit tombstone ``doc`` proves (its own write's, or
        one in its ``after``) still exist? Read from the store's authority: a listing
        may come from a replica that lags, and sweeping the proof of a committed
        record would have it taken back (a lost fire)."""
        for write in (doc.write, *(proof_write for _, proof_write in doc.after)):
            entry = await self._call(self._store.get_current, _FIRE_PREFIX + write)
            if entry is not None and entry.value is not None:
                return True
        return False

    async def sweep(self) -> int:
        now = self._wall()
        entry = await self._get(SWEEPER_KEY)
        holder: _Lease | None = None
        if entry is not None and entry.value is not None:
            try:
                holder = _decode_lease(entry.value)
            except (ValueError, KeyError, TypeError):
                holder = None
        if (
            holder is not None
            and holder.process != self._process_id
            and now <= holder.expires + self._skew
        ):
            return 0
        lock = _Lease(self._process_id, self._epoch, now + 3 * self._lease)
        try:
            await self._call(
                self._store.put,
                SWEEPER_KEY,
                _encode_lease(lock),
                last=0 if entry is None else entry.revision,
            )
        except RevisionConflict:
            return 0  # another process won the election
        removed = 0
        windows = await self._call(self._store.entries, _WINDOW_PREFIX)
        # Listed after the windows: a record whose commit made a tombstone listed
        # above was written before it, so it is in this listing unless completed.
        records = await self._call(self._store.entries, _FIRE_PREFIX)
        recorded = set()  # the window keys that fire records name
        for item in records:
            if item.value is not None:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    record = _FireRecord.decode(item.value)
                    recorded.add(window_key(record.workflow, record.key))
        for item in windows:
            marker = item.revision if item.value is None else None
            if marker is None:
                doc = self._parse(item)
                if doc is None or not doc.fired or doc.last > now - self._lease:
                    continue
                if doc.fired_order is not None and doc.last > now - _ORDER_LEASES * self._lease:
                    continue  # drop_stale still reads its last fired order key
                if item.key in recorded:
                    continue  # the proof that decides a fire record of the key
                if doc.running is not None and await self._blocked_until(doc.running, now):
                    continue  # its run still blocks the key
                if await self._proves_a_record(doc):
                    # The same, for a record the listing missed: kept until the record
                    # is completed or taken back. Last: up to five leader reads.
                    continue
                # An at-most-once tombstone a lease old: its proof is no longer needed.
                self._forget(item.key)
                try:
                    marker = await self._call(self._store.delete, item.key, last=item.revision)
                except RevisionConflict:
                    continue
            known = self._known.get(item.key)
            if known is not None and known[0] == marker:
                self._forget(item.key)  # purged: the key is created anew
            if await self._call(self._store.purge_marker, item.key, revision=marker):
                removed += 1
        for item in records:
            if item.value is None and await self._call(
                self._store.purge_marker, item.key, revision=item.revision
            ):
                removed += 1
        # A lease that expired long ago (ten leases) belongs to a dead process.
        grave = now - 10 * self._lease - self._skew
        for item in await self._call(self._store.entries, _LEASE_PREFIX):
            if item.value is None:
                if await self._call(self._store.purge_marker, item.key, revision=item.revision):
                    removed += 1
                continue
            try:
                lease = _decode_lease(item.value)
            except (ValueError, KeyError, TypeError):
                continue
            if lease.expires < grave:
                try:
                    marker = await self._call(self._store.delete, item.key, last=item.revision)
                except RevisionConflict:
                    continue
                if await self._call(self._store.purge_marker, item.key, revision=marker):
                    removed += 1
                self._leases.pop(lease.process, None)
        return removed

    async def adopt_orphans(self, workflows: Collection[str]) -> Orphans:
        self._check_not_taken()
        orphans = Orphans([], await self._settle_unproven(), [])
        adopting = self._can_take_over()
        now = self._wall()
        for entry in await self._call(self._store.entries, _WINDOW_PREFIX):
            doc = self._parse(entry)
            if doc is None or doc.fired:
                continue
            try:
                workflow, key = parse_window_key(entry.key)
            except ValueError:
                continue
            if self._mine(doc):
                self._owned[entry.key] = doc.run_id
                self._remember(entry.key, entry.revision, doc)
                orphans.owned.append(
                    OwnedWindow(workflow, key, doc.run_id, doc.mode, doc.at, doc.first, doc.count)
                )
                continue
            if not adopting or workflow not in workflows or await self._owner_live(doc, now):
                continue
            # The owner died with the window open: take it over as it is (no ping).
            new = replace(
                doc,
                owner=self._process_id,
                epoch=self._epoch,
                armed=doc.at,
                write=uuid.uuid4().hex,
            )
            try:
                revision = await self._call(
                    self._store.put, entry.key, new.encode(), last=entry.revision
                )
            except RevisionConflict:
                continue  # a peer adopted it, or a ping took it over
            self._remember(entry.key, revision, new)
            self.takeovers += 1
            self._owned[entry.key] = doc.run_id
            logger.info(
                "adopted window %s (run %s) of dead process %s", entry.key, doc.run_id, doc.owner
            )
            adopted_window = OwnedWindow(
                workflow, key, doc.run_id, doc.mode, doc.at, doc.first, doc.count
            )
            orphans.windows.append(adopted_window)
            orphans.owned.append(adopted_window)
        if not adopting:
            return orphans  # the grace after an outage: no takeover yet
        for entry in await self._call(self._store.entries, _FIRE_PREFIX):
            if entry.value is None:
                continue
            try:
                record = _FireRecord.decode(entry.value)
            except (ValueError, KeyError, TypeError):
                logger.warning("fire record %s is unreadable; leaving it", entry.key)
                continue
            if record.workflow not in workflows or await self._live(
                record.owner, record.epoch, now
            ):
                continue
            if (
                record.owner == self._process_id
                and self._replaced is not None
                and self._replaced.live(now, self._skew)
            ):
                # An earlier coordinator with our process id, whose lease we replaced,
                # may still be running this fire (a twin runs until its next heartbeat
                # fences it, and completes what it started): adopted once its lease
                # lapsed, as any process's, so a live twin's fire never runs twice.
                continue
            window = self._parse(await self._get(window_key(record.workflow, record.key)))
            if (
                window is not None
                and not window.fired
                and window.run_id == record.run_id
                and window.first == record.first
            ):
                # The owner died between writing the record and deleting the window:
                # the fire never committed, and the window (adopted, or to be) fires
                # it. Running the record too would run the burst twice.
                with contextlib.suppress(RevisionConflict):
                    await self._remove_record(entry.key, entry.revision)
                continue
            if (
                record.write is not None
                and _commit_landed(window, record.run_id, record.write) is False
            ):
                # The run's proof names another commit (a peer took the fire), or is
                # gone (see _commit_landed): this record's commit never landed.
                with contextlib.suppress(RevisionConflict):
                    await self._remove_record(entry.key, entry.revision)
                continue
            adopted = replace(
                record, owner=self._process_id, epoch=self._epoch, attempt=record.attempt + 1
            )
            try:
                revision = await self._call(
                    self._store.put, entry.key, adopted.encode(), last=entry.revision
                )
            except RevisionConflict:
                continue
            self.adopted_fires += 1
            self._fire_records[entry.key] = revision
            logger.info(
                "adopted interrupted fire %s (run %s, attempt %d) of dead process %s",
                entry.key,
                record.run_id,
                adopted.attempt,
                record.owner,
            )
            # The token: this attempt's commit, later than the first's.
            orphans.fires.append(self._orphan(entry.key, record, adopted.attempt, revision))
        return orphans

    async def window_status(self, workflow: str, key: str) -> WindowStatus | None:
        entry = await self._get(window_key(workflow, key))
        doc = self._parse(entry)
        if doc is None or doc.fired:
            return None
        assert entry is not None
        now = self._wall()
        waiting = (
            doc.queue
            and doc.running is not None
            and doc.at <= now
            and await self._blocked_until(doc.running, now) is not None
        )
        return WindowStatus(
            doc.run_id,
            doc.mode,
            doc.owner,
            await self._owner_live(doc, now),
            doc.first,
            doc.last,
            None if waiting else doc.at,
            doc.cap,
            doc.count,
            entry.revision,
            self._token(entry.revision),
        )

    async def handoff(self) -> None:
        if self._released:
            return
        self._released = True
        # The lease is marked released (not deleted), so that peers see the hand-off at
        # their next look even if they never saw this process alive; the sweeper
        # deletes it ten leases later.
        lease = _Lease(
            self._process_id,
            self._epoch,
            self._wall(),
            released=True,
            heartbeat=self.heartbeat_interval,
        )
        try:
            with trio.move_on_after(self._op_timeout):
                with contextlib.suppress(RevisionConflict):
                    await self._call(
                        self._store.put,
                        self._process_key,
                        _encode_lease(lease),
                        last=self._lease_revision,
                    )
        except BackendError as exc:
            logger.warning(
                "hand-off could not mark the lease released (%s); peers take over %d "
                "windows once it lapses",
                exc,
                len(self._owned),
            )

    async def release(self, runs: Collection[str] | None = None) -> None:
        if self._released:
            return
        self._released = True
        try:
            with trio.move_on_after(self._op_timeout) as scope:
                await self._apply_queued_deletes()
                for kv_key, run_id in list(self._owned.items()):
                    if runs is not None and run_id not in runs:
                        continue  # left for a peer to adopt once our lease is gone
                    entry = await self._get(kv_key)
                    doc = self._parse(entry)
                    if (
                        doc is not None
                        and not doc.fired
                        and doc.run_id == run_id
                        and self._mine(doc)
                    ):
                        assert entry is not None
                        self._forget(kv_key)
                        try:
                            await self._commit_window(kv_key, doc.closed(), entry.revision)
                        except RevisionConflict:
                            logger.warning("release of %s lost a race to another write", kv_key)
                    del self._owned[kv_key]
                    self._known_counts.pop(kv_key, None)
                if self._lease_revision:
                    with contextlib.suppress(RevisionConflict):
                        await self._call(
                            self._store.delete, self._process_key, last=self._lease_revision
                        )
            if scope.cancelled_caught:
                logger.warning("release did not finish within %.3g s", self._op_timeout)
        except BackendError as exc:
            logger.warning(
                "release could not reach the backend (%s); %d windows stay until a ping "
                "takes them over",
                exc,
                len(self._owned),
            )
