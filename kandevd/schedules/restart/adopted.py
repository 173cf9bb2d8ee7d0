"""Scheduled turns a previous daemon left running, adopted at start.

A turn runs with an execution record in ``<home>/turns/<key>/`` (see
:mod:`kandevd.schedules.sessions.session`). When the daemon dies (or stops with
``runtime.keep_agents_on_stop``) during a turn, its agent keeps running under
its shim. The next start marks the entry ``error: interrupted: server
restarted`` (a stale run, until shown otherwise); then, before the orphan
sweep, each such turn whose shim still runs is adopted here, and its run is
not stale: the entry reads ``running`` again, the runtime waits for the turn
(its profile timeout applies), the job counts as running (no other session of
it starts meanwhile; ``jobs stop``, its ``timeout_s`` and the shutdown reach
the turn), and when it ends its real outcome, cost, evaluation and output are
recorded, its stdout merged into its log, its record removed once that is
written, and the run ends with the turn's outcome (``success`` included),
which the job's state, notification and ``pause_after_failures`` follow as for
any run. A turn that ended meanwhile, or was not adopted, is settled by
:mod:`kandevd.schedules.restart.stranded` on the first tick.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from kandevd.runtime import DETACHED, AgentRuntime, ExecutionResult, ExecutionSpec
from kandevd.runtime.records import ExecutionRecord, locate, record_alive
from kandevd.schedules import history as hist
from kandevd.schedules.history import SHUTDOWN_ERROR, HistoryEntry, TurnRecord
from kandevd.schedules.jobs import JobNotFound
from kandevd.schedules.registry import JobRegistry
from kandevd.schedules.restart.stranded import Stranded, StrandedTurns
from kandevd.schedules.sessions.runner import SessionRunner
from kandevd.schedules.sessions.session import (
    MANUAL_STOP_ERROR,
    SessionControl,
    SessionPlan,
    apply_result,
    remove_turn_record,
    turn_key,
)
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now

log = logging.getLogger("kandevd.scheduler")


def adopt_turns(noted: StrandedTurns, registry: JobRegistry, runner: SessionRunner,
                runtime: AgentRuntime, home: str) -> frozenset[int]:
    """Adopt every live turn of the entries ``noted`` at start; the adopted shims' pids
    (which the orphan sweep must leave alone)."""
    kept: set[int] = set()
    for stranded in noted.pending():
        try:
            pid = _adopt_entry(stranded, noted, registry, runner, runtime, home)
        except Exception:  # one broken entry must not keep the daemon from starting
            log.exception("%s: adopting the turn of run %s failed; its agent is stopped",
                          stranded.job_key, stranded.entry_id)
            continue
        if pid is not None:
            kept.add(pid)
    return frozenset(kept)


def _adopt_entry(stranded: Stranded, noted: StrandedTurns, registry: JobRegistry,
                 runner: SessionRunner, runtime: AgentRuntime, home: str) -> int | None:
    entry = stranded.history.entry(stranded.entry_id)
    if entry is None or stranded.job_key is None or not is_entry_id(stranded.entry_id):
        return None
    for position, turn in enumerate(entry.get("turns") or []):
        if not isinstance(turn, dict):
            continue
        index = turn.get("index", position)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            continue
        key = turn_key(stranded.entry_id, index)
        record = runtime.record_for(runner.turns_folder / key)
        if record is None or record.run_id != stranded.entry_id or record.key != key:
            continue  # (not this turn's record: never adopted on its word)
        record = locate(record)
        if not record_alive(record):
            continue  # ended meanwhile: settled on the first tick
        _adopt(stranded, entry, position, record, registry, runner, runtime, home)
        noted.discard(stranded.entry_id)
        return record.pid
    return None


def _adopt(stranded: Stranded, entry: HistoryEntry, position: int,
           record: ExecutionRecord, registry: JobRegistry, runner: SessionRunner,
           runtime: AgentRuntime, home: str) -> None:
    history, job_key = stranded.history, stranded.job_key
    assert job_key is not None
    key = record.record_dir.name
    spec = ExecutionSpec(
        key=key, kind="turn", argv=record.argv, stdin={}, cwd=record.record_dir,
        log_path=record.log_path, timeout_s=record.timeout_s,
        session_id=record.session_id, run_id=record.run_id, home=home,
        record_dir=record.record_dir)
    plan = SessionPlan(job_id=job_key, program=None,  # type: ignore[arg-type]
                       trigger_source=str(entry.get("trigger_source") or "cron"),
                       session_id=str(entry.get("session_id") or record.session_id),
                       entry_id=stranded.entry_id)

    def on_stop(control: SessionControl) -> None:
        if control.detach:
            runtime.detach_execution(key)
        elif control.stop_error != SHUTDOWN_ERROR:  # (the runtime's own stop ends it)
            reason = "stopped by scheduler.jobs.stop" \
                if control.stop_error == MANUAL_STOP_ERROR else str(control.stop_error)
            runtime.stop_execution(key, reason)

    control = SessionControl(runtime.wake_waiters, on_stop)
    deadline, timeout = _deadline(registry, job_key, entry)
    # A product's conversation takes one message at a time, whichever schedule sends it.
    conversation = registry.session_lock(entry)
    if conversation is not None and not conversation.acquire(blocking=False):
        conversation = None  # (nothing else runs yet at start: cannot happen)
    runner.hold(plan, control, deadline=deadline, timeout_s=timeout)

    ended: list[HistoryEntry] = []

    def release() -> None:
        if conversation is not None:
            conversation.release()
        runner.release(plan, history, ended[0] if ended else None)

    def on_done(result: ExecutionResult) -> None:
        try:
            if result.outcome != DETACHED:  # (else it runs on, for the next start)
                # Its record goes once the outcome is on the entry (see Session.turn).
                final = _record_end(history, stranded.entry_id, position, result, control,
                                    after=lambda: remove_turn_record(record.record_dir,
                                                                     runtime.settle_ids))
                if final is not None:
                    ended.append(final)
                    log.log(logging.WARNING if final["status"] == hist.ERROR
                            else logging.INFO, "session %s of %s ended: %s%s",
                            plan.session_id, job_key, final["status"],
                            f" ({final['error']})" if final.get("error") else "")
        except Exception:
            log.exception("%s: the end of adopted turn %s could not be recorded",
                          job_key, key)
        finally:
            release()

    try:
        _mark_adopted(history, stranded.entry_id, position)
        runner.reopened(job_key, entry)
        runtime.adopt(spec, record, on_done)
    except BaseException:
        release()
        _unmark(history, stranded.entry_id, position)
        runner.reopened(job_key, None)
        raise
    log.info("%s: adopted turn %s of run %s (agent pid %d) left running by the previous "
             "daemon", job_key, key, stranded.entry_id, record.pid)


def _deadline(registry: JobRegistry, job_key: str, entry: HistoryEntry
              ) -> tuple[datetime | None, float | None]:
    """The job's ``timeout_s`` counted from the run's start (None: no limit)."""
    try:
        timeout = registry.by_key(job_key).spec.schedule.options.timeout_s
    except JobNotFound:
        return None, None
    started = entry.get("started_at")
    if not timeout or not isinstance(started, str):
        return None, None
    try:
        return parse_rfc3339(started) + timedelta(seconds=timeout), timeout
    except ValueError:
        return None, None


def _mark_adopted(history: hist.History, entry_id: str, position: int) -> None:
    """The run goes on here: the entry (marked interrupted at start, stale until its turn
    was found running) and the turn read ``running`` again."""
    def change(turn: TurnRecord) -> None:
        turn.update(status=hist.RUNNING, error=None, adopted_at=rfc3339(utc_now()))
    _change_turn(history, entry_id, position, change, status=hist.RUNNING, error=None,
                 completed_at=None, duration_ms=None)


def _unmark(history: hist.History, entry_id: str, position: int) -> None:
    """Adoption failed: the run is interrupted again (its agent is stopped at start)."""
    def change(turn: TurnRecord) -> None:
        if turn.get("status") == hist.RUNNING:
            turn.update(status=hist.ERROR, error=hist.RESTART_ERROR)
    try:
        _change_turn(history, entry_id, position, change, status=hist.ERROR,
                     error=hist.RESTART_ERROR, completed_at=rfc3339(utc_now()))
    except Exception:
        log.exception("run %s: its turn could not be marked interrupted again", entry_id)


def _record_end(history: hist.History, entry_id: str, position: int,
                result: ExecutionResult, control: SessionControl, *,
                after: Any = None) -> HistoryEntry | None:
    """The adopted turn's end, and the run's: its real outcome, as a session ends (a stop
    as a stop, a timeout as an error); the entry as written (None: it is gone)."""
    def change(turn: TurnRecord) -> None:
        apply_result(turn, result, stop_requested=control.stop_requested)
        if turn["status"] == hist.STOPPED and control.stop_status == hist.ERROR:
            turn["status"], turn["error"] = hist.ERROR, control.stop_error  # a timeout

    def end(entry: HistoryEntry) -> HistoryEntry:
        if control.stop_requested:
            status, error = control.stop_status, control.stop_error
        else:
            status, error = hist.outcome_after_restart(entry) or (hist.ERROR,
                                                                  hist.RESTART_ERROR)
        now = utc_now()
        try:
            took = max(0, int((now - parse_rfc3339(str(entry.get("started_at"))))
                              .total_seconds() * 1000))
        except ValueError:
            took = None
        return {"status": status, "error": error, "completed_at": rfc3339(now),
                "duration_ms": took}
    return _change_turn(history, entry_id, position, change, ending=end, after=after)


def is_entry_id(value: str) -> bool:
    """A history entry id the daemon made (hex): safe in a folder name."""
    return 0 < len(value) <= 64 and all(c in "0123456789abcdef" for c in value)


def _change_turn(history: hist.History, entry_id: str, position: int, change: Any, *,
                 ending: Any = None, after: Any = None, **fields: Any
                 ) -> HistoryEntry | None:
    """Change one turn of the entry (and the entry's ``fields``; ``ending(entry)``: more
    fields from the changed entry); the entry as written (None: not in the file)."""
    entry = history.entry(entry_id)
    if entry is None:
        return None
    turns = [dict(t) if isinstance(t, dict) else t for t in entry.get("turns") or []]
    if position >= len(turns) or not isinstance(turns[position], dict):
        return None
    change(turns[position])
    cost = sum(t.get("cost_cents") or 0 for t in turns if isinstance(t, dict))
    changed = {**entry, **fields, "turns": turns, "cost_cents": cost}
    if ending is not None:
        changed.update(ending(changed))
    history.update_entry(entry_id, changed, after)
    return changed

