"""Outcomes: an ended execution's result, on disk first, then in the database, then told.

An outcome is recorded, never re-earned: when an execution ends, an outcome
the shim's exit file cannot tell (a timeout, an interruption, an error of
ours) is written to the attempt's folder before the database hears of it.
While the loop runs, outcomes wait for its next drain, which writes them
together with its claims in one durable commit; otherwise each execution
writes its own, and outcomes that arrive together share one commit
(:class:`~kandevd.runqueue.groupcommit.GroupCommit`). A write the database
refuses is retried from memory with back-off; the run stays live here (its
agent busy) until it succeeds, and the agent is never run again to learn it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from kandevd.bus import EventBus
from kandevd.faults import Faults
from kandevd.fsutil import append_note
from kandevd.runqueue.groupcommit import GroupCommit
from kandevd.runqueue.live import LiveRuns, Waker
from kandevd.runs.model import Claim, Run
from kandevd.runs.retry import RetryDecider
from kandevd.runtime import (
    DETACHED,
    ERROR,
    INTERRUPTED,
    STOPPED,
    ExecutionResult,
    attempts,
    records,
)
from kandevd.runtime.output import attempt_ended
from kandevd.store.base import is_environmental
from kandevd.store.runs import RunRepository
from kandevd.timeutil import rfc3339

log = logging.getLogger("kandevd.queue")

#: Outcomes that leave the run as it is: interrupted by the shutdown (it stays
#: ``claimed`` for the next start), stopped by a cancel (already ``cancelled``),
#: or detached (the agent runs on for the next daemon instance to adopt).
NO_WRITE = frozenset({INTERRUPTED, STOPPED, DETACHED})
#: Back-off of a failed outcome write: first retry after 0.1 s, doubling, at most
#: 2 s apart, so a disk that frees up is noticed within about two seconds.
_WRITE_RETRY_FIRST_S = 0.1
_WRITE_RETRY_MAX_S = 2.0
#: Refusals (other than a full disk or a busy database) after which an outcome is
#: recorded as a plain failed attempt instead.
_PLAIN_OUTCOME_AFTER = 10


def note_ended(claim: Claim, result: ExecutionResult, *, once: bool = False) -> None:
    """The ``==== attempt N ended <time>: <outcome> ====`` line that closes an attempt in
    its log (``runs logs``). ``once``: unless the log already ends with it (an outcome
    recorded after a restart, whose daemon may have written it before it died)."""
    if once and _last_line(result.log_path).startswith(
            f"[kandevd] ==== attempt {claim.run.attempt} ended "):
        return
    append_note(result.log_path, attempt_ended(claim.run.attempt, result.ended_at,
                                               result.outcome, result.error))


def _last_line(path: Path) -> str:
    """The last non-empty line of a log ('' when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, 2) - 4096))
            tail = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line for line in tail.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class Observer(Protocol):
    """Who hears of executions as they end and runs as they are first claimed (metrics)."""

    def observe_execution(self, result: ExecutionResult) -> None: ...

    def observe_first_claim(self, requested_at: str, claimed_at: str) -> None: ...


@dataclass
class _Unrecorded:
    """An outcome the database refused; retried from memory at ``due`` (monotonic)."""

    claim: Claim
    result: ExecutionResult
    failures: int
    due: float


@dataclass(frozen=True, slots=True)
class Written:
    """What writing an outcome did. ``recorded``: False when the attempt was superseded
    (its token no longer in force) or the outcome needs no write; ``run``: the run as
    written (finished; or, for a failed attempt, queued for its retry, failed, or
    cancelled as too old)."""

    recorded: bool
    run: Run | None = None


NOT_WRITTEN = Written(False)


def finished_run(claimed: Run, now: datetime, summary: str | None, cost_cents: float | None,
                 log_path: str) -> Run:
    """The run as a successful attempt's write leaves it (statements.FINISH), without
    reading it back: the cost adds up over the attempts."""
    cost = claimed.cost_cents if cost_cents is None else (claimed.cost_cents or 0) + cost_cents
    return dataclasses.replace(claimed, status="finished", finished_at=rfc3339(now),
                   output_summary=summary, cost_cents=cost, log_path=log_path,
                   error_message=None, scheduled_retry_at=None)


class OutcomeRecorder:
    def __init__(self, repo: RunRepository, live: LiveRuns, bus: EventBus, wake: Waker, *,
                 decide_retry: RetryDecider, clock: Callable[[], datetime], faults: Faults,
                 observer: Observer | None = None,
                 monotonic: Callable[[], float] = time.monotonic,
                 release: Callable[[list[ExecutionResult]], None] | None = None) -> None:
        """``release(results)``: these outcomes are recorded; what the runtime kept of
        them for a restart (the keeper's exit record, the agent's stdout) may go."""
        self.repo = repo
        self.release = release
        self.live = live
        self.bus = bus
        self.wake = wake
        self.decide_retry = decide_retry
        self.clock = clock
        self.faults = faults
        self.observer = observer
        self.monotonic = monotonic  # paces the retries of refused outcome writes
        self._lock = threading.Lock()  # what follows, shared by the workers and the loop
        self._defer = False  # outcomes go to the loop's next drain (see defer_outcomes)
        self._outcomes: list[tuple[Claim, ExecutionResult]] = []
        self._unrecorded: list[_Unrecorded] = []
        self._failure_counts: dict[str, int] = {}  # run id -> refused writes of its outcome
        self.retries_total = 0  # failed attempts re-queued under the retry policy
        self.write_failures = 0
        # Outcomes of executions that end together share one commit (one fsync).
        self.commits = GroupCommit(repo.store)

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
            self.record(claim, result)

    def on_done(self, claim: Claim, result: ExecutionResult) -> None:
        """An execution ended (in the runtime's worker thread).

        The outcome is on disk before anyone tries the database, so whatever
        happens to that write (or to this process), the agent is not run
        again to learn it: the shim's exit file already says how an agent
        that exited on its own ended (the next start reads it, see
        :meth:`restore_after_restart`); any other outcome (a timeout, an
        interruption, an error of ours) is written to the attempt's
        ``outcome.json`` first. A refused write writes it too.
        """
        directory = self.live.folder(claim)
        if result.outcome != DETACHED and not result.framed:
            note_ended(claim, result)
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
                self.record(claim, result)
        finally:
            self.wake()  # the agent is free (or its outcome waits for the loop)

    def take(self) -> list[tuple[Claim, ExecutionResult]]:
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

    def record(self, claim: Claim, result: ExecutionResult, *, keep_refused: bool = True
               ) -> bool:
        """Write one outcome in its own (group) commit, then announce it; False when the
        write was refused.

        A refused write keeps the outcome in memory for a retry with back-off;
        until it succeeds the run stays live here, so its agent stays busy and
        stale-claim recovery leaves it alone. ``keep_refused`` False: kept by whoever
        reported it instead (a runner, which sends it again).
        """
        if result.outcome in NO_WRITE:
            self.settled(claim, result)
            self.announce(claim, result, NOT_WRITTEN)
            return True
        try:
            effect = self.commits.submit(lambda: self.apply(claim, result))
        except Exception as exc:
            if not keep_refused:
                log.warning("run %s: its outcome could not be written (%s); its runner "
                            "sends it again", claim.run.id, exc)
                return False
            self._write_refused(claim, result, exc)
            return False
        self.settled(claim, result)
        self.announce(claim, result, effect)
        return True

    def _write_refused(self, claim: Claim, result: ExecutionResult, exc: Exception) -> None:
        run_id = claim.run.id
        directory = self.live.folder(claim)
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
        self.wake()

    def settled(self, claim: Claim, result: ExecutionResult) -> None:
        """The database has the outcome (or it needs none): the run is no longer live here."""
        self.settled_all([(claim, result)])

    def settled_all(self, outcomes: list[tuple[Claim, ExecutionResult]]) -> None:
        """:meth:`settled` for outcomes written in one commit: what kept them for a restart
        (the keeper's journal) is released in one message."""
        released: list[ExecutionResult] = []
        retried: list[tuple[str, int]] = []
        for claim, result in outcomes:
            run_id = claim.run.id
            directory = self.live.folder(claim)
            self.live.end(run_id, claim.token)
            with self._lock:
                failures = self._failure_counts.pop(run_id, 0)
            # (An execution the keeper ran has a folder only when an outcome was written.)
            if result.outcome not in (INTERRUPTED, DETACHED) and directory.is_dir():
                attempts.discard(directory)
            if result.outcome != DETACHED:
                released.append(result)
            if failures:
                retried.append((run_id, failures))
        if self.release is not None and released:
            self.release(released)
        # Said once everything the outcome kept is released (its stdout file included).
        for run_id, failures in retried:
            log.info("run %s: its outcome was written after %d refused attempt(s)",
                     run_id, failures)

    def apply(self, claim: Claim, result: ExecutionResult) -> Written:
        """The database side of an outcome; what it did is what :meth:`announce` reports.

        An execution that was interrupted or stopped writes nothing.
        """
        run_id = claim.run.id
        if result.outcome in NO_WRITE:
            return NOT_WRITTEN
        self.faults.outcome_write()
        now = self.clock()
        log_path = str(result.log_path)
        if result.succeeded:
            recorded = self.repo.finish(run_id, claim.token, now=now, summary=result.summary,
                                        cost_cents=result.cost_cents, log_path=log_path)
            return Written(recorded, finished_run(claim.run, now, result.summary,
                                                  result.cost_cents, log_path)
                           if recorded else None)
        updated = self.repo.fail_attempt(
            run_id, claim.token, now=now, error=result.error or result.outcome,
            decide=self.decide_retry, summary=result.summary, cost_cents=result.cost_cents,
            log_path=log_path)
        return Written(updated is not None, updated)

    def announce(self, claim: Claim, result: ExecutionResult, effect: Written) -> None:
        run_id = claim.run.id
        if self.observer is not None:
            self.observer.observe_execution(result)
        if result.outcome == INTERRUPTED:
            # (by the stop: the next start takes it back; by a fence: its heal does)
            log.info("run %s %s; it stays claimed until it is taken back", run_id,
                     result.error or "interrupted")
        elif result.outcome == DETACHED:
            log.info("run %s: agent left running for the next start to adopt", run_id)
        elif result.outcome == STOPPED:
            log.info("run %s: agent process stopped (%s)", run_id, result.error)
        elif result.succeeded:
            if effect.recorded:
                log.debug("run %s finished", run_id)
                self.bus.publish("run.finished", {"run_id": run_id,
                                                  "agent_id": claim.run.agent_id,
                                                  "cost_cents": result.cost_cents,
                                                  "run": effect.run})
            else:
                log.warning("run %s: completion of a superseded attempt ignored", run_id)
        elif effect.run is None:
            log.warning("run %s: failure of a superseded attempt ignored", run_id)
        else:
            self.announce_failure(effect.run, result.error)

    def announce_rescued(self, run_ids: Iterable[str]) -> None:
        """Runs a rescue re-queued (their attempt counted) or gave up: their events,
        as an outcome's (read back: rescues are rare, and write many runs at once)."""
        for run_id in run_ids:
            try:
                run = self.repo.get(run_id)
            except Exception:  # (gone meanwhile, or the database refused: no event)
                continue
            self.bus.publish("run.retry_scheduled" if run.status == "queued"
                             else f"run.{run.status}", {"run": run})

    def announce_failure(self, updated: Run, error: str | None) -> None:
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
