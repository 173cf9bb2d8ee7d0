"""RunQueue: enqueue, claim -> dispatch to the runtime, and attempt outcomes.

This is the queue's service object; :class:`kandevd.queue.loop.QueueLoop`
only decides *when* :meth:`RunQueue.drain` runs. Everything that changes a
run goes through :class:`kandevd.store.runs.RunRepository` so the database
stays the truth.

Dispatch order for one claim: reserve a runtime slot (never blocks) ->
claim the oldest eligible run in one transaction -> start the execution. If
there is no slot nothing is claimed; if there is no eligible run the slot is
given back; if the execution cannot be started the claim is re-queued.
"""

from __future__ import annotations

import logging
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kandevd.bus import EventBus
from kandevd.config import Config
from kandevd.paths import HomeLayout
from kandevd.runtime import AgentRuntime, ExecutionResult, ExecutionSpec
from kandevd.store.runs import Claim, EnqueueResult, RunRepository
from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.queue")

ECHO_AGENT = (sys.executable, "-m", "kandevd.agents.echo")


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
        self.signals_enabled = True
        self.claimed_total = 0

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
        """Claim and dispatch up to ``limit`` runs; return how many were started."""
        started = 0
        while started < limit:
            reservation = self.runtime.try_reserve()
            if reservation is None:
                break
            try:
                claim = self.repo.claim_next(now, exclude_agents=self.live_agents())
            except BaseException:
                self.runtime.release(reservation)
                raise
            if claim is None:
                self.runtime.release(reservation)
                break
            if self._dispatch(reservation, claim):
                started += 1
        self.claimed_total += started
        return started

    def _dispatch(self, reservation: Any, claim: Claim) -> bool:
        run = claim.run
        profile = self.config.profile(claim.profile)
        session_id = f"ses_{uuid.uuid4().hex}"
        with self._lock:
            self._live[run["id"]] = run["agent_id"]
        try:
            spec = ExecutionSpec(
                key=run["id"], kind="run",
                argv=tuple(profile.command) if profile.command else ECHO_AGENT,
                stdin={"kind": "run", "run_id": run["id"], "session_id": session_id,
                       "agent_id": run["agent_id"], "task_id": run["task_id"],
                       "workspace_id": run["workspace_id"], "reason": run["reason"],
                       "payload": run["payload"]},
                cwd=self.layout.runs / run["id"],
                log_path=self.layout.run_logs / f"{run['id']}.log",
                timeout_s=profile.timeout_s, env=dict(profile.env), run_id=run["id"],
                session_id=session_id, home=str(self.layout.root),
            )
            self.runtime.start(reservation, spec,
                               lambda result: self._on_done(claim, result))
        except Exception as exc:
            with self._lock:
                self._live.pop(run["id"], None)
            self.runtime.release(reservation)
            self.repo.requeue(run["id"], claim.token, self.clock())
            log.error("run %s: could not start its agent (%s); re-queued", run["id"], exc)
            return False
        log.info("run %s claimed (agent %s, reason %s, seq %d)", run["id"], run["agent_id"],
                 run["reason"], run["seq"])
        self.bus.publish("run.claimed", {"run": run})
        return True

    def _on_done(self, claim: Claim, result: ExecutionResult) -> None:
        """Record an attempt's outcome (runs in the runtime's worker thread)."""
        run_id = claim.run["id"]
        try:
            self._record(claim, result)
        finally:
            with self._lock:
                self._live.pop(run_id, None)
            self.signal()

    def _record(self, claim: Claim, result: ExecutionResult) -> None:
        run_id = claim.run["id"]
        now = self.clock()
        log_path = str(result.log_path)
        if result.outcome == "interrupted":
            log.info("run %s interrupted by shutdown; stays claimed for the next start", run_id)
            return
        if result.outcome == "stopped":
            log.info("run %s: agent process stopped (%s)", run_id, result.error)
            return
        if result.succeeded:
            if self.repo.finish(run_id, claim.token, now=now, summary=result.summary,
                                cost_cents=result.cost_cents, log_path=log_path):
                log.info("run %s finished", run_id)
                self.bus.publish("run.finished", {"run_id": run_id,
                                                  "agent_id": claim.run["agent_id"],
                                                  "cost_cents": result.cost_cents})
            else:
                log.warning("run %s: completion of a superseded attempt ignored", run_id)
            return
        updated = self.repo.fail_attempt(run_id, claim.token, now=now,
                                         error=result.error or result.outcome,
                                         policy=self.config.retry, summary=result.summary,
                                         cost_cents=result.cost_cents, log_path=log_path)
        if updated is None:
            log.warning("run %s: failure of a superseded attempt ignored", run_id)
        elif updated["status"] == "queued":
            log.info("run %s failed (%s); retry %d at %s", run_id, result.error,
                     updated["retry_count"], updated["scheduled_retry_at"])
            self.bus.publish("run.retry_scheduled", {"run": updated})
        else:
            log.warning("run %s %s: %s", run_id, updated["status"], result.error)
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

    def cancel(self, run_id: str, reason: str | None = None) -> dict[str, Any]:
        run, previous = self.repo.cancel(run_id, reason, self.clock())
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
