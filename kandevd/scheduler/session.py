"""A scheduled session: the turns of one fire (or manual trigger), one after another.

A session is a sequence of agent executions of kind ``turn`` through the
AgentRuntime (so they share ``runtime.max_concurrent`` with queued runs), each
started only after the previous one exited::

    preflight   when decisions.json holds ``answered`` decisions (workshop mode);
                success marks them ``applied``; failure ends the session
    messages    the schedule's messages in its workshop_mode (default message:
                "Run the full workflow using run_full_workflow tool.")
    report      mode workshop + workshop_mode run + no message mentions
                run_full_report: one report turn per selected group, in
                ``iteration-0/<group>``
    pulse       pulse: true, after success or error (not after a stop); the pulse's own
                outcome does not change the session's status

The session owns one history entry: written ``running`` at the start, updated
after every turn, completed at the end. A stop (``scheduler.jobs.stop`` or the
daemon's shutdown) sends no further turn and ends the current one through the
runtime (SIGTERM, grace, SIGKILL); the entry is recorded ``stopped``.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.config import Config, UnknownProfile
from kandevd.paths import HomeLayout
from kandevd.runtime import ExecutionResult
from kandevd.runtime.specs import agent_execution
from kandevd.timeutil import rfc3339, utc_now
from kandevd.workflows import history as hist
from kandevd.workflows.decisions import Decisions
from kandevd.workflows.manifest import Schedule, Workflow

log = logging.getLogger("kandevd.scheduler.session")

DEFAULT_MESSAGE = "Run the full workflow using run_full_workflow tool."
REPORT_MESSAGE = "Generate the final report using run_full_report tool."
PREFLIGHT_MESSAGE = ("Apply the answered decisions (in `decisions`) to the workflow before "
                     "this scheduled run.")
REPORT_TOOL = "run_full_report"
RUN_FOLDER = "iteration-0"
MANUAL_STOP_ERROR = "stopped: scheduler.jobs.stop"


class SessionControl:
    """How other threads stop a session: the stop request and the turn it ends."""

    def __init__(self, wake_runtime: Callable[[], None]) -> None:
        self._cond = threading.Condition()
        self._wake_runtime = wake_runtime
        self.stop_error: str | None = None
        self.shutdown_deadline: float | None = None

    @property
    def stop_requested(self) -> bool:
        with self._cond:
            return self.stop_error is not None

    def request_stop(self, error: str, *, grace_s: float = 0.0) -> None:
        """Stop the session; the current turn gets ``grace_s`` to finish first."""
        with self._cond:
            if self.stop_error is None:
                self.stop_error = error
                self.shutdown_deadline = time.monotonic() + grace_s
            self._cond.notify_all()
        self._wake_runtime()

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait_turn(self, done: threading.Event, stop_turn: Callable[[], None]) -> None:
        """Wait until ``done``; when a stop arrives (and its grace passes) end the turn."""
        stopped = False
        with self._cond:
            while not done.is_set():
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
class SessionPlan:
    """One session to run: what fired, and the ids it will be known by."""

    job_id: str
    workflow: Workflow
    schedule: Schedule
    trigger_source: str  # "cron" | "manual"
    session_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    entry_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class TurnSpec:
    kind: str
    message: str
    workshop_mode: str
    run_folder: str
    decisions: list[dict[str, Any]] | None = None


class Session:
    """Runs one :class:`SessionPlan` in the calling thread; see the module docstring."""

    def __init__(self, plan: SessionPlan, *, config: Config, layout: HomeLayout, runtime: Any,
                 history: hist.History, control: SessionControl,
                 on_corrupt: Callable[[Any], None] | None = None,
                 clock: Callable[[], datetime] = utc_now) -> None:
        self.plan = plan
        self._config = config
        self._layout = layout
        self._runtime = runtime
        self._history = history
        self.control = control
        self._on_corrupt = on_corrupt
        self._clock = clock
        self.entry: dict[str, Any] = {}
        self._turn_index = 0

    # -- the sequence ---------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run every turn; return the completed history entry."""
        plan, schedule = self.plan, self.plan.schedule
        started = self._clock()
        self.entry = {
            "id": plan.entry_id, "schedule_id": schedule.id, "run_folder": RUN_FOLDER,
            "session_id": plan.session_id, "status": hist.RUNNING, "error": None,
            "duration_ms": None, "group_ids": list(schedule.group_ids),
            "started_at": rfc3339(started), "completed_at": None,
            "trigger_source": plan.trigger_source, "turns": [], "cost_cents": 0,
        }
        self._history.record_start(self.entry, started)
        log.info("session %s of %s started (%s)", plan.session_id, plan.job_id,
                 plan.trigger_source)
        try:
            status, error = self._turns()
        except Exception as exc:  # a bug or a broken file must not leave the entry running
            log.exception("session %s of %s failed", plan.session_id, plan.job_id)
            status, error = hist.ERROR, f"internal error: {type(exc).__name__}: {exc}"
        if schedule.pulse and status in (hist.SUCCESS, hist.ERROR) \
                and not self.control.stop_requested:
            message = (f"Pulse: scheduled run {plan.entry_id} of schedule {schedule.id} "
                       f"finished with status {status}.")
            self._turn(TurnSpec("pulse", message, "workshop", RUN_FOLDER))
        # The entry turns terminal only once the session is over, pulse included, so a
        # reader who sees it finished knows nothing of it still runs.
        self.entry.update(status=status, error=error)
        self._complete(started)
        log.info("session %s of %s ended: %s%s", plan.session_id, plan.job_id, status,
                 f" ({error})" if error else "")
        return self.entry

    def _turns(self) -> tuple[str, str | None]:
        plan, schedule = self.plan, self.plan.schedule
        decisions = Decisions(plan.workflow.folder, on_corrupt=self._on_corrupt)
        answered = decisions.answered()
        if answered:
            turn = self._turn(TurnSpec("preflight", PREFLIGHT_MESSAGE, "workshop", RUN_FOLDER,
                                       answered))
            if turn["status"] != hist.SUCCESS:
                return self._ended_by(turn)
            decisions.mark_applied([d.get("id") for d in answered], plan.session_id,
                                   self._clock())
        messages = list(schedule.messages) or [DEFAULT_MESSAGE]
        for message in messages:
            if self.control.stop_requested:
                return hist.STOPPED, self.control.stop_error
            turn = self._turn(TurnSpec("message", message, schedule.workshop_mode, RUN_FOLDER))
            if turn["status"] != hist.SUCCESS:
                return self._ended_by(turn)
        if schedule.mode == "workshop" and schedule.workshop_mode == "run" \
                and not any(REPORT_TOOL in m for m in messages):
            for group in self._selected_groups():
                if self.control.stop_requested:
                    return hist.STOPPED, self.control.stop_error
                turn = self._turn(TurnSpec("report", REPORT_MESSAGE, "run",
                                           f"{RUN_FOLDER}/{group}"))
                if turn["status"] != hist.SUCCESS:
                    return self._ended_by(turn)
        return hist.SUCCESS, None

    def _ended_by(self, turn: dict[str, Any]) -> tuple[str, str | None]:
        if turn["status"] == hist.STOPPED:
            return hist.STOPPED, self.control.stop_error or turn.get("error")
        return hist.ERROR, f"{turn['kind']} turn {turn['index']} failed: {turn.get('error')}"

    def _selected_groups(self) -> list[str]:
        enabled = self.plan.workflow.enabled_groups
        return [g for g in self.plan.schedule.group_ids if g in enabled]

    def _complete(self, started: datetime) -> None:
        ended = self._clock()
        self.entry["completed_at"] = rfc3339(ended)
        self.entry["duration_ms"] = max(0, int((ended - started).total_seconds() * 1000))
        self._history.update_entry(self.plan.entry_id, copy.deepcopy(self.entry))

    # -- one turn -------------------------------------------------------------------
    def _turn(self, turn: TurnSpec) -> dict[str, Any]:
        index = self._turn_index
        self._turn_index += 1
        record: dict[str, Any] = {"index": index, "kind": turn.kind, "message": turn.message,
                                  "workshop_mode": turn.workshop_mode, "status": hist.RUNNING,
                                  "started_at": None, "duration_ms": None, "log_path": None,
                                  "cost_cents": 0, "error": None}
        self.entry["turns"].append(record)
        self._history.update_entry(self.plan.entry_id, copy.deepcopy(self.entry))
        result = self._execute(turn, index, record)
        if result is not None:
            record["started_at"] = rfc3339(result.started_at)
            record["duration_ms"] = int(result.duration_s * 1000)
            record["cost_cents"] = result.cost_cents or 0
            record["log_path"] = str(result.log_path)
            if result.succeeded:
                record["status"] = hist.SUCCESS
            elif result.outcome in ("stopped", "interrupted") and self.control.stop_requested:
                record["status"] = hist.STOPPED
                record["error"] = result.error
            else:
                record["status"] = hist.ERROR
                record["error"] = result.error or result.outcome
        self.entry["cost_cents"] = sum(t.get("cost_cents") or 0 for t in self.entry["turns"])
        self._history.update_entry(self.plan.entry_id, copy.deepcopy(self.entry))
        return record

    def _execute(self, turn: TurnSpec, index: int, record: dict[str, Any]
                 ) -> ExecutionResult | None:
        plan = self.plan
        try:
            profile = self._config.profile(plan.workflow.agent_profile)
        except UnknownProfile as exc:
            record.update(status=hist.ERROR, error=str(exc))
            return None
        folder = plan.workflow.folder / "runs" / turn.run_folder
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            record.update(status=hist.ERROR, error=f"cannot create run folder {folder}: {exc}")
            return None
        key = f"turn-{plan.session_id}-{index}"
        spec = agent_execution(profile, self._layout, kind="turn", key=key,
                               stdin=self._stdin(turn, index), session_id=plan.session_id,
                               run_id=plan.entry_id, cwd=folder,
                               log_path=self._log_path(index, turn.kind))
        done = threading.Event()
        outcome: list[ExecutionResult] = []

        def on_done(result: ExecutionResult) -> None:
            outcome.append(result)
            done.set()
            self.control.notify()

        if not self._runtime.launch_when_free(spec, on_done,
                                              lambda: self.control.stop_requested):
            record.update(status=hist.STOPPED,
                          error=self.control.stop_error or "agent runtime is stopping")
            return None
        def stop_turn() -> None:
            reason = "stopped by scheduler.jobs.stop" \
                if self.control.stop_error == MANUAL_STOP_ERROR else "daemon shutting down"
            self._runtime.stop_execution(key, reason)

        self.control.wait_turn(done, stop_turn)
        return outcome[0]

    def _log_path(self, index: int, kind: str) -> Path:
        return self._layout.logs / "sessions" / self.plan.session_id / f"{index:02d}-{kind}.log"

    def _stdin(self, turn: TurnSpec, index: int) -> dict[str, Any]:
        plan, schedule = self.plan, self.plan.schedule
        options: dict[str, Any] = {
            "run_mode": "use_same_run", "selected_run_folder": turn.run_folder,
            "execution_strategy": "start_from_beginning_no_human",
            "workshop_mode": turn.workshop_mode,
            "enabled_group_ids": self._selected_groups(),
        }
        if plan.workflow.pending_upgrades:
            options["contract_upgrades_pending"] = True
        stdin: dict[str, Any] = {
            "kind": "turn", "session_id": plan.session_id, "run_id": plan.entry_id,
            "workflow": plan.workflow.name, "schedule_id": schedule.id,
            "message": turn.message, "workshop_mode": turn.workshop_mode,
            "agent_mode": "workflow_phase", "phase_id": "workflow-builder",
            "triggered_by": plan.trigger_source, "turn": {"index": index, "kind": turn.kind},
            "payload": dict(schedule.trigger_payload), "execution_options": options,
        }
        if turn.decisions is not None:
            stdin["decisions"] = turn.decisions
        return stdin
