"""The conformance suite every :class:`~trio_debounce.abc.DebounceBackend` must pass."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from .._backend import DebounceBackend, Finalized, Registered
from .._types import Mode

OpenBackends = Callable[[int], AbstractAsyncContextManager[Sequence[DebounceBackend]]]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


async def check_debounce_backend(
    open_backends: OpenBackends,
    *,
    process_lease: float,
    max_clock_skew: float,
    tick: float = 0.1,
) -> None:
    """Run the protocol's conformance checks against a backend implementation.

    Args:
      open_backends: ``open_backends(n)`` is an async context manager yielding ``n``
        fresh backends that share one store, each with its own process id (one that no
        live lease holds: a live lease of the id is watched for a renewal before the
        first write, see :doc:`/protocol`, *Process*), a process lease of
        ``process_lease`` seconds and a clock skew tolerance of ``max_clock_skew``
        seconds. They must not be attached to coordinators: the suite calls the
        methods itself.
      process_lease (float): the backends' process lease, seconds.
      max_clock_skew (float): the backends' tolerated clock skew, seconds.
      tick (float): the unit of the suite's delays, seconds: long enough for a few
        round trips to the store (the suite's windows last 10 to 20 ticks).

    Works under :class:`trio.testing.MockClock` (pure-Trio backends) and on the real
    clock (network backends). Each check uses its own workflow name, so a shared
    store left over from earlier checks does not interfere.

    A change of the contract: a ping at or after a window's due time must take the
    window's fire (:attr:`~trio_debounce.abc.Registration.taken`) and open the next
    window (``late_ping_takes_the_fire``, also after a ``max_count`` was reached, and the
    last ping of ``cap_is_kept``). The
    suite used to require the opposite: that such a ping be absorbed into the due
    window, moving its time, while its owner lived (``late_ping_is_absorbed``).

    Raises:
      AssertionError: a check failed; the message says which rule was broken.
    """
    checks = (
        _outcomes,
        _cap_is_kept,
        _finalize,
        _late_ping_takes_the_fire,
        _cancel,
        _take,
        _release,
        _concurrent_pings,
        _sweep,
        _takeover,
        _payloads_and_tokens,
        _at_most_once,
        _adopt_orphans_and_status,
    )
    for check in checks:
        try:
            await check(open_backends, process_lease, max_clock_skew, tick)
        except AssertionError as exc:
            raise AssertionError(f"{check.__name__.strip('_')}: {exc}") from exc


def _workflow(name: str) -> str:
    return f"conformance-{name}-{uuid.uuid4().hex[:8]}"


async def _outcomes(open_backends: OpenBackends, lease: float, skew: float, tick: float) -> None:
    wf = _workflow("outcomes")
    async with open_backends(2) as (a, b):
        t0 = a.wall_time()
        r1 = await a.register(
            wf, "k", mode=Mode.TRAILING, delay=20 * tick, max_delay=None, run_id="r1"
        )
        _check(r1.outcome is Registered.OPENED and r1.owner, f"first ping: {r1}")
        _check(r1.run_id == "r1" and r1.ping_count == 1 and r1.stored, f"first ping: {r1}")
        _check(abs(r1.scheduled_at - (r1.first_ping_at + 20 * tick)) < 1e-6, f"fire time {r1}")
        _check(t0 <= r1.first_ping_at <= a.wall_time(), f"first ping time {r1}")
        r2 = await a.register(
            wf, "k", mode=Mode.TRAILING, delay=20 * tick, max_delay=None, run_id="x"
        )
        _check(r2.outcome is Registered.EXTENDED and r2.run_id == "r1", f"owner's 2nd ping: {r2}")
        _check(r2.ping_count == 2 and r2.first_ping_at == r1.first_ping_at, f"2nd ping: {r2}")
        r3 = await b.register(
            wf, "k", mode=Mode.TRAILING, delay=20 * tick, max_delay=None, run_id="y"
        )
        _check(r3.outcome is Registered.COALESCED and not r3.owner, f"peer's ping: {r3}")
        _check(r3.run_id == "r1" and r3.ping_count == 3, f"peer's ping: {r3}")
        try:
            await b.register(wf, "k", mode=Mode.LEADING, delay=tick, max_delay=None, run_id="z")
        except ValueError:
            pass
        else:
            raise AssertionError("a ping with another mode was accepted")
        r4 = await b.register(
            wf, "k", mode=Mode.TRAILING, delay=20 * tick, max_delay=None, run_id="y"
        )
        _check(r4.ping_count == 4, f"a refused ping was counted: {r4}")
        await a.cancel(wf, "k")


async def _cap_is_kept(open_backends: OpenBackends, lease: float, skew: float, tick: float) -> None:
    wf = _workflow("cap")
    async with open_backends(2) as (a, b):
        # Pings 2 ticks apart, each pushing the deadline 6 ticks on: the last one (at
        # about 6 ticks) would put it at 12, past the cap at 10. The 4 ticks between
        # the last ping and the cap leave room for a loaded machine's slow calls.
        r = await a.register(
            wf, "k", mode=Mode.TRAILING, delay=6 * tick, max_delay=10 * tick, run_id="r"
        )
        cap = r.first_ping_at + 10 * tick
        for i in range(3):
            await trio.sleep(2 * tick)
            who = (a, b)[i % 2]
            r = await who.register(
                wf, "k", mode=Mode.TRAILING, delay=6 * tick, max_delay=None, run_id="x"
            )
            _check(r.scheduled_at <= cap + 1e-6, f"ping {i + 2} pushed the fire past the cap: {r}")
        _check(abs(r.scheduled_at - cap) < 1e-6, f"the cap was not applied: {r}, cap {cap}")
        # A ping after the cap never joins the window: it takes its fire (at the cap,
        # with the window's four pings) and opens the next one.
        await trio.sleep(5 * tick)
        r = await b.register(
            wf, "k", mode=Mode.TRAILING, delay=6 * tick, max_delay=None, run_id="y"
        )
        _check(r.outcome is Registered.OPENED and r.run_id == "y", f"a ping after the cap: {r}")
        _check(len(r.taken) == 1, f"a ping after the cap did not take the fire: {r}")
        fire = r.taken[0]
        _check(fire.outcome is Finalized.FIRE and fire.ping_count == 4, f"the cap's fire: {fire}")
        _check(abs((fire.scheduled_at or 0.0) - cap) < 1e-6, f"fired past the cap: {fire}")
        if fire.fire_id is not None:
            await b.complete(fire.fire_id)
        f = await a.finalize(wf, "k", "r")
        _check(f.outcome is Finalized.ABANDONED, f"the owner's finalize after the take: {f}")
        await b.cancel(wf, "k")


async def _finalize(open_backends: OpenBackends, lease: float, skew: float, tick: float) -> None:
    wf = _workflow("finalize")
    async with open_backends(2) as (a, b):
        r = await a.register(
            wf, "k", mode=Mode.TRAILING, delay=5 * tick, max_delay=None, run_id="r"
        )
        early = await a.finalize(wf, "k", "r")
        _check(early.outcome is Finalized.RESCHEDULE, f"finalize before the fire time: {early}")
        _check(early.scheduled_at == r.scheduled_at, f"reschedule time: {early} vs {r}")
        other = await b.finalize(wf, "k", "r")
        _check(other.outcome is Finalized.ABANDONED, f"a non-owner's finalize: {other}")
        wrong = await a.finalize(wf, "k", "not-the-run")
        _check(wrong.outcome is Finalized.ABANDONED, f"finalize with another run id: {wrong}")
        await trio.sleep(r.scheduled_at - a.wall_time() + tick)
        fired = await a.finalize(wf, "k", "r")
        _check(fired.outcome is Finalized.FIRE, f"finalize when due: {fired}")
        _check(fired.ping_count == 1 and fired.mode is Mode.TRAILING, f"fire: {fired}")
        _check(fired.scheduled_at == r.scheduled_at, f"logical fire time: {fired} vs {r}")
        again = await a.finalize(wf, "k", "r")
        _check(again.outcome is Finalized.ABANDONED, f"second finalize: {again}")
        fresh = await b.register(
            wf, "k", mode=Mode.TRAILING, delay=tick, max_delay=None, run_id="s"
        )
        _check(fresh.outcome is Registered.OPENED, f"a ping after the fire: {fresh}")
        await b.cancel(wf, "k")


async def _late_ping_takes_the_fire(
    open_backends: OpenBackends, lease: float, skew: float, tick: float
) -> None:
    # A ping at or after a window's due time never joins it, even before its (live)
    # owner's finalize: the pinger takes the fire by compare-and-swap (returned in
    # Registration.taken, with the window's own count and due time) and opens the
    # next window; the owner's finalize is then abandoned. This replaced "a late ping
    # is absorbed" (the ping used to land in the due window and move its time).
    wf = _workflow("late")
    async with open_backends(2) as (a, b):
        r = await a.register(
            wf, "k", mode=Mode.TRAILING, delay=3 * tick, max_delay=None, run_id="r", payload=1
        )
        await trio.sleep(r.scheduled_at - a.wall_time() + tick)
        late = await b.register(
            wf, "k", mode=Mode.TRAILING, delay=5 * tick, max_delay=None, run_id="x", payload=2
        )
        _check(late.outcome is Registered.OPENED and late.run_id == "x", f"late ping: {late}")
        _check(late.ping_count == 1 and late.owner, f"late ping: {late}")
        _check(len(late.taken) == 1, f"the late ping did not take the due fire: {late}")
        fire = late.taken[0]
        _check(fire.outcome is Finalized.FIRE and fire.ping_count == 1, f"the taken fire: {fire}")
        _check(fire.payload == 1 and fire.run_id in ("r", ""), f"the taken fire: {fire}")
        _check(fire.scheduled_at == r.scheduled_at, f"the taken fire's time: {fire} vs {r}")
        if fire.fire_id is not None:
            await b.complete(fire.fire_id)
        f = await a.finalize(wf, "k", "r")
        _check(f.outcome is Finalized.ABANDONED, f"owner's finalize after the take: {f}")
        # The other way round: the owner's own late ping takes its own window's fire.
        await trio.sleep(late.scheduled_at - a.wall_time() + tick)
        again = await a.register(
            wf, "k", mode=Mode.TRAILING, delay=3 * tick, max_delay=None, run_id="s", payload=3
        )
        _check(again.outcome is Registered.OPENED and again.run_id == "s", f"late: {again}")
        _check(
            len(again.taken) == 1 and again.taken[0].payload == 2,
            f"the owner's late ping did not take the due fire: {again}",
        )
        if again.taken[0].fire_id is not None:
            await a.complete(again.taken[0].fire_id)
        f = await b.finalize(wf, "k", "x")
        _check(f.outcome is Finalized.ABANDONED, f"finalize after the take: {f}")
        await a.cancel(wf, "k")
    # max_count: the peer's ping that reaches it makes the window due at its time; the
    # next ping, whoever makes it, takes that fire and opens the next window.
    async with open_backends(2) as (a, b):
        kw: dict[str, Any] = {
            "mode": Mode.TRAILING,
            "delay": 20 * tick,
            "max_delay": None,
            "max_count": 2,
        }
        await a.register(wf, "m", run_id="m1", payload=1, **kw)
        full = await b.register(wf, "m", run_id="m2", payload=2, **kw)
        _check(full.ping_count == 2 and full.take_at is not None, f"max_count reached: {full}")
        _check(full.scheduled_at <= b.wall_time(), f"max_count reached, not due: {full}")
        nxt = await a.register(wf, "m", run_id="m3", payload=3, **kw)
        _check(nxt.outcome is Registered.OPENED and nxt.run_id == "m3", f"after max_count: {nxt}")
        _check(
            [(t.ping_count, t.payload) for t in nxt.taken] == [(2, 2)],
            f"the ping after max_count did not take the window's fire: {nxt}",
        )
        for t in nxt.taken:
            if t.fire_id is not None:
                await a.complete(t.fire_id)
        await a.cancel(wf, "m")


async def _cancel(open_backends: OpenBackends, lease: float, skew: float, tick: float) -> None:
    wf = _workflow("cancel")
    async with open_backends(2) as (a, b):
        await a.register(wf, "k", mode=Mode.TRAILING, delay=20 * tick, max_delay=None, run_id="r")
        _check(await b.cancel(wf, "k"), "cancel of an open window returned False")
        _check(not await b.cancel(wf, "k"), "a second cancel returned True")
        f = await a.finalize(wf, "k", "r", force=True)
        _check(f.outcome is Finalized.ABANDONED, f"finalize of a cancelled window: {f}")
        _check(
            not await a.owned_windows() or all(w.workflow != wf for w in await a.owned_windows()),
            "a cancelled window is still owned",
        )


async def _take(open_backends: OpenBackends, lease: float, skew: float, tick: float) -> None:
    wf = _workflow("take")
    async with open_backends(2) as (a, b):
        await a.register(wf, "k", mode=Mode.TRAILING, delay=30 * tick, max_delay=None, run_id="r")
        r = await b.register(
            wf, "k", mode=Mode.TRAILING, delay=3 * tick, max_delay=None, run_id="x"
        )
        _check(r.take_at is not None and r.take_at == r.scheduled_at, f"earlier ping: {r}")
        assert r.take_at is not None
        await trio.sleep(r.take_at - b.wall_time() + tick)
        f = await b.finalize(wf, "k", "r", take=True)
        _check(f.outcome is Finalized.FIRE and f.ping_count == 2, f"the taker's finalize: {f}")
        f = await a.finalize(wf, "k", "r", force=True)
        _check(f.outcome is Finalized.ABANDONED, f"the owner's finalize after a take: {f}")
        # A later ping is not taken while the owner wakes in time.
        await a.register(wf, "k", mode=Mode.TRAILING, delay=3 * tick, max_delay=None, run_id="s")
        r = await b.register(
            wf, "k", mode=Mode.TRAILING, delay=10 * tick, max_delay=None, run_id="y"
        )
        _check(r.take_at is None, f"a ping that moves the fire later asked for a take: {r}")
        await a.cancel(wf, "k")


async def _release(open_backends: OpenBackends, lease: float, skew: float, tick: float) -> None:
    wf = _workflow("release")
    async with open_backends(2) as (a, b):
        await a.register(wf, "k", mode=Mode.TRAILING, delay=20 * tick, max_delay=None, run_id="r")
        owned = [w for w in await a.owned_windows() if w.workflow == wf]
        _check([(w.key, w.run_id) for w in owned] == [("k", "r")], f"owned windows: {owned}")
        _check(not [w for w in await b.owned_windows() if w.workflow == wf], "peer owns it too")
        await a.release()
        await a.release()  # idempotent
        r = await b.register(wf, "k", mode=Mode.TRAILING, delay=tick, max_delay=None, run_id="s")
        _check(r.outcome is Registered.OPENED and r.run_id == "s", f"ping after release: {r}")
        await b.cancel(wf, "k")


async def _concurrent_pings(
    open_backends: OpenBackends, lease: float, skew: float, tick: float
) -> None:
    wf = _workflow("storm")
    async with open_backends(5) as backends:
        results = []

        async def ping(backend: DebounceBackend, i: int) -> None:
            results.append(
                await backend.register(
                    wf, "k", mode=Mode.TRAILING, delay=10 * tick, max_delay=None, run_id=f"r{i}"
                )
            )

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(ping, backends[i % len(backends)], i)
        opened = [r for r in results if r.outcome is Registered.OPENED]
        _check(len(opened) == 1, f"{len(opened)} pings opened the window: {results}")
        _check(len({r.run_id for r in results}) == 1, "pings saw different run ids")
        _check(
            sorted(r.ping_count for r in results) == list(range(1, 11)),
            f"counts {sorted(r.ping_count for r in results)}",
        )
        owner = backends[int(opened[0].run_id[1:]) % len(backends)]
        latest = max(results, key=lambda r: r.ping_count)
        await trio.sleep(latest.scheduled_at - owner.wall_time() + tick)
        fires = 0
        for backend in backends:
            f = await backend.finalize(wf, "k", opened[0].run_id)
            fires += f.outcome is Finalized.FIRE
        _check(fires == 1, f"{fires} fires")


async def _sweep(open_backends: OpenBackends, lease: float, skew: float, tick: float) -> None:
    wf = _workflow("sweep")
    async with open_backends(1) as (a,):
        await a.register(wf, "k", mode=Mode.TRAILING, delay=20 * tick, max_delay=None, run_id="r")
        await a.cancel(wf, "k")
        _check(await a.sweep() >= 1, "the sweep removed no delete marker")
        r = await a.register(
            wf, "k", mode=Mode.TRAILING, delay=20 * tick, max_delay=None, run_id="s"
        )
        _check(r.outcome is Registered.OPENED, f"a ping after the sweep: {r}")
        await a.sweep()
        owned = [w for w in await a.owned_windows() if w.workflow == wf]
        _check(len(owned) == 1, "the sweep removed a live window")
        await a.cancel(wf, "k")


async def _takeover(open_backends: OpenBackends, lease: float, skew: float, tick: float) -> None:
    wf = _workflow("takeover")
    async with open_backends(2) as (a, b):
        r = await a.register(
            wf, "k", mode=Mode.BOTH, delay=2 * lease, max_delay=10 * lease, run_id="r"
        )
        # a stops renewing its lease (it "died"); b waits until the lease has lapsed.
        await b.refresh_lease()
        await trio.sleep(lease + skew + 2 * tick)
        await b.refresh_lease()
        t = await b.register(wf, "k", mode=Mode.BOTH, delay=tick, max_delay=None, run_id="x")
        _check(t.outcome is Registered.TOOK_OVER and t.owner, f"ping after the owner died: {t}")
        _check(t.run_id == "r" and t.first_ping_at == r.first_ping_at, f"takeover kept: {t}")
        _check(t.ping_count == 2, f"takeover count: {t}")
        f = await a.finalize(wf, "k", "r", force=True)
        _check(f.outcome is Finalized.ABANDONED, f"the dead owner's finalize: {f}")
        await trio.sleep(t.scheduled_at - b.wall_time() + tick)
        f = await b.finalize(wf, "k", "r")
        _check(f.outcome is Finalized.FIRE and f.ping_count == 2, f"the new owner's fire: {f}")


async def _payloads_and_tokens(
    open_backends: OpenBackends, lease: float, skew: float, tick: float
) -> None:
    wf = _workflow("payload")
    async with open_backends(2) as (a, b):
        r = await a.register(
            wf, "k", mode=Mode.BOTH, delay=3 * tick, max_delay=None, run_id="r", payload=(1, 2)
        )
        _check(r.payload == [1, 2], f"a ping's payload, round-tripped: {r.payload!r}")
        await b.register(
            wf, "k", mode=Mode.BOTH, delay=3 * tick, max_delay=None, run_id="x", payload={"b": 2}
        )
        await trio.sleep(r.scheduled_at - a.wall_time() + 4 * tick)
        await a.refresh_lease()
        f = await a.finalize(wf, "k", "r")
        _check(f.outcome is Finalized.FIRE, f"the fire: {f}")
        _check(f.payload == {"b": 2}, f"the latest stored payload: {f.payload!r}")
        _check(f.fencing_token > r.fencing_token, f"tokens: {r.fencing_token}, {f}")
        _check(f.fire_id is not None, "an at-least-once fire has a fire record")
        assert f.fire_id is not None
        await a.complete(f.fire_id)
        await a.complete(f.fire_id)  # idempotent
        r2 = await b.register(
            wf, "k", mode=Mode.BOTH, delay=tick, max_delay=None, run_id="s", payload=None
        )
        _check(r2.outcome is Registered.OPENED, f"a ping after the fire: {r2}")
        _check(r2.fencing_token > f.fencing_token, "tokens increase across windows")
        await b.cancel(wf, "k")


async def _at_most_once(
    open_backends: OpenBackends, lease: float, skew: float, tick: float
) -> None:
    wf = _workflow("at-most-once")
    async with open_backends(2) as (a, b):
        r = await a.register(
            wf, "k", mode=Mode.TRAILING, delay=2 * tick, max_delay=None, run_id="r", payload=1
        )
        await trio.sleep(r.scheduled_at - a.wall_time() + 2 * tick)
        await a.refresh_lease()
        f = await a.finalize(wf, "k", "r", delivery="at-most-once")
        _check(f.outcome is Finalized.FIRE and f.fire_id is None, f"the fire: {f}")
        again = await a.finalize(wf, "k", "r", delivery="at-most-once", force=True)
        _check(again.outcome is Finalized.ABANDONED, f"fired twice: {again}")
        _check(await a.window_status(wf, "k") is None, "a fired window has no status")
        n = await b.register(
            wf, "k", mode=Mode.TRAILING, delay=tick, max_delay=None, run_id="s", payload=2
        )
        _check(n.outcome is Registered.OPENED, f"a ping over the tombstone: {n}")
        await b.cancel(wf, "k")


async def _adopt_orphans_and_status(
    open_backends: OpenBackends, lease: float, skew: float, tick: float
) -> None:
    wf = _workflow("orphans")
    async with open_backends(2) as (a, b):
        await b.refresh_lease()
        await a.refresh_lease()
        r = await a.register(
            wf, "k", mode=Mode.TRAILING, delay=100 * lease, max_delay=None, run_id="r", payload=7
        )
        status = await b.window_status(wf, "k")
        _check(status is not None and status.owner == a.process_id, f"status: {status}")
        assert status is not None
        _check(status.owner_live and status.ping_count == 1, f"status: {status}")
        _check(status.scheduled_at == r.scheduled_at, f"status time: {status}")
        none = await b.adopt_orphans([wf])
        _check(not none.windows, "a live owner's window was adopted")
        await b.refresh_lease()
        await a.handoff()  # a leaves: its lease is released at once
        dead = await b.refresh_lease()
        _check(a.process_id in dead, f"the hand-off was not seen: {dead}")
        other = await b.adopt_orphans(["another-workflow"])
        _check(not other.windows, "a window of a workflow not handled was adopted")
        adopted = await b.adopt_orphans([wf])
        _check(
            [(w.key, w.run_id) for w in adopted.windows] == [("k", "r")],
            f"adopted: {adopted}",
        )
        status = await b.window_status(wf, "k")
        _check(status is not None and status.owner == b.process_id, f"after: {status}")
        await b.cancel(wf, "k")
