"""RunQueue: the queue's one face, and its intake (enqueue, cancel, retry, explain).

Everything that changes a run goes through the run repository, so the
database stays the truth. The rooms behind it: dispatch.py (reserve → claim
→ start), outcomes.py (journal → group commit → refused-write retry →
announce), restore.py (restart adoption, peer settlement); the queue loop
(loop.py) only decides *when* :meth:`RunQueue.drain` runs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.bus import EventBus
from kandevd.config import Config
from kandevd.faults import NO_FAULTS, Faults
from kandevd.fsutil import append_note
from kandevd.paths import HomeLayout
from kandevd.runqueue.dispatch import Dispatcher
from kandevd.runqueue.live import LiveRuns, Waker
from kandevd.runqueue.outcomes import Observer, OutcomeRecorder
from kandevd.runqueue.restore import Restorer
from kandevd.runs.labels import covers
from kandevd.runs.model import Claim, EnqueueRequest, EnqueueResult, Explanation, Run, RunPage
from kandevd.runs.retry import retry_decider
from kandevd.runtime import AgentRuntime, ExecutionResult
from kandevd.store.runners import Runners
from kandevd.store.runs import RunRepository
from kandevd.timeutil import rfc3339, utc_now

log = logging.getLogger("kandevd.queue")


class RunQueue:
    def __init__(self, repo: RunRepository, runtime: AgentRuntime, config: Config,
                 layout: HomeLayout, bus: EventBus, *,
                 clock: Callable[[], datetime] = utc_now, faults: Faults = NO_FAULTS,
                 monotonic: Callable[[], float] = time.monotonic,
                 observer: Observer | None = None,
                 on_saturated: Callable[[], None] | None = None,
                 waker: Waker | None = None) -> None:
        """``observer``: hears of executions as they end (metrics); ``on_saturated``:
        several daemons: a pass filled every free slot here, the others should look;
        ``waker``: the in-process signal, also given to the runtime as what a freed slot
        calls (default: a new one, which no slot calls: a test's)."""
        self.repo = repo
        self.runtime = runtime
        self.config = config
        self.layout = layout
        self.bus = bus
        self.clock = clock
        self.live = LiveRuns(layout.attempts)
        #: The in-process signal (the runtime calls it too when a slot frees).
        self.wake = waker if waker is not None else Waker()
        #: The queue loop's wake-up event (the loop is built with it).
        self.wakeup = self.wake.event
        self.outcomes = OutcomeRecorder(
            repo, self.live, bus, self.wake, decide_retry=retry_decider(config.retry),
            clock=clock, faults=faults, observer=observer, monotonic=monotonic,
            release=runtime.settle)
        self.dispatcher = Dispatcher(repo, runtime, self.outcomes, self.live, bus, config,
                                     layout, clock=clock, faults=faults, observer=observer,
                                     on_saturated=on_saturated)
        self.restorer = Restorer(repo, runtime, self.outcomes, self.live, self.wake, config,
                                 layout, clock=clock)

    # -- signal -----------------------------------------------------------------
    def signal(self) -> None:
        self.wake()

    def signal_if_a_slot_is_free(self) -> None:
        """Wake the loop for new work, unless every runtime slot runs an execution.

        Then a pass could claim nothing, and the slot that frees next wakes the
        loop anyway (the runtime's slot listener), after this run was committed,
        so no run waits longer. A slot merely reserved does not count: the pass
        holding it may have looked for work before this run was committed, and
        gives it back without waking anyone. Under load this spares a pass (and
        a commit of whatever outcomes it would take along) per enqueue.
        """
        if not self.runtime.all_running:
            self.wake()

    # -- intake -----------------------------------------------------------------
    def enqueue(self, *, workspace_id: str, agent_id: str, reason: str,
                task_id: str | None = None, payload: dict[str, Any] | None = None,
                idempotency_key: str | None = None, coalesce: bool = True) -> EnqueueResult:
        """Persist a run request (what the ``queue_run`` workflow action calls).

        The caller may hold a transaction of its own (Office recovery re-checks
        and enqueues in one): ``run.queued`` and the wake-up wait for the
        outermost commit, so nobody hears of a run that may still roll back.
        """
        result = self.repo.enqueue(workspace_id=workspace_id, agent_id=agent_id, reason=reason,
                                   task_id=task_id, payload=payload,
                                   idempotency_key=idempotency_key, coalesce=coalesce,
                                   now=self.clock())
        if result.inserted:
            run = result.run

            def announce() -> None:
                self.bus.publish("run.queued", {"run": run})
                if result.claimable:  # (a paused agent's run: its resume wakes the loop)
                    self.signal_if_a_slot_is_free()

            self.repo.store.after_commit(announce)
        return result

    def enqueue_many(self, items: list[EnqueueRequest]) -> list[EnqueueResult]:
        """Persist a batch of run requests in one transaction (``runs.enqueue_many``).

        All or nothing (see :meth:`RunRepository.enqueue_many`); the new runs
        are announced after the commit, with one wake-up for the batch.
        """
        results = self.repo.enqueue_many(items, now=self.clock())
        inserted = [result.run for result in results if result.inserted]
        claimable = any(result.inserted and result.claimable for result in results)
        if inserted:
            def announce() -> None:
                for run in inserted:
                    self.bus.publish("run.queued", {"run": run})
                if claimable:
                    self.signal_if_a_slot_is_free()

            self.repo.store.after_commit(announce)
        return results

    def retry(self, run_id: str) -> Run:
        """``runs.retry``: a failed or cancelled run queued again with a fresh attempt budget."""
        now = self.clock()
        run = self.repo.retry(run_id, now)
        # (The run cannot be claimed again before a live attempt's outcome is settled.)
        self.live.forget_cancel_unless_live(run_id)
        # (A run an earlier version cancelled as it ran names no log: where it is written.)
        log_file = run.log_path or self._log_if_any(run_id)
        if log_file and os.path.isfile(log_file):  # (its attempts start at 1 again)
            append_note(Path(log_file), f"==== re-queued by runs.retry {rfc3339(now)}: "
                        "its attempts count from 1 again ====")
        log.info("run %s re-queued by runs.retry", run_id)
        self.bus.publish("run.queued", {"run": run})
        self.wake()
        return run

    def cancel(self, run_id: str, reason: str | None = None, *,
               only_queued: bool = False) -> Run:
        run, previous = self.repo.cancel(run_id, reason, self.clock(), only_queued=only_queued,
                                         log_path=self._log_if_any(run_id))
        if previous == "claimed":
            # Seen by a dispatch that has not started the execution yet (the claim may
            # even be committed but not handed to a dispatch): it stops it.
            self.live.request_cancel(run_id)
            self.runtime.stop_execution(run_id, reason or "cancelled")
        log.info("run %s cancelled (was %s)", run_id, previous)
        self.bus.publish("run.cancelled", {"run": run})
        self.wake()
        return run

    # -- runners on other machines (the gateway) -------------------------------------
    def claim_for_runner(self, claimed_by: str, agents: frozenset[str], limit: int = 1
                         ) -> list[Claim]:
        """Up to ``limit`` runs of ``agents`` (those a runner may take), oldest first, one
        per agent, claimed for it in one statement; announced as any claim."""
        claims = self.repo.claim_batch(self.clock(), limit, runner=(claimed_by, agents))
        for claim in claims:
            self.bus.publish("run.claimed", {"run": claim.run})
        return claims

    def claim_in_force(self, run_id: str, token: str) -> Claim | None:
        """Run ``run_id``'s claim ``token`` while it still holds (None: it ended)."""
        return self.repo.claim_of(run_id, token)

    def record_remote(self, claim: Claim, result: ExecutionResult) -> bool:
        """A runner's execution ended: its outcome recorded as a local one's is; False
        when the database refused it (the runner keeps it and sends it again)."""
        try:
            return self.outcomes.record(claim, result, keep_refused=False)
        finally:
            self.wake()

    def release_remote(self, claim: Claim, why: str) -> None:
        """A runner stopped gracefully during the execution: back to the queue, uncounted."""
        if self.repo.release_interrupted(self.clock(), [(claim.run.id, claim.token)], why):
            log.info("run %s: %s; re-queued", claim.run.id, why)
            try:  # (subscribers saw it claimed: it waits in the queue again)
                self.bus.publish("run.queued", {"run": self.repo.get(claim.run.id)})
            except Exception:  # (gone meanwhile, or the database refused: no event)
                log.debug("run %s: no run.queued event for its release", claim.run.id)
        self.wake()

    def rescue_remote(self, claims: list[tuple[str, str]], why: str) -> dict[str, str]:
        """A silent runner's claims: re-queued, their attempt counted (or dead-lettered)."""
        done = self.repo.rescue_claims(self.clock(), claims, why)
        for run_id, status in done.items():
            log.warning("run %s: %s; %s", run_id, why,
                        "re-queued" if status == "queued" else "gave up")
            self._close_attempt(run_id, why)
        if done:
            self.outcomes.announce_rescued(done)
            self.wake()
        return done

    def _log_if_any(self, run_id: str) -> str | None:
        """Where run ``run_id``'s log is written, when it has one (an attempt started)."""
        path = self.layout.run_logs / f"{run_id}.log"
        return str(path) if path.is_file() else None

    def _close_attempt(self, run_id: str, why: str) -> None:
        """The attempt a rescue took back ends in the run's log too (a runner that went
        silent never sends its end): ``==== attempt N ended <time>: error (why) ====``."""
        self.restorer.end_attempt_in_log(run_id, why, outcome="error")

    def explain(self, run_id: str) -> Explanation:
        now = self.clock()
        explained = self.repo.explain(run_id, now,
                                      runtime_full=self.runtime.active
                                      >= self.runtime.max_concurrent,
                                      live_agents=self.live.agent_ids())
        labels = explained["details"].get("runs_on")
        if labels and not self._runner_online(labels, now):
            explained["blockers"].append("no_runner")  # (details.runs_on names the labels)
            explained["eligible"] = False
        return explained

    def _runner_online(self, labels: list[str], now: datetime) -> bool:
        """Is a runner carrying every one of ``labels`` online (seen lately)? None is
        while no gateway can hear them: none here, and no other daemon's (not shared)."""
        if not self.config.gateway.listen and not self.repo.store.shared:
            return False
        recent = self.config.gateway.dead_after_s
        return any(covers(row.labels, labels) and row.online(now, recent)
                   for row in Runners(self.repo.store).all())

    def get(self, run_id: str) -> Run:
        """``runs.get`` (RunNotFound: no such run)."""
        return self.repo.get(run_id)

    def page(self, *, limit: int = 50, offset: int = 0, order: str = "asc",
             **filters: str | None) -> RunPage:
        """``runs.list``: a page of runs matching ``filters``, in request order."""
        return self.repo.list(limit=limit, offset=offset, order=order, **filters)

    def counts(self) -> dict[str, int]:
        """Runs by status, for ``daemon.status`` (``failed`` is the dead letter)."""
        return self.repo.count_by_status()

    def retrying(self, now: datetime) -> tuple[int, str | None]:
        """Queued runs waiting for their retry's back-off: how many, and the first due."""
        return self.repo.retrying(now)

    def oldest_queued_at(self, now: datetime) -> str | None:
        """When the oldest run ready to claim was requested (None: none is)."""
        return self.repo.oldest_queued_at(now)

    @property
    def adopted_total(self) -> int:
        """Executions of earlier instances adopted at start."""
        return self.restorer.adopted_total

    def release_peers(self) -> None:
        """The earlier instances of this home are settled: claims by them are peers'."""
        self.repo.release_peers()

    # -- the rooms behind it, as the loop, the daemon and status see them ---------------
    def drain(self, now: datetime, limit: int) -> int:
        return self.dispatcher.drain(now, limit)

    def defer_outcomes(self, enabled: bool) -> None:
        self.outcomes.defer_outcomes(enabled)

    def next_write_retry_in(self) -> float | None:
        return self.outcomes.next_write_retry_in()

    def unrecorded(self) -> int:
        return self.outcomes.unrecorded()

    def live_runs(self) -> frozenset[str]:
        return self.live.run_ids()

    def live_agents(self) -> frozenset[str]:
        return self.live.agent_ids()

    def recover_stale(self, now: datetime) -> dict[str, str]:
        return self.restorer.recover_stale(now)

    def restore_after_restart(self, *, adopt: bool) -> frozenset[int]:
        return self.restorer.restore_after_restart(adopt=adopt)

    def recover_after_restart(self) -> dict[str, str]:
        return self.restorer.recover_after_restart()

    def release_interrupted(self) -> list[str]:
        return self.restorer.release_interrupted()

    def settle_with_peers(self, rescue: bool = True) -> None:
        self.restorer.settle_with_peers(rescue)

    def fenced(self, keys: frozenset[str]) -> None:
        """A fence stopped the executions of ``keys``: the runs among them go back to the
        queue once it healed (while this daemon still holds them)."""
        self.restorer.note_fenced(keys & self.live.run_ids())

    def stats(self) -> dict[str, int]:
        """Counters for ``daemon.status``."""
        commits = self.outcomes.commits
        return {"claimed": self.dispatcher.claimed_total, "outcome_commits": commits.commits,
                "outcomes": commits.operations, "retries": self.outcomes.retries_total,
                "rescued": self.restorer.rescued_total}
