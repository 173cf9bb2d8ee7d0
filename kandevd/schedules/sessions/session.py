"""A scheduled session: the turns of one run, one after another, and its history entry.

A session is a sequence of agent executions of kind ``turn`` through the
AgentRuntime (so they share ``runtime.max_concurrent`` with queued runs), each
started only after the previous one exited. *What* the turns are is the
session's :class:`Program`: a workflow schedule's (preflight, messages,
reports, pulse: :mod:`kandevd.schedules.workflows.program`) or a product
schedule's (its messages into the user's conversation:
:mod:`kandevd.schedules.products.program`). This module is the part they share: the
history entry (written ``running`` at the start, updated around every turn,
completed at the end), one turn's execution, and stopping.

A stop (``scheduler.jobs.stop`` or the daemon's shutdown) sends no further
turn and ends the current one through the runtime (SIGTERM, grace, SIGKILL);
the entry is recorded ``stopped``. A turn runs with an execution record in
``<home>/turns/<key>/`` as a queued run does in its attempt folder, so a
shutdown with ``runtime.keep_agents_on_stop`` leaves it running (the entry
stays ``running``) and the next daemon adopts it
(:mod:`kandevd.schedules.restart.adopted`). The record is removed only once the turn's
outcome is on the entry (a full disk delays that write), so whatever stops the
daemon first, the next start finds the turn's end
(:mod:`kandevd.schedules.restart.stranded`).
"""

from __future__ import annotations

import copy
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from kandevd.config import Config, UnknownProfile
from kandevd.fsutil import ensure_dir
from kandevd.paths import HomeLayout
from kandevd.runtime import DETACHED, ExecutionResult
from kandevd.runtime.attempts import spent_stdout_path
from kandevd.runtime.specs import agent_execution
from kandevd.schedules import history as hist
from kandevd.schedules.history import HistoryEntry, TurnRecord
from kandevd.timeutil import rfc3339, utc_now

log = logging.getLogger("kandevd.scheduler.session")

MANUAL_STOP_ERROR = "stopped: scheduler.jobs.stop"
#: How long a turn left running at a shutdown may take to detach before it is stopped.
DETACH_WAIT_S = 5.0
#: A turn whose agent started this much after it was sent (it waited for a slot) has its
#: ``started_at`` written again while it runs (its end writes the exact start anyway).
RESTAMP_AFTER_S = 1.0


class TurnRuntime(Protocol):
    """Where a session's turns execute: the AgentRuntime here, or the turns the gateway
    hands to runners on other machines (a schedule with ``runs_on``)."""

    def launch_when_free(self, spec: Any, on_done: Callable[[ExecutionResult], None],
                         cancelled: Callable[[], bool]) -> bool: ...

    def stop_execution(self, key: str, reason: str) -> bool: ...

    def detach_execution(self, key: str) -> bool: ...

    def settle_ids(self, ids: list[str]) -> None: ...


class TurnDetached(Exception):
    """The daemon stopped and left the turn's agent running for the next one to adopt."""


def turn_key(entry_id: str, index: int) -> str:
    """The execution key of a turn, also the name of its record folder."""
    return f"turn-{entry_id}-{index}"


def turn_record_dir(layout: HomeLayout, entry_id: str, index: int) -> Path:
    """Where the turn's shim records its process, exit status and stdout."""
    return layout.turns / turn_key(entry_id, index)


def remove_turn_record(record_dir: Path,
                       settle: Callable[[list[str]], None] | None = None) -> None:
    """The record of an ended turn: its outcome is on the entry, so it goes (with its
    stdout file, merged into the log); ``settle`` tells the runtime the keeper may forget
    its exit."""
    shutil.rmtree(record_dir, ignore_errors=True)
    spent_stdout_path(record_dir).unlink(missing_ok=True)
    if settle is not None:
        settle([record_dir.name])


def apply_result(record: TurnRecord, result: ExecutionResult, *,
                 stop_requested: bool) -> None:
    """A turn's record once its execution ended (also an adopted turn's)."""
    record["started_at"] = rfc3339(result.started_at)
    record["duration_ms"] = int(result.duration_s * 1000)
    record["cost_cents"] = result.cost_cents or 0
    record["log_path"] = str(result.log_path)
    if result.exit_code is not None:
        record["exit_code"] = result.exit_code
    # The agent's final word (its summary line): judged without opening the log.
    record["output"] = result.summary
    if result.evaluation is not None:
        record["evaluation"] = result.evaluation
    if result.succeeded:
        record["status"], record["error"] = hist.SUCCESS, None
    elif result.outcome in ("stopped", "interrupted") and stop_requested:
        record["status"] = hist.STOPPED
        record["error"] = result.error
    else:
        record["status"] = hist.ERROR
        record["error"] = result.error or result.outcome


class SessionControl:
    """How other threads stop a session: the stop request and the turn it ends."""

    def __init__(self, wake_runtime: Callable[[], None],
                 on_stop: Callable[[SessionControl], None] | None = None) -> None:
        """``on_stop(control)``: called once when a stop is requested (an adopted turn,
        which no session thread waits for, is stopped through it)."""
        self._cond = threading.Condition()
        self._wake_runtime = wake_runtime
        self._on_stop = on_stop
        self.stop_error: str | None = None
        #: How a stopped session is recorded: ``stopped``, or ``error`` for a timeout.
        self.stop_status: str = hist.STOPPED
        self.shutdown_deadline: float | None = None
        #: The stop leaves the current turn's agent running (runtime.keep_agents_on_stop).
        self.detach = False

    @property
    def stop_requested(self) -> bool:
        with self._cond:
            return self.stop_error is not None

    def request_stop(self, error: str, *, grace_s: float = 0.0,
                     status: str = hist.STOPPED, detach: bool = False) -> None:
        """Stop the session; the current turn gets ``grace_s`` to finish first
        (``detach``: its agent is left running for the next daemon instead)."""
        first = False
        with self._cond:
            if self.stop_error is None:
                first = True
                self.stop_error = error
                self.stop_status = status
                self.detach = detach
                self.shutdown_deadline = time.monotonic() + grace_s
            self._cond.notify_all()
        self._wake_runtime()
        if first and self._on_stop is not None:
            self._on_stop(self)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait_turn(self, done: threading.Event, stop_turn: Callable[[], None]) -> None:
        """Wait until ``done``; when a stop arrives (and its grace passes) end the turn.

        A turn asked to detach that has not within :data:`DETACH_WAIT_S` (its record
        could not be written, so it cannot be left running) is stopped instead."""
        stopped = False
        with self._cond:
            while not done.is_set():
                if stopped and self.detach:
                    if not self._cond.wait(DETACH_WAIT_S) and not done.is_set():
                        self.detach, stopped = False, False
                    continue
                if self.stop_error is not None and not stopped:
                    remaining = (self.shutdown_deadline or 0) - time.monotonic()
                    if remaining <= 0:
                        stopped = True
                        self._cond.release()
                        try:
                            stop_turn()
                        finally:
                            self._cond.acquire()
                        continue
                    self._cond.wait(remaining)
                    continue
                self._cond.wait()


@dataclass
class TurnSpec:
    """One turn to run: what it is, where it runs, and what its stdin adds."""

    kind: str
    message: str
    workshop_mode: str | None
    cwd: Path
    stdin: dict[str, Any] = field(default_factory=dict)


class Program(Protocol):
    """What a session runs: the turn sequence of a workflow or a product schedule."""

    agent_profile: str

    def entry_fields(self) -> HistoryEntry:
        """Fields of the history entry besides the common ones (``schedule_id``, ...)."""

    def run_turns(self, session: Session) -> tuple[str, str | None]:
        """Run the turns through ``session.turn``; return ``(status, error)``."""

    def after(self, session: Session, status: str) -> None:
        """Turns after the outcome is known (a workflow's pulse); may do nothing."""

    def log_path(self, session: Session, index: int, kind: str) -> Path:
        """Where the turn's stdout and stderr go."""


@dataclass
class SessionPlan:
    """One session to run: what fired, and the ids it will be known by."""

    job_id: str
    program: Program
    trigger_source: str  # "cron" | "manual" | "backfill" | "catchup"
    session_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    entry_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: The fire time it stands for, when that is not its start (jitter, backfill).
    intended_at: datetime | None = None
    #: A catch-up run: the missed fire times it stands for.
    fire_times: list[datetime] | None = None


class Session:
    """Runs one :class:`SessionPlan` in the calling thread; see the module docstring."""

    def __init__(self, plan: SessionPlan, *, config: Config, layout: HomeLayout,
                 runtime: TurnRuntime,
                 history: hist.History, control: SessionControl,
                 clock: Callable[[], datetime] = utc_now) -> None:
        self.plan = plan
        self.layout = layout
        self._config = config
        self._runtime = runtime
        self._history = history
        self.control = control
        self.clock = clock
        self.entry: HistoryEntry = {}
        self._turn_index = 0
        self._started: datetime | None = None

    def begin(self) -> None:
        """Write the ``running`` entry (in the caller's thread: a start that cannot be
        recorded raises OSError, and the session does not start)."""
        plan = self.plan
        started = self._started = self.clock()
        self.entry = {
            "id": plan.entry_id, **plan.program.entry_fields(), "session_id": plan.session_id,
            "status": hist.RUNNING, "error": None, "duration_ms": None,
            "started_at": rfc3339(started), "completed_at": None,
            "trigger_source": plan.trigger_source, "turns": [], "cost_cents": 0,
        }
        if plan.intended_at is not None:
            self.entry["intended_at"] = rfc3339(plan.intended_at)
            if plan.trigger_source == "cron":  # late (jitter, or a leader change): how much
                self.entry["late_s"] = round((started - plan.intended_at).total_seconds(), 3)
        if plan.fire_times:
            self.entry["fire_times"] = [rfc3339(t) for t in plan.fire_times]
        self._history.record_start(self.entry, started)
        log.info("session %s of %s started (%s)", plan.session_id, plan.job_id,
                 plan.trigger_source)

    def abandon(self, error: str) -> None:
        """A begun session that will not run after all: its entry ends ``error``."""
        self.entry.update(status=hist.ERROR, error=error, completed_at=rfc3339(self.clock()))
        self._save()

    def run(self) -> HistoryEntry | None:
        """Run every turn (after :meth:`begin`); return the completed history entry
        (None: its agent was left running at a shutdown, the entry ``running``)."""
        if self._started is None:
            self.begin()
        plan = self.plan
        started = self._started
        assert started is not None
        try:
            status, error = plan.program.run_turns(self)
            if not self.control.stop_requested:
                plan.program.after(self, status)
        except TurnDetached:
            # The entry stays ``running``: the next start marks it interrupted (as the
            # specification says) and adopts the turn, whose outcome is recorded then.
            log.info("session %s of %s left running for the next start to adopt",
                     plan.session_id, plan.job_id)
            return None
        except Exception as exc:  # a bug or a broken file must not leave the entry running
            log.exception("session %s of %s failed", plan.session_id, plan.job_id)
            status, error = hist.ERROR, f"internal error: {type(exc).__name__}: {exc}"
        # The entry turns terminal only once the session is over (a pulse included), so
        # a reader who sees it finished knows nothing of it still runs.
        self.entry.update(status=status, error=error)
        ended = self.clock()
        self.entry["completed_at"] = rfc3339(ended)
        self.entry["duration_ms"] = max(0, int((ended - started).total_seconds() * 1000))
        self._save()
        log.log(logging.WARNING if status == hist.ERROR else logging.INFO,
                "session %s of %s ended: %s%s", plan.session_id, plan.job_id, status,
                f" ({error})" if error else "")
        return self.entry

    def ended_by(self, turn: TurnRecord) -> tuple[str, str | None] | None:
        """The session's end when ``turn`` did not succeed (None: go on)."""
        if turn["status"] == hist.SUCCESS:
            return None
        if turn["status"] == hist.STOPPED:
            return self.control.stop_status, self.control.stop_error or turn.get("error")
        # Numbered from 1, as the console and ``jobs logs`` number turns (``index`` is 0-based).
        return hist.ERROR, f"{turn['kind']} turn {turn['index'] + 1} failed: {turn.get('error')}"

    def stopped(self) -> tuple[str, str | None] | None:
        """The session's end when a stop was asked for before the next turn."""
        if self.control.stop_requested:
            return self.control.stop_status, self.control.stop_error
        return None

    def _save(self, after: Callable[[], None] | None = None) -> None:
        self._history.update_entry(self.plan.entry_id, copy.deepcopy(self.entry), after)

    # -- one turn -------------------------------------------------------------------
    def turn(self, turn: TurnSpec) -> TurnRecord:
        """Run one turn to its end; return its record (also kept in the entry)."""
        index = self._turn_index
        self._turn_index += 1
        # ``started_at`` from the moment it is sent, so a turn shown while it runs says
        # when it began (its agent starts at once unless it waits for a slot).
        sent = self.clock()
        record: TurnRecord = {"index": index, "kind": turn.kind, "message": turn.message,
                                  "workshop_mode": turn.workshop_mode, "status": hist.RUNNING,
                                  "started_at": rfc3339(sent), "duration_ms": None,
                                  "log_path": None, "cost_cents": 0, "error": None}
        # Known before it starts, so ``jobs logs --follow`` can show a turn as it runs.
        record["log_path"] = str(self.plan.program.log_path(self, index, turn.kind))
        self.entry["turns"].append(record)
        self._save()
        result = self._execute(turn, index, record, sent)
        if result is not None and result.outcome == DETACHED:
            raise TurnDetached(index)
        if result is not None:
            apply_result(record, result, stop_requested=self.control.stop_requested)
        self.entry["cost_cents"] = sum(t.get("cost_cents") or 0 for t in self.entry["turns"])
        # The record goes once the turn's outcome is on the entry, which a full disk may
        # delay (the write is kept until it lands); a daemon that stops before then
        # leaves the record, and the next start settles the turn from it.
        record_dir = turn_record_dir(self.layout, self.plan.entry_id, index)
        self._save(after=lambda: remove_turn_record(record_dir, self._runtime.settle_ids))
        return record

    def _execute(self, turn: TurnSpec, index: int, record: TurnRecord, sent: datetime
                 ) -> ExecutionResult | None:
        plan = self.plan
        try:
            profile = self._config.profile(plan.program.agent_profile)
        except UnknownProfile as exc:
            if not getattr(self._runtime, "remote", False):
                record.update(status=hist.ERROR, error=str(exc), started_at=None)
                return None
            profile = self._config.profile("default")  # (the runner runs its own profile)
        try:
            ensure_dir(turn.cwd)  # 0700 for the parents it creates too
        except OSError as exc:
            record.update(status=hist.ERROR, error=f"cannot create run folder {turn.cwd}: {exc}",
                          started_at=None)
            return None
        key = turn_key(plan.entry_id, index)
        record_dir = turn_record_dir(self.layout, plan.entry_id, index)
        stdin = {"kind": "turn", "session_id": plan.session_id, "run_id": plan.entry_id,
                 "message": turn.message, "triggered_by": plan.trigger_source,
                 "turn": {"index": index, "kind": turn.kind}, **turn.stdin}
        if plan.intended_at is not None:
            stdin["intended_at"] = rfc3339(plan.intended_at)
        spec = agent_execution(profile, self.layout, kind="turn", key=key, stdin=stdin,
                               session_id=plan.session_id, run_id=plan.entry_id, cwd=turn.cwd,
                               log_path=plan.program.log_path(self, index, turn.kind),
                               record_dir=record_dir)
        done = threading.Event()
        outcome: list[ExecutionResult] = []

        def on_done(result: ExecutionResult) -> None:
            outcome.append(result)
            done.set()
            self.control.notify()

        if not self._runtime.launch_when_free(spec, on_done,
                                              lambda: self.control.stop_requested):
            record.update(status=hist.STOPPED,
                          error=self.control.stop_error or getattr(self._runtime, "held_reason",
                                                                   None)
                          or "agent runtime is stopping", started_at=None)
            return None
        started = self.clock()
        if (started - sent).total_seconds() >= RESTAMP_AFTER_S:  # it waited for a slot
            record["started_at"] = rfc3339(started)
            self._save()

        def stop_turn() -> None:
            if self.control.detach:
                self._runtime.detach_execution(key)
                return
            error = self.control.stop_error or ""
            reason = "stopped by scheduler.jobs.stop" if error == MANUAL_STOP_ERROR \
                else "daemon shutting down" if error == hist.SHUTDOWN_ERROR else error
            self._runtime.stop_execution(key, reason)

        self.control.wait_turn(done, stop_turn)
        return outcome[0]
