"""The turns of a workflow schedule's session (the :class:`Program` of a workflow)::

    preflight   when decisions.json holds ``answered`` decisions (workshop mode);
                success marks them ``applied``; failure ends the session
    messages    the schedule's messages in its workshop_mode (default message:
                "Run the full workflow using run_full_workflow tool.")
    report      mode workshop + workshop_mode run + no message mentions
                run_full_report: one report turn per selected group, in
                ``iteration-0/<group>``
    pulse       pulse: true, after success or error (not after a stop); the pulse's own
                outcome does not change the session's status
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kandevd.schedules import history as hist
from kandevd.schedules.history import HistoryEntry
from kandevd.schedules.sessions.session import Session, TurnSpec
from kandevd.schedules.workflows.decisions import Decision, Decisions
from kandevd.schedules.workflows.manifest import Schedule, Workflow

DEFAULT_MESSAGE = "Run the full workflow using run_full_workflow tool."
REPORT_MESSAGE = "Generate the final report using run_full_report tool."
PREFLIGHT_MESSAGE = ("Apply the answered decisions (in `decisions`) to the workflow before "
                     "this scheduled run.")
REPORT_TOOL = "run_full_report"
RUN_FOLDER = "iteration-0"


class WorkflowProgram:
    def __init__(self, workflow: Workflow, schedule: Schedule, *,
                 on_corrupt: Callable[[Any], None] | None = None) -> None:
        self.workflow = workflow
        self.schedule = schedule
        self.agent_profile = workflow.agent_profile
        self._on_corrupt = on_corrupt

    def entry_fields(self) -> HistoryEntry:
        return {"schedule_id": self.schedule.id, "run_folder": RUN_FOLDER,
                "group_ids": list(self.schedule.group_ids)}

    def log_path(self, session: Session, index: int, kind: str) -> Path:
        return session.layout.logs / "sessions" / session.plan.session_id / \
            f"{index:02d}-{kind}.log"

    def selected_groups(self) -> list[str]:
        return [g for g in self.schedule.group_ids if g in self.workflow.enabled_groups]

    def _turn(self, session: Session, kind: str, message: str, workshop_mode: str,
              run_folder: str, decisions: list[Decision] | None = None
              ) -> dict[str, Any]:
        options: dict[str, Any] = {
            "run_mode": "use_same_run", "selected_run_folder": run_folder,
            "execution_strategy": "start_from_beginning_no_human",
            "workshop_mode": workshop_mode, "enabled_group_ids": self.selected_groups(),
        }
        if self.workflow.pending_upgrades:
            options["contract_upgrades_pending"] = True
        stdin: dict[str, Any] = {
            "workflow": self.workflow.name, "schedule_id": self.schedule.id,
            "workshop_mode": workshop_mode, "agent_mode": "workflow_phase",
            "phase_id": "workflow-builder", "payload": dict(self.schedule.trigger_payload),
            "execution_options": options,
        }
        if decisions is not None:
            stdin["decisions"] = decisions
        return session.turn(TurnSpec(kind, message, workshop_mode,
                                     self.workflow.folder / "runs" / run_folder, stdin))

    def run_turns(self, session: Session) -> tuple[str, str | None]:
        schedule = self.schedule
        decisions = Decisions(self.workflow.folder, on_corrupt=self._on_corrupt)
        try:
            answered = decisions.answered()
        except OSError as exc:  # (there but unreadable now: no turn runs without them)
            return hist.ERROR, f"{exc}; its decisions were not applied and no message " \
                "was sent"
        if answered:
            turn = self._turn(session, "preflight", PREFLIGHT_MESSAGE, "workshop", RUN_FOLDER,
                              answered)
            if (end := session.ended_by(turn)) is not None:
                return end
            decisions.mark_applied([d.get("id") for d in answered], session.plan.session_id,
                                   session.clock())
        messages = list(schedule.messages) or [DEFAULT_MESSAGE]
        for message in messages:
            if (end := session.stopped()) is not None:
                return end
            turn = self._turn(session, "message", message, schedule.workshop_mode, RUN_FOLDER)
            if (end := session.ended_by(turn)) is not None:
                return end
        if schedule.mode == "workshop" and schedule.workshop_mode == "run" \
                and not any(REPORT_TOOL in m for m in messages):
            for group in self.selected_groups():
                if (end := session.stopped()) is not None:
                    return end
                turn = self._turn(session, "report", REPORT_MESSAGE, "run",
                                  f"{RUN_FOLDER}/{group}")
                if (end := session.ended_by(turn)) is not None:
                    return end
        return hist.SUCCESS, None

    def after(self, session: Session, status: str) -> None:
        if self.schedule.pulse and status in (hist.SUCCESS, hist.ERROR):
            message = (f"Pulse: scheduled run {session.plan.entry_id} of schedule "
                       f"{self.schedule.id} finished with status {status}.")
            self._turn(session, "pulse", message, "workshop", RUN_FOLDER)
