"""Restore: what earlier daemon instances (or dead peers) left claimed, settled.

At start-up, before any recovery, each claim of an earlier instance is
settled in this order: an outcome file is recorded; an agent whose shim
wrote its exit status is recorded from it; with ``adopt``, an agent still
running is adopted (waited for here; its timeout and ``runs.cancel`` still
apply). Only what is left is rescued: re-queued with an attempt counted, or
failed once its attempts are used. On a shared store, each heartbeat rescues
dead daemons' claims and stops executions this daemon no longer holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.config import Config
from kandevd.fsutil import append_note
from kandevd.paths import HomeLayout
from kandevd.runqueue.live import LiveRuns, Waker
from kandevd.runqueue.outcomes import OutcomeRecorder, note_ended
from kandevd.runs.model import Claim
from kandevd.runtime import INTERRUPTED, AgentRuntime, ExecutionResult, ExecutionSpec, attempts
from kandevd.runtime.output import attempt_ended, open_attempt
from kandevd.runtime.records import (
    ExecutionRecord,
    locate,
    outcome_from_record,
    record_alive,
)
from kandevd.runtime.stopping import FORCED_REASON
from kandevd.store.runs import RunRepository

log = logging.getLogger("kandevd.queue")


class Restorer:
    def __init__(self, repo: RunRepository, runtime: AgentRuntime, outcomes: OutcomeRecorder,
                 live: LiveRuns, wake: Waker, config: Config, layout: HomeLayout, *,
                 clock: Callable[[], datetime]) -> None:
        self.repo = repo
        self.runtime = runtime
        self.outcomes = outcomes
        self.live = live
        self.wake = wake
        self.config = config
        self.layout = layout
        self.clock = clock
        self.adopted_total = 0
        self.rescued_total = 0  # claims rescued (stale, or left by an earlier instance)
        #: Runs a fence interrupted, given back to the queue once their executions ended.
        self._fenced: set[str] = set()
        self._fenced_lock = threading.Lock()

    def recover_stale(self, now: datetime) -> dict[str, str]:
        recovered = self.repo.recover_stale(now, self.config.queue.stale_claim_s,
                                            self.live.run_ids())
        for run_id in recovered:
            self.end_attempt_in_log(run_id, "its claim went stale: no execution was alive")
        self._log_rescued(recovered, "stale claim")
        self.repo.prune_keys(now)
        return recovered

    def _log_rescued(self, rescued: dict[str, str], what: str) -> None:
        self.rescued_total += len(rescued)
        self.outcomes.announce_rescued(rescued)
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
        if not token or run_id in self.live.run_ids():  # settled here already
            return None
        directory = attempts.existing_attempt_dir(self.live.attempts_folder, run_id, token)
        kept = self.runtime.record_for(attempts.attempt_dir(self.live.attempts_folder, run_id,
                                                            token))
        if kept is None and not directory.is_dir():
            return None
        if directory != attempts.attempt_dir(self.live.attempts_folder, run_id, token):
            self.live.keep_folder(run_id, token, directory)  # a legacy attempt's journal
        claim = self.repo.claim_of(run_id, token)
        if claim is None:
            return None
        result = attempts.read_outcome(directory, run_id)
        interrupted = result is not None and result.outcome == INTERRUPTED
        if result is not None and not interrupted:
            return self._record_restored(claim, result)
        record = kept if kept is not None else self.runtime.record_for(directory)
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
        note_ended(claim, result, once=True)  # (its daemon died before closing the attempt)
        self.live.begin(claim.run.id, claim.run.agent_id)
        self.outcomes.record(claim, result)
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
        self.live.begin(run_id, claim.run.agent_id)
        try:
            self.runtime.adopt(spec, record, lambda res: self.outcomes.on_done(claim, res))
        except BaseException:
            self.live.end(run_id)
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
        recovered = self.repo.requeue_foreign_claims(self.clock(), keep=self.live.run_ids(),
                                                     uncounted=self._gracefully_interrupted())
        pruned = attempts.prune(self.live.attempts_folder, self.repo.claimed_tokens())
        if pruned:
            log.info("removed %d attempt folder(s) of earlier attempts", pruned)
        for run_id in recovered:
            self.end_attempt_in_log(run_id)
        if recovered:
            requeued = sum(1 for status in recovered.values() if status == "queued")
            self.outcomes.announce_rescued(k for k, v in recovered.items() if v == "queued")
            self.rescued_total += requeued
            log.info("re-queued %d run(s) claimed by a previous daemon instance", requeued)
        self._log_rescued({k: v for k, v in recovered.items() if v == "failed"},
                          "claimed by a previous daemon instance")
        return recovered

    def end_attempt_in_log(self, run_id: str, why: str = "the daemon stopped during the "
                           "execution; a restart took the run back",
                           outcome: str = "interrupted") -> None:
        """A rescued attempt whose execution wrote no end (the daemon was killed, a runner
        went silent) ends in the run's log too: ``==== attempt N ended <now>: outcome
        (why) ====``; once (an attempt the log ends already is left as it is), and only
        where the log is (another daemon's gateway may hold a runner's)."""
        path = self.layout.run_logs / f"{run_id}.log"
        attempt = open_attempt(path)
        if attempt is not None:
            append_note(path, attempt_ended(attempt, self.clock(), outcome, why))

    def _gracefully_interrupted(self) -> set[str]:
        """Claims of earlier instances whose outcome file says a graceful stop interrupted them.

        Such an execution does not count toward ``queue.max_attempts``; one whose
        daemon crashed (no outcome written) or was forced to exit still does.
        """
        return {run_id for run_id, _token in self._interrupted(self.repo.foreign_claims())}

    def _interrupted(self, claims: list[Any]) -> list[tuple[str, str]]:
        found = []
        for row in claims:
            token = row["claim_token"]
            if not token:
                continue
            directory = attempts.existing_attempt_dir(self.live.attempts_folder, row["id"], token)
            result = attempts.read_outcome(directory, row["id"]) if directory.is_dir() else None
            if (result is not None and result.outcome == INTERRUPTED
                    and FORCED_REASON not in (result.error or "")):
                found.append((row["id"], token))
        return found

    def release_interrupted(self) -> list[str]:
        """Leaving a cluster after a graceful stop: this instance's interrupted runs go back
        to the queue now, their attempts given back, for the other daemons to take up
        (they would otherwise rescue them with an attempt counted)."""
        released = self.repo.release_interrupted(self.clock(),
                                                 self._interrupted(self.repo.own_claims()))
        if released:
            log.info("re-queued %d run(s) this graceful stop interrupted", len(released))
        return released

    def note_fenced(self, runs: frozenset[str]) -> None:
        with self._fenced_lock:
            self._fenced |= runs

    def _release_fenced(self) -> None:
        """At each heartbeat after a fence: the runs it interrupted whose executions have
        ended go back to the queue (no attempt counted) while this daemon still holds
        them; a run is forgotten once released or no longer this daemon's."""
        live = self.live.run_ids()  # (before the outcomes are read: an end in between waits)
        own = self.repo.own_claims()
        with self._fenced_lock:
            fenced = set(self._fenced)
        claims = [c for c in self._interrupted(own) if c[0] in fenced and c[0] not in live]
        released = self.repo.release_interrupted(
            self.clock(), claims,
            "interrupted: the daemon fenced itself (it lost the database) during the execution")
        if released:
            log.warning("re-queued %d run(s) the fence interrupted: %s", len(released),
                        ", ".join(sorted(released)))
            self.wake()
        held = {row["id"] for row in own}
        with self._fenced_lock:
            self._fenced = {r for r in self._fenced
                            if r not in released and (r in live or r in held)}

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
                keep=self.live.run_ids(), dead_peers=True)
            if rescued:
                self._log_rescued(rescued, "claimed by a daemon that stopped")
                self.wake()
        with self._fenced_lock:
            fenced = bool(self._fenced)
        if fenced:
            self._release_fenced()
        for run_id in self.repo.not_claimed_here(self.live.run_ids()):
            log.warning("run %s: no longer claimed by this daemon (cancelled or taken over "
                        "elsewhere); stopping its execution here", run_id)
            self.runtime.stop_execution(run_id, "the run is no longer claimed by this daemon")
