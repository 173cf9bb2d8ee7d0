"""QueueLoop: the ONE backend-wide drain of the ``runs`` queue.

There is exactly one per process, for every workspace. It wakes at once on
the in-process signal (``RunQueue.signal`` -> ``Loop.wake``: an enqueue, a
finished run, a freed runtime slot) and otherwise runs a safety pass every
``queue.safety_interval_s``, which recovers work after a missed signal, a
run inserted by another process, or a restart. Bursts of signals coalesce
naturally: a signal during a tick only re-arms the wake event, so a burst
costs one extra tick, not one per signal.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kandevd.lifecycle import Loop
from kandevd.queue.processor import RunQueue


class QueueLoop(Loop):
    def __init__(self, queue: RunQueue, *, safety_interval_s: float, max_claims_per_tick: int,
                 **kwargs: Any) -> None:
        super().__init__("queue", **kwargs)
        self.queue = queue
        self.safety_interval_s = float(safety_interval_s)
        self.max_claims_per_tick = int(max_claims_per_tick)
        queue.set_waker(self.wake)

    def tick(self, now: datetime) -> float:
        started = self.queue.drain(now, self.max_claims_per_tick)
        self.queue.recover_stale(now)
        if started >= self.max_claims_per_tick:
            return 0.0  # there may be more eligible work right now
        wait = self.safety_interval_s
        due = self.queue.repo.next_due(now)
        if due is not None:
            wait = min(wait, max((due - now).total_seconds(), 0.0))
        return wait
