"""RunQueue: enqueue, claim -> dispatch to the runtime, and attempt outcomes.

This is the queue's service object; :class:`kandevd.queue.loop.QueueLoop`
only decides *when* :meth:`RunQueue.drain` runs. Everything that changes a
run goes through :class:`kandevd.store.runs.RunRepository` so the database
stays the truth.

One drain: reserve the free runtime slots (never blocks) -> claim at most
that many runs in one transaction (the oldest eligible run of each eligible
agent, oldest first) -> start each execution; unused slots are given back,
whatever raises. If the execution of a claim cannot be started, the claim
goes back to the queue while the runtime is stopping, and is otherwise a
failed attempt under the retry policy (so a broken profile backs off instead
of spinning).

An outcome is recorded, never re-earned (see :mod:`kandevd.runtime.attempts`):
when an execution ends, its outcome is first written to the attempt's folder,
then to the database (outcomes that arrive together share one durable
commit, :class:`kandevd.queue.groupcommit.GroupCommit`). A database write that
fails is retried with back-off from memory; the agent stays busy only until
it succeeds, and the agent is never run again to learn the same thing.

A cancel that lands between a claim and the start of its execution is
remembered under the queue's lock, and the dispatch stops the execution as
soon as it has started (before the agent, in practice).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.bus import EventBus
from kandevd.config import Config
from kandevd.faults import NO_FAULTS, Faults
from kandevd.fsutil import append_note
from kandevd.paths import HomeLayout
from kandevd.queue.groupcommit import GroupCommit
from kandevd.runs.model import Claim, EnqueueResult, Run
from kandevd.runs.retry import retry_decider
from kandevd.runtime import (
    DETACHED,
    ERROR,
    INTERRUPTED,
    STOPPED,
    AgentRuntime,
    ExecutionResult,
    ExecutionSpec,
    Reservation,
    RuntimeStopped,
    attempts,
    records,
)
from kandevd.runtime.records import (
    ExecutionRecord,
    locate,
    outcome_from_record,
    read_record,
    record_alive,
)
from kandevd.runtime.specs import agent_execution
from kandevd.store.base import is_environmental
from kandevd.store.runs import RunRepository
from kandevd.timeutil import rfc3339, utc_now

log = logging.getLogger("kandevd.queue")

#: Outcomes that leave the run as it is: interrupted by the shutdown (it stays
#: ``claimed`` for the next start), stopped by a cancel (already ``cancelled``),
#: or detached (the agent runs on for the next daemon instance to adopt).
_NO_WRITE = frozenset({INTERRUPTED, STOPPED, DETACHED})
#: Back-off of a failed outcome write: first retry after 0.1 s, doubling, at most
#: 2 s apart, so a disk that frees up is noticed within about two seconds.
_WRITE_RETRY_FIRST_S = 0.1
_WRITE_RETRY_MAX_S = 2.0
#: Refusals (other than a full disk or a busy database) after which an outcome is
#: recorded as a plain failed attempt instead.
_PLAIN_OUTCOME_AFTER = 10


@dataclass
class _Unrecorded:
    """An outcome the database refused; retried from memory at ``due`` (monotonic)."""

    claim: Claim
    result: ExecutionResult
    failures: int
    due: float


class RunQueue:
    def __init__(self, repo: RunRepository, runtime: AgentRuntime, config: Config,
                 layout: HomeLayout, bus: EventBus, *,
                 clock: Callable[[], datetime] = utc_now, faults: Faults = NO_FAULTS,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.repo = repo
        self.runtime = runtime
        self.config = config
        self.layout = layout
        self.bus = bus
        self.clock = clock
        self.faults = faults
        self.monotonic = monotonic  # paces the retries of refused outcome writes
        #: The retry policy, applied by the store inside each failed attempt's transaction.
        self.decide_retry = retry_decider(config.retry)
        self._lock = threading.Lock()
        self._live: dict[str, str] = {}  # run id -> agent id: executing, or outcome unwritten
        #: (run id, claim token) -> the attempt's folder, when it is not the one
        #: attempt_dir() names (an attempt of the legacy two-level layout).
        self._attempt_dirs: dict[tuple[str, str], Path] = {}
        self._cancel_requested: set[str] = set()  # claimed runs cancelled, maybe not started
        self._waker: Callable[[], None] | None = None
        #: Several daemons: called when a pass filled every free slot here and runs may
        #: still wait, so the others should look (a run freed by an outcome that this
        #: daemon claimed again at once needs no one else).
        self.on_saturated: Callable[[], None] | None = None
        self._defer = False  # outcomes go to the loop's next drain (see defer_outcomes)
        self._outcomes: list[tuple[Claim, ExecutionResult]] = []
        self._unrecorded: list[_Unrecorded] = []
        self._failure_counts: dict[str, int] = {}  # run id -> refused writes of its outcome
        self.signals_enabled = True
        self.claimed_total = 0
        self.adopted_total = 0
        self.retries_total = 0  # failed attempts re-queued under the retry policy
        self.rescued_total = 0  # claims rescued (stale, or left by an earlier instance)
        self.metrics: Any = None  # kandevd.metrics.DaemonMetrics, set by the daemon
        self.write_failures = 0
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
            self.signal()

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
                self.signal_if_a_slot_is_free()

            self.repo.store.after_commit(announce)
        return result

    def enqueue_many(self, items: list[dict[str, Any]]) -> list[EnqueueResult]:
        """Persist a batch of run requests in one transaction (``runs.enqueue_many``).

        All or nothing (see :meth:`RunRepository.enqueue_many`); the new runs
        are announced after the commit, with one wake-up for the batch.
        """
        results = self.repo.enqueue_many(items, now=self.clock())
        inserted = [result.run for result in results if result.inserted]
        if inserted:
            def announce() -> None:
                for run in inserted:
                    self.bus.publish("run.queued", {"run": run})
                self.signal_if_a_slot_is_free()

            self.repo.store.after_commit(announce)
        return results

    def retry(self, run_id: str) -> Run:
        """``runs.retry``: a failed or cancelled run queued again with a fresh attempt budget."""
        run = self.repo.retry(run_id, self.clock())
        with self._lock:
            # A new request: no old cancel applies. Unless the cancelled attempt is still
            # live here (being dispatched or stopped): its flag must still stop it, and
            # the run cannot be claimed again before that attempt's outcome is settled.
            if run_id not in self._live:
                self._cancel_requested.discard(run_id)
        log.info("run %s re-queued by runs.retry", run_id)
        self.bus.publish("run.queued", {"run": run})
        self.signal()
        return run

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
        eligible agent, oldest first. Every reservation not spent on a started
        execution is given back, whatever raises. Returns how many runs were
        started.
        """
        outcomes = self._take_outcomes()
        if not outcomes and not self.repo.has_queued():
            return 0  # idle: touch neither the runtime's slots nor the write lock
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
                                               exclude_agents=self.live_agents())
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
        with self._lock:
            busy = {agent for run_id, agent in self._live.items()
                    if run_id not in ended or run_id in leaving}
        try:
            # Outcomes and claims only: on PostgreSQL both guard themselves with row locks.
            with self.repo.store.transaction(exclusive=False):
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
                self._record(claim, result)
            return self.repo.claim_batch(now, slots, exclude_agents=self.live_agents()) \
                if slots else []
        for (claim, result), effect in zip(outcomes, effects, strict=True):
            self._recorded(claim, result)
            self._announce(claim, result, effect)
        return claims

    def _spec(self, claim: Claim, *, session_id: str | None = None) -> ExecutionSpec:
        """The execution of a claimed run (CONTRACT.md section 5)."""
        run = claim.run
        run_id = run.id
        profile = self.config.profile(claim.profile)
        session_id = session_id or f"ses_{uuid.uuid4().hex}"
        return agent_execution(
            profile, self.layout, kind="run", key=run_id, run_id=run_id, session_id=session_id,
            stdin={"kind": "run", "run_id": run_id, "session_id": session_id,
                   "agent_id": run.agent_id, "task_id": run.task_id,
                   "workspace_id": run.workspace_id, "reason": run.reason,
                   "payload": run.payload},
            record_dir=attempts.attempt_dir(self.layout.attempts, run_id, claim.token))

    def _dispatch(self, reservation: Reservation, claim: Claim) -> bool:
        """Start the claimed run's execution; False (and the claim settled) when it cannot.

        Never raises: a claim that can be neither started nor settled stays
        ``claimed`` with no live execution, which stale-claim recovery rescues.
        """
        run = claim.run
        run_id = run.id
        with self._lock:
            self._live[run_id] = run.agent_id
        try:
            self.faults.before_start(run_id)
            spec = self._spec(claim)
            append_note(spec.log_path, f"==== attempt {run.attempt} started "
                                           f"{rfc3339(self.clock())} ====")
            self.runtime.start(reservation, spec,
                               lambda result: self._on_done(claim, result))
        except Exception as exc:
            with self._lock:
                self._live.pop(run_id, None)
                self._cancel_requested.discard(run_id)
            self.runtime.release(reservation)  # a no-op when start() already gave it back
            try:
                self._not_started(claim, exc)
            except Exception:
                log.exception("run %s: its failed start could not be recorded; stale-claim "
                              "recovery will rescue it", run_id)
            return False
        with self._lock:
            cancelled = run_id in self._cancel_requested
        if cancelled:  # runs.cancel came between the claim and the start
            self.runtime.stop_execution(run_id, "cancelled")
        if self.metrics is not None and run.attempt == 1 and run.claimed_at:
            self.metrics.observe_first_claim(run.requested_at, run.claimed_at)
        log.info("run %s claimed (agent %s, reason %s, seq %d)", run_id, run.agent_id,
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
                                         decide=self.decide_retry)
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
                pending += [(u.claim, u.result) for u in self._unrecorded]
                self._unrecorded = []
        for claim, result in pending:
            self._record(claim, result)

    def _on_done(self, claim: Claim, result: ExecutionResult) -> None:
        """An execution ended (in the runtime's worker thread).

        The outcome is on disk before anyone tries the database, so whatever
        happens to that write (or to this process), the agent is not run
        again to learn it: the shim's exit file already says how an agent
        that exited on its own ended (the next start reads it, see
        :meth:`restore_after_restart`); any other outcome (a timeout, an
        interruption, an error of ours) is written to the attempt's
        ``outcome.json`` first. A refused write writes it too.
        """
        directory = self._attempt_dir(claim)
        if result.outcome != DETACHED:
            ending = result.outcome + (f" ({result.error})" if result.error else "")
            append_note(result.log_path, f"==== attempt {claim.run.attempt} "
                                             f"ended {rfc3339(result.ended_at)}: {ending} ====")
        if result.outcome == STOPPED:
            attempts.discard(directory)  # cancelled: the run row already says so
        elif result.outcome != DETACHED and not records.exit_file_tells(directory, result):
            attempts.write_outcome(directory, result)
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
        """Outcomes handed over since the last drain, plus refused writes now due again."""
        now = self.monotonic()
        with self._lock:
            pending, self._outcomes = self._outcomes, []
            due = [u for u in self._unrecorded if u.due <= now]
            if due:
                self._unrecorded = [u for u in self._unrecorded if u.due > now]
        return pending + [(u.claim, u.result) for u in due]

    def next_write_retry_in(self) -> float | None:
        """Seconds until the next refused outcome write is due again (None: none waits)."""
        with self._lock:
            if not self._unrecorded:
                return None
            return max(0.0, min(u.due for u in self._unrecorded) - self.monotonic())

    def unrecorded(self) -> int:
        """Outcomes known here that the database has not accepted yet."""
        with self._lock:
            return len(self._unrecorded)

    def _record(self, claim: Claim, result: ExecutionResult) -> None:
        """Write one outcome in its own (group) commit, then announce it.

        A refused write keeps the outcome in memory for a retry with back-off;
        until it succeeds the run stays live here, so its agent stays busy and
        stale-claim recovery leaves it alone.
        """
        if result.outcome in _NO_WRITE:
            self._recorded(claim, result)
            self._announce(claim, result, None)
            return
        try:
            effect = self.commits.submit(lambda: self._apply(claim, result))
        except Exception as exc:
            self._write_refused(claim, result, exc)
            return
        self._recorded(claim, result)
        self._announce(claim, result, effect)

    def _write_refused(self, claim: Claim, result: ExecutionResult, exc: Exception) -> None:
        run_id = claim.run.id
        directory = self._attempt_dir(claim)
        if not attempts.has_outcome(directory):
            attempts.write_outcome(directory, result)  # kept for a restart too
        if (not is_environmental(exc) and result.outcome != ERROR
                and self._failure_counts.get(run_id, 0) + 1 >= _PLAIN_OUTCOME_AFTER):
            # Refused again and again, and not for want of disk: something in this
            # outcome itself cannot be stored. Record the attempt as failed without it,
            # so the run is settled (and retried under the policy) instead of holding
            # its agent for ever; the full outcome stays in the attempt's outcome file.
            log.error("run %s: its outcome keeps being refused (%s); recording the attempt "
                      "as failed without it", run_id, exc)
            result = dataclasses.replace(
                result, outcome=ERROR, summary=None, cost_cents=None,
                error=f"its outcome could not be recorded: {type(exc).__name__}: {exc}")
        with self._lock:
            previous = next((u for u in self._unrecorded if u.claim.run.id == run_id), None)
            failures = (previous.failures if previous
                        else self._failure_counts.get(run_id, 0)) + 1
            self._unrecorded = [u for u in self._unrecorded if u.claim.run.id != run_id]
            delay = min(_WRITE_RETRY_FIRST_S * 2 ** (failures - 1), _WRITE_RETRY_MAX_S)
            self._unrecorded.append(_Unrecorded(claim, result, failures,
                                                self.monotonic() + delay))
            self._failure_counts[run_id] = failures
            self.write_failures += 1
        level = logging.WARNING if failures == 1 else logging.DEBUG
        log.log(level, "run %s: its outcome (%s) could not be written to the database (%s); "
                "kept, retrying in %.1fs (the agent is not run again)", run_id, result.outcome,
                exc, delay)
        self.signal()

    def _recorded(self, claim: Claim, result: ExecutionResult) -> None:
        """The database has the outcome (or it needs none): the run is no longer live here."""
        run_id = claim.run.id
        directory = self._attempt_dir(claim)
        with self._lock:
            self._live.pop(run_id, None)
            self._attempt_dirs.pop((run_id, claim.token), None)
            self._cancel_requested.discard(run_id)
            failures = self._failure_counts.pop(run_id, 0)
        if result.outcome not in (INTERRUPTED, DETACHED):
            attempts.discard(directory)
        if failures:
            log.info("run %s: its outcome was written after %d refused attempt(s)", run_id,
                     failures)

    def _attempt_dir(self, claim: Claim) -> Path:
        """The folder of ``claim``'s attempt: where its execution keeps its attempts."""
        run_id = claim.run.id
        with self._lock:
            known = self._attempt_dirs.get((run_id, claim.token))
        return known if known is not None else attempts.attempt_dir(self.layout.attempts, run_id,
                                                                   claim.token)

    def _apply(self, claim: Claim, result: ExecutionResult) -> Any:
        """The database side of an outcome; returns what :meth:`_announce` reports.

        ``True``/``False`` for a success (False: a superseded attempt), the
        updated run (or None when superseded) for a failure, and ``None`` for
        an execution that was interrupted or stopped, which writes nothing.
        """
        run_id = claim.run.id
        if result.outcome in _NO_WRITE:
            return None
        self.faults.outcome_write()
        now = self.clock()
        log_path = str(result.log_path)
        if result.succeeded:
            return self.repo.finish(run_id, claim.token, now=now, summary=result.summary,
                                    cost_cents=result.cost_cents, log_path=log_path)
        return self.repo.fail_attempt(
            run_id, claim.token, now=now, error=result.error or result.outcome,
            decide=self.decide_retry, summary=result.summary, cost_cents=result.cost_cents,
            log_path=log_path)

    def _announce(self, claim: Claim, result: ExecutionResult, effect: Any) -> None:
        run_id = claim.run.id
        if self.metrics is not None:
            self.metrics.observe_execution(result)
        if result.outcome == INTERRUPTED:
            log.info("run %s interrupted by shutdown; stays claimed for the next start", run_id)
        elif result.outcome == DETACHED:
            log.info("run %s: agent left running for the next start to adopt", run_id)
        elif result.outcome == STOPPED:
            log.info("run %s: agent process stopped (%s)", run_id, result.error)
        elif result.succeeded:
            if effect:
                log.info("run %s finished", run_id)
                self.bus.publish("run.finished", {"run_id": run_id,
                                                  "agent_id": claim.run.agent_id,
                                                  "cost_cents": result.cost_cents})
            else:
                log.warning("run %s: completion of a superseded attempt ignored", run_id)
        elif effect is None:
            log.warning("run %s: failure of a superseded attempt ignored", run_id)
        else:
            self._announce_failure(effect, result.error)

    def _announce_failure(self, updated: Run, error: str | None) -> None:
        run_id = updated.id
        if updated.status == "queued":
            self.retries_total += 1
            log.info("run %s failed (%s); retry %d at %s", run_id, error,
                     updated.retry_count, updated.scheduled_retry_at)
            self.bus.publish("run.retry_scheduled", {"run": updated})
        else:
            log.warning("run %s %s: %s", run_id, updated.status,
                        updated.error_message or error)
            self.bus.publish(f"run.{updated.status}", {"run": updated})

    # -- recovery / control -------------------------------------------------------
    def recover_stale(self, now: datetime) -> dict[str, str]:
        recovered = self.repo.recover_stale(now, self.config.queue.stale_claim_s,
                                            self.live_runs())
        self._log_rescued(recovered, "stale claim")
        self.repo.prune_keys(now)
        return recovered

    def _log_rescued(self, rescued: dict[str, str], what: str) -> None:
        self.rescued_total += len(rescued)
        for run_id, status in rescued.items():
            if status == "failed":
                log.warning("run %s: %s; attempts used up, the run failed (dead letter)",
                            run_id, what)
            else:
                log.warning("run %s: %s re-queued", run_id, what)

    def restore_after_restart(self, *, adopt: bool, only_success: bool = False
                              ) -> frozenset[int]:
        """At start-up, before any recovery: settle what earlier instances left claimed.

        For each of their claims, in this order: an outcome file is recorded;
        an agent whose shim wrote its exit status is recorded from it; with
        ``adopt``, an agent still running is adopted (waited for here, its
        timeout and ``runs.cancel`` still apply). Returns the pids of the
        adopted shims, which the orphan sweep must leave alone. What is left
        is rescued by :meth:`recover_after_restart`.
        """
        kept: set[int] = set()
        for row in self.repo.foreign_claims():
            try:
                pid = self._restore_one(row["id"], row["claim_token"], adopt=adopt,
                                        only_success=only_success)
            except Exception:
                log.exception("run %s: restoring its execution failed; it will be rescued",
                              row["id"])
                continue
            if pid is not None:
                kept.add(pid)
        return frozenset(kept)

    def _restore_one(self, run_id: str, token: str | None, *, adopt: bool,
                     only_success: bool = False) -> int | None:
        """Settle one claim an earlier instance left; the adopted shim's pid, if any.

        The order matters: the daemon's own outcome file first; then whether
        the shim still runs (looked at *before* its exit file, so a shim that
        ends in between is read as ended, never as vanished); then its exit file.
        """
        if not token or run_id in self.live_runs():  # settled here already
            return None
        directory = attempts.existing_attempt_dir(self.layout.attempts, run_id, token)
        if not directory.is_dir():
            return None
        if directory != attempts.attempt_dir(self.layout.attempts, run_id, token):
            with self._lock:  # a legacy attempt: its journal stays where it is
                self._attempt_dirs[(run_id, token)] = directory
        claim = self.repo.claim_of(run_id, token)
        if claim is None:
            return None
        result = attempts.read_outcome(directory, run_id)
        interrupted = result is not None and result.outcome == INTERRUPTED
        if result is not None and not interrupted:
            return self._record_restored(claim, result)
        record = read_record(directory)
        if record is None:
            return None
        if record.run_id != run_id:  # (a recycled folder whose emptying a power cut lost)
            log.warning("run %s: the execution record in %s names run %s; ignored",
                        run_id, directory, record.run_id)
            return None
        record = locate(record)
        if record_alive(record):
            return self._adopt(claim, record, directory) if adopt else None
        ended = outcome_from_record(record, directory)
        if ended is None or ((interrupted or only_success) and not ended.succeeded):
            return None  # nothing known, or stopped by the shutdown: rescued (re-queued)
        # Also after an interrupting shutdown: an agent that exited 0 all the same did
        # its work, and running it again would repeat it.
        return self._record_restored(claim, ended)

    def _record_restored(self, claim: Claim, result: ExecutionResult) -> None:
        log.info("run %s: recording the outcome its execution left on disk (%s)",
                 claim.run.id, result.outcome)
        with self._lock:
            self._live[claim.run.id] = claim.run.agent_id
        self._record(claim, result)
        return None

    def _adopt(self, claim: Claim, record: ExecutionRecord, directory: Path) -> int:
        """Wait here for an execution an earlier instance started; the shim's pid."""
        run_id = claim.run.id
        # Built from the record, not the profile: the agent is running already, so a
        # profile renamed or removed meanwhile must not stop it from being adopted.
        spec = ExecutionSpec(
            key=run_id, kind="run", argv=record.argv, stdin={}, cwd=self.layout.runs / run_id,
            log_path=record.log_path, timeout_s=record.timeout_s,
            session_id=record.session_id, run_id=run_id, home=str(self.layout.root),
            record_dir=directory)
        with self._lock:
            self._live[run_id] = claim.run.agent_id
        try:
            self.runtime.adopt(spec, record, lambda res: self._on_done(claim, res))
        except BaseException:
            with self._lock:
                self._live.pop(run_id, None)
            raise
        # The claim becomes this instance's own (live runs are not rescued either way).
        try:
            self.repo.adopt_claim(run_id, claim.token)
        except Exception:
            log.exception("run %s: marking its claim as adopted failed; it stays live here",
                          run_id)
        self.adopted_total += 1
        log.info("run %s: adopted its agent (pid %d) left running by the previous instance",
                 run_id, record.pid)
        return record.pid

    def recover_after_restart(self) -> dict[str, str]:
        """Claims of earlier instances with no known outcome: re-queued, or the dead letter."""
        # An agent that ended since the restore left its exit file: a clean exit is
        # recorded rather than run again. (Any other status may be the sweep's own
        # SIGTERM: such a run is re-queued like the rest, one attempt counted.)
        self.restore_after_restart(adopt=False, only_success=True)
        recovered = self.repo.requeue_foreign_claims(self.clock(), keep=self.live_runs())
        pruned = attempts.prune(self.layout.attempts, self.repo.claimed_tokens())
        if pruned:
            log.info("removed %d attempt folder(s) of earlier attempts", pruned)
        if recovered:
            requeued = sum(1 for status in recovered.values() if status == "queued")
            self.rescued_total += requeued
            log.info("re-queued %d run(s) claimed by a previous daemon instance", requeued)
        self._log_rescued({k: v for k, v in recovered.items() if v == "failed"},
                          "claimed by a previous daemon instance")
        return recovered

    def settle_with_peers(self, rescue: bool = True) -> None:
        """A cluster heartbeat: rescue dead daemons' claims, stop executions lost here.

        Claims of daemons whose heartbeat is older than ``cluster.dead_after_s``
        are re-queued (an attempt counted) or failed once their attempts are
        used. A run live here that this daemon no longer holds (cancelled on
        another daemon, or rescued because this one was taken for dead) has its
        execution stopped: someone else owns the run now.
        """
        if rescue:
            rescued = self.repo.requeue_foreign_claims(
                self.clock(), "the daemon that claimed it stopped (no heartbeat)",
                keep=self.live_runs(), dead_peers=True)
            if rescued:
                self._log_rescued(rescued, "claimed by a daemon that stopped")
                self.signal()
        for run_id in self.repo.not_claimed_here(self.live_runs()):
            log.warning("run %s: no longer claimed by this daemon (cancelled or taken over "
                        "elsewhere); stopping its execution here", run_id)
            self.runtime.stop_execution(run_id, "the run is no longer claimed by this daemon")

    def cancel(self, run_id: str, reason: str | None = None, *,
               only_queued: bool = False) -> Run:
        run, previous = self.repo.cancel(run_id, reason, self.clock(), only_queued=only_queued)
        if previous == "claimed":
            with self._lock:
                # Seen by a dispatch that has not started the execution yet (the claim
                # may even be committed but not handed to a dispatch): it stops it.
                self._cancel_requested.add(run_id)
            self.runtime.stop_execution(run_id, reason or "cancelled")
        log.info("run %s cancelled (was %s)", run_id, previous)
        self.bus.publish("run.cancelled", {"run": run})
        self.signal()
        return run

    def explain(self, run_id: str) -> dict[str, Any]:
        return self.repo.explain(run_id, self.clock(),
                                 runtime_full=self.runtime.active >= self.runtime.max_concurrent,
                                 live_agents=self.live_agents())

    def counts(self) -> dict[str, int]:
        """Runs by status, for ``daemon.status`` (``failed`` is the dead letter)."""
        return self.repo.count_by_status()

