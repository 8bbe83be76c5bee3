"""The protocol's decisions on documents as read: pure, no Trio and no I/O.

What one ping, or a batch of them, does to a window's document; when a fire commits
and what its tombstone keeps; whether a commit whose answer was lost had landed. The
window's own rules (its times, count and payloads) are :mod:`trio_debounce._engine`'s:
this module translates between the stored document and the engine's window.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from .. import _engine
from .._backend import Registered, Registration
from .._flow import Flow, FlowSpec, describe
from .._options import DEFAULT, InitialFactory, Reducer, WindowOptions
from .._payload import PayloadSerializer
from .._types import FireReason, Mode
from ._documents import AFTER_KEEP, RunMarker, WindowDoc, WindowFull
from ._flow_rules import (
    absorbs_as_debounce,
    apply_flow,
    cooling,
    dropped_result,
    late_into,
)

logger = logging.getLogger("trio_debounce.backend")


@dataclass(frozen=True, slots=True)
class Identity:
    """Who applies the rules: this process in this opening, and what it writes with."""

    process_id: str
    epoch: str
    serializer: PayloadSerializer
    #: The largest document the store takes, bytes.
    max_value_bytes: int

    def owns(self, doc: WindowDoc) -> bool:
        return doc.owner == self.process_id and doc.epoch == self.epoch

    def names_run(self, doc: WindowDoc | None, run_id: str) -> bool:
        """Does ``doc`` hold ``run_id`` as its key's ``queue-latest`` run of this process?"""
        marker = None if doc is None else doc.running
        return (
            marker is not None
            and marker.run_id == run_id
            and (marker.process, marker.epoch) == (self.process_id, self.epoch)
        )


@dataclass(slots=True, eq=False)
class Ping:
    """What one register call asks for, as the rules apply it."""

    mode: Mode
    delay: float
    max_delay: float | None
    run_id: str
    #: The payload, serialized.
    text: str
    #: The payload as the serializer gives it back.
    own: Any
    max_count: int | None = None
    payload_policy: str = "last"
    order_key: float | None = None
    max_items: int | None = None
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
    #: The flow-control window this ping is for (throttle, audit, batch, rate
    #: limit; see :func:`flow_mode`), None for a debounce ping.
    flow: FlowSpec | None = None
    #: A batch item's serialized length, bytes (counted against ``max_bytes``).
    size: int = 0
    #: No window option beyond mode, delay and max_delay: merged by fold_plain.
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
            and (self.flow is None or absorbs_as_debounce(self.flow))
        )


P = TypeVar("P", bound=Ping)


@dataclass(frozen=True, slots=True)
class Applied(Generic[P]):
    """What :func:`apply_batch` made of a batch of pings."""

    #: The pings applied, with their outcomes, in order.
    pings: list[tuple[P, Registered]]
    #: The document to write (for a batch whose first ping found the window due: that
    #: due document, with no ping applied).
    doc: WindowDoc | None
    #: When to take the fire of a ``coalesced`` window that moved earlier, or None.
    take_at: float | None
    #: The pings left for the next write.
    rest: list[P]
    #: The pings that write nothing, answered: a Registration or the error to raise.
    answers: list[tuple[P, Registration | Exception]]


def load_payload(serializer: PayloadSerializer, text: str | None) -> Any:
    """A stored payload, deserialized (None if none was stored, or if it cannot be
    deserialized: written by something else, or by another serializer; logged)."""
    if text is None:
        return None
    try:
        return serializer.loads(text)
    except (Exception, RecursionError) as exc:
        logger.warning(
            "a stored payload (%d chars) cannot be deserialized (%s: %.80s); the handler gets None",
            len(text),
            type(exc).__name__,
            exc,
        )
        return None


def is_stale(order_key: float | None, fired_order: float | None) -> bool:
    """Is a ping with ``order_key`` stale: not above the key's last fired order key?"""
    return order_key is not None and _engine.is_stale(order_key, fired_order)


def options_of(doc: WindowDoc) -> WindowOptions | None:
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


def commit_landed(doc: WindowDoc | None, run_id: str, write: str) -> bool | None:
    """Did the commit of write ``write`` (a fire record's) close run ``run_id``, judged by
    its key's document ``doc`` as read now?

    True or False where the document proves it; None while the run's window is still
    open (its owner fires it). The proof is the run's tombstone, or the ``after`` of
    the newer windows over it; see docs/protocol.rst, "Fire records and their proof".
    """
    if doc is None:
        return False
    if doc.run_id == run_id:
        return doc.write == write if doc.fired else None
    for proof_run, proof_write in doc.after:
        if proof_run == run_id:
            return proof_write == write
    return len(doc.after) >= AFTER_KEEP


def opening_landed(
    doc: WindowDoc | None,
    opened: WindowDoc,
    prior_run: str | None,
    now: float,
    lease: float,
    skew: float,
) -> bool | None:
    """Did a write that opened window ``opened`` over a document of run ``prior_run``
    (None: the key held no window) land, its answer lost, judged by the key's document
    ``doc`` as read at wall time ``now``?

    True: the window is the document's, or in its ``after`` (it landed; it may have
    fired since, under newer windows). False: it did not: the document it was written
    over is still there, or was followed directly by another window; or the ``after``
    list goes back to an empty key and no tombstone of the window could have been
    swept yet (the sweeper keeps one ``lease`` past its last ping, and clocks may
    differ by ``skew`` each way). None: cannot tell (it may have landed, fired and been
    swept, or pushed out of a full ``after``): writing the run again could fire it
    twice. See docs/protocol.rst, "Group commit".
    """
    chain = () if doc is None else (doc.run_id, *(run for run, _ in doc.after))
    if opened.run_id in chain:
        return True
    if prior_run is not None and prior_run in chain:
        return False
    if (doc is None or len(doc.after) < AFTER_KEEP) and now < opened.last + lease - 2 * skew:
        return False
    return None


def leading_refire(doc: WindowDoc | None, run_id: str, write: str) -> bool | None:
    """May a survivor run again the leading fire of run ``run_id``, whose record names
    the window's opening write ``write``, judged by its key's document ``doc`` as read
    now? True: its opening landed and no later fire of the key has committed. False:
    the opening never landed (the record is taken back). None: it landed, but a later
    fire committed (the run's trailing edge) or a later window opened over it: the
    re-run is skipped, so that a key's fencing tokens keep the order its payloads were
    stored in. See docs/protocol.rst, "Fire records and their proof"."""
    if doc is None:
        return False
    if doc.run_id == run_id:
        if doc.opened_by != write:
            return False
        trailing = doc.mode is Mode.TRAILING or (doc.mode is Mode.BOTH and doc.count >= 2)
        return None if doc.fired and trailing else True
    if any(proof_run == run_id for proof_run, _ in doc.after) or len(doc.after) >= AFTER_KEEP:
        return None
    return False


def due_at(doc: WindowDoc | None, now: float, blocked: float | None) -> bool:
    """Is ``doc`` an open window that is due at ``now`` (its ``at`` has come: its
    deadline, its cap, or the time of the ping that reached its ``max_count``), so that
    a ping at ``now`` must not join it? A ``queue-latest`` window that waits for its
    key's run (``blocked``) is not: pings join it."""
    return (
        doc is not None
        and not doc.fired
        and not _engine.joins(doc.at, now, doc.queue and blocked is not None)
    )


def is_plain_window(doc: WindowDoc | None, mode: Mode, flow: FlowSpec | None = None) -> bool:
    """Is ``doc`` an open window of ``mode`` (and ``flow``: a both-edges throttle's or
    an audit's, or None) with no option beyond mode, delay and max_delay (what a run of
    plain pings can be folded into)?"""
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
        and doc.flow == flow
    )


def window_state(
    doc: WindowDoc, waiting: bool, serializer: PayloadSerializer
) -> _engine.WindowState:
    """The engine's view of an open window's document: its times, count and
    accumulation, payloads deserialized ("last" and "first" keep the stored text)."""
    opts = options_of(doc)
    trailing = _engine.trailing_pending(doc.mode, doc.count)
    cap = _engine.INF if doc.cap is None else doc.cap
    state = _engine.WindowState(doc.mode, doc.first, doc.at, cap, doc.payload, trailing, opts)
    state.count = doc.count
    state.waiting = waiting
    if opts is not None:
        state.best = doc.order
        state.max_order = doc.max_order
        state.held = doc.held
        if opts.payload_policy == "collect":
            values = load_payload(serializer, doc.payload) or []
            state.acc = [(o, n, v) for (o, n), v in zip(doc.ranks, values, strict=True)]
            state.held = len(state.acc)
        elif opts.reducer:
            state.acc = load_payload(serializer, doc.payload)
    return state


def _check_same_options(doc: WindowDoc, ping: Ping) -> None:
    """Raise ValueError if ``ping``'s options differ from the open window's."""
    if doc.flow != ping.flow:
        raise ValueError(
            f"{describe(ping.flow)} differs from {describe(doc.flow)} of the open window "
            f"(run {doc.run_id})"
        )
    if doc.flow is not None:
        return  # the spec is all of a flow window's parameters (its mode may be a cool-down's)
    if doc.mode is not ping.mode:
        raise ValueError(
            f"mode {ping.mode.value!r} differs from the mode {doc.mode.value!r} of the open "
            f"window (run {doc.run_id})"
        )
    if doc.max_count != ping.max_count:
        raise ValueError(
            f"max_count {ping.max_count!r} differs from the max_count {doc.max_count!r} of "
            f"the open window (run {doc.run_id})"
        )
    if doc.payload_policy != ping.payload_policy:
        raise ValueError(
            f"payload_policy {ping.payload_policy!r} differs from the payload_policy "
            f"{doc.payload_policy!r} of the open window (run {doc.run_id})"
        )
    if doc.ordered != (ping.order_key is not None):
        raise ValueError(
            f"the open window (run {doc.run_id}) was opened "
            + ("with an order_key: every ping of it needs one" if doc.ordered else
               "without an order_key: its pings cannot carry one")
        )  # fmt: skip
    overlaps = ("allow", "queue-latest")
    for name, mine, theirs in (
        ("max_items", ping.max_items, doc.max_items),
        ("overflow", ping.overflow, doc.overflow),
        ("overlap", overlaps[ping.queue], overlaps[doc.queue]),
        ("run_timeout", ping.run_timeout, doc.run_timeout),
    ):
        if mine != theirs:
            raise ValueError(
                f"{name} {mine!r} differs from the {name} {theirs!r} of the open window "
                f"(run {doc.run_id})"
            )


def _open(
    doc: WindowDoc | None,
    ping: Ping,
    me: Identity,
    now: float,
    write: str,
    blocked_until: float | None,
) -> tuple[Registered, WindowDoc, float | None]:
    """A ping with no open window: it opens one (over ``doc``, a tombstone, if any)."""
    running = None if doc is None or blocked_until is None else doc.running
    fired_order = None if doc is None else doc.fired_order
    if ping.drop_stale and is_stale(ping.order_key, fired_order):
        assert doc is not None
        return Registered.STALE, doc, None
    serializer = me.serializer
    payload = ping.text
    mode = ping.mode
    cool_until = cooling(doc, ping.flow, now)
    if cool_until is not None:
        mode = Mode.TRAILING  # a throttle's cool-down: no leading fire
    window_opts = WindowOptions(
        max_count=ping.max_count,
        payload_policy=ping.payload_policy,
        max_items=ping.max_items,
        overflow=ping.overflow,
        overlap="queue-latest" if ping.queue else "allow",
        run_timeout=ping.run_timeout,
        ordered=ping.order_key is not None,
    )
    # The engine decides the window's times and what it holds; the document
    # keeps the payloads serialized.
    first: Any = payload
    value: Any = None
    if ping.payload_policy == "collect":
        first = serializer.loads(payload)
    elif ping.reducer is not None:
        value = _engine.first_value(ping.reducer, serializer.loads(payload))
    state = _engine.open_window(
        now,
        first,
        delay=ping.delay,
        max_delay=ping.max_delay,
        mode=mode,
        opts=None if window_opts == DEFAULT else window_opts,
        order=ping.order_key,
        value=value,
    )
    ranks: tuple[tuple[float, int], ...] = ()
    held = 0
    if ping.payload_policy == "collect":
        ranks = tuple((float(o), n) for o, n, _ in state.acc)
        payload = serializer.dumps([item[2] for item in state.acc])
    elif ping.reducer is not None:
        payload = serializer.dumps(state.acc)
        held = state.held
    if _engine.leading(mode):
        # The leading fire happens with this write: its order key is fired.
        fired_order = _engine.fired_order_after(fired_order, ping.order_key)
    at = state.deadline
    cap = None if state.cap == _engine.INF else state.cap
    if cool_until is not None:
        at = cap = cool_until  # the cool-down's end, not a span from this ping
    new = WindowDoc(
        me.process_id,
        me.epoch,
        ping.run_id,
        mode,
        ping.delay,
        ping.max_delay,
        now,
        now,
        at,
        cap,
        at,
        1,
        write,
        write,
        payload,
        max_count=ping.max_count,
        payload_policy=ping.payload_policy,
        ordered=ping.order_key is not None,
        order=ping.order_key,
        max_items=ping.max_items,
        ranks=ranks,
        overflow=ping.overflow,
        held=held,
        queue=ping.queue,
        run_timeout=ping.run_timeout,
        running=running,
        max_order=ping.order_key,
        fired_order=fired_order,
        after=() if doc is None else ((doc.run_id, doc.write), *doc.after)[:AFTER_KEEP],
        flow=ping.flow,
        flow_fires=1 if mode is Mode.LEADING else 0,
        size=ping.size,
        # The key's last write ids go on (a lost answer is recognised across windows).
        writes=() if doc is None else doc.history(write),
    )
    return Registered.OPENED, new, None


def apply_ping(
    doc: WindowDoc | None,
    ping: Ping,
    me: Identity,
    now: float,
    write: str,
    *,
    owner_live: bool,
    takeover: bool,
    blocked_until: float | None = None,
) -> tuple[Registered, WindowDoc, float | None]:
    """Apply one ping, at ``now``, to a window's document as read, for write ``write``.

    Returns the outcome, the document to write (for ``stale``, the document as
    read: nothing is written) and, for a ``coalesced`` ping that moved the fire
    earlier than the owner armed, when to take it. ``owner_live``: the window's owner
    is live; ``takeover``: a window of a dead owner may be taken over now (not in the
    grace after an outage). ``blocked_until``: when the key's ``queue-latest`` run
    (``doc.running``) stops blocking for sure, or None if it does not block now.

    Raises:
      ValueError: the ping's options differ from the open window's.
      WindowFull: the window holds ``max_items`` (or as much as the store takes)
        under ``overflow="fire-early"``: nothing to write; it fires first.
      Exception: whatever the reducer or the serializer raise.
    """
    if doc is not None and doc.mode is Mode.LEADING and late_into(doc, ping.flow, now):
        # A drop or a rate-limit fire of the closed window, as if it had landed in time.
        outcome, new = apply_flow(doc, now, write)
        return outcome, new, None
    if doc is None or doc.fired:
        return _open(doc, ping, me, now, write, blocked_until)
    _check_same_options(doc, ping)
    if ping.drop_stale and is_stale(ping.order_key, doc.fired_order):
        return Registered.STALE, doc, None
    spec = doc.flow
    if spec is not None and doc.mode is Mode.LEADING:
        outcome, new = apply_flow(doc, now, write)
        return outcome, new, None
    if doc.overflow == "fire-early" and doc.items >= (doc.max_items or 0):
        raise WindowFull(doc)
    if spec is not None and spec.max_bytes is not None and doc.size + ping.size > spec.max_bytes:
        raise WindowFull(doc)  # the batch fires before this item
    serializer = me.serializer
    reducer = ping.reducer
    payload = ping.text
    # Waiting: due while the key's run blocks; pings join it and leave its time alone.
    waiting = doc.queue and blocked_until is not None and doc.at <= now
    # The engine applies the ping (its times, count and payload policy) to the
    # document's window, payloads deserialized; the document stores them serialized.
    state = window_state(doc, waiting, serializer)
    opts = state.opts
    policy_value: Any = payload  # "last" and "first" keep the stored text
    folded: Any = None
    if opts is not None and opts.payload_policy == "collect":
        policy_value = load_payload(serializer, payload)
    elif reducer is not None:
        folded = reducer[0](state.acc, serializer.loads(payload))
    # A ping older than the window's latest (its write landed late) leaves the
    # latest ping's time standing, as if the pings had landed in time order; the
    # max_count ping makes the window due at the latest ping's time, and the next
    # ping, at that time or later, takes its fire and opens the next window.
    _engine.absorb(
        state,
        now,
        policy_value,
        delay=ping.delay,
        order=ping.order_key,
        value=folded,
        latest=doc.last,
    )
    ranks = doc.ranks
    held = doc.held
    if opts is not None and opts.payload_policy == "collect":
        ranks = tuple((float(o), n) for o, n, _ in state.acc)
        payload = serializer.dumps([item[2] for item in state.acc])
    elif reducer is not None:
        payload = serializer.dumps(state.acc)
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
        "writes": doc.history(write),
        "payload": payload,
        "order": state.best if opts is not None else doc.order,
        "ranks": ranks,
        "held": held,
        "max_order": state.max_order if opts is not None else doc.max_order,
        "running": doc.running if blocked_until is not None else None,
    }
    if spec is not None:
        changes["size"] = doc.size + ping.size
        if doc.mode is Mode.BOTH and doc.count == 1:
            changes["since"] = now  # the first ping after the leading fire
    if doc.accumulates:
        # Bounded by the store's size limit too: "fire-early" fires what the window
        # holds, "drop-oldest" drops more of the lowest items.
        items = state.acc
        while len(replace(doc, **changes).encode()) > me.max_value_bytes:
            if doc.overflow == "fire-early":
                raise WindowFull(doc)
            if len(items) <= 1:
                break  # this payload alone is too large: the write refuses it
            del items[0]
            changes["ranks"] = tuple((float(o), n) for o, n, _ in items)
            changes["payload"] = serializer.dumps([item[2] for item in items])
    if me.owns(doc):
        return Registered.EXTENDED, replace(doc, armed=at, **changes), None
    if owner_live or not takeover:
        take_at = at if at < doc.armed and not waiting else None
        return Registered.COALESCED, replace(doc, **changes), take_at
    new = replace(doc, owner=me.process_id, epoch=me.epoch, armed=at, **changes)
    return Registered.TOOK_OVER, new, None


def apply_batch(
    doc: WindowDoc | None,
    live: bool,
    now: float,
    pending: Sequence[P],
    write: str,
    remembered: bool,
    blocked: float | None,
    me: Identity,
    *,
    takeover: bool,
) -> Applied[P] | None:
    """Apply the pings of ``pending`` (not yet answered) to ``doc`` in order
    (:func:`apply_ping` each, as if written one after the other; ``blocked`` as it
    takes it).

    A ping that opens a leading or both-edges window goes alone (its leading fire
    carries its own payload), and so does one marked ``alone``. A ping that writes
    nothing is answered on its own, the others go on: refused (ValueError, or whatever
    its reducer or the serializer raise) with the error; ``drop_stale`` and stale with
    its ``stale`` registration; into a full ``fire-early`` window with an
    ``overflowed`` one (or, after pings of this write, left for the next write, so that
    the window it fires holds them). Each of these decisions is made on a fresh read:
    on a ``remembered`` document (it may be stale) the result is None instead.

    Each ping is applied at its own time (``ping.now``; ``now`` for a ping without
    one). A ping at or after the due time of the window as the pings before it
    left it never joins that window: the pings before it are written, and it and
    the rest are left for the next write; if it is the first, nothing is applied
    and the result holds that due ``doc`` and no ping: the caller takes its fire, then
    applies the rest to what that leaves.
    """
    applied: list[tuple[P, Registered]] = []
    answers: list[tuple[P, Registration | Exception]] = []
    take_at: float | None = None
    fold = 0  # pending[:fold] are applied already (by fold_plain)
    for index, ping in enumerate(pending):
        if index < fold:
            continue
        at = now if ping.now is None else ping.now
        if not ping.joins_due and due_at(doc, at, blocked):
            return Applied(applied, doc, take_at, list(pending[index:]), answers)
        if applied and ping.alone:
            return Applied(applied, doc, take_at, list(pending[index:]), answers)
        if ping.plain and not ping.alone and is_plain_window(doc, ping.mode, ping.flow):
            assert doc is not None
            folded = fold_plain(
                doc, live, now, pending, index, write, blocked, me, takeover=takeover
            )
            if folded is not None:
                fold, doc, take_at, outcome = folded
                applied.extend((other, outcome) for other in pending[index:fold])
                if outcome is not Registered.COALESCED:
                    live = True
                continue
        try:
            outcome, new, take = apply_ping(
                doc, ping, me, at, write, owner_live=live, takeover=takeover, blocked_until=blocked
            )
        except WindowFull as full:
            if remembered:
                return None
            if applied:
                return Applied(applied, doc, take_at, list(pending[index:]), answers)
            # Nothing written: the caller fires the full window, then pings again.
            answers.append(
                (
                    ping,
                    Registration(
                        Registered.COALESCED,
                        full.doc.run_id,
                        full.doc.mode,
                        # A batch's fire: at this item's time (it could not hold it).
                        full.doc.at if full.doc.flow is None else at,
                        full.doc.first,
                        full.doc.count,
                        stored=False,
                        overflowed=True,
                    ),
                )
            )
            continue
        except Exception as exc:  # options that differ, a reducer that raises
            if remembered:
                return None
            answers.append((ping, exc))
            continue
        if outcome is Registered.STALE:
            if remembered:
                return None
            answers.append((ping, stale_result(new, blocked, at)))
            continue
        if outcome is Registered.DROPPED:
            if remembered:
                return None  # decided on a fresh read
            answers.append((ping, dropped_result(new)))
            continue
        if outcome is Registered.FIRED:
            if applied:
                return Applied(applied, doc, take_at, list(pending[index:]), answers)
            # Alone in its write: its result names its own run.
            applied.append((ping, outcome))
            return Applied(applied, new, None, list(pending[index + 1 :]), answers)
        applied.append((ping, outcome))
        doc, take_at = new, take
        if outcome is not Registered.COALESCED:
            live = True  # ours from now on
        if ping.alone or (outcome is Registered.OPENED and new.mode is not Mode.TRAILING):
            return Applied(applied, doc, take_at, list(pending[index + 1 :]), answers)
    return Applied(applied, doc, take_at, [], answers)


def fold_plain(
    doc: WindowDoc,
    live: bool,
    now: float,
    pending: Sequence[Ping],
    start: int,
    write: str,
    blocked: float | None,
    me: Identity,
    *,
    takeover: bool,
) -> tuple[int, WindowDoc, float | None, Registered] | None:
    """Apply the plain pings ``pending[start:end]`` (a run of them, up to the first
    ping that is not plain or has another mode or flow) to the open plain window ``doc``
    at once: one document instead of one per ping, the same as :func:`apply_ping`
    for each in turn (tests/protocol/test_group_commit.py checks it against that).

    Returns ``end``, the document, the take time (as the run's last ping left it)
    and the outcome every ping of the run gets; None if the run would take the
    window over (:func:`apply_ping` takes that ping alone, then the run is ours).
    """
    mine = me.owns(doc)
    if not mine and not live and takeover:
        return None
    end = start
    mode = doc.mode
    state = window_state(doc, False, me.serializer)
    latest = doc.last
    flow = doc.flow
    since = doc.since
    while end < len(pending):
        ping = pending[end]
        if not ping.plain or ping.alone or ping.mode is not mode or ping.flow != flow:
            break
        t = now if ping.now is None else ping.now
        if not _engine.absorbs(state, t):
            break  # due at its time (the first ping was checked by the caller)
        if flow is not None and mode is Mode.BOTH and state.count == 1:
            since = t  # a throttle's first ping after its leading fire
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
        "writes": doc.history(write),
        "payload": state.payload,
        "order": None,
        "running": doc.running if blocked is not None else None,
        "since": since,
    }
    if mine:
        return end, replace(doc, armed=at, **changes), None, Registered.EXTENDED
    take_at = at if at < doc.armed else None
    return end, replace(doc, **changes), take_at, Registered.COALESCED


def stale_result(doc: WindowDoc, blocked: float | None, now: float) -> Registration:
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


def absorbs_unstored(
    doc: WindowDoc | None, live: bool, me: Identity, pings: Sequence[Ping]
) -> bool:
    """After a batch found no write within its deadline (contention, not an outage):
    may its ``pings`` be coalesced into ``doc`` without being stored? Yes when a live
    peer owns the open window and has a trailing fire pending that comes after their
    arrival (a both-edges window with one ping has none: stored, the ping would have
    made one), and the window is not a flow window (each of whose accepted pings is
    counted in a fire)."""
    return (
        doc is not None
        and not doc.fired
        and live
        and not me.owns(doc)
        and _engine.trailing_pending(doc.mode, doc.count)
        and not doc.accumulates
        and doc.flow is None
        and all(ping.now is None or ping.now < doc.at for ping in pings)
    )


def would_commit(
    doc: WindowDoc | None,
    run_id: str,
    me: Identity,
    now: float,
    *,
    take: bool,
    force: bool,
    early: bool,
) -> bool:
    """Would a finalize of ``run_id`` at ``now`` commit a fire on ``doc`` as it is? (Not
    sure while the key's ``queue-latest`` run may block it: that is read afresh.)"""
    return (
        doc is not None
        and not doc.fired
        and doc.run_id == run_id
        and (take or me.owns(doc))
        and (force or doc.at <= now)
        and (early or not doc.queue or doc.running is None)
    )


def fire_time(doc: WindowDoc, now: float, force: bool, at: float | None = None) -> float:
    """The time a finalize at ``now`` fires ``doc`` at: its due time, or when forced
    ``now`` (or ``at``, if earlier: the time of the batch item that found it full); a
    ``queue-latest`` window that waited for its key's run fires when that run stopped
    blocking (its ``until``, or ``now`` when noticed later; a run's end, recorded,
    made it due then)."""
    if force:
        return now if at is None else min(now, at)
    if not doc.queue or doc.running is None:
        return doc.at
    marker = doc.running
    released = now
    if marker is not None and marker.until is not None:
        released = min(now, marker.until)
    return max(doc.at, released)


def fire_reason(doc: WindowDoc, fired_at: float, *, early: bool = False) -> FireReason:
    """Why the trailing fire of ``doc`` at ``fired_at`` fired
    (:func:`~trio_debounce._engine.trailing_reason`), judged against the due time its
    pings set: an ``early`` fire (a ping found the window full) is ``"overflow"``
    (``overflow="fire-early"``), a batch's ``"max-items"`` if it held ``max_items``
    items (it waited for its key's run, or its owner had yet to fire it), else
    ``"max-bytes"``; a ``queue-latest`` window
    that waited for its key's run (:func:`fire_time` put its fire past its due time,
    when the run stopped blocking) is ``"run-end"``; a due time that a flush moved
    earlier (a forced finalize, ``_control.Control.request_flush``) makes a
    ``"flush"`` fire. A flow window's fire gives its mode's reason (``"interval"``,
    ``"max-wait"``, ``"max-items"``). The caller may name a cause it knows better
    (an exit's flush, a run's end here, an adoption): see
    :func:`~trio_debounce._engine.caused`."""
    if early:
        if doc.flow is not None and doc.flow.flow is Flow.BATCH:
            full = doc.count >= doc.flow.max_items
            return FireReason.MAX_ITEMS if full else FireReason.MAX_BYTES
        if doc.flow is None:
            return FireReason.OVERFLOW
    if doc.queue and doc.running is not None and fired_at > doc.at:
        return FireReason.RUN_END
    cap = _engine.INF if doc.cap is None else doc.cap
    due = doc.at
    if doc.max_count is None or doc.count < doc.max_count:
        due = max(due, _engine.deadline_of(doc.last, doc.delay, cap))
    reason = _engine.trailing_reason(fired_at, due, cap, doc.count, doc.max_count)
    spec = doc.flow
    if spec is None or reason is FireReason.FLUSH:
        return reason
    if spec.flow is Flow.BATCH:
        return FireReason.MAX_ITEMS if reason is FireReason.MAX_COUNT else FireReason.MAX_WAIT
    return FireReason.INTERVAL


def tombstone(doc: WindowDoc, write: str, fired_at: float, me: Identity) -> WindowDoc:
    """The document that commits ``doc``'s fire by write ``write``: a tombstone
    (``fired``, naming the write, so that a commit whose answer was lost is proven by
    a read), with the running state of this fire's ``queue-latest`` run and the highest
    order key fired for the key."""
    pending = doc.mode is Mode.TRAILING or (doc.mode is Mode.BOTH and doc.count >= 2)
    fired_order = doc.fired_order
    top = doc.max_order if doc.max_order is not None else doc.order
    if pending and top is not None:
        fired_order = top if fired_order is None else max(fired_order, top)
    running = doc.running
    if doc.queue and pending:
        until = None if doc.run_timeout is None else fired_at + doc.run_timeout
        running = RunMarker(me.process_id, me.epoch, doc.run_id, until)
    cool_until = None
    spec = doc.flow
    if spec is not None and spec.flow is Flow.THROTTLE and spec.trailing and pending:
        cool_until = fired_at + spec.span  # the next fire of the key waits for it
    return replace(
        doc,
        fired=True,
        write=write,
        writes=doc.history(write),
        running=running,
        fired_order=fired_order,
        cool_until=cool_until,
    )
