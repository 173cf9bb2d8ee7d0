"""What a daemon does when its cluster says so: the callbacks, in one typed value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class ClusterHooks:
    """What the daemon does when the cluster says so (built by the composition root).

    ``wake()`` when another daemon may have made work claimable here;
    ``on_beat(rescue)`` at every heartbeat once settled: stop executions
    lost here, and with ``rescue`` (steady for dead_after_s) re-queue dead
    daemons' claims. ``on_fence(reason)``: stop claiming and stop every
    agent (:mod:`kandevd.cluster.fence`); ``on_heal(seconds fenced)``: heartbeats
    complete again. ``on_leader(since)``: this daemon became the leader;
    ``since`` is when the previous leader's lease was last renewed, when it
    took over an expired one (occurrences since then may lack their fire).
    """

    wake: Callable[[], None]
    on_beat: Callable[[bool], None] | None = None
    on_fence: Callable[[str], None] | None = None
    on_heal: Callable[[float], None] | None = None
    on_leader: Callable[[datetime | None], None] | None = None
