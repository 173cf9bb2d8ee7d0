"""When a runner's keeper stops every agent by itself (a daemon's keeper never does).

A runner on another machine must have stopped its agents before its server
gives their runs to another runner (docs/runners.md). The runner's own fence
does that while the runner runs; the keeper, a process of its own, does it
when the runner cannot:

- the runner is gone (no client attached) for ``stop_alone_after`` seconds
  (its ``hello``);
- the runner's last word on its server is older than it said: every look of
  its fence sends ``fence {until}`` (when, on the machine's monotonic clock,
  half of ``dead_after_s`` has passed since the sending of the last request
  its server answered, and two looks more). A runner that is frozen (SIGSTOP,
  a debugger) renews nothing, so its agents are stopped at ``until``, as if it
  had stopped them itself. Its ``hello`` (with ``fence: true``) arms the fence
  for ``stop_alone_after``, so one frozen before its first look is covered
  too. A fence that runs out while no runner is attached stops them as the
  runner being gone does.
"""

from __future__ import annotations

#: The longest SIGKILL grace of a stop the keeper decides on its own.
MAX_GRACE_S = 5.0


class Fences:
    def __init__(self) -> None:
        #: A runner's keeper (its ``hello``): with no client this long, stop every agent.
        self.stop_alone_after: float | None = None
        #: When (monotonic) the last client went (None: one is attached).
        self.alone_since: float | None = None
        #: When (monotonic) the runner's fence runs out, unless renewed.
        self.fence_at: float | None = None

    def attached(self) -> None:
        self.alone_since = None

    def detached(self, now: float) -> None:
        if self.stop_alone_after is not None:
            self.alone_since = now

    def armed(self, now: float) -> None:
        """A runner attached (its ``hello``): its fence holds from now, before its first
        look renews it, and an earlier runner's that ends sooner still holds."""
        if self.stop_alone_after is not None:
            at = now + self.stop_alone_after
            self.fence_at = at if self.fence_at is None else min(self.fence_at, at)

    def renewed(self, until: float) -> None:
        self.fence_at = until

    def next_at(self) -> float | None:
        """The next moment a stop may be due (None: none is set)."""
        due = [at for at in (self.fence_at, self._alone_at()) if at is not None]
        return min(due) if due else None

    def due(self, now: float) -> tuple[str, str, float] | None:
        """``(by, reason, grace)`` of the stop of every agent that is due now (once per
        absence, once per fence that ran out); None: nothing is."""
        grace = min(MAX_GRACE_S, (self.stop_alone_after or 2 * MAX_GRACE_S) / 2)
        alone_at = self._alone_at()
        if alone_at is not None and now >= alone_at:
            self.alone_since = None
            return "interrupted", "its runner was gone", grace
        if self.fence_at is not None and now >= self.fence_at:
            self.fence_at = None
            if self.alone_since is not None:  # (its agents are not known to be wanted)
                return "interrupted", "its runner was gone", grace
            return "stopped", "its runner lost touch with its server (the keeper's fence)", \
                grace
        return None

    def _alone_at(self) -> float | None:
        if self.alone_since is None or self.stop_alone_after is None:
            return None
        return self.alone_since + self.stop_alone_after
