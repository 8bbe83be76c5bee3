"""The protocol's decisions for flow-control windows (throttle, audit, batch, rate
limit) on documents as read, beside :mod:`._rules`' for every window: pure, no Trio and
no I/O (see :doc:`/protocol`, "Flow-control windows").

A flow window is stored as the debounce window whose rules it shares
(:func:`trio_debounce._flow.stored_as`); what differs is decided here: a throttle's
cool-down kept in its tombstone, the drops and fires of a leading-only window, the
trailing fire's count, and a ping whose write landed after its window closed.
"""

from __future__ import annotations

from dataclasses import replace

from .._backend import Registered, Registration
from .._flow import Flow, FlowSpec, describe
from .._types import Mode
from ._documents import WindowDoc

__all__ = [
    "absorbs_as_debounce",
    "apply_flow",
    "cooling",
    "dropped_result",
    "fire_shape",
    "late_into",
]


def absorbs_as_debounce(spec: FlowSpec) -> bool:
    """Do the pings of a flow window of ``spec`` absorb as a plain debounce window's
    do (a both-edges throttle, an audit), so that runs of them fold?"""
    return spec.trailing and (spec.flow is Flow.THROTTLE or spec.flow is Flow.AUDIT)


def cooling(doc: WindowDoc | None, flow: FlowSpec | None, now: float) -> float | None:
    """The end of the window without a leading fire that a ping of ``flow`` at ``now``
    opens over the tombstone ``doc``, or None (a new window of the ping's own): a
    throttle's cool-down (its trailing fire kept its end); for a ping that landed after
    its window closed (:func:`late_into`), a both-edges throttle's trailing fire that
    window would have made (at its end, due already), or an audit window that starts
    at that window's end (so that audit fires stay ``interval`` apart, as in one
    process; the ping then fires up to its lateness more than ``interval`` after it).

    Raises:
      ValueError: the ping is not one of that throttle (a mode clash, as with an open
        window).
    """
    if doc is None or not doc.fired or doc.cancelled:
        return None
    if doc.cool_until is not None and now < doc.cool_until:
        if doc.flow != flow:
            # The cool-down is the throttle's window, open until its end.
            raise ValueError(
                f"{describe(flow)} differs from {describe(doc.flow)} of the window "
                f"(run {doc.run_id}) cooling down until its end"
            )
        return doc.cool_until
    if flow is not None and late_into(doc, flow, now):
        if doc.mode is Mode.BOTH:
            # It landed after its window closed with no trailing fire: the trailing
            # fire it would have made, at that window's end (due already).
            return doc.at
        if flow.flow is Flow.AUDIT:
            return doc.at + flow.span
    return None


def late_into(doc: WindowDoc, flow: FlowSpec | None, now: float) -> bool:
    """Does a ping of ``flow`` at ``now`` belong to the window whose tombstone ``doc``
    is (its time is before that window's end, but its write came after the window
    closed: a compare-and-swap it lost, then a backoff)? A flow window's rules then
    apply to it as if it had landed in time (a cancel's tombstone excepted)."""
    return (
        doc.fired
        and not doc.cancelled
        and doc.flow is not None
        and doc.flow == flow
        and now < doc.at
    )


def apply_flow(doc: WindowDoc, now: float, write: str) -> tuple[Registered, WindowDoc]:
    """A ping at ``now`` of a leading-only throttle or rate-limit window ``doc`` (open
    and not due, or closed and :func:`late_into` it): its fire within the limit (write
    ``write`` counts it), or a drop (nothing written: ``doc`` as read)."""
    spec = doc.flow
    assert spec is not None
    if spec.flow is Flow.RATE_LIMIT and doc.flow_fires < spec.limit:
        new = replace(
            doc,
            flow_fires=doc.flow_fires + 1,
            count=doc.count + 1,
            last=max(now, doc.last),
            write=write,
            writes=doc.history(write),
        )
        return Registered.FIRED, new
    return Registered.DROPPED, doc


def dropped_result(doc: WindowDoc) -> Registration:
    """The result of a ping that was dropped (nothing written)."""
    return Registration(Registered.DROPPED, doc.run_id, doc.mode, doc.at, doc.first, doc.count)


def fire_shape(doc: WindowDoc) -> tuple[Mode, int, float]:
    """The mode, ping count and first ping time of ``doc``'s trailing fire: a
    both-edges throttle's trailing fire counts the pings after its leading fire (from
    ``since``), a trailing fire of their own; any other window's, its own."""
    if doc.flow is not None and doc.mode is Mode.BOTH and doc.count >= 2:
        return Mode.TRAILING, doc.count - 1, doc.first if doc.since is None else doc.since
    return doc.mode, doc.count, doc.first
