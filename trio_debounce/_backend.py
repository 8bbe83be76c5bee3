"""The cross-process debounce backend interface and its result types.

Re-exported as :mod:`trio_debounce.abc`. The protocol it describes is in
:doc:`/protocol`; ``trio_debounce._protocol`` implements it over any revisioned
key-value store (:class:`~trio_debounce._kv.KvStore`).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, NamedTuple

import trio

from ._events import BackendEvent
from ._flow import FlowSpec
from ._types import Edge, FireReason, InitialFactory, Mode, Reducer

#: How long (seconds) a process remembers a write of its own whose answer was lost
#: and which it then wrote again or gave up on: a write queued at a stalled server (or
#: resent after a reconnect) may land that late, and is then settled, not fired (see
#: docs/protocol.rst, "A register that failed but landed").
LATE_WRITE_HORIZON = 600.0
#: At most this many such writes are remembered (the oldest are forgotten first).
LATE_WRITES_KEPT = 10_000

#: The values of ``open_coordinator(delivery=...)``.
Delivery = Literal["at-least-once", "at-most-once"]
#: The values of :attr:`WindowChange.change`.
WindowChangeKind = Literal["listed", "opened", "updated", "fired", "closed"]


class Registered(str, enum.Enum):
    """What :meth:`DebounceBackend.register` did with one ping.

    ``Registered.OPENED`` (``"opened"``)
      No window was open: this ping opened one, owned by this process.
    ``Registered.TOOK_OVER`` (``"took-over"``)
      The window's owner process had lost its lease: this process now owns the window,
      which keeps its run id, first ping, cap and count (a leading edge is not fired
      again).
    ``Registered.EXTENDED`` (``"extended"``)
      This process already owned the window; the ping extended it.
    ``Registered.COALESCED`` (``"coalesced"``)
      Another live process owns the window; the ping was absorbed by it.
    ``Registered.STALE`` (``"stale"``)
      A ``drop_stale`` ping whose order key is not above the last one fired for its
      key: dropped, nothing written. ``run_id`` is the open window's (``""`` if none).
    ``Registered.DROPPED`` (``"dropped"``)
      A ping of a leading-only throttle or of a rate limit past its limit, in its open
      window: dropped, nothing written (decided on the window's document as read).
    ``Registered.FIRED`` (``"fired"``)
      A rate-limit ping within the limit of the open window: this write counted its
      fire, which the caller runs at once as a leading fire of the ping's own
      ``run_id`` (the Registration's).
    """

    OPENED = "opened"
    TOOK_OVER = "took-over"
    EXTENDED = "extended"
    COALESCED = "coalesced"
    STALE = "stale"
    DROPPED = "dropped"
    FIRED = "fired"

    def __str__(self) -> str:
        return self.value


class Finalized(str, enum.Enum):
    """What :meth:`DebounceBackend.finalize` decided for a due window.

    ``Finalized.FIRE`` (``"fire"``)
      The fire was committed by a compare-and-swap on the revision this call read (a
      delete of the window under at-least-once, after its fire record; a tombstone
      under at-most-once): the window is closed and its trailing fire (if its mode and count call
      for one) belongs to the caller, exactly once.
    ``Finalized.RESCHEDULE`` (``"reschedule"``)
      Pings from other processes moved the fire time; wait until ``scheduled_at`` and
      finalize again.
    ``Finalized.ABANDONED`` (``"abandoned"``)
      The window is no longer the caller's (another run id, another owner, cancelled or
      already fired): do nothing.
    """

    FIRE = "fire"
    RESCHEDULE = "reschedule"
    ABANDONED = "abandoned"

    def __str__(self) -> str:
        return self.value


class Registration(NamedTuple):
    """The result of :meth:`DebounceBackend.register` (immutable).

    Times are wall-clock epoch seconds, read through the backend's wall clock.

    Attributes:
      outcome (Registered): what the ping did.
      run_id (str): the window's active run id.
      mode (Mode): the window's mode (the document's mode wins).
      scheduled_at (float): when the window is due: its trailing fire time, or for a
        leading window the end of its silence.
      first_ping_at (float): the time of the window's first ping.
      ping_count (int): pings the window has absorbed across all processes, this one
        included.
      stored (bool): False only for a ``coalesced`` result returned without writing,
        because the overall deadline passed under contention while the window had a
        live owner with a fire pending (the fire comes after this ping's arrival).
      take_at (float | None): for ``coalesced`` only: this ping moved the fire earlier
        than the time the owner armed, so the caller must call
        :meth:`DebounceBackend.finalize` with ``take=True`` at ``take_at``.
      payload (Any): this ping's payload as every process reads it back (round-tripped
        through the serializer); the leading fire of an ``opened`` window carries it.
      fencing_token (int): the token of the write that stored this ping (the leading
        fire of an ``opened`` window carries it).
      overflowed (bool): nothing was written because the window holds ``max_items``
        payloads (or as much as the store's size limit takes) under
        ``overflow="fire-early"``: the caller fires it at once with what it holds
        (:meth:`DebounceBackend.finalize` with ``take=True, force=True``, for the
        ``run_id`` given here) and registers the ping again, which opens the next
        window. ``stored`` is False.
      waiting (bool): the window is due but waits for its key's ``queue-latest`` run
        to end; ``scheduled_at`` is then when the owner looks again (the run's
        ``run_timeout`` or its process's lease), not a fire time.
      taken (tuple[Finalization, ...]): the fires this ping took by compare-and-swap
        before it was applied: a ping whose time is at or after a stored window's due
        time never joins that window, so it commits that window's fire (as a taker:
        fire record first under at-least-once) and then opens the next window. Each is
        a ``fire`` :class:`Finalization` (``scheduled_at`` the window's due time) whose
        trailing fire, if its mode and count call for one, the caller runs with its
        own handler, and whose ``fire_id`` it passes to
        :meth:`DebounceBackend.complete` afterwards. Empty when the ping met no due
        window, and when a coordinator is attached: the backend then hands each taken
        fire to the coordinator as soon as it is committed (see
        :meth:`DebounceBackend.attach`), so a ping that fails after its take
        does not lose the fire. Optional: a backend that predates it leaves it empty.
      fire_id (str | None): for an ``opened`` leading or both-edges window under
        at-least-once delivery: the leading fire's record, written before the opening
        write, to pass to :meth:`DebounceBackend.complete` once its handler has
        returned (a survivor runs the fire again if this process dies first). None
        otherwise, and from a backend that predates it.
    """

    outcome: Registered
    run_id: str
    mode: Mode
    scheduled_at: float
    first_ping_at: float
    ping_count: int
    stored: bool = True
    take_at: float | None = None
    payload: Any = None
    fencing_token: int = 0
    overflowed: bool = False
    waiting: bool = False
    taken: tuple[Finalization, ...] = ()
    fire_id: str | None = None

    @property
    def owner(self) -> bool:
        """True if this process owns the window after the ping."""
        return self.outcome in (Registered.OPENED, Registered.TOOK_OVER, Registered.EXTENDED)


class Finalization(NamedTuple):
    """The result of :meth:`DebounceBackend.finalize` (immutable).

    Attributes:
      outcome (Finalized): fire, reschedule or abandoned.
      scheduled_at (float | None): wall-clock epoch seconds: for ``fire`` the window's
        logical fire time (its scheduled time, or now for a forced finalize); for
        ``reschedule`` the new time to finalize at; ``None`` for ``abandoned``.
      ping_count (int): the window's global ping count (0 for ``abandoned``).
      first_ping_at (float | None): the window's first ping, wall clock (``None`` for
        ``abandoned``).
      mode (Mode | None): the window's mode (``None`` for ``abandoned``).
      last_ping_at (float | None): the window's last ping, wall clock (``None`` for
        ``abandoned``).
      payload (Any): for ``fire``: the window's latest stored payload, deserialized.
      fencing_token (int): for ``fire``: the fire's fencing token (see
        :attr:`trio_debounce.Fire.fencing_token`).
      fire_id (str | None): for ``fire`` under at-least-once delivery: the fire record
        to pass to :meth:`DebounceBackend.complete` once the handler has returned.
      blocks (bool): for ``fire`` of an ``overlap="queue-latest"`` window: the fire's
        run blocks its key's next fire until the caller passes the run to
        :meth:`DebounceBackend.end_run` once the handler has returned (or until its
        ``run_timeout``, or until this process's lease lapses).
      run_id (str): for ``fire``: the run id of the window that fired (``""`` from a
        backend that does not say; the caller named the run it finalized). Needed
        for a fire taken by :meth:`DebounceBackend.register` (see
        :attr:`Registration.taken`).
      reason (FireReason): for ``fire``: why the window fired (``"delay"``,
        ``"max-delay"``, ``"max-count"`` or ``"flush"``), for the coordinator's
        :class:`~trio_debounce.FireStarted`; ``"delay"`` from a backend that does
        not say.
    """

    outcome: Finalized
    scheduled_at: float | None = None
    ping_count: int = 0
    first_ping_at: float | None = None
    mode: Mode | None = None
    last_ping_at: float | None = None
    payload: Any = None
    fencing_token: int = 0
    fire_id: str | None = None
    blocks: bool = False
    run_id: str = ""
    reason: FireReason = FireReason.DELAY


class OwnedWindow(NamedTuple):
    """A window whose record names this process as its owner.

    Attributes:
      workflow (str): the window's workflow.
      key (str): the window's debounce key.
      run_id (str): its active run id.
      mode (Mode): its mode.
      scheduled_at (float): when it is due, wall-clock epoch seconds.
      first_ping_at (float): its first ping, wall clock.
      ping_count (int): its global ping count.
    """

    workflow: str
    key: str
    run_id: str
    mode: Mode
    scheduled_at: float
    first_ping_at: float
    ping_count: int


class OrphanFire(NamedTuple):
    """A fire whose process died while its handler ran, now adopted by this process
    (at-least-once delivery): run the handler again, then :meth:`~DebounceBackend.complete`.
    Or a fire commit of this process whose answer was lost, proven since (attempt 1,
    with its ``reason``): run it, its first run, then complete it.

    Attributes:
      fire_id (str): the fire record.
      workflow (str): the window's workflow.
      key (str): the window's debounce key.
      run_id (str): the window's run id.
      payload (Any): the window's latest stored payload, deserialized.
      ping_count (int): the window's global ping count.
      first_ping_at (float): its first ping, wall clock.
      fired_at (float): its logical fire time, wall clock.
      attempt (int): this attempt's number (2 for the first re-run).
      fencing_token (int): this attempt's token: the adoption's write, higher than the
        attempt it repeats.
      edge (Edge): the edge of the fire it repeats: ``Edge.TRAILING``, or
        ``Edge.LEADING`` for a leading fire (at-least-once writes its record before the
        window's opening write).
      reason (FireReason | None): why a lost commit of this process fired (its
        window's reason: ``"delay"``, ``"max-count"``, ...); None for a re-run, which
        runs as ``"re-run"``.
    """

    fire_id: str
    workflow: str
    key: str
    run_id: str
    payload: Any
    ping_count: int
    first_ping_at: float
    fired_at: float
    attempt: int
    fencing_token: int
    edge: Edge = Edge.TRAILING
    reason: FireReason | None = None


class Orphans(NamedTuple):
    """What :meth:`DebounceBackend.adopt_orphans` took over from dead processes.

    Attributes:
      windows (list[OwnedWindow]): open windows, now owned by this process.
      fires (list[OrphanFire]): interrupted fires to run again, and this process's
        lost commits proven since (their first run, with their ``reason``).
      owned (list[OwnedWindow]): every window that names this process as its owner
        after the call (the adopted ones included), from the same listing: what
        :meth:`DebounceBackend.owned_windows` would return, without a second scan.
      deferred (bool): True when takeovers were held back (the grace after an outage,
        while live peers renew their leases): the coordinator calls again at its next
        heartbeat instead of waiting for its periodic reconcile.
    """

    windows: list[OwnedWindow]
    fires: list[OrphanFire]
    owned: list[OwnedWindow]
    deferred: bool = False


class WindowStatus(NamedTuple):
    """The cluster-wide state of one open window (:meth:`Coordinator.window_status`).

    Times are wall-clock epoch seconds.

    Attributes:
      run_id (str): the window's run id.
      mode (Mode): its mode.
      owner (str): the process id of its owner.
      owner_live (bool): whether the owner's lease was live when read.
      first_ping_at (float): its first ping.
      last_ping_at (float): its latest ping.
      scheduled_at (float | None): when it is due; None while it is due but waits for
        its key's ``queue-latest`` run to end.
      cap_at (float | None): ``first_ping_at + max_delay``, or None.
      ping_count (int): pings across all processes.
      revision (int): the document's revision in the store.
      fencing_token (int): the token a fire at this revision would carry at least.
    """

    run_id: str
    mode: Mode
    owner: str
    owner_live: bool
    first_ping_at: float
    last_ping_at: float
    scheduled_at: float | None
    cap_at: float | None
    ping_count: int
    revision: int
    fencing_token: int


class WindowInfo(NamedTuple):
    """One window of a shared store, as an operator sees it (:meth:`Coordinator.inspect`,
    :meth:`DebounceBackend.inspect`, ``trio-debounce windows``).

    Times are wall-clock epoch seconds, durations seconds.

    Attributes:
      workflow (str): the window's workflow.
      key (str): its debounce key.
      run_id (str): its run id.
      mode (Mode): its mode.
      state (str): ``"open"`` (its due time is ahead); ``"due"`` (its due time has
        come, and no fire of it has committed yet); ``"waiting"`` (due, but its key's
        ``queue-latest`` run blocks it); ``"firing"`` (the fire record of a committed
        fire of its run exists: its handler runs, at least once).
      owner (str): the process id of its owner.
      owner_lease_left (float | None): seconds until the owner's lease expires
        (negative: lapsed); None if the owner has no lease in the store.
      first_ping_at (float): its first ping.
      last_ping_at (float): its latest ping.
      ping_count (int): pings across all processes.
      due_at (float): when it is due (its trailing fire; for a leading window the end
        of its silence).
      cap_at (float | None): ``first_ping_at + max_delay``, or None.
      payload_bytes (int): the size of its stored payload (serialized), bytes.
      fencing_token (int): the token a fire at this revision would carry at least.
      revision (int): the document's revision in the store.
    """

    workflow: str
    key: str
    run_id: str
    mode: Mode
    state: Literal["open", "due", "waiting", "firing"]
    owner: str
    owner_lease_left: float | None
    first_ping_at: float
    last_ping_at: float
    ping_count: int
    due_at: float
    cap_at: float | None
    payload_bytes: int
    fencing_token: int
    revision: int


class WindowChange(NamedTuple):
    """One change of a shared store's windows, as
    :meth:`DebounceBackend.open_window_watch` and ``trio-debounce windows --follow``
    report it: the difference between two successive readings of what
    :meth:`DebounceBackend.inspect` lists.

    Attributes:
      change (str): what happened to the window of ``(workflow, key)``:

        * ``"listed"``: it was there when the watch opened (the initial values);
        * ``"opened"``: a window (a run id) appeared;
        * ``"updated"``: it changed: pings, due time, owner (a takeover), state (see
          :attr:`WindowInfo.state`), size of its payload;
        * ``"fired"``: its state became ``"firing"``: a fire of its run committed
          under at-least-once delivery, and its handler runs;
        * ``"closed"``: it is gone from the listing: its handler returned after a fire
          (at-least-once), it fired under at-most-once, or it was cancelled, released
          or deleted. ``window`` is None.

      workflow (str): the window's workflow.
      key (str): its debounce key.
      run_id (str): its run id (for ``"closed"``: the run that left).
      window (WindowInfo | None): the window after the change; None for ``"closed"``.
      at (float): when the watch saw the change, wall-clock epoch seconds (read
        through the backend's :meth:`~DebounceBackend.wall_time`).
    """

    change: WindowChangeKind
    workflow: str
    key: str
    run_id: str
    window: WindowInfo | None
    at: float


class ProcessInfo(NamedTuple):
    """One process lease of a shared store (:meth:`DebounceBackend.processes`,
    ``trio-debounce processes``).

    Attributes:
      process_id (str): the process id.
      epoch (str): the opening of the coordinator that holds it (a uuid4 hex).
      live (bool): the lease has not expired (give or take the skew margin), and was
        not released by a hand-off.
      expires_in (float): seconds until the lease expires (negative: lapsed).
      heartbeat_interval (float | None): the holder's heartbeat interval, seconds;
        None where the lease does not record it.
      last_beat_age (float | None): seconds since the holder last wrote the lease;
        None where the lease does not record its length.
      draining (bool): the process is leaving (its exit has begun).
      released (bool): the process has left and handed its windows off.
      windows (int): the open windows it owns.
      fire_records (int): the fire records it holds (handlers running, at least once).
      runs (int): the persisted deferred runs it holds, pending or started, when the
        store also holds a run store's records (a NATS run store in the same bucket);
        0 otherwise.
    """

    process_id: str
    epoch: str
    live: bool
    expires_in: float
    heartbeat_interval: float | None
    last_beat_age: float | None
    draining: bool
    released: bool
    windows: int
    fire_records: int
    runs: int = 0


class DebounceBackend(abc.ABC):
    """Shared debounce windows for coordinators in several processes.

    One backend object serves one coordinator (one *process* in the protocol's terms:
    it has one :attr:`process_id` and one process lease). Pass it to
    :func:`~trio_debounce.open_coordinator` as ``backend=``; the coordinator calls
    these methods, and runs :meth:`refresh_lease` from one heartbeat task in its
    nursery. Every method is a Trio async function that cannot hang: register, finalize,
    cancel and release are bounded as a whole by the backend's operation deadline, and
    every single store request of the others by its own.

    All methods raise :class:`~trio_debounce.BackendUnavailableError` when the store
    cannot be reached or does not answer in time (the operation may still have been
    applied), :class:`~trio_debounce.BackendAuthError` on a permission error, and
    :class:`~trio_debounce.BackendError` for anything else.
    """

    #: True while a coordinator uses this backend (see :meth:`attach`).
    _in_use: bool = False
    #: True if :meth:`register` can never raise :exc:`trio.Cancelled` (every wait in
    #: it is shielded or refuses cancellation): the coordinator then spares the cancel
    #: scope it otherwise opens around each call.
    _register_uncancellable: bool = False
    #: What :meth:`attach` was given: the delivery a fire taken by :meth:`register`
    #: is committed under, and the callback that runs it (``"at-least-once"`` and None
    #: while no coordinator is attached: taken fires are then in
    #: :attr:`Registration.taken`).
    _ping_delivery: Delivery = "at-least-once"
    _taken_hook: Callable[[str, str, Finalization], None] | None = None
    _unproven_take_hook: Callable[[str, str, str], None] | None = None
    _event_hook: Callable[[BackendEvent], None] | None = None

    def attach(
        self,
        *,
        delivery: Delivery,
        on_taken: Callable[[str, str, Finalization], None] | None = None,
        on_unproven_take: Callable[[str, str, str], None] | None = None,
        on_event: Callable[[BackendEvent], None] | None = None,
    ) -> None:
        """Mark this backend as used by one coordinator (``open_coordinator`` calls it
        before its first request, :meth:`detach` when its block has closed).

        Args:
          delivery (str): the coordinator's ``"at-least-once"`` or ``"at-most-once"``:
            what a fire that :meth:`register` takes is committed under.
          on_taken: ``on_taken(workflow, key, finalization)``, called synchronously as
            soon as :meth:`register` has committed a taken fire (see
            :attr:`Registration.taken`), so that the coordinator runs it even if the
            ping then fails; None leaves taken fires in the registration.
          on_unproven_take: ``on_unproven_take(workflow, key, run_id)``, called
            synchronously when :meth:`register` sent the at-most-once commit of a
            taken fire and its answer did not come within ``op_timeout``: the
            coordinator proves it (:meth:`finalize` with ``take=True`` re-reads for up
            to a lease) and runs it if it landed; None drops such a fire.
          on_event: ``on_event(event)``, called synchronously with each
            :data:`~trio_debounce.BackendEvent` (store calls, lease renewals and
            lapses, proofs, skipped re-runs) when the coordinator has an ``on_event``
            hook; it never raises. None (the default): the backend reports nothing and
            spends nothing on it. A backend that reports nothing may ignore it.

        Raises:
          RuntimeError: another coordinator uses this backend (each needs its own:
            one process id each).
        """
        if self._in_use:
            raise RuntimeError(
                f"{self!r} already serves an open coordinator; give each coordinator "
                "its own backend (one process id each)"
            )
        self._in_use = True
        self._ping_delivery = delivery
        self._taken_hook = on_taken
        self._unproven_take_hook = on_unproven_take
        self._event_hook = on_event

    def detach(self) -> None:
        """The coordinator that :meth:`attach` marked is done with this backend."""
        self._in_use = False
        self._ping_delivery = "at-least-once"
        self._taken_hook = None
        self._unproven_take_hook = None
        self._event_hook = None

    @property
    @abc.abstractmethod
    def process_id(self) -> str:
        """This process's id (a uuid4 hex unless given)."""

    @property
    @abc.abstractmethod
    def heartbeat_interval(self) -> float:
        """Seconds between :meth:`refresh_lease` calls (a third of the lease by default)."""

    @abc.abstractmethod
    def lease_held(self) -> bool:
        """Is this process's own lease still live by its own clock, with the skew
        margin? If not, a peer may have taken its windows over: a stale owner checks
        this before it fires without the store's confirmation."""

    @abc.abstractmethod
    def wall_time(self) -> float:
        """The backend's wall clock, epoch seconds: every shared time is read here."""

    def take_deleted(self, run_id: str) -> bool:
        """Was the window of ``run_id``, which this process owned, found deleted by
        another writer (a peer's :meth:`cancel`, an operator's delete of its key) rather
        than fired? True at most once per run, so the coordinator counts it once (as a
        cancel, and in ``statistics().deleted_externally``). The default: never (a
        backend that cannot tell)."""
        return False

    @abc.abstractmethod
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
        flow: FlowSpec | None = None,
        size: int = 0,
        now: float | None = None,
    ) -> Registration:
        """Register one ping of ``(workflow, key)``, with its payload.

        ``max_count`` (window option, fixed by the first ping like ``mode``): the ping
        that brings the window's count to it makes the window due at once (its
        ``scheduled_at`` is now; a non-owner's ping gets ``take_at``). The coordinator
        passes it only when it is not None, so a backend written before it existed
        keeps working for windows without it. Likewise ``payload_policy`` (``"last"``
        or ``"first"``, fixed by the first ping: which payload the record keeps) and
        ``order_key`` (a window opened with one needs one on every ping: the kept
        payload is the one with the highest order key, or the lowest under
        ``"first"``). ``payload_policy="collect"`` keeps the list of the window's
        payloads (by order key, then arrival), at most ``max_items`` of them (the lowest
        dropped beyond), and a ping that cannot be written before the deadline raises
        rather than being absorbed unstored. The returned ``payload`` is then the
        record's, not the ping's. A named reducer (``payload_policy`` its name,
        ``reducer`` its ``(fn, initial)`` as registered in this process) keeps the
        accumulated value in the record, folded by each ping's compare-and-swap (``fn``
        may run more than once per ping, on a fresh copy each time). ``overflow``
        (``"fire-early"`` or ``"drop-oldest"``, with ``"collect"`` or a reducer): a ping
        into a window that holds ``max_items`` under ``"fire-early"`` writes nothing
        and returns ``overflowed``. ``overlap="queue-latest"`` (with ``run_timeout``)
        makes a window that comes due while its key's run executes wait (``waiting``).
        ``drop_stale``: a ping whose order key is not above the last fired one for the
        key is dropped (outcome ``stale``). The coordinator passes each of these only
        when it is not the default. ``flow`` (a throttle, audit, batch or rate-limit
        window's :class:`~trio_debounce._flow.FlowSpec`, fixed by the first ping; passed
        with the debounce mode, delay and max_delay it is shared as) and ``size`` (a
        batch item's serialized length, bytes) too: a ping of such a window may be
        ``dropped`` (nothing written) or ``fired`` (a rate-limit fire of its own run), a
        throttle's trailing fire keeps a cool-down in its tombstone, and a batch item
        that would take the batch past ``max_bytes`` finds it ``overflowed`` (see
        :doc:`/protocol`, "Flow-control windows"), its ``scheduled_at`` its own time:
        the caller takes that fire at that time, then registers the item again with
        ``now`` (wall clock), so that it opens the next batch at its own time.

        Atomic: the ping is applied to the window's record by one compare-and-swap
        (retried on conflict, with jittered backoff, until the operation deadline), or
        not at all. Not idempotent: each call is one more ping. The window's fire time
        becomes ``min(now + delay, first_ping + max_delay)``; ``mode`` and the cap
        belong to the record (the first ping's), ``run_id`` is used only when the ping
        opens a window. A record whose owner process is live is never replaced.
        ``payload`` is serialized into the record and becomes the window's latest
        payload.

        The ping's time ``now`` is this backend's :meth:`wall_time` when the call is
        made, kept through group commit, conflicts and retries. A ping whose time is
        at or after a stored window's due time (``scheduled_at``: its deadline, its
        cap, or the time of the ping that reached its ``max_count``) never joins that
        window, whoever owns it (this process, a live peer, a dead one): unless the
        window waits for its key's ``queue-latest`` run, the call first takes the
        window's fire by compare-and-swap (``finalize(take=True)`` under
        :meth:`attach`'s delivery; see :attr:`Registration.taken`), then opens the next
        window; a lost compare-and-swap re-reads (the window fired elsewhere: the
        ping opens the next one). This is a change of the contract: backends used to
        absorb such a late ping into the due window.

        Returns:
          Registration: see :class:`Registered` for the outcomes.

        Raises:
          ValueError: ``mode`` differs from the open window's mode, or the record would
            be too large (:class:`~trio_debounce.DocumentTooLargeError`).
          BackendUnavailableError: no answer before the deadline (and no live owner was
            seen to fall back on).
        """

    @abc.abstractmethod
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
        fire_at: float | None = None,
    ) -> Finalization:
        """Decide a window that is due on this process's clock.

        The window is named by its active ``run_id``. Fires only after a
        compare-and-swap on the exact revision read (a delete, or an at-most-once
        tombstone), so a ping that lands between the read and the commit is never lost
        (the commit fails and the call re-reads).
        Idempotent in effect: once a window has fired, later calls return ``abandoned``.

        Args:
          take: finalize a window this process does not own (it moved the fire earlier
            than the owner armed, see :attr:`Registration.take_at`).
          force: fire now even if the fire time has not come (a flush).
          delivery: ``"at-least-once"`` writes a fire record (returned as
            ``fire_id``) before the window is deleted, so a fire whose process dies in
            its handler runs again elsewhere; ``"at-most-once"`` commits the fire by one
            compare-and-swap that marks the window fired, and fires only when that is
            proven.
          fire_at: with ``force``, the fire's logical time (wall clock) instead of now:
            the time of the batch item that found the window full. Passed only when
            set, so a backend that predates it keeps working.
          early: fire even while the key's ``queue-latest`` run blocks (a window that
            overflowed under ``"fire-early"``). Without it, a ``queue-latest`` window
            that is due (or forced) while its key's run blocks is not fired: the result
            is ``reschedule`` to when to look again (its record is made due now if
            forced, so it waits).

        If the store cannot be reached, the call raises
        :class:`~trio_debounce.BackendUnavailableError`. Under at-least-once, an owner's
        call first queues a revision-checked delete of the window (and of a fire record
        it may have left), applied by a later :meth:`refresh_lease`, and the owner fires
        anyway; under at-most-once the window is left in the store, unfired, for a
        later reconcile (unless the lost commit had landed).

        Raises:
          LeaseLapsedError: (a :class:`~trio_debounce.BackendUnavailableError`) an
            owner's call failed while this process's lease had lapsed: the caller must
            not fire unconfirmed, and calls again for the same run once a heartbeat
            renewed the lease. A commit of the failed call that landed is proven by that
            call, or by the next :meth:`adopt_orphans`, which returns it in
            :attr:`Orphans.fires` (attempt 1) to be run; one that did not land is taken
            back. A taker's failed at-least-once commit is settled the same way.
          BackendUnavailableError: otherwise, as above.
        """

    async def end_run(self, workflow: str, key: str, run_id: str) -> str | None:
        """The handler of the ``queue-latest`` fire ``run_id`` (a :class:`Finalization`
        with ``blocks``) returned: the run stops blocking its key.

        A compare-and-swap on the key's record, if it still names this run. Returns
        the run id of a window of the key that is due and waiting for the run: the
        caller finalizes it with ``take=True, force=True`` and fires it now; None
        otherwise. Idempotent. The default does nothing (a backend without
        ``queue-latest``).
        """
        return None

    @abc.abstractmethod
    async def complete(self, fire_id: str) -> None:
        """The handler of the fire ``fire_id`` returned: delete its fire record
        (revision-checked; queued for a later :meth:`refresh_lease` if the store cannot
        be reached). Idempotent."""

    @abc.abstractmethod
    async def cancel(self, workflow: str, key: str) -> bool:
        """Close the window ``(workflow, key)`` without firing, whoever owns it.

        A revision-checked write of a cancel tombstone (see :doc:`/protocol`,
        "Tombstones that keep a key's state"). Returns True if a window was open.
        Idempotent: a second call returns False.
        """

    async def request_flush(self, workflow: str, key: str) -> WindowStatus | None:
        """Ask that the open window ``(workflow, key)`` fire now, whoever owns it: the
        steering of ``trio-debounce flush`` (see :doc:`/cli`, "Steering a window").

        Makes the window due now by a compare-and-swap of its document, and, when its
        owner is live, leaves the owner a request that its heartbeat reads
        (:meth:`take_flush_requests`): the owner fires it within about one heartbeat
        interval. A dead owner's window is fired by the survivor that adopts it. The
        fire happens in the owner (or adopter), by the protocol's usual rules, so it
        can never happen twice; it is a ``flush`` fire
        (:class:`~trio_debounce.FireStarted`).

        Returns:
          WindowStatus | None: the window as written (``scheduled_at`` now), or None
          if no trailing fire is pending: no open window, or a leading edge's
          (nothing to flush; nothing is written).

        Raises:
          NotImplementedError: this backend cannot be steered (the default).
          BackendUnavailableError: not done within the operation deadline.
          BackendError: the store failed.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot flush a window from outside")

    async def take_flush_requests(self) -> list[tuple[str, str, str]]:
        """The flush requests left for this process (:meth:`request_flush`), each
        ``(workflow, key, run_id)``, read and removed; called by the heartbeat after
        each :meth:`refresh_lease`. The default has none.

        Raises:
          BackendError: the store failed (the heartbeat counts an outage).
        """
        await trio.lowlevel.checkpoint()
        return []

    @abc.abstractmethod
    async def refresh_lease(self) -> Collection[str]:
        """Renew this process's lease (creating it on the first call), and re-read the
        other processes' leases.

        Also applies deletes queued while the store was unreachable. Idempotent.

        Returns:
          the ids of processes found dead since the last call: lease lapsed (beyond the
          skew), gone, or released by a hand-off.
        """

    async def wait_process_id_free(self) -> None:
        """Wait, before the first :meth:`refresh_lease`, until no live coordinator holds
        this backend's :attr:`process_id`: called once by the coordinator at start.

        The default returns at once (a checkpoint): a backend without stable process
        ids has nothing to wait for. :class:`~trio_debounce.testing.MemoryBackend` and
        the NATS backend watch a live lease of another opening of the id for the
        holder's heartbeat interval plus ``max_clock_skew`` (see :doc:`/protocol`,
        *Process*), re-reading it a few times; it writes nothing.

        Raises:
          ProcessIdTakenError: the lease was renewed meanwhile: a live coordinator
            holds the process id, and this one must not start.
          BackendUnavailableError: the store could not be read.
        """
        await trio.lowlevel.checkpoint()

    @abc.abstractmethod
    async def adopt_orphans(self, workflows: Collection[str]) -> Orphans:
        """Take over, by compare-and-swap, the open windows and interrupted fires of
        dead processes, for the given workflows (those this coordinator handles).

        Scans the window and fire records once; nothing is taken over during the grace
        period after an outage. Returns what was adopted, and the windows this process
        owns (so a reconcile needs no second listing)."""

    @abc.abstractmethod
    async def window_status(self, workflow: str, key: str) -> WindowStatus | None:
        """The cluster-wide state of the open window ``(workflow, key)``, or None."""

    async def inspect(
        self, workflow: str | None = None, key_prefix: str | None = None
    ) -> list[WindowInfo]:
        """Every window of the store, whoever owns it, for operators (reads only; no
        lease of this process is needed).

        Args:
          workflow (str | None): only this workflow's windows (the store filters them).
          key_prefix (str | None): only windows whose debounce key starts with it
            (filtered after listing the workflow's keys: a listing grows with the
            number of keys).

        Returns:
          list[WindowInfo]: open windows, and fired ones whose handler still runs
          (at least once), sorted by workflow and key.

        Raises:
          TypeError, ValueError: a bad ``workflow`` or ``key_prefix``.
          NotImplementedError: this backend cannot list its store (the default).
          BackendError: the store failed.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list its windows")

    def open_window_watch(
        self, workflow: str | None = None, key_prefix: str | None = None
    ) -> AbstractAsyncContextManager[AsyncIterator[WindowChange]]:
        """Follow the store's windows, whoever owns them, for operators: an async
        context manager whose value is an async iterator of :class:`WindowChange`.

        ::

            async with backend.open_window_watch("orders") as changes:
                async for change in changes:
                    print(change.change, change.key, change.window)

        The iterator first gives a ``"listed"`` change per window there when the
        watch opened (what :meth:`inspect` would list), then one change per later
        change, as it happens; it never ends on its own. Reads only, like
        :meth:`inspect`: no lease of this process is needed, nothing is written. The
        watch stops when the block exits.

        Args:
          workflow (str | None): only this workflow's windows.
          key_prefix (str | None): only windows whose debounce key starts with it.

        Raises:
          NotImplementedError: this backend cannot watch its store (the default;
            raised by the call, before the ``async with``).
          TypeError, ValueError: a bad ``workflow`` or ``key_prefix`` (on entering).
          BackendError: the store could not be read when the watch opened (on
            entering), or later in a way that retrying cannot mend (from the
            iteration: a refused permission, for instance).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot watch its windows")

    async def processes(self) -> list[ProcessInfo]:
        """Every process lease of the store, with the windows and fire records each
        holds, sorted by process id (reads only).

        Raises:
          NotImplementedError: this backend cannot list its store (the default).
          BackendError: the store failed.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list its processes")

    @abc.abstractmethod
    async def owned_windows(self) -> list[OwnedWindow]:
        """The windows whose records name this process (and this opening of it) as
        owner, for reconciling with the coordinator's local tasks."""

    @abc.abstractmethod
    async def sweep(self) -> int:
        """Remove garbage with revision-checked operations: delete markers (of windows,
        fire records and leases), at-most-once tombstones a lease old, and the leases of
        long-dead processes. At most one process sweeps at a time.

        Returns the number of records removed (0 if another process holds the sweep).
        Windows of dead owners are kept (survivors adopt them).
        """

    async def mark_draining(self) -> None:
        """The start of a hand-off exit: mark this process's lease *draining* (it still
        renews it), so that live peers take its windows over at their next heartbeat
        while it waits for its running handlers; its fire records stay its own until
        :meth:`handoff`. The default does nothing (peers then wait for the hand-off).

        Raises:
          BackendError: the store failed (the caller logs it and goes on).
        """
        await trio.lowlevel.checkpoint()

    @abc.abstractmethod
    async def handoff(self) -> None:
        """Leave: mark this process's lease released (its process counts as dead at
        once) but keep its windows and fire records, so live peers (or the next
        coordinator that handles the workflow) take them over at their next look.
        Called once, shielded, instead of :meth:`release`. Idempotent."""

    @abc.abstractmethod
    async def release(
        self, runs: Collection[str] | None = None, *, own_only: Collection[str] = ()
    ) -> Collection[str] | None:
        """Leave: apply the deletes queued during an outage, delete (revision-checked)
        the window records of ``runs`` that this process owns (all it owns when None),
        then delete its lease. Windows it owns but does not delete stay in the store, and
        peers adopt them once the lease is gone. Called once, shielded, when the
        coordinator's block is left. Idempotent.

        Args:
          runs (Collection[str] | None): run ids of owned windows to delete.
          own_only (Collection[str]): run ids of owned windows to delete only if every
            ping stored in them came from this process (an explicit
            ``on_exit="cancel"``); one that holds a peer's ping is left for a peer.

        Returns:
          Collection[str] | None: the run ids whose windows it deleted (None: not
          known, a backend that predates ``own_only``).
        """
