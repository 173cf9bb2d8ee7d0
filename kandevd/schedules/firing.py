"""What a due fire does: the policy (pure :func:`decide_fire`) and its bookkeeping.

The cron loop decides each due fire here; the session runner asks again here for
the fire a ``buffer_one`` schedule kept, once the session before it has ended. So
neither calls the other: both are given the one :class:`Firing`.
"""

from __future__ import annotations

import enum
import logging

from kandevd.schedules.jobs import Job
from kandevd.schedules.registry import JobRegistry

log = logging.getLogger("kandevd.scheduler")


class Decision(enum.Enum):
    RUN = "run"
    BUFFER = "buffer"
    REPLACE = "replace"
    SKIP_OVERLAP = "skip_overlap"
    SKIP_PAUSED = "skip_paused"
    SKIP_DISABLED = "skip_disabled"
    SKIP_UNRECORDED = "skip_unrecorded"


def decide_fire(*, execution_enabled: bool, workflow_allowed: bool, paused: bool,
                running: bool, buffered: bool, overlap_policy: str) -> Decision:
    """What a due cron fire does. Pure: the whole policy in one place.

    Execution switched off (config, environment) or the workflow kept out by the
    allow/block lists: skipped as disabled. Globally paused: skipped as paused.
    Otherwise it runs, unless the schedule's previous session still runs: then
    ``skip`` skips it, ``buffer_one`` keeps it for when that session ends (one at
    most: a further fire while one waits is skipped), ``replace`` stops that
    session and runs when it has ended (a further fire meanwhile is skipped).
    """
    if not execution_enabled or not workflow_allowed:
        return Decision.SKIP_DISABLED
    if paused:
        return Decision.SKIP_PAUSED
    if not running:
        return Decision.RUN
    if buffered:
        return Decision.SKIP_OVERLAP
    if overlap_policy == "buffer_one":
        return Decision.BUFFER
    if overlap_policy == "replace":
        return Decision.REPLACE
    return Decision.SKIP_OVERLAP


class Firing:
    """The fire policy over the registry's switches and pause; a skip counted and said."""

    def __init__(self, registry: JobRegistry) -> None:
        self.registry = registry

    def decide(self, job: Job, *, paused: bool, running: bool, buffered: bool) -> Decision:
        switches = self.registry.switches
        return decide_fire(
            execution_enabled=switches.execution_enabled,
            workflow_allowed=job.spec.verdict(switches) is None,
            paused=paused, running=running, buffered=buffered,
            overlap_policy=job.spec.overlap_policy)

    def skip(self, job: Job, decision: Decision, why: str | None = None) -> None:
        """Count a fire that does not run and say why, once, at INFO."""
        state = job.state
        if decision is Decision.SKIP_OVERLAP:
            state.skipped_overlap += 1
        elif decision is Decision.SKIP_PAUSED:
            state.skipped_paused += 1
            why = "the scheduler is globally paused"
        else:
            state.skipped_disabled += 1
            why = self.registry.ineligible_reason(job, paused=False)
        log.info("%s: cron fire skipped: %s", job.key, why)

    def buffered_fire_runs(self, job: Job) -> bool:
        """The fire a ``buffer_one`` schedule kept, decided again now that it may start:
        a pause, a disabled schedule or a switch turned off since then still wins."""
        if not job.enabled or job.state.invalid is not None:
            log.info("%s: buffered fire dropped: the schedule was %s", job.key,
                     "disabled" if not job.enabled else "made invalid")
            return False
        decision = self.decide(job, paused=self.registry.pause.get()["globally_paused"],
                               running=False, buffered=False)
        if decision is Decision.RUN:
            return True
        self.skip(job, decision)
        return False
