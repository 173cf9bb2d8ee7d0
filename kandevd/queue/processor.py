"""RunQueue: enqueue, claim -> dispatch to the runtime, and attempt outcomes.

This is the queue's service object; :class:`kandevd.queue.loop.QueueLoop`
only decides *when* :meth:`RunQueue.drain` runs. Everything that changes a
run goes through :class:`kandevd.store.runs.RunRepository` so the database
stays the truth.

One drain: reserve the free runtime slots (never blocks) -> claim at most
that many runs in one transaction (the oldest eligible run of each eligible
agent, oldest first) -> start each execution; unused slots are given back.
If the execution of a claim cannot be started, the claim goes back to the
queue while the runtime is stopping, and is otherwise a failed attempt under
the retry policy (so a broken profile backs off instead of spinning).

An execution's outcome is recorded from the runtime's worker thread through
:class:`kandevd.queue.groupcommit.GroupCommit`: outcomes that arrive together
share one durable commit. Then the agent is free and the loop is signalled.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kandevd.bus import EventBus
from kandevd.config import Config
from kandevd.paths import HomeLayout
from kandevd.queue.groupcommit import GroupCommit
from kandevd.runtime import (
    INTERRUPTED,
    STOPPED,
    AgentRuntime,
    ExecutionResult,
    ExecutionSpec,
    Reservation,
    RuntimeStopped,
)
from kandevd.runtime.specs import agent_execution
from kandevd.store.runs import Claim, EnqueueResult, RunRepository
from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.queue")

#: Outcomes that leave the run as it is: interrupted by the shutdown (it stays
#: ``claimed`` for the next start) or stopped by a cancel (already ``cancelled``).
_NO_WRITE = frozenset({INTERRUPTED, STOPPED})


class RunQueue:
    def __init__(self, repo: RunRepository, runtime: AgentRuntime, config: Config,
                 layout: HomeLayout, bus: EventBus, *,
                 clock: Callable[[], datetime] = utc_now) -> None:
        self.repo = repo
        self.runtime = runtime
        self.config = config
        self.layout = layout
        self.bus = bus
        self.clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, str] = {}  # run id -> agent id of executions started here
        self._waker: Callable[[], None] | None = None
        self._defer = False  # outcomes go to the loop's next drain (see defer_outcomes)
        self._outcomes: list[tuple[Claim, ExecutionResult]] = []
        self.signals_enabled = True
        self.claimed_total = 0
        # Outcomes of executions that end together share one commit (one fsync).
        self.commits = GroupCommit(repo.store)

    # -- signal -----------------------------------------------------------------
    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """The in-process signal: the queue loop's ``wake``."""
        self._waker = waker

    def signal(self) -> None:
        waker = self._waker
        if waker is not None and self.signals_enabled:
            waker()

    # -- intake -----------------------------------------------------------------
    def enqueue(self, *, workspace_id: str, agent_id: str, reason: str,
                task_id: str | None = None, payload: dict[str, Any] | None = None,
                idempotency_key: str | None = None, coalesce: bool = True) -> EnqueueResult:
        """Persist a run request (what the ``queue_run`` workflow action calls)."""
        result = self.repo.enqueue(workspace_id=workspace_id, agent_id=agent_id, reason=reason,
                                   task_id=task_id, payload=payload,
                                   idempotency_key=idempotency_key, coalesce=coalesce,
                                   now=self.clock())
        if result.inserted:
            self.bus.publish("run.queued", {"run": result.run})
            self.signal()
        return result

    # -- drain ------------------------------------------------------------------
    def live_agents(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._live.values())

    def live_runs(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._live)

    def drain(self, now: datetime, limit: int) -> int:
        """Record pending outcomes, claim and dispatch up to ``limit`` runs.

        Slots are reserved first (never blocking), then one transaction writes
        the outcomes handed over by finished executions and claims at most as
        many runs as slots were reserved: the oldest eligible run of each
        eligible agent, oldest first. Unused slots are given back. Returns how
        many runs were started. A run whose execution cannot even start is
        failed through the retry policy, so nothing here can spin.
        """
        outcomes = self._take_outcomes()
        if not outcomes and not self.repo.has_queued():
            return 0  # idle: touch neither the runtime's slots nor the write lock
        reservations: list[Reservation] = []
        while len(reservations) < limit:
            reservation = self.runtime.try_reserve()
            if reservation is None:
                break
            reservations.append(reservation)
        try:
            if outcomes:
                claims = self._record_and_claim(outcomes, now, len(reservations))
            elif reservations:
                claims = self.repo.claim_batch(now, len(reservations),
                                               exclude_agents=self.live_agents())
            else:
                claims = []
        except BaseException:
            for reservation in reservations:
                self.runtime.release(reservation)
            raise
        for reservation in reservations[len(claims):]:
            self.runtime.release(reservation)
        started = 0
        for reservation, claim in zip(reservations, claims, strict=False):
            if self._dispatch(reservation, claim):
                started += 1
        self.claimed_total += started
        return started

    def _record_and_claim(self, outcomes: list[tuple[Claim, ExecutionResult]], now: datetime,
                          slots: int) -> list[Claim]:
        """Write ``outcomes`` and claim up to ``slots`` runs in one durable commit."""
        ended = {claim.run["id"] for claim, _result in outcomes}
        with self._lock:
            busy = {agent for run_id, agent in self._live.items() if run_id not in ended}
        try:
            with self.repo.store.transaction():
                effects = [self._apply(claim, result) for claim, result in outcomes]
                # The outcomes were stamped with the clock just now: claim no earlier,
                # so an agent's next claimed_at never precedes its last finished_at.
                claim_now = max(now, self.clock())
                claims = (self.repo.claim_batch(claim_now, slots, exclude_agents=busy)
                          if slots else [])
            self.commits.commits += 1
            self.commits.operations += len(outcomes)
        except Exception as exc:
            # One bad outcome must not hold the others (or the claims) back.
            log.warning("recording %d outcome(s) together failed (%s); one by one",
                        len(outcomes), exc)
            for claim, result in outcomes:
                try:
                    self._record(claim, result)
                except Exception:
                    log.exception("run %s: its outcome could not be recorded",
                                  claim.run["id"])
            return self.repo.claim_batch(now, slots, exclude_agents=self.live_agents()) \
                if slots else []
        with self._lock:
            for run_id in ended:
                self._live.pop(run_id, None)
        for (claim, result), effect in zip(outcomes, effects, strict=True):
            self._announce(claim, result, effect)
        return claims

    def _spec(self, claim: Claim) -> ExecutionSpec:
        """The execution of a claimed run (CONTRACT.md section 5)."""
        run = claim.run
        run_id = run["id"]
        profile = self.config.profile(claim.profile)
        session_id = f"ses_{uuid.uuid4().hex}"
        return agent_execution(
            profile, self.layout, kind="run", key=run_id, run_id=run_id, session_id=session_id,
            stdin={"kind": "run", "run_id": run_id, "session_id": session_id,
                   "agent_id": run["agent_id"], "task_id": run["task_id"],
                   "workspace_id": run["workspace_id"], "reason": run["reason"],
                   "payload": run["payload"]})

    def _dispatch(self, reservation: Any, claim: Claim) -> bool:
        """Start the claimed run's execution; False (and the claim settled) when it cannot."""
        run = claim.run
        with self._lock:
            self._live[run["id"]] = run["agent_id"]
        try:
            spec = self._spec(claim)
            self.runtime.start(reservation, spec,
                               lambda result: self._on_done(claim, result))
        except Exception as exc:
            with self._lock:
                self._live.pop(run["id"], None)
            self.runtime.release(reservation)  # a no-op when start() already gave it back
            self._not_started(claim, exc)
            return False
        log.info("run %s claimed (agent %s, reason %s, seq %d)", run["id"], run["agent_id"],
                 run["reason"], run["seq"])
        self.bus.publish("run.claimed", {"run": run})
        return True

    def _not_started(self, claim: Claim, exc: Exception) -> None:
        """A claim whose execution could not start: back to the queue, or a failed attempt.

        While the runtime is stopping that is nobody's fault: the run simply
        goes back to the queue. Anything else (a profile that cannot be run)
        is a failed attempt under the retry policy, so it backs off instead of
        being claimed again at once.
        """
        run_id = claim.run["id"]
        now = self.clock()
        if isinstance(exc, RuntimeStopped):
            self.repo.requeue(run_id, claim.token, now)
            log.info("run %s: runtime is stopping; re-queued", run_id)
            return
        error = f"could not start the agent: {exc}"
        log.error("run %s: %s", run_id, error)
        updated = self.repo.fail_attempt(run_id, claim.token, now=now, error=error,
                                         policy=self.config.retry)
        if updated is not None:
            self._announce_failure(updated, error)

    # -- outcomes ---------------------------------------------------------------
    def defer_outcomes(self, enabled: bool) -> None:
        """Hand outcomes to the queue loop (True) or record them in the worker (False).

        The loop turns deferral on while its thread runs: the next drain then
        writes every outcome that arrived together with the claims it makes,
        in one durable commit. Turning it off (the loop's last act) records
        whatever is still pending, so after the loop has stopped (e.g. the
        agents interrupted by the shutdown) nothing waits for it.
        """
        with self._lock:
            self._defer = enabled
            pending: list[tuple[Claim, ExecutionResult]] = []
            if not enabled:
                pending, self._outcomes = self._outcomes, []
        if pending:
            for claim, result in pending:
                self._record(claim, result)

    def _on_done(self, claim: Claim, result: ExecutionResult) -> None:
        """An execution ended (in the runtime's worker thread)."""
        with self._lock:
            deferred = self._defer
            if deferred:
                self._outcomes.append((claim, result))
        try:
            if not deferred:
                self._record(claim, result)
        finally:
            self.signal()  # the agent is free (or its outcome waits for the loop)

    def _take_outcomes(self) -> list[tuple[Claim, ExecutionResult]]:
        with self._lock:
            pending, self._outcomes = self._outcomes, []
        return pending

    def _record(self, claim: Claim, result: ExecutionResult) -> None:
        """Write one outcome in its own (group) commit, then announce it."""
        try:
            effect = (None if result.outcome in _NO_WRITE
                      else self.commits.submit(lambda: self._apply(claim, result)))
        finally:
            with self._lock:
                self._live.pop(claim.run["id"], None)
        self._announce(claim, result, effect)

    def _apply(self, claim: Claim, result: ExecutionResult) -> Any:
        """The database side of an outcome; returns what :meth:`_announce` reports.

        ``True``/``False`` for a success (False: a superseded attempt), the
        updated run (or None when superseded) for a failure, and ``None`` for
        an execution that was interrupted or stopped, which writes nothing.
        """
        run_id = claim.run["id"]
        if result.outcome in _NO_WRITE:
            return None
        now = self.clock()
        log_path = str(result.log_path)
        if result.succeeded:
            return self.repo.finish(run_id, claim.token, now=now, summary=result.summary,
                                    cost_cents=result.cost_cents, log_path=log_path)
        return self.repo.fail_attempt(
            run_id, claim.token, now=now, error=result.error or result.outcome,
            policy=self.config.retry, summary=result.summary, cost_cents=result.cost_cents,
            log_path=log_path)

    def _announce(self, claim: Claim, result: ExecutionResult, effect: Any) -> None:
        run_id = claim.run["id"]
        if result.outcome == INTERRUPTED:
            log.info("run %s interrupted by shutdown; stays claimed for the next start", run_id)
        elif result.outcome == STOPPED:
            log.info("run %s: agent process stopped (%s)", run_id, result.error)
        elif result.succeeded:
            if effect:
                log.info("run %s finished", run_id)
                self.bus.publish("run.finished", {"run_id": run_id,
                                                  "agent_id": claim.run["agent_id"],
                                                  "cost_cents": result.cost_cents})
            else:
                log.warning("run %s: completion of a superseded attempt ignored", run_id)
        elif effect is None:
            log.warning("run %s: failure of a superseded attempt ignored", run_id)
        else:
            self._announce_failure(effect, result.error)

    def _announce_failure(self, updated: dict[str, Any], error: str | None) -> None:
        run_id = updated["id"]
        if updated["status"] == "queued":
            log.info("run %s failed (%s); retry %d at %s", run_id, error,
                     updated["retry_count"], updated["scheduled_retry_at"])
            self.bus.publish("run.retry_scheduled", {"run": updated})
        else:
            log.warning("run %s %s: %s", run_id, updated["status"], error)
            self.bus.publish(f"run.{updated['status']}", {"run": updated})

    # -- recovery / control -------------------------------------------------------
    def recover_stale(self, now: datetime) -> list[str]:
        recovered = self.repo.recover_stale(now, self.config.queue.stale_claim_s,
                                            self.live_runs())
        for run_id in recovered:
            log.warning("run %s: stale claim re-queued", run_id)
        return recovered

    def recover_after_restart(self) -> list[str]:
        recovered = self.repo.requeue_foreign_claims(self.clock())
        if recovered:
            log.info("re-queued %d run(s) claimed by a previous daemon instance", len(recovered))
        return recovered

    def cancel(self, run_id: str, reason: str | None = None, *,
               only_queued: bool = False) -> dict[str, Any]:
        run, previous = self.repo.cancel(run_id, reason, self.clock(), only_queued=only_queued)
        if previous == "claimed":
            self.runtime.stop_execution(run_id, reason or "cancelled")
        log.info("run %s cancelled (was %s)", run_id, previous)
        self.bus.publish("run.cancelled", {"run": run})
        self.signal()
        return run

    def explain(self, run_id: str) -> dict[str, Any]:
        return self.repo.explain(run_id, self.clock(),
                                 runtime_full=self.runtime.active >= self.runtime.max_concurrent,
                                 live_agents=self.live_agents())
