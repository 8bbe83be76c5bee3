"""The coordinator's flow-control methods: :meth:`~Coordinator.throttle`,
:meth:`~Coordinator.batch` and :meth:`~Coordinator.rate_limit`, and their ``_nowait``
forms (a mixin of :class:`~trio_debounce.Coordinator`; the rules are
:mod:`._flow`'s, the windows :mod:`._flow_local`'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio
from trio.lowlevel import enable_ki_protection

from . import _options, _validate
from ._events import PingAnswered, PingRejected
from ._flow import DEFAULT_BATCH_ITEMS, Flow, FlowSpec, stored_as
from ._payload import JsonSerializer
from ._shared import await_ping
from ._types import DebounceResult, Handler, Overlap

if TYPE_CHECKING:
    from ._backend import DebounceBackend
    from ._firing import Ledger
    from ._flow_local import FlowWindows
    from ._shared import SharedWindows


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return value


def throttle_spec(
    interval: object,
    leading: object,
    trailing: object,
    overlap: object = _options.ALLOW,
    run_timeout: object = None,
) -> FlowSpec:
    """The :class:`FlowSpec` of ``throttle(interval, leading=, trailing=, overlap=,
    run_timeout=)``, checked (``"queue-latest"``: only without a leading edge)."""
    span = _validate.positive_duration("interval", interval)
    if not isinstance(leading, bool) or not isinstance(trailing, bool):
        raise TypeError(f"leading and trailing must be bools, got {leading!r} and {trailing!r}")
    if not leading and not trailing:
        raise ValueError("throttle needs an edge: leading and trailing cannot both be False")
    refusal = None
    if leading:
        refusal = "overlap='queue-latest' needs throttle(leading=False) (an audit)"
    how, timeout = _options.overlap_of(overlap, run_timeout, refusal)
    if not leading:
        queue = how == _options.QUEUE_LATEST
        return FlowSpec(
            Flow.AUDIT, span, leading=False, trailing=True, queue=queue, run_timeout=timeout
        )
    return FlowSpec(Flow.THROTTLE, span, leading=True, trailing=trailing)


def batch_spec(
    max_items: object,
    max_wait: object,
    max_bytes: object,
    overlap: object = _options.ALLOW,
    run_timeout: object = None,
) -> FlowSpec:
    """The :class:`FlowSpec` of ``batch(max_items=, max_wait=, max_bytes=, overlap=,
    run_timeout=)``, checked."""
    span = _validate.positive_duration("max_wait", max_wait)
    items = DEFAULT_BATCH_ITEMS if max_items is None else _positive_int("max_items", max_items)
    limit = None if max_bytes is None else _positive_int("max_bytes", max_bytes)
    how, timeout = _options.overlap_of(overlap, run_timeout, None)
    queue = how == _options.QUEUE_LATEST
    return FlowSpec(
        Flow.BATCH, span, max_items=items, max_bytes=limit, queue=queue, run_timeout=timeout
    )


def item_size(spec: FlowSpec, item: Any) -> int:
    """A batch item's size against ``max_bytes``: its JSON length in UTF-8 bytes (0
    without a byte bound).

    Raises:
      ValueError: the item alone is larger than ``max_bytes``.
    """
    if spec.max_bytes is None:
        return 0
    size = len(JsonSerializer().dumps(item).encode("utf-8"))
    if size > spec.max_bytes:
        raise ValueError(f"the item is {size} bytes as JSON, more than max_bytes={spec.max_bytes}")
    return size


def rate_limit_spec(limit: object, period: object, overlap: object = _options.ALLOW) -> FlowSpec:
    """The :class:`FlowSpec` of ``rate_limit(limit=, period=, overlap=)``, checked
    (``"queue-latest"`` is refused: every fire of a rate limit is a leading edge)."""
    span = _validate.positive_duration("period", period)
    refusal = "overlap='queue-latest' does not apply to rate_limit (every fire is leading)"
    _options.overlap_of(overlap, None, refusal)
    return FlowSpec(Flow.RATE_LIMIT, span, limit=_positive_int("limit", limit))


def _plain_overlap(overlap: object, run_timeout: object) -> bool:
    """May a ping with these take the fast path, whose check is only that its raw
    arguments equal the open window's? Only with exact types: ``True == 1.0``, so an
    equal but ill-typed value must take the slow path, which refuses it."""
    return type(overlap) is str and (run_timeout is None or type(run_timeout) is float)


# The first item of each method's raw-argument tuple (FlowWindow.params).
_THROTTLE, _BATCH, _RATE_LIMIT = "throttle", "batch", "rate-limit"


class FlowControl:
    """The flow-control methods of :class:`~trio_debounce.Coordinator`."""

    # Set by Coordinator.__init__.
    _flow: FlowWindows
    _ledger: Ledger
    _backend: DebounceBackend | None
    _shared: SharedWindows | None

    def _flow_plain(self) -> bool:
        """May a ping take the fast path (no backend, no event hook)?"""
        return self._backend is None and self._ledger.hook is None

    def _flow_ping(
        self,
        spec: FlowSpec,
        workflow: str,
        key: str,
        payload: Any,
        run_id: str | None,
        on_fire: Handler | None,
        size: int = 0,
        params: tuple[Any, ...] = (),
    ) -> DebounceResult:
        if self._backend is not None:
            raise RuntimeError(
                f"{spec.flow.value}_nowait() cannot reach the backend (it does no I/O); "
                f"with a backend, await the {spec.flow.value.replace('-', '_')}() method"
            )
        if self._ledger.hook is None:
            return self._flow.ping(spec, workflow, key, payload, run_id, on_fire, size, params)
        at = trio.current_time()
        try:
            result = self._flow.ping(spec, workflow, key, payload, run_id, on_fire, size, params)
        except Exception as exc:
            self._ledger.emit(PingRejected(workflow, key, exc, at))
            raise
        self._ledger.emit(PingAnswered(workflow, key, result, at))
        return result

    async def _flow_await(
        self,
        spec: FlowSpec,
        workflow: str,
        key: str,
        payload: Any,
        run_id: str | None,
        on_fire: Handler | None,
        size: int = 0,
    ) -> DebounceResult:
        """A flow ping with a backend: registered in the shared window, shielded, as
        :meth:`Coordinator.debounce` registers one (see :doc:`/protocol`, "Flow-control
        windows")."""
        shared = self._shared
        assert shared is not None
        at = trio.current_time()
        span = spec.span
        call = shared.ping(
            workflow, key, payload, span, span, stored_as(spec), run_id, on_fire, None, spec, size
        )
        return await await_ping(shared, self._ledger, workflow, key, at, call)

    # ---------------------------------------------------------------- throttle

    @enable_ki_protection
    def throttle_nowait(
        self,
        workflow: str,
        key: str,
        payload: Any = None,
        *,
        interval: float,
        leading: bool = True,
        trailing: bool = True,
        overlap: Overlap = "allow",
        run_timeout: float | None = None,
        run_id: str | None = None,
        on_fire: Handler | None = None,
    ) -> DebounceResult:
        """Throttle ``(workflow, key)``: fire at most once per ``interval`` seconds.

        With both edges (the default, as lodash's ``throttle``): a ping while no
        window is open fires at once (a leading edge, outcome ``fire-immediate``) and
        opens a window of ``interval`` seconds; later pings in it are absorbed
        (``coalesce``) without moving its end; at its end, if a ping came after the
        leading fire, the latest of them fires (a trailing edge, reason ``interval``)
        and opens a *cool-down* window of ``interval`` seconds, whose pings fire as the
        next trailing edge at its end, and so on; a window with no ping since its last
        fire fires nothing and closes. So the fires of a key are at least ``interval``
        apart, never closer (unlike lodash's, whose leading edge can follow a trailing
        one at once; as RxJS 7's ``throttleTime`` with both edges).

        ``trailing=False``: the pings after the leading fire are dropped (outcome
        ``dropped``, counted in ``statistics().dropped_pings``), and the window ends
        ``interval`` after it opened. It fires like ``debounce(mode="leading",
        max_delay=interval)`` except that those pings are drops, not coalesced pings.

        ``leading=False`` (an *audit*, RxJS's ``auditTime``): the first ping opens a
        window (``schedule-trailing``), later pings replace its payload (the timer is
        not restarted), and the latest fires at ``interval`` after the first; then the
        window is closed.

        A ping at exactly a window's end belongs to what comes next (the tie rule of
        :doc:`/semantics`). ``interval``, ``leading`` and ``trailing`` belong to the
        window, fixed by its first ping: a later ping with other values raises
        :exc:`ValueError`, as does a throttle ping for a key with an open debounce,
        batch or rate-limit window.

        Args:
          workflow (str): the window's workflow, as for :meth:`debounce_nowait`.
          key (str): the window's debounce key.
          payload (Any): what a fire carries: a leading fire its own ping's, a trailing
            fire the latest since the last fire.
          interval (float): seconds > 0, finite.
          leading (bool): fire a window's first ping at once.
          trailing (bool): fire the latest later ping at the window's end (leading
            and trailing cannot both be False).
          overlap (str): ``"allow"`` (the default): fires of a key may run at once.
            ``"queue-latest"`` (an audit only: ``leading=False``; a leading edge is
            committed at ping time and cannot wait): a window that comes due while
            the handler of its key's previous fire is executing waits for it,
            absorbing pings, and fires the latest when that handler returns (reason
            ``run-end``), as ``debounce(overlap="queue-latest")`` does. So one key's
            handlers never overlap, and its fires are still at least ``interval``
            apart (spacing is measured on the fire times, not on handler ends).
          run_timeout (float | None): seconds > 0, only with ``"queue-latest"``: a
            run stops blocking its key this long after its fire (the handler is not
            cancelled; the next fire then overlaps it).
          run_id (str | None): the run id of the window this ping opens (a uuid4 hex
            when None); the leading and trailing fires of a window share it, each
            cool-down has its own.
          on_fire: the window's handler (the latest non-None among its pings), else
            the workflow's.

        Returns:
          DebounceResult: ``fire-immediate``, ``schedule-trailing``, ``coalesce`` or
          ``dropped``; ``scheduled_at`` is the window's end while a trailing fire is
          pending (Trio's clock), else None; ``ping_count`` the pings its next fire
          carries.

        Raises:
          TypeError, ValueError: a bad argument (named), or parameters that differ
            from the open window's.
          LookupError: no ``on_fire`` and no handler for ``workflow``.
          RuntimeError: the coordinator has a backend (a ``_nowait`` call does no
            I/O: await :meth:`throttle`).
          trio.ClosedResourceError: the ``async with`` block has exited.
        """
        params = (_THROTTLE, interval, leading, trailing, overlap, run_timeout)
        if (
            type(interval) is float
            and type(leading) is bool
            and type(trailing) is bool
            and _plain_overlap(overlap, run_timeout)
            and self._flow_plain()
        ):
            result = self._flow.ping_open(params, workflow, key, payload, run_id, on_fire)
            if result is not None:
                return result
        spec = throttle_spec(interval, leading, trailing, overlap, run_timeout)
        return self._flow_ping(spec, workflow, key, payload, run_id, on_fire, 0, params)

    async def throttle(
        self,
        workflow: str,
        key: str,
        payload: Any = None,
        *,
        interval: float,
        leading: bool = True,
        trailing: bool = True,
        overlap: Overlap = "allow",
        run_timeout: float | None = None,
        run_id: str | None = None,
        on_fire: Handler | None = None,
    ) -> DebounceResult:
        """:meth:`throttle_nowait`, as a checkpoint (a cancelled caller raises
        :exc:`trio.Cancelled` before any state changes).

        With a backend (``open_coordinator(backend=...)``) the ping is registered in the
        key's shared window, one window across processes whoever pings it (see
        :doc:`/protocol`, "Flow-control windows"), shielded from cancellation and within
        the backend's operation deadline, as :meth:`debounce` registers one;
        ``DebounceResult.owner`` and ``stored`` as for :meth:`debounce`. The same goes
        for :meth:`batch` and :meth:`rate_limit`.

        Raises:
          trio_debounce.BackendUnavailableError: with a backend, the ping was not taken
            (whatever ``on_backend_error``: a flow window never fails open).
          TypeError, ValueError, LookupError, trio.ClosedResourceError: as
            :meth:`throttle_nowait`.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._shared is not None:
            spec = throttle_spec(interval, leading, trailing, overlap, run_timeout)
            return await self._flow_await(spec, workflow, key, payload, run_id, on_fire)
        result = self.throttle_nowait(
            workflow,
            key,
            payload,
            interval=interval,
            leading=leading,
            trailing=trailing,
            overlap=overlap,
            run_timeout=run_timeout,
            run_id=run_id,
            on_fire=on_fire,
        )
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    # ------------------------------------------------------------------- batch

    @enable_ki_protection
    def batch_nowait(
        self,
        workflow: str,
        key: str,
        item: Any,
        *,
        max_wait: float,
        max_items: int | None = None,
        max_bytes: int | None = None,
        overlap: Overlap = "allow",
        run_timeout: float | None = None,
        run_id: str | None = None,
        on_fire: Handler | None = None,
    ) -> DebounceResult:
        """Add ``item`` to the batch of ``(workflow, key)``; a batch fires the list of
        its items, in order, when it is full or old enough.

        The first item opens a batch (``schedule-trailing``); later items are appended
        (``coalesce``). It fires (a trailing edge) at the ``max_items``-th item, at
        that instant, by that call (reason ``max-items``); ``max_wait`` seconds after
        its first item (``max-wait``); or, before an item that would take its size past
        ``max_bytes``, at that instant (``max-bytes``), that item opening the next
        batch. So no fire holds more than ``max_items`` items or ``max_bytes`` bytes
        (unlike Inngest's batch, which fires when it reaches its size cap). An item at
        exactly ``max_wait`` after the first belongs to the next batch. The handler
        runs as a task, never inside this call.

        For debounce timing with a batch payload (fire after a silence, not at a fixed
        age), use ``debounce(..., payload_policy="collect", max_count=N)``: see
        :doc:`/semantics`, "Throttle, batch and rate limit".

        Args:
          item (Any): the item; its size is its length in UTF-8 bytes as JSON (the
            serializer of a backend's documents), counted against ``max_bytes``.
          max_wait (float): seconds > 0, finite.
          max_items (int | None): >= 1 (default 1000: a batch is always bounded).
          max_bytes (int | None): >= 1, or None for no byte bound.
          overlap (str): ``"allow"`` (the default) or ``"queue-latest"``: a batch
            that comes due (``max_wait``, or its ``max_items``-th item) while the
            handler of its key's previous batch is executing waits for it, taking
            more items, and fires when that handler returns (reason ``run-end``). It
            stays bounded while it waits: an item it cannot hold (past ``max_items``
            or ``max_bytes``) fires it at once (reason ``max-items`` or
            ``max-bytes``), the previous handler still running, and opens the next
            batch.
          run_timeout (float | None): as for :meth:`throttle_nowait`.
          workflow, key, run_id, on_fire: as for :meth:`throttle_nowait`.

        Returns:
          DebounceResult: ``schedule-trailing`` (this item opened a batch),
          ``coalesce``, or ``fire-immediate`` (a batch of one item); ``ping_count``
          the items of the batch (of the fire, for the item that completed it).

        Raises:
          ValueError: also for an item alone larger than ``max_bytes`` (nothing
            changes), and parameters that differ from the open batch's.
          TypeError, LookupError, RuntimeError, trio.ClosedResourceError: as
            :meth:`throttle_nowait`.
        """
        params = (_BATCH, max_wait, max_items, max_bytes, overlap, run_timeout)
        if (
            max_bytes is None
            and type(max_wait) is float
            and (max_items is None or type(max_items) is int)
            and _plain_overlap(overlap, run_timeout)
            and self._flow_plain()
        ):
            result = self._flow.ping_open(params, workflow, key, item, run_id, on_fire)
            if result is not None:
                return result
        spec = batch_spec(max_items, max_wait, max_bytes, overlap, run_timeout)
        size = item_size(spec, item)
        return self._flow_ping(spec, workflow, key, item, run_id, on_fire, size, params)

    async def batch(
        self,
        workflow: str,
        key: str,
        item: Any,
        *,
        max_wait: float,
        max_items: int | None = None,
        max_bytes: int | None = None,
        overlap: Overlap = "allow",
        run_timeout: float | None = None,
        run_id: str | None = None,
        on_fire: Handler | None = None,
    ) -> DebounceResult:
        """:meth:`batch_nowait`, as a checkpoint; with a backend, shared as
        :meth:`throttle` says (a batch's items are kept in its document, bounded by
        ``max_items``, ``max_bytes`` and the store's size limit)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._shared is not None:
            spec = batch_spec(max_items, max_wait, max_bytes, overlap, run_timeout)
            size = item_size(spec, item)
            return await self._flow_await(spec, workflow, key, item, run_id, on_fire, size)
        result = self.batch_nowait(
            workflow,
            key,
            item,
            max_wait=max_wait,
            max_items=max_items,
            max_bytes=max_bytes,
            overlap=overlap,
            run_timeout=run_timeout,
            run_id=run_id,
            on_fire=on_fire,
        )
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    # -------------------------------------------------------------- rate limit

    @enable_ki_protection
    def rate_limit_nowait(
        self,
        workflow: str,
        key: str,
        payload: Any = None,
        *,
        limit: int,
        period: float,
        overlap: Overlap = "allow",
        run_id: str | None = None,
        on_fire: Handler | None = None,
    ) -> DebounceResult:
        """Fire each ping of ``(workflow, key)`` at once, at most ``limit`` per window
        of ``period`` seconds.

        The first ping opens a window of ``period`` seconds, fixed from that ping;
        each of its first ``limit`` pings fires at once (a leading edge, its own run,
        outcome ``fire-immediate``); the rest are dropped (``dropped``, counted in
        ``statistics().dropped_pings``). A ping at or after the window's end opens the
        next window. A fixed window, not a sliding one or a GCRA (Inngest's
        ``rateLimit``): up to ``2 * limit`` fires can fall within ``period`` seconds
        that span two windows.

        Args:
          limit (int): >= 1.
          period (float): seconds > 0, finite.
          overlap (str): ``"allow"`` only: ``"queue-latest"`` raises
            :exc:`ValueError`, as for a leading debounce window (each fire is a
            leading edge, committed at ping time).
          run_id (str | None): this fire's run id (a uuid4 hex when None).
          workflow, key, payload, on_fire: as for :meth:`throttle_nowait`.

        Returns:
          DebounceResult: ``fire-immediate`` or ``dropped``.

        Raises:
          TypeError, ValueError, LookupError, RuntimeError, trio.ClosedResourceError:
            as :meth:`throttle_nowait`.
        """
        params = (_RATE_LIMIT, limit, period, overlap)
        if (
            type(period) is float
            and type(limit) is int
            and _plain_overlap(overlap, None)
            and self._flow_plain()
        ):
            result = self._flow.ping_open(params, workflow, key, payload, run_id, on_fire)
            if result is not None:
                return result
        spec = rate_limit_spec(limit, period, overlap)
        return self._flow_ping(spec, workflow, key, payload, run_id, on_fire, 0, params)

    async def rate_limit(
        self,
        workflow: str,
        key: str,
        payload: Any = None,
        *,
        limit: int,
        period: float,
        overlap: Overlap = "allow",
        run_id: str | None = None,
        on_fire: Handler | None = None,
    ) -> DebounceResult:
        """:meth:`rate_limit_nowait`, as a checkpoint; with a backend, shared as
        :meth:`throttle` says (the window's fires are counted in its document, so the
        limit holds across processes)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._shared is not None:
            spec = rate_limit_spec(limit, period, overlap)
            return await self._flow_await(spec, workflow, key, payload, run_id, on_fire)
        result = self.rate_limit_nowait(
            workflow,
            key,
            payload,
            limit=limit,
            period=period,
            overlap=overlap,
            run_id=run_id,
            on_fire=on_fire,
        )
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result
