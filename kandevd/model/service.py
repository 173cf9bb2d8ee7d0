"""WorkspaceService: the workspace model's rules on top of its SQL.

It checks every reference a create or update names (inside the same
transaction as the write), publishes what changed on the event bus after the
commit, runs a step's ``on_enter`` actions when a task moves, and starts the
interactive Kanban launch.

Events go out after the commit, in the caller's thread: ``task.created``,
``task.updated`` (``changes`` names the changed fields, ``runner`` when the
effective runner changed, always ``step_id`` on a move), ``workspace.*``,
``agent.*``, ``workflow.created``, ``task.launched``, ``task.launch_finished``
(docs/architecture.md lists their payloads). One instance serves the daemon.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from kandevd.bus import EventBus
from kandevd.config import Config, UnknownProfile
from kandevd.model.actions import ActionError, run_queue_run, target_agent_id, validate_action
from kandevd.model.agents import check_status, cooldown_in_force, profile_ref
from kandevd.model.answers import Launched, TaskMove
from kandevd.model.errors import ConflictError, InvalidReference, LaunchRefused, NotFoundError
from kandevd.paths import HomeLayout
from kandevd.runqueue.service import RunQueue
from kandevd.runtime import AgentRuntime, ExecutionResult, RuntimeFull
from kandevd.runtime.specs import agent_execution
from kandevd.store import workspace as sql
from kandevd.store.base import BaseStore
from kandevd.store.workspace import (
    AgentRecord,
    RecordPage,
    TaskRecord,
    WorkflowRecord,
    WorkspaceRecord,
)
from kandevd.timeutil import rfc3339, utc_now

if TYPE_CHECKING:
    import sqlite3

log = logging.getLogger("kandevd.model")

STYLES = ("kanban", "office", "custom")
_TIMESTAMPS = frozenset({"created_at", "updated_at"})
Found = TypeVar("Found")



def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def changed_fields(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Names of the fields whose value differs (timestamps are not changes)."""
    return [name for name in after if name not in _TIMESTAMPS and before.get(name) != after[name]]


class WorkspaceService:
    def __init__(self, store: BaseStore, bus: EventBus, queue: RunQueue, runtime: AgentRuntime,
                 config: Config, layout: HomeLayout, *,
                 clock: Callable[[], datetime] = utc_now) -> None:
        self.store = store
        self.bus = bus
        self.queue = queue
        self.runtime = runtime
        self.config = config
        self.layout = layout
        self.clock = clock

    def _now(self) -> str:
        return rfc3339(self.clock())

    # -- lookups that raise -------------------------------------------------------
    @staticmethod
    def _need(found: Found | None, what: str, ident: str) -> Found:
        if found is None:
            raise NotFoundError(f"{what} {ident!r} does not exist")
        return found

    @staticmethod
    def _workspace_ref(conn: sqlite3.Connection, workspace_id: str) -> WorkspaceRecord:
        workspace = sql.get_workspace(conn, workspace_id)
        if workspace is None:
            raise InvalidReference(f"workspace_id: workspace {workspace_id!r} does not exist")
        return workspace

    @staticmethod
    def _agent_ref(conn: sqlite3.Connection, field: str, agent_id: str,
                   workspace_id: str) -> AgentRecord:
        agent = sql.get_agent(conn, agent_id)
        if agent is None:
            raise InvalidReference(f"{field}: agent {agent_id!r} does not exist")
        if agent["workspace_id"] != workspace_id:
            raise InvalidReference(f"{field}: agent {agent_id!r} belongs to workspace "
                                   f"{agent['workspace_id']!r}, not {workspace_id!r}")
        return agent

    @staticmethod
    def _free_id(conn: sqlite3.Connection, table: str, what: str, ident: str) -> None:
        if sql.id_taken(conn, table, ident):
            raise ConflictError(f"{what} {ident!r} already exists")

    def _announce_update(self, kind: str, before: Mapping[str, Any],
                         after: Mapping[str, Any]) -> list[str]:
        """Log and publish ``<kind>.updated`` with what changed (nothing when nothing did)."""
        changes = changed_fields(before, after)
        if changes:
            log.info("%s %s updated (%s)", kind, after["id"], ", ".join(changes))
            self.bus.publish(f"{kind}.updated", {kind: after, "previous": before,
                                                 "changes": changes})
        return changes

    # -- workspaces ------------------------------------------------------------------
    def create_workspace(self, params: Mapping[str, Any]) -> WorkspaceRecord:
        now = self._now()
        workspace = {"id": params.get("id") or new_id("ws"), "name": params["name"],
                     "office_workflow_id": params.get("office_workflow_id") or "",
                     "created_at": now, "updated_at": now}
        with self.store.transaction() as conn:
            self._free_id(conn, "workspaces", "workspace", workspace["id"])
            office = workspace["office_workflow_id"]
            if office:
                # A new workspace owns no workflow yet, so this names the workflow that
                # will be its Office workflow once created; it must not be another's.
                existing = sql.get_workflow(conn, office)
                if existing is not None:
                    raise InvalidReference(
                        f"office_workflow_id: workflow {office!r} belongs to workspace "
                        f"{existing['workspace_id']!r}")
            sql.insert_workspace(conn, workspace)
            created = self._need(sql.get_workspace(conn, workspace["id"]), "workspace",
                                 workspace["id"])
        log.info("workspace %s created", created["id"])
        self.bus.publish("workspace.created", {"workspace": created})
        return created

    def update_workspace(self, params: Mapping[str, Any]) -> WorkspaceRecord:
        workspace_id = params["id"]
        with self.store.transaction() as conn:
            before = self._need(sql.get_workspace(conn, workspace_id), "workspace", workspace_id)
            fields: dict[str, Any] = {}
            if "name" in params:
                fields["name"] = params["name"]
            if "office_workflow_id" in params:
                office = params["office_workflow_id"] or ""
                if office:
                    workflow = sql.get_workflow(conn, office)
                    if workflow is None or workflow["workspace_id"] != workspace_id:
                        raise InvalidReference(
                            f"office_workflow_id: workflow {office!r} is not a workflow of "
                            f"workspace {workspace_id!r}")
                fields["office_workflow_id"] = office
            fields["updated_at"] = self._now()
            sql.update_workspace(conn, workspace_id, fields)
            after = self._need(sql.get_workspace(conn, workspace_id), "workspace", workspace_id)
        self._announce_update("workspace", before, after)
        return after

    def get_workspace(self, workspace_id: str) -> WorkspaceRecord:
        with self.store.connection() as conn:
            return self._need(sql.get_workspace(conn, workspace_id), "workspace", workspace_id)

    def list_workspaces(self, *, limit: int = 50, offset: int = 0) -> RecordPage[WorkspaceRecord]:
        with self.store.connection() as conn:
            return sql.list_workspaces(conn, limit=limit, offset=offset)

    # -- agents ------------------------------------------------------------------------
    def create_agent(self, params: Mapping[str, Any]) -> AgentRecord:
        now = self._now()
        agent = {"id": params.get("id") or new_id("agt"), "workspace_id": params["workspace_id"],
                 "name": params["name"],
                 "profile": profile_ref(params.get("profile") or "default", self.config.agents,
                                        remote=bool(params.get("runs_on"))),
                 "cooldown_s": float(params.get("cooldown_s", 0)),
                 "status": params.get("status") or "active", "created_at": now,
                 "updated_at": now, "runs_on": params.get("runs_on") or None}
        check_status(agent["status"])
        with self.store.transaction() as conn:
            self._free_id(conn, "agents", "agent", agent["id"])
            self._workspace_ref(conn, agent["workspace_id"])
            sql.insert_agent(conn, agent)
            created = self._need(sql.get_agent(conn, agent["id"]), "agent", agent["id"])
        log.info("agent %s created in workspace %s (profile %s)", created["id"],
                 created["workspace_id"], created["profile"])
        self.bus.publish("agent.created", {"agent": created})
        return created

    def update_agent(self, params: Mapping[str, Any]) -> AgentRecord:
        agent_id = params["id"]
        fields: dict[str, Any] = {}
        if "status" in params:
            check_status(params["status"])
            fields["status"] = params["status"]
        if "cooldown_s" in params:
            fields["cooldown_s"] = float(params["cooldown_s"])
        if "runs_on" in params:  # (null: its runs run on the daemon's machine again)
            fields["runs_on"] = params["runs_on"] or None
        with self.store.transaction() as conn:
            before = self._need(sql.get_agent(conn, agent_id), "agent", agent_id)
            remote = bool(fields["runs_on"] if "runs_on" in fields else before["runs_on"])
            if "profile" in params or ("runs_on" in fields and not remote):
                fields["profile"] = profile_ref(params.get("profile", before["profile"]),
                                                self.config.agents, remote=remote)
            now = self.clock()
            if "cooldown_s" in fields:  # (a cooldown in force follows the new length)
                fields["cooldown_until"] = cooldown_in_force(
                    before["cooldown_until"], before["last_finished_at"],
                    fields["cooldown_s"], now)
            fields["updated_at"] = rfc3339(now)
            sql.update_agent(conn, agent_id, fields)
            after = self._need(sql.get_agent(conn, agent_id), "agent", agent_id)
        changes = changed_fields(before, after)
        if changes:
            log.info("agent %s updated (%s)", agent_id,
                     ", ".join(f"{name}={after[name]!r}" for name in changes))
            self.bus.publish("agent.updated", {"agent": after, "previous": before,
                                               "changes": changes})
        if after["status"] == "active":
            # A resumed agent (or a shorter cooldown) may make queued runs claimable now.
            self.queue.signal()
        return after

    def get_agent(self, agent_id: str) -> AgentRecord:
        with self.store.connection() as conn:
            return self._need(sql.get_agent(conn, agent_id), "agent", agent_id)

    def list_agents(self, *, limit: int = 50, offset: int = 0, **filters: Any
                    ) -> RecordPage[AgentRecord]:
        with self.store.connection() as conn:
            return sql.list_agents(conn, limit=limit, offset=offset, **filters)

    # -- workflows ------------------------------------------------------------------------
    def create_workflow(self, params: Mapping[str, Any]) -> WorkflowRecord:
        workflow = {"id": params.get("id") or new_id("wf"),
                    "workspace_id": params["workspace_id"], "name": params["name"],
                    "style": params["style"], "created_at": self._now()}
        if workflow["style"] not in STYLES:
            raise InvalidReference(f"style: must be one of {', '.join(STYLES)}, "
                                   f"not {workflow['style']!r}")
        steps = [dict(step) for step in params.get("steps") or ()]
        with self.store.transaction() as conn:
            self._free_id(conn, "workflows", "workflow", workflow["id"])
            self._workspace_ref(conn, workflow["workspace_id"])
            self._check_steps(conn, steps, workflow["workspace_id"])
            sql.insert_workflow(conn, workflow, steps)
            created = self._need(sql.get_workflow(conn, workflow["id"]), "workflow",
                                 workflow["id"])
        log.info("workflow %s (%s) created in workspace %s with %d step(s)", created["id"],
                 created["style"], created["workspace_id"], len(created["steps"]))
        self.bus.publish("workflow.created", {"workflow": created})
        return created

    def _check_steps(self, conn: sqlite3.Connection, steps: Sequence[dict[str, Any]],
                     workspace_id: str) -> None:
        seen: set[str] = set()
        for index, step in enumerate(steps):
            where = f"steps.{index}"
            if step["id"] in seen:
                raise InvalidReference(f"{where}.id: step id {step['id']!r} is used twice "
                                       "in this workflow")
            seen.add(step["id"])
            if step.get("agent_id"):
                self._agent_ref(conn, f"{where}.agent_id", step["agent_id"], workspace_id)
            for number, action in enumerate(step.get("on_enter") or ()):
                field = f"{where}.on_enter.{number}"
                try:
                    validate_action(action, field)
                except ActionError as exc:
                    raise InvalidReference(str(exc)) from None
                explicit = target_agent_id(action)
                if explicit is not None:
                    self._agent_ref(conn, f"{field}.target", explicit, workspace_id)

    def get_workflow(self, workflow_id: str) -> WorkflowRecord:
        with self.store.connection() as conn:
            return self._need(sql.get_workflow(conn, workflow_id), "workflow", workflow_id)

    def list_workflows(self, *, limit: int = 50, offset: int = 0, **filters: Any
                       ) -> RecordPage[WorkflowRecord]:
        with self.store.connection() as conn:
            return sql.list_workflows(conn, limit=limit, offset=offset, **filters)

    # -- tasks ----------------------------------------------------------------------------
    def _task_refs(self, conn: sqlite3.Connection, task: Mapping[str, Any]) -> None:
        """The task's workflow and step fit its workspace; its runner is one of its agents."""
        workflow = sql.get_workflow(conn, task["workflow_id"])
        if workflow is None:
            raise InvalidReference(f"workflow_id: workflow {task['workflow_id']!r} does not exist")
        if workflow["workspace_id"] != task["workspace_id"]:
            raise InvalidReference(f"workflow_id: workflow {workflow['id']!r} belongs to "
                                   f"workspace {workflow['workspace_id']!r}, not "
                                   f"{task['workspace_id']!r}")
        if task["step_id"] is not None and \
                sql.get_step(conn, workflow["id"], task["step_id"]) is None:
            raise InvalidReference(f"step_id: step {task['step_id']!r} does not exist in "
                                   f"workflow {workflow['id']!r}")
        if task["runner_agent_id"]:
            self._agent_ref(conn, "runner_agent_id", task["runner_agent_id"],
                            task["workspace_id"])

    def create_task(self, params: Mapping[str, Any]) -> TaskRecord:
        now = self._now()
        row = {"id": params.get("id") or new_id("task"), "workspace_id": params["workspace_id"],
               "workflow_id": params["workflow_id"], "step_id": params.get("step_id") or None,
               "title": params["title"], "project_id": params.get("project_id") or "",
               "state": params.get("state") or "TODO",
               "runner_agent_id": params.get("runner_agent_id") or None,
               "created_at": now, "updated_at": now}
        with self.store.transaction() as conn:
            self._free_id(conn, "tasks", "task", row["id"])
            self._workspace_ref(conn, row["workspace_id"])
            if row["step_id"] is None:
                row["step_id"] = sql.first_step_id(conn, row["workflow_id"])
            self._task_refs(conn, row)
            sql.insert_task(conn, row)
            task = self._need(sql.get_task(conn, row["id"]), "task", row["id"])
        log.info("task %s created in workflow %s at step %s (runner %s)", task["id"],
                 task["workflow_id"], task["step_id"], task["runner"])
        self.bus.publish("task.created", {"task": task, "changes": list(task)})
        return task

    def update_task(self, params: Mapping[str, Any]) -> TaskRecord:
        task_id = params["id"]
        fields = {name: params[name] for name in ("title", "state", "project_id")
                  if name in params}
        if "project_id" in fields:
            fields["project_id"] = fields["project_id"] or ""
        if "runner_agent_id" in params:
            fields["runner_agent_id"] = params["runner_agent_id"] or None
        with self.store.transaction() as conn:
            before = self._need(sql.get_task(conn, task_id), "task", task_id)
            if fields.get("runner_agent_id"):
                self._agent_ref(conn, "runner_agent_id", fields["runner_agent_id"],
                                before["workspace_id"])
            fields["updated_at"] = self._now()
            sql.update_task(conn, task_id, fields)
            after = self._need(sql.get_task(conn, task_id), "task", task_id)
        self._announce_update("task", before, after)
        return after

    def move_task(self, task_id: str, step_id: str) -> TaskMove:
        """Enter ``step_id``, publish ``task.updated``, then run the step's ``on_enter``.

        Each move into a different step is a new entry (the task's entry counter
        goes up), and a ``queue_run``'s idempotency key names the entry: coming
        back into a step queues again, while moving to the step the task is
        already on replays the same entry, whose keys keep it from queueing twice.
        """
        with self.store.transaction() as conn:
            before = self._need(sql.get_task(conn, task_id), "task", task_id)
            step = sql.get_step(conn, before["workflow_id"], step_id)
            if step is None:
                raise InvalidReference(f"step_id: step {step_id!r} does not exist in workflow "
                                       f"{before['workflow_id']!r}")
            sql.update_task(conn, task_id, {"step_id": step_id, "updated_at": self._now()})
            entry = sql.enter_step(conn, task_id, new_entry=before["step_id"] != step_id)
            after = self._need(sql.get_task(conn, task_id), "task", task_id)
        changes = changed_fields(before, after)
        if "step_id" not in changes:
            changes.insert(0, "step_id")
        if before["step_id"] != step_id:
            log.info("task %s moved from step %s to %s (runner %s)", task_id,
                     before["step_id"], step_id, after["runner"])
        else:  # (its on_enter actions run again, as the same entry)
            log.info("task %s entered step %s again (runner %s)", task_id, step_id,
                     after["runner"])
        self.bus.publish("task.updated", {"task": after, "previous": before, "changes": changes})
        results = [self._run_action(action, after, step_id, entry)
                   for action in step["on_enter"]]
        return {"task": after, "actions": results}

    def _run_action(self, action: Mapping[str, Any], task: Mapping[str, Any],
                    step_id: str, entry: int) -> dict[str, Any]:
        if action.get("action") != "queue_run":  # stored before a schema change; never run
            log.warning("task %s entered step %s: unknown action %r skipped", task["id"],
                        step_id, action.get("action"))
            return {"action": action.get("action"), "skipped": "unknown_action"}
        return run_queue_run(action, task, step_id, enqueue=self.queue.enqueue,
                             lookup_agent=self._lookup_agent, step_entry=entry)

    def _lookup_agent(self, agent_id: str) -> AgentRecord | None:
        with self.store.connection() as conn:
            return sql.get_agent(conn, agent_id)

    def get_task(self, task_id: str) -> TaskRecord:
        with self.store.connection() as conn:
            return self._need(sql.get_task(conn, task_id), "task", task_id)

    def list_tasks(self, *, limit: int = 50, offset: int = 0, **filters: Any
                   ) -> RecordPage[TaskRecord]:
        with self.store.connection() as conn:
            return sql.list_tasks(conn, limit=limit, offset=offset, **filters)

    # -- the Kanban launch path ---------------------------------------------------------
    def launch_task(self, task_id: str, prompt: str | None = None) -> Launched:
        """Start the task's runner now (kind ``launch``); no ``runs`` row is created."""
        with self.store.connection() as conn:
            task = self._need(sql.get_task(conn, task_id), "task", task_id)
            runner = task["runner"]
            if not runner:
                raise InvalidReference(
                    f"id: task {task_id!r} has no runner (set runner_agent_id, or move it to a "
                    "step with an agent_id)")
            agent = sql.get_agent(conn, runner)
        if agent is None:
            raise InvalidReference(f"id: the runner {runner!r} of task {task_id!r} does not exist")
        if agent["status"] != "active":
            raise LaunchRefused(f"agent {runner!r} is {agent['status']}")
        try:
            profile = self.config.profile(agent["profile"])
        except UnknownProfile as exc:
            raise LaunchRefused(f"agent {runner!r}: {exc}") from None
        session_id = new_id("ses")
        stdin: dict[str, Any] = {"kind": "launch", "session_id": session_id, "agent_id": runner,
                                 "task_id": task_id, "workspace_id": task["workspace_id"]}
        if prompt is not None:
            stdin["message"] = prompt
        spec = agent_execution(profile, self.layout, kind="launch", key=session_id,
                               stdin=stdin, session_id=session_id)
        try:
            self.runtime.launch(spec, lambda result: self._launch_done(task, runner, result))
        except RuntimeFull:
            raise LaunchRefused("runtime is full") from None
        log.info("task %s launched: agent %s, session %s", task_id, runner, session_id)
        self.bus.publish("task.launched", {"task_id": task_id, "agent_id": runner,
                                           "session_id": session_id,
                                           "log_path": str(spec.log_path)})
        return {"session_id": session_id}

    def _launch_done(self, task: Mapping[str, Any], agent_id: str,
                     result: ExecutionResult) -> None:
        """Log how a launch ended (runs in the runtime's worker thread)."""
        if result.succeeded:
            log.info("launch %s of task %s (agent %s) succeeded in %.1fs", result.key,
                     task["id"], agent_id, result.duration_s)
        else:
            log.warning("launch %s of task %s (agent %s) ended %s: %s", result.key, task["id"],
                        agent_id, result.outcome, result.error)
        self.bus.publish("task.launch_finished", {
            "task_id": task["id"], "agent_id": agent_id, "session_id": result.key,
            "outcome": result.outcome, "exit_code": result.exit_code,
            "summary": result.summary, "cost_cents": result.cost_cents})
