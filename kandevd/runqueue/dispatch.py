"""Dispatch: reserve runtime slots, claim runs for them, start their executions.

One drain reserves the free runtime slots (never blocking), then one
transaction writes the outcomes handed over since the last drain and claims
at most one run per reserved slot (the oldest eligible run of each eligible
agent, oldest first), then each execution starts. Unused slots are given
back, whatever raises. A claim whose execution cannot start goes back to the
queue while the runtime is stopping, and is otherwise a failed attempt under
the retry policy (a broken profile backs off instead of spinning). A cancel
that lands between a claim and its start is remembered: the agent is not
started, or, when the cancel comes as it starts, it is stopped as soon as it
has started.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import datetime

from kandevd.bus import EventBus
from kandevd.config import Config
from kandevd.faults import Faults
from kandevd.fsutil import append_note
from kandevd.paths import HomeLayout
from kandevd.runqueue.live import LiveRuns
from kandevd.runqueue.outcomes import Observer, OutcomeRecorder
from kandevd.runs.model import Claim
from kandevd.runtime import (
    AgentRuntime,
    ExecutionResult,
    ExecutionSpec,
    Reservation,
    RuntimeStopped,
    attempts,
)
from kandevd.runtime.output import attempt_started
from kandevd.runtime.specs import agent_execution
from kandevd.store.runs import RunRepository

log = logging.getLogger("kandevd.queue")

#: How long an outcome waits for others to share its commit while executions still
#: run (group commit): fewer commits and passes a run, for a millisecond of latency.
OUTCOME_WINDOW_S = 0.001


class Dispatcher:
    def __init__(self, repo: RunRepository, runtime: AgentRuntime, outcomes: OutcomeRecorder,
                 live: LiveRuns, bus: EventBus, config: Config, layout: HomeLayout, *,
                 clock: Callable[[], datetime], faults: Faults, observer: Observer | None = None,
                 on_saturated: Callable[[], None] | None = None) -> None:
        """``on_saturated``: several daemons: called when a pass filled every free slot
        here and runs may still wait, so the others should look."""
        self.repo = repo
        self.runtime = runtime
        self.outcomes = outcomes
        self.live = live
        self.bus = bus
        self.config = config
        self.layout = layout
        self.clock = clock
        self.faults = faults
        self.observer = observer
        self.on_saturated = on_saturated
        self.claimed_total = 0

    def drain(self, now: datetime, limit: int) -> int:
        """Record pending outcomes, claim and dispatch up to ``limit`` runs.

        Slots are reserved first (never blocking), then one transaction writes
        the outcomes handed over by finished executions and claims at most as
        many runs as slots were reserved: the oldest eligible run of each
        eligible agent, oldest first. Every reservation not spent on a started
        execution is given back, whatever raises. Returns how many runs were
        started.
        """
        outcomes = self.outcomes.take()
        if outcomes and self.runtime.active and OUTCOME_WINDOW_S:
            # Other executions run: the next outcome may be a moment away. Waiting that
            # moment lets it share this commit (and this pass) instead of paying its own.
            time.sleep(OUTCOME_WINDOW_S)
            outcomes += self.outcomes.take()
        if not outcomes and (self.runtime.active >= self.runtime.max_concurrent
                             or not self.repo.has_queued()):
            # Every slot runs (an enqueue's wake-up while the queue drains) or nothing
            # waits: touch neither the database nor the runtime's slots.
            return 0
        reservations: list[Reservation] = []
        started = 0
        try:
            while len(reservations) < limit:
                reservation = self.runtime.try_reserve()
                if reservation is None:
                    break
                reservations.append(reservation)
            if outcomes:
                claims = self._record_and_claim(outcomes, now, len(reservations))
            elif reservations:
                claims = self.repo.claim_batch(now, len(reservations),
                                               exclude_agents=self.live.agent_ids())
            else:
                claims = []
            for reservation, claim in zip(reservations, claims, strict=False):
                if self._dispatch(reservation, claim):
                    started += 1
            if self.on_saturated is not None and claims and len(claims) >= len(reservations):
                # Every free slot here took a run: what is left is for other daemons. (A
                # pass that found no free slot changed nothing and tells no one: daemons
                # with full slots would otherwise wake each other without end.)
                self.on_saturated()
        finally:
            for reservation in reservations:
                self.runtime.release(reservation)  # a no-op for the ones started
            self.claimed_total += started
        return started

    def _record_and_claim(self, outcomes: list[tuple[Claim, ExecutionResult]], now: datetime,
                          slots: int) -> list[Claim]:
        """Write ``outcomes`` and claim up to ``slots`` runs in one durable commit."""
        ended = {claim.run.id for claim, _result in outcomes}
        # An ended execution may still hold its runtime key for a moment (its worker
        # is returning): its agent waits for the next pass, or a re-claim of the same
        # run (a retry due at once) would collide with it.
        leaving = self.runtime.live_keys()
        busy = self.live.busy_agents(ended, leaving)
        try:
            # Outcomes and claims only: on PostgreSQL both guard themselves with row locks.
            with self.repo.store.transaction(exclusive=False):
                effects = [self.outcomes.apply(claim, result) for claim, result in outcomes]
                # The outcomes were stamped with the clock just now: claim no earlier,
                # so an agent's next claimed_at never precedes its last finished_at.
                claim_now = max(now, self.clock())
                claims = (self.repo.claim_batch(claim_now, slots, exclude_agents=busy)
                          if slots else [])
            self.outcomes.commits.commits += 1
            self.outcomes.commits.operations += len(outcomes)
        except Exception as exc:
            # One bad outcome must not hold the others (or the claims) back.
            log.warning("recording %d outcome(s) together failed (%s); one by one",
                        len(outcomes), exc)
            for claim, result in outcomes:
                self.outcomes.record(claim, result)
            return self.repo.claim_batch(now, slots, exclude_agents=self.live.agent_ids()) \
                if slots else []
        self.outcomes.settled_all(outcomes)
        for (claim, result), effect in zip(outcomes, effects, strict=True):
            self.outcomes.announce(claim, result, effect)
        return claims

    def _spec(self, claim: Claim, *, session_id: str | None = None) -> ExecutionSpec:
        """The execution of a claimed run (docs/agents.md)."""
        run = claim.run
        run_id = run.id
        profile = self.config.profile(claim.profile)
        # (32 random hex digits, as a uuid4's, a fifth of its cost)
        session_id = session_id or f"ses_{os.urandom(16).hex()}"
        return agent_execution(
            profile, self.layout, kind="run", key=run_id, run_id=run_id, session_id=session_id,
            stdin={"kind": "run", "run_id": run_id, "session_id": session_id,
                   "agent_id": run.agent_id, "task_id": run.task_id,
                   "workspace_id": run.workspace_id, "reason": run.reason,
                   "payload": run.payload},
            record_dir=attempts.attempt_dir(self.live.attempts_folder, run_id, claim.token),
            attempt=run.attempt if self.runtime.frames_logs else 0)

    def _dispatch(self, reservation: Reservation, claim: Claim) -> bool:
        """Start the claimed run's execution; False (and the claim settled) when it cannot.

        Never raises: a claim that can be neither started nor settled stays
        ``claimed`` with no live execution, which stale-claim recovery rescues.
        """
        run = claim.run
        run_id = run.id
        self.live.begin(run_id, run.agent_id)
        try:
            self.faults.before_start(run_id)
            if self.live.cancel_requested(run_id):
                # runs.cancel came before the start: the run is cancelled, and an agent
                # started now could finish before the stop reaches it. Start nothing.
                self.live.end(run_id)
                self.runtime.release(reservation)
                log.info("run %s: cancelled before its agent started; nothing started",
                         run_id)
                self.outcomes.wake()  # (its slot is free for another run)
                return False
            spec = self._spec(claim)
            if not spec.attempt:  # (a runner that frames logs notes it as it opens it)
                append_note(spec.log_path, attempt_started(run.attempt, self.clock()))
            self.runtime.start(reservation, spec,
                               lambda result: self.outcomes.on_done(claim, result))
        except Exception as exc:
            self.live.end(run_id)
            self.runtime.release(reservation)  # a no-op when start() already gave it back
            try:
                self._not_started(claim, exc)
            except Exception:
                log.exception("run %s: its failed start could not be recorded; stale-claim "
                              "recovery will rescue it", run_id)
            return False
        if self.live.cancel_requested(run_id):  # runs.cancel came between claim and start
            self.runtime.stop_execution(run_id, "cancelled")
        if self.observer is not None and run.attempt == 1 and run.claimed_at:
            self.observer.observe_first_claim(run.requested_at, run.claimed_at)
        log.debug("run %s claimed (agent %s, reason %s, seq %d)", run_id, run.agent_id,
                 run.reason, run.seq)
        self.bus.publish("run.claimed", {"run": run})
        return True

    def _not_started(self, claim: Claim, exc: Exception) -> None:
        """A claim whose execution could not start: back to the queue, or a failed attempt.

        While the runtime is stopping that is nobody's fault: the run simply
        goes back to the queue (the attempt is given back). Anything else (a
        profile that cannot be run) is a failed attempt under the retry
        policy, so it backs off instead of being claimed again at once.
        """
        run_id = claim.run.id
        now = self.clock()
        if isinstance(exc, RuntimeStopped):
            self.repo.requeue(run_id, claim.token, now)
            log.info("run %s: runtime is stopping; re-queued", run_id)
            return
        error = f"could not start the agent: {exc}"
        log.error("run %s: %s", run_id, error)
        updated = self.repo.fail_attempt(run_id, claim.token, now=now, error=error,
                                         decide=self.outcomes.decide_retry)
        if updated is not None:
            self.outcomes.announce_failure(updated, error)
