"""Fence: a daemon cut off from the shared database stops its own work in time.

The other daemons take a daemon for dead ``cluster.dead_after_s`` after its
last heartbeat (the database's clock) and re-queue its claims. So that no run
executes twice at once, the daemon itself, once it has completed no heartbeat
for ``cluster.fence_after_s`` (its monotonic clock, counted from when that
heartbeat was *sent*, which is no later than the database stamped it), stops
claiming and stops its agents (SIGTERM, then SIGKILL after the fence's
grace): all of it ends before ``dead_after_s`` (:func:`kandevd.cluster.timing.fence_timing`).
When a fresh heartbeat completes again (sent less than half of
``fence_after_s`` ago), it heals: it records what it kept and claims again.
With ``cluster.on_partition: keep_running`` nothing is fenced.

:meth:`Fence.tick` is the whole decision, stepped with an explicit ``now``;
the watchdog thread only calls it, so fencing and healing never race. The
clock is ``CLOCK_BOOTTIME``: it goes on while the machine is suspended (a
monotonic clock that stopped would let a resumed daemon believe itself
alive).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kandevd.cluster.timing import FenceTiming, boot_clock

log = logging.getLogger("kandevd.cluster")

#: How often the watchdog looks (part of the timing's margin).
WATCH_EVERY_S = 0.2


class Fence:
    """Fences this daemon after a silence of the heartbeat, heals it after a fresh one."""

    def __init__(self, timing: FenceTiming, *, on_fence: Callable[[str], None],
                 on_heal: Callable[[float], None], enabled: bool = True,
                 clock: Callable[[], float] = boot_clock) -> None:
        self.timing = timing
        self._on_fence = on_fence
        self._on_heal = on_heal
        self.enabled = enabled
        self._clock = clock
        self._lock = threading.Lock()
        self._last_ok = clock()  # the start counts as a heartbeat: the join just wrote one
        self._fenced_at: float | None = None
        self._fresh = False  # a fresh heartbeat completed since the fence
        self.fences = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def fenced(self) -> bool:
        with self._lock:
            return self._fenced_at is not None

    def beat_ok(self, sent_at: float) -> None:
        """A heartbeat sent at ``sent_at`` (this clock) completed. Only a fresh one (sent
        less than half of ``fence_after_s`` ago) lets the next :meth:`tick` heal a fence:
        an old one's stamp may be one the others already take for dead."""
        now = self._clock()
        with self._lock:
            self._last_ok = max(self._last_ok, sent_at)
            if self._fenced_at is not None and now - sent_at < self.timing.after_s / 2:
                self._fresh = True

    def tick(self, now: float) -> float:
        """Fence when the last completed heartbeat is ``fence_after_s`` old, heal after a
        fresh one; seconds until the next look."""
        with self._lock:
            if not self.enabled:
                return WATCH_EVERY_S
            if self._fenced_at is not None:
                if not self._fresh:
                    return WATCH_EVERY_S
                away, self._fenced_at, self._fresh = now - self._fenced_at, None, False
                healed = True
            else:
                healed = False
                silent = now - self._last_ok
                if silent < self.timing.after_s:
                    return max(0.01, min(WATCH_EVERY_S, self.timing.after_s - silent))
                self._fenced_at = now
                self.fences += 1
        if healed:
            log.warning("cluster: heartbeats complete again after %.1fs fenced: claiming "
                        "again", away)
            self._on_heal(away)
            return WATCH_EVERY_S
        reason = (f"fenced: no heartbeat completed for {silent:.1f}s (cluster.fence_after_s "
                  f"{self.timing.after_s:g}); the other daemons take this one for dead soon")
        log.warning("cluster: %s; stopping its agents (SIGKILL after %gs) and claiming "
                    "nothing until the database answers again", reason,
                    self.timing.kill_grace_s)
        self._on_fence(reason)
        return WATCH_EVERY_S

    # -- the watchdog thread ---------------------------------------------------------
    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="kandevd-fence",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.tick(self._clock())
            except Exception:  # the watchdog must outlive a failing callback
                log.exception("cluster: fencing failed")
                wait = WATCH_EVERY_S
            self._stop.wait(wait)
