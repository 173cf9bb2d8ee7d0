"""Scheduled turns a previous daemon left running, adopted at start.

A turn runs with an execution record in ``<home>/turns/<key>/`` (see
:mod:`kandevd.schedules.session`). When the daemon dies (or stops with
``runtime.keep_agents_on_stop``) during a turn, its agent keeps running under
its shim. The next start marks the entry ``error: interrupted: server
restarted``, as the specification says; then, before the orphan sweep, each
such turn whose shim still runs is adopted here: the runtime waits for it
(its profile timeout applies), the job counts as running (no other session of
it starts meanwhile; ``jobs stop``, its ``timeout_s`` and the shutdown reach
the turn), and when it ends its real outcome, cost, evaluation and output are
recorded on the entry, its stdout merged into its log and its record removed.
A turn that ended meanwhile, or was not adopted, is settled by
:mod:`kandevd.schedules.stranded` on the first tick.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from kandevd.runtime import DETACHED, ExecutionResult, ExecutionSpec
from kandevd.runtime.records import ExecutionRecord, locate, read_record, record_alive
from kandevd.schedules import history as hist
from kandevd.schedules.history import SHUTDOWN_ERROR
from kandevd.schedules.jobs import JobNotFound
from kandevd.schedules.products.program import conversation_lock
from kandevd.schedules.registry import JobRegistry
from kandevd.schedules.runner import SessionRunner
from kandevd.schedules.session import (
    MANUAL_STOP_ERROR,
    SessionControl,
    SessionPlan,
    apply_result,
    remove_turn_record,
    turn_key,
)
from kandevd.schedules.stranded import STRANDED, Stranded
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now

log = logging.getLogger("kandevd.scheduler")


def adopt_turns(registry: JobRegistry, runner: SessionRunner, runtime: Any, home: str
                ) -> frozenset[int]:
    """Adopt every live turn of the entries repaired at start; the adopted shims' pids
    (which the orphan sweep must leave alone)."""
    kept: set[int] = set()
    for stranded in STRANDED.pending():
        try:
            pid = _adopt_entry(stranded, registry, runner, runtime, home)
        except Exception:  # one broken entry must not keep the daemon from starting
            log.exception("%s: adopting the turn of run %s failed; its agent is stopped",
                          stranded.job_key, stranded.entry_id)
            continue
        if pid is not None:
            kept.add(pid)
    return frozenset(kept)


def _adopt_entry(stranded: Stranded, registry: JobRegistry, runner: SessionRunner,
                 runtime: Any, home: str) -> int | None:
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
        record = read_record(runner.turns_folder / key)
        if record is None or record.run_id != stranded.entry_id or record.key != key:
            continue  # (not this turn's record: never adopted on its word)
        record = locate(record)
        if not record_alive(record):
            continue  # ended meanwhile: settled on the first tick
        _adopt(stranded, entry, position, record, registry, runner, runtime, home)
        STRANDED.discard(stranded.entry_id)
        return record.pid
    return None


def _adopt(stranded: Stranded, entry: dict[str, Any], position: int,
           record: ExecutionRecord, registry: JobRegistry, runner: SessionRunner,
           runtime: Any, home: str) -> None:
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
    conversation = _conversation(registry, entry)
    if conversation is not None and not conversation.acquire(blocking=False):
        conversation = None  # (nothing else runs yet at start: cannot happen)
    runner.hold(plan, control, deadline=deadline, timeout_s=timeout)

    def release() -> None:
        if conversation is not None:
            conversation.release()
        runner.release(plan, history)

    def on_done(result: ExecutionResult) -> None:
        try:
            if result.outcome != DETACHED:
                _record_end(history, stranded.entry_id, position, result, control)
        except Exception:
            log.exception("%s: the end of adopted turn %s could not be recorded",
                          job_key, key)
        finally:
            if result.outcome != DETACHED:
                remove_turn_record(record.record_dir)
            release()

    try:
        _mark_adopted(history, stranded.entry_id, position)
        runtime.adopt(spec, record, on_done)
    except BaseException:
        release()
        _unmark(history, stranded.entry_id, position)
        raise
    log.info("%s: adopted turn %s of run %s (shim pid %d) left running by the previous "
             "daemon", job_key, key, stranded.entry_id, record.pid)


def _deadline(registry: JobRegistry, job_key: str, entry: dict[str, Any]
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
    """The turn runs again as far as readers know (the entry stays interrupted)."""
    def change(turn: dict[str, Any]) -> None:
        turn.update(status=hist.RUNNING, error=None, adopted_at=rfc3339(utc_now()))
    _change_turn(history, entry_id, position, change)


def _unmark(history: hist.History, entry_id: str, position: int) -> None:
    """Adoption failed: the turn is interrupted again (its agent is stopped at start)."""
    def change(turn: dict[str, Any]) -> None:
        if turn.get("status") == hist.RUNNING:
            turn.update(status=hist.ERROR, error=hist.RESTART_ERROR)
    try:
        _change_turn(history, entry_id, position, change)
    except Exception:
        log.exception("run %s: its turn could not be marked interrupted again", entry_id)


def _record_end(history: hist.History, entry_id: str, position: int,
                result: ExecutionResult, control: SessionControl) -> None:
    def change(turn: dict[str, Any]) -> None:
        apply_result(turn, result, stop_requested=control.stop_requested)
        if turn["status"] == hist.STOPPED and control.stop_status == hist.ERROR:
            # A timeout: the entry keeps saying the daemon restarted, so the turn says it.
            turn["status"], turn["error"] = hist.ERROR, control.stop_error
    _change_turn(history, entry_id, position, change)


def _conversation(registry: JobRegistry, entry: dict[str, Any]) -> Any:
    """The lock of the product conversation an entry's turn speaks in (None: a workflow)."""
    product, user = entry.get("product"), entry.get("user_id")
    if not isinstance(product, str) or not isinstance(user, str):
        return None
    return conversation_lock(registry.root, user, product)


def is_entry_id(value: str) -> bool:
    """A history entry id the daemon made (hex): safe in a folder name."""
    return 0 < len(value) <= 64 and all(c in "0123456789abcdef" for c in value)


def _change_turn(history: hist.History, entry_id: str, position: int, change: Any) -> None:
    entry = history.entry(entry_id)
    if entry is None:
        return
    turns = [dict(t) if isinstance(t, dict) else t for t in entry.get("turns") or []]
    if position >= len(turns) or not isinstance(turns[position], dict):
        return
    change(turns[position])
    cost = sum(t.get("cost_cents") or 0 for t in turns if isinstance(t, dict))
    history.update_entry(entry_id, {**entry, "turns": turns, "cost_cents": cost})

