"""When a daemon cut off from the shared database fences itself: the timings, checked.

Pure arithmetic on the ``cluster`` settings, shared by the config (which refuses
unsafe values with exit 78) and the fence itself (:mod:`kandevd.cluster.fence`).
The clock is ``CLOCK_BOOTTIME``: it goes on while the machine is suspended (a
monotonic clock that stopped would let a resumed daemon believe itself alive).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


def boot_clock() -> float:
    """Seconds on ``CLOCK_BOOTTIME`` (monotonic, suspend included) where there is one."""
    return time.clock_gettime(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))


@dataclass(frozen=True)
class FenceTiming:
    """When a cut-off daemon fences itself, and how long its agents get to stop."""

    after_s: float
    #: SIGTERM, then SIGKILL this much later.
    kill_grace_s: float
    #: What the watchdog's own cadence and the clocks may add.
    margin_s: float

    @property
    def done_by_s(self) -> float:
        """Since the last heartbeat that completed: every agent of this daemon is gone."""
        return self.after_s + self.kill_grace_s + self.margin_s


def fence_timing(dead_after_s: float, fence_after_s: float | None) -> FenceTiming:
    """The fencing times: the agents' grace and the margin scale with ``dead_after_s``
    (2 s and 1 s at the default 10 s), and the default ``fence_after_s`` is what is
    left, so fencing with its grace ends before peers take the daemon for dead."""
    grace, margin = min(2.0, dead_after_s / 5), min(1.0, dead_after_s / 10)
    after = fence_after_s if fence_after_s is not None \
        else math.floor((dead_after_s - grace - margin) * 1000) / 1000
    return FenceTiming(after, grace, margin)


def fencing_problem(heartbeat_s: float, dead_after_s: float, fence_after_s: float | None,
                    on_partition: str) -> str | None:
    """Why these cluster timings cannot keep a run from executing twice (None: they can)."""
    if on_partition != "fence":
        return None
    timing = fence_timing(dead_after_s, fence_after_s)
    if timing.after_s < 1.5 * heartbeat_s:
        need = 1.5 * heartbeat_s
        if fence_after_s is None:  # derived: dead * 0.7 below 10 s, dead - 3 above
            least = need / 0.7 if need / 0.7 <= 10 else need + 3
            fix = f"raise dead_after_s to at least {math.ceil(least * 100) / 100:g}"
        else:
            fix = f"use at least {need:g}"
        return (f"cluster.fence_after_s: {timing.after_s:g} is too short for heartbeat_s "
                f"{heartbeat_s:g}: a daemon would stop its agents between two heartbeats "
                f"(it must be at least 1.5 heartbeats); {fix}, or set "
                f"cluster.on_partition: keep_running")
    if timing.done_by_s > dead_after_s:
        return (f"cluster.fence_after_s: {timing.after_s:g} is too long for dead_after_s "
                f"{dead_after_s:g}: fencing (then {timing.kill_grace_s:g}s for the agents "
                f"to stop, and {timing.margin_s:g}s of margin) must end before the other "
                f"daemons take this one for dead; use at most "
                f"{dead_after_s - timing.kill_grace_s - timing.margin_s:g} (or leave it null "
                f"to derive it)")
    return None
