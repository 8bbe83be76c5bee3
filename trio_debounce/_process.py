"""The process-id twin watch, pure: how long to watch a live lease of our own process
id before this opening writes its first lease, how often to look, and what each look
means. The window lease (``_protocol._leases``) and the run lease (``_runs._lease``)
both call it; each reads its own store.

Two coordinators must never share a process id. A lease of our process id that is
still live at start is either a live twin (another coordinator, started with the same
id) or a predecessor that crashed, or stalls, before its lease lapsed; only a renewal
tells them apart. So the opening watches the lease for its holder's heartbeat
interval (ours if it did not record one, capped at our lease) plus the clock-skew
margin, but no longer than until it lapses beyond the skew: renewed meanwhile, it is
a live twin and the opening is refused (:exc:`~trio_debounce.ProcessIdTakenError`);
not renewed, the holder is dead or stalled and the process id is taken over (a stalled
holder is fenced at its next heartbeat).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ._errors import ProcessIdTakenError
from ._wallclock import wall_to_trio

#: Looks at the lease while it is watched, besides the first (the stores' interfaces
#: have no watch to wait on), so a live twin is refused at its renewal rather than at
#: the end of the watch.
TWIN_LOOKS = 4


class Look(enum.Enum):
    """What one look at the watched lease means."""

    #: Not renewed, and the watch goes on.
    WATCHING = "watching"
    #: Renewed (its revision or expiry moved): a live twin holds the process id.
    RENEWED = "renewed"
    #: Not renewed for the whole watch: the process id may be taken over.
    OVER = "over"


@dataclass(frozen=True, slots=True)
class TwinWatch:
    """A watch of a live lease of another epoch of our process id.

    Attributes:
      epoch (str): the watched lease's epoch, for messages.
      revision (int): the lease's store revision when the watch began.
      expires (float): its expiry (wall-clock epoch seconds) then.
      until (float): when the watch ends (Trio time, seconds).
      step (float): seconds between two looks.
    """

    epoch: str
    revision: int
    expires: float
    until: float
    step: float

    @classmethod
    def start(
        cls,
        *,
        epoch: str,
        revision: int,
        expires: float,
        heartbeat: object,
        own_heartbeat: float,
        lease: float,
        skew: float,
        wall_now: float,
        trio_now: float,
    ) -> TwinWatch:
        """The watch of a live lease of ``epoch``, read at ``wall_now`` (wall clock) /
        ``trio_now`` (Trio clock): for ``heartbeat`` (the interval its holder recorded, seconds;
        ``own_heartbeat`` when it recorded none or no usable value), capped at
        ``lease`` (our lease, seconds), plus ``skew`` (seconds); never past its expiry
        plus the skew."""
        beat = heartbeat
        if isinstance(beat, bool) or not isinstance(beat, float | int) or not 0 < beat < math.inf:
            beat = own_heartbeat
        until = min(
            trio_now + min(float(beat), lease) + skew,
            wall_to_trio(expires + skew, wall_now=wall_now, trio_now=trio_now),
        )
        return cls(epoch, revision, expires, until, max((until - trio_now) / TWIN_LOOKS, 1e-3))

    def next_look(self, now: float) -> float:
        """When to look next (Trio time), from ``now``."""
        return min(self.until, now + self.step)

    def look(self, *, revision: int, expires: float, now: float) -> Look:
        """What the lease read at ``now`` (Trio time), at ``revision`` with expiry
        ``expires``, means for the watch."""
        if revision != self.revision or expires != self.expires:
            return Look.RENEWED
        return Look.OVER if now >= self.until else Look.WATCHING


def taken_error(process_id: str, holder: str, opening: str) -> ProcessIdTakenError:
    """The error that refuses an opening whose process id a live coordinator holds.

    Args:
      process_id: the process id.
      holder: the live holder, for the message (``"epoch 3"``, ``"run lease epoch 3"``).
      opening: this opening, for the message (``"this one (epoch 4)"``).
    """
    return ProcessIdTakenError(
        f"process id {process_id!r} is held by a live coordinator ({holder}, whose lease "
        f"was renewed while this one watched it); {opening} is refused and wrote "
        f"nothing: two live coordinators must never share a process id"
    )
