"""The documents of the protocol, as stored: window documents, process leases and fire
records, their JSON encodings, the schema versions and the key prefixes.

Every decoder raises only ValueError, KeyError or TypeError on a document it cannot
read (what its callers catch); see :doc:`/protocol`, "Documents".
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, replace
from typing import Any

from .. import _codec, _validate
from .._flow import Flow, FlowSpec
from .._keys import WINDOW_PREFIX
from .._types import Mode

SCHEMA_VERSION = 1
#: The version of a window document that uses the first window options (``max_count``,
#: ``payload_policy="first"``, order keys); documents without them stay version 1, so
#: processes that predate them keep reading those. Readers accept both.
WINDOW_SCHEMA_OPTIONS = 2
#: The version of a window document that needs the later options: a named reducer,
#: ``overflow="fire-early"``, ``overlap="queue-latest"`` (and the running state of its
#: runs), or the last fired order key that ``drop_stale`` reads. A version-2 reader
#: would misread those, so they are written as version 3; readers take 1, 2 and 3.
WINDOW_SCHEMA_RUNS = 3
#: The version of a flow-control window's document (throttle, audit, batch, rate limit:
#: its ``flow`` object). A version-3 reader would take it for a debounce window and
#: fire it by the wrong rules, so it refuses it (ValueError) instead; readers take 1-4.
WINDOW_SCHEMA_FLOW = 4
_BUILTIN_POLICIES = ("last", "first", "collect")
SWEEPER_KEY = "s.sweeper"
LEASE_PREFIX = "p."
WINDOW_KEY_PREFIX = WINDOW_PREFIX + "."
FIRE_PREFIX = "f."
#: How many tombstones before it a window names in ``after``.
AFTER_KEEP = 4
#: How many write ids before its latest a key's document keeps in ``writes``.
WRITES_KEEP = 6


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
    #: latest first (at most ``AFTER_KEEP``): the proof of how each of those runs was
    #: committed, kept (in this window's tombstone too) so that a fire record of such
    #: a run is decided by it after its tombstone is gone (see ``_rules.commit_landed``).
    #: Any schema version; older readers ignore it.
    after: tuple[tuple[str, str], ...] = ()
    #: True in the tombstone a cancel writes (with ``fired``): the window was closed
    #: without a fire. Its owner counts a cancel when it reads it (an older reader
    #: ignores the field and takes the tombstone for a peer's fire: it abandons the
    #: window, no fire either way). Any schema version.
    cancelled: bool = False
    #: The flow-control window's parameters (version 4), None for a debounce window.
    flow: FlowSpec | None = None
    #: A rate-limit window's fires so far (its opening's leading fire included).
    flow_fires: int = 0
    #: A batch's size, bytes: the sum of its items' serialized lengths.
    size: int = 0
    #: A throttle's cool-down, kept in the tombstone of a trailing fire: until when
    #: (wall clock) a ping opens a window without a leading fire.
    cool_until: float | None = None
    #: A both-edges throttle's first ping after its leading fire (its trailing fire's
    #: ``first_ping_at``).
    since: float | None = None
    #: The key's write ids before ``write`` (its pings', its commits', across its
    #: windows), the latest first (at most ``WRITES_KEEP``): a write whose answer was
    #: lost is recognised by a re-read after others wrote on top of it, its window's
    #: commit and newer windows included (``Answers.landed``). Any schema version;
    #: older readers ignore it (and drop it when they write).
    writes: tuple[str, ...] = ()

    def history(self, write: str) -> tuple[str, ...]:
        """``writes`` for a ping's write ``write`` into this window: this document's
        ``write`` goes first (unless it is ``write``: pings of one batch share it)."""
        if write == self.write:
            return self.writes
        return (self.write, *self.writes)[:WRITES_KEEP]

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
        write = uuid.uuid4().hex
        return replace(self, fired=True, write=write, writes=self.history(write))

    def cancel_tombstone(self) -> WindowDoc:
        """What a cancel from outside the owner writes (``Coordinator.cancel`` of a
        peer's window, ``trio-debounce cancel``): a tombstone that says the window
        closed without a fire, under a new write id, never a bare delete. The owner
        reads it as a cancel (``StoreView.note_cancelled``), and a ping whose opening
        answer was lost recognises its run in it (no second window of the run); the
        sweeper removes it as any tombstone."""
        write = uuid.uuid4().hex
        return replace(self, fired=True, cancelled=True, write=write, writes=self.history(write))

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
        if self.cancelled:
            extra["cancelled"] = True
        if self.writes:
            extra["writes"] = list(self.writes)
        if self.flow is not None:
            extra["flow"] = _encode_flow(self)
            version = WINDOW_SCHEMA_FLOW
        elif v3:
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
        """Parse a document; raises ValueError for anything but a valid version 1 to 4."""
        obj = _codec.strict_loads(raw)
        versions = (SCHEMA_VERSION, WINDOW_SCHEMA_OPTIONS, WINDOW_SCHEMA_RUNS, WINDOW_SCHEMA_FLOW)
        if not isinstance(obj, dict) or obj.get("v") not in versions:
            raise ValueError("not a version 1, 2, 3 or 4 window document")
        max_count = None
        policy = "last"
        ordered = False
        order = None
        max_items = None
        ranks: tuple[tuple[float, int], ...] = ()
        extra: dict[str, Any] = {}
        if obj["v"] >= WINDOW_SCHEMA_OPTIONS:
            v3 = obj["v"] >= WINDOW_SCHEMA_RUNS
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
            if not isinstance(after, list) or not 0 < len(after) <= AFTER_KEEP:
                raise ValueError(f"bad after {after!r}")
            proofs = []
            for proof in after:
                if (
                    not isinstance(proof, list)
                    or len(proof) != 2
                    or not all(isinstance(part, str) for part in proof)
                ):
                    raise ValueError(f"bad after {after!r}")
                proofs.append((_codec.utf8("after", proof[0]), _codec.utf8("after", proof[1])))
            extra["after"] = tuple(proofs)
        if obj.get("cancelled", False) is True:
            extra["cancelled"] = True
        writes = obj.get("writes")
        if writes is not None:
            if (
                not isinstance(writes, list)
                or len(writes) > WRITES_KEEP
                or not all(isinstance(w, str) for w in writes)
            ):
                raise ValueError(f"bad writes {writes!r}")
            extra["writes"] = tuple(_codec.utf8("writes", w) for w in writes)
        if obj["v"] == WINDOW_SCHEMA_FLOW:
            extra.update(_decode_flow(obj.get("flow")))
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
            payload=_codec.opt_string(obj, "payload"),
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
        if doc.flow is not None and doc.queue:
            # overlap="queue-latest" is stored as for any window (queue, run_timeout).
            doc = replace(doc, flow=replace(doc.flow, queue=True, run_timeout=doc.run_timeout))
        if doc.flow is not None and not _fits(doc.flow, doc):
            raise ValueError(f"a {doc.flow.flow.value} flow in a {doc.mode.value} window")
        return doc


def _encode_flow(doc: WindowDoc) -> dict[str, Any]:
    spec = doc.flow
    assert spec is not None
    obj: dict[str, Any] = {"kind": spec.flow.value, "span": spec.span}
    if spec.flow is Flow.THROTTLE:
        obj["trailing"] = spec.trailing
        if doc.since is not None:
            obj["since"] = doc.since
        if doc.cool_until is not None:
            obj["cool_until"] = doc.cool_until
    elif spec.flow is Flow.BATCH:
        obj["max_items"] = spec.max_items
        if spec.max_bytes is not None:
            obj["max_bytes"] = spec.max_bytes
            obj["size"] = doc.size
    elif spec.flow is Flow.RATE_LIMIT:
        obj["limit"] = spec.limit
        obj["fires"] = doc.flow_fires
    return obj


def _decode_flow(obj: Any) -> dict[str, Any]:
    """The WindowDoc fields of a version-4 document's ``flow`` object."""
    if not isinstance(obj, dict):
        raise ValueError(f"bad flow {obj!r}")
    kind = Flow(obj["kind"])
    span = _num(obj, "span")
    if not span > 0:
        raise ValueError(f"bad flow span {span!r}")
    fields: dict[str, Any] = {}
    if kind is Flow.THROTTLE:
        trailing = obj["trailing"]
        if not isinstance(trailing, bool):
            raise ValueError(f"bad flow trailing {trailing!r}")
        spec = FlowSpec(kind, span, leading=True, trailing=trailing)
        for name in ("since", "cool_until"):
            if obj.get(name) is not None:
                fields[name] = _num(obj, name)
    elif kind is Flow.AUDIT:
        spec = FlowSpec(kind, span, leading=False, trailing=True)
    elif kind is Flow.BATCH:
        max_bytes = obj.get("max_bytes")
        spec = FlowSpec(
            kind,
            span,
            max_items=_positive(obj.get("max_items")),
            max_bytes=None if max_bytes is None else _positive(max_bytes),
        )
        if max_bytes is not None:
            fields["size"] = _count(obj.get("size"))
    else:
        spec = FlowSpec(kind, span, limit=_positive(obj.get("limit")))
        fields["flow_fires"] = _count(obj.get("fires"))
    fields["flow"] = spec
    return fields


def _fits(spec: FlowSpec, doc: WindowDoc) -> bool:
    """Is ``doc`` the debounce window ``spec``'s flow is stored as (a forged or
    corrupt document may say otherwise)? A throttle's cool-down is a trailing window."""
    if spec.queue and spec.flow not in (Flow.AUDIT, Flow.BATCH):
        return False
    if spec.flow is Flow.THROTTLE:
        allowed = (Mode.BOTH, Mode.TRAILING) if spec.trailing else (Mode.LEADING,)
        return doc.mode in allowed and doc.payload_policy == "last"
    if spec.flow is Flow.AUDIT:
        return doc.mode is Mode.TRAILING and doc.payload_policy == "last"
    if spec.flow is Flow.BATCH:
        return doc.mode is Mode.TRAILING and doc.payload_policy == "collect"
    return doc.mode is Mode.LEADING and doc.payload_policy == "last"


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"bad count {value!r}")
    return value


def _positive(value: Any) -> int:
    if _count(value) < 1:
        raise ValueError(f"bad count {value!r}")
    return int(value)


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
    return _codec.string(obj, name, nonempty=True)


def _num(obj: dict[str, Any], name: str) -> float:
    return float(_codec.number(obj, name))


class WindowFull(Exception):
    """Raised by a ping into a window that holds ``max_items`` under
    ``overflow="fire-early"``: the window fires first (see :class:`Registration`)."""

    def __init__(self, doc: WindowDoc) -> None:
        super().__init__(f"window {doc.run_id} is full")
        self.doc = doc


@dataclass(frozen=True, slots=True)
class Lease:
    process: str
    epoch: str
    expires: float
    #: Handed off: the process left, its windows are for peers to take at once.
    released: bool = False
    #: The holder's heartbeat interval, seconds: how long a newcomer with the same
    #: process id watches this lease for a renewal. None in leases written before
    #: it was recorded (or holding no usable value): the reader uses its own.
    heartbeat: float | None = None
    #: Draining: the process is leaving (a hand-off exit waiting for its running
    #: handlers): it renews the lease, but its windows are for peers to take now
    #: (never its fire records, nor its queue-latest runs). Older readers ignore it.
    draining: bool = False
    #: The holder's process lease, seconds: each write sets ``expires`` this far
    #: ahead, so an operator's listing tells the age of the last beat. None in leases
    #: written before it was recorded. Older readers ignore it.
    seconds: float | None = None

    def live(self, now: float, skew: float) -> bool:
        return not self.released and now <= self.expires + skew


def decode_lease(raw: bytes) -> Lease:
    obj = _codec.strict_loads(raw)
    if not isinstance(obj, dict) or obj.get("v") != SCHEMA_VERSION:
        raise ValueError("not a version 1 lease")
    heartbeat = _validate.advisory_seconds(obj.get("beat"))
    return Lease(
        _str(obj, "process"),
        _str(obj, "epoch"),
        _num(obj, "expires"),
        obj.get("released", False) is True,
        heartbeat,
        obj.get("draining", False) is True,
        _validate.advisory_seconds(obj.get("lease")),
    )


def encode_lease(lease: Lease) -> bytes:
    doc: dict[str, object] = {
        "v": SCHEMA_VERSION,
        "process": lease.process,
        "epoch": lease.epoch,
        "expires": lease.expires,
        "released": lease.released,
    }
    if lease.heartbeat is not None:
        doc["beat"] = lease.heartbeat  # optional: older readers ignore it
    if lease.draining:
        doc["draining"] = True  # optional: older readers ignore it (they wait)
    if lease.seconds is not None:
        doc["lease"] = lease.seconds  # optional: older readers ignore it
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


#: The most flush requests a control document keeps (the oldest go first): a bound
#: on its size, far above what one heartbeat interval of an operator's commands makes.
CONTROL_KEEP = 64


@dataclass(frozen=True, slots=True)
class FlushRequest:
    """A request that the owner of window ``(workflow, key)`` fire run ``run_id`` now
    (``trio-debounce flush``), kept in the owner's control document (``c.<process>``)
    until its heartbeat reads it; ``at`` is when it was made (wall clock)."""

    workflow: str
    key: str
    run_id: str
    at: float


def decode_control(raw: bytes) -> tuple[FlushRequest, ...]:
    obj = _codec.strict_loads(raw)
    if not isinstance(obj, dict) or obj.get("v") != SCHEMA_VERSION:
        raise ValueError("not a version 1 control document")
    items = obj.get("flush", [])
    if not isinstance(items, list):
        raise TypeError("flush must be a list")
    requests = []
    for item in items:
        if not isinstance(item, dict):
            raise TypeError("a flush request must be an object")
        requests.append(
            FlushRequest(
                _str(item, "workflow"), _str(item, "key"), _str(item, "run"), _num(item, "at")
            )
        )
    return tuple(requests)


def encode_control(requests: tuple[FlushRequest, ...]) -> bytes:
    doc = {
        "v": SCHEMA_VERSION,
        "flush": [
            {"workflow": r.workflow, "key": r.key, "run": r.run_id, "at": r.at}
            for r in requests[-CONTROL_KEEP:]
        ],
    }
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True, slots=True)
class FireRecord:
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
    #: True for a leading fire's record: written before the window's opening write,
    #: whose write id it names (the window's ``opened_by``). Older versions ignore the
    #: field, and never run such a record again (they find its commit not proven).
    leading: bool = False

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
                **({"edge": "leading"} if self.leading else {}),
            },
            separators=(",", ":"),
        ).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes) -> FireRecord:
        obj = _codec.strict_loads(raw)
        if not isinstance(obj, dict) or obj.get("v") != SCHEMA_VERSION:
            raise ValueError("not a version 1 fire record")
        return cls(
            owner=_str(obj, "owner"),
            epoch=_str(obj, "epoch"),
            workflow=_str(obj, "workflow"),
            key=_str(obj, "key"),
            run_id=_str(obj, "run"),
            payload=_codec.opt_string(obj, "payload"),
            count=int(obj["count"]),
            first=_num(obj, "first"),
            at=_num(obj, "at"),
            attempt=int(obj["attempt"]),
            write=_codec.opt_string(obj, "write"),
            leading=_codec.opt_string(obj, "edge") == "leading",
        )
