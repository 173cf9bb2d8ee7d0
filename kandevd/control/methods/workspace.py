"""``workspaces.*``, ``agents.*``, ``workflows.*``, ``tasks.*``: the workspace model.

Params are checked against the schemas below before a handler runs (unknown
names and wrong types are -32602). The handlers hand over to the daemon's
:class:`kandevd.model.service.WorkspaceService` and translate its errors: an
unknown ``id`` is ``not_found``, a taken id ``conflict``, a bad
reference ``invalid_params`` naming the field, a launch the runtime cannot
take ``refused``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kandevd.control.registry import Registry, object_schema, paging_properties
from kandevd.control.services import Services
from kandevd.model.actions import ACTION_SCHEMA
from kandevd.model.agents import AGENT_STATUSES
from kandevd.model.service import STYLES
from kandevd.runs.labels import RUNS_ON_SCHEMA

#: Ids a caller chooses for a new object: safe in paths and in ``:``-separated keys.
NEW_ID = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$",
          "x-message": "is not allowed: use letters, digits, '.', '_' and '-', starting "
                       "with a letter or digit (at most 128 characters)"}
#: Ids that are only looked up: anything else is simply not found.
ID = {"type": "string", "minLength": 1, "maxLength": 200}
OPTIONAL_ID = {"type": ["string", "null"], "maxLength": 200}
NAME = {"type": "string", "minLength": 1, "maxLength": 500}
#: Ten years: a longer duration means "never" and only overflows date arithmetic.
MAX_SECONDS = 315_360_000
SECONDS = {"type": "number", "minimum": 0, "maximum": MAX_SECONDS}

STEP = object_schema({
    "id": NEW_ID, "name": NAME, "agent_id": OPTIONAL_ID,
    "on_enter": {"type": "array", "items": ACTION_SCHEMA},
}, ("id", "name"))

SCHEMAS: dict[str, dict[str, Any]] = {
    "workspaces.create": object_schema(
        {"id": NEW_ID, "name": NAME, "office_workflow_id": {"type": "string"}}, ("name",)),
    "workspaces.update": object_schema(
        {"id": ID, "name": NAME, "office_workflow_id": {"type": "string"}}, ("id",)),
    "workspaces.get": object_schema({"id": ID}, ("id",)),
    "workspaces.list": object_schema(paging_properties()),
    "agents.create": object_schema({
        "id": NEW_ID, "workspace_id": ID, "name": NAME, "profile": NAME,
        "cooldown_s": SECONDS, "status": {"enum": list(AGENT_STATUSES)},
        "runs_on": RUNS_ON_SCHEMA,
    }, ("workspace_id", "name")),
    "agents.update": object_schema({
        "id": ID, "status": {"enum": list(AGENT_STATUSES)}, "cooldown_s": SECONDS,
        "profile": NAME, "runs_on": RUNS_ON_SCHEMA,
    }, ("id",)),
    "agents.get": object_schema({"id": ID}, ("id",)),
    "agents.list": object_schema({"workspace_id": ID, "status": {"enum": list(AGENT_STATUSES)},
                                  **paging_properties()}),
    "workflows.create": object_schema({
        "id": NEW_ID, "workspace_id": ID, "name": NAME, "style": {"enum": list(STYLES)},
        "steps": {"type": "array", "items": STEP},
    }, ("workspace_id", "name", "style", "steps")),
    "workflows.get": object_schema({"id": ID}, ("id",)),
    "workflows.list": object_schema({"workspace_id": ID, "style": {"enum": list(STYLES)},
                                     **paging_properties()}),
    "tasks.create": object_schema({
        "id": NEW_ID, "workspace_id": ID, "workflow_id": ID, "title": NAME,
        "step_id": OPTIONAL_ID, "project_id": {"type": "string", "maxLength": 200},
        "state": {"type": "string", "minLength": 1, "maxLength": 100},
        "runner_agent_id": OPTIONAL_ID,
    }, ("workspace_id", "workflow_id", "title")),
    "tasks.update": object_schema({
        "id": ID, "title": NAME, "state": {"type": "string", "minLength": 1, "maxLength": 100},
        "runner_agent_id": OPTIONAL_ID, "project_id": {"type": "string", "maxLength": 200},
    }, ("id",)),
    "tasks.move": object_schema({"id": ID, "step_id": ID}, ("id", "step_id")),
    "tasks.get": object_schema({"id": ID}, ("id",)),
    "tasks.list": object_schema({
        "workspace_id": ID, "workflow_id": ID, "step_id": ID, "state": {"type": "string"},
        "project_id": {"type": "string"}, "runner": ID, **paging_properties(),
    }),
    "tasks.launch": object_schema({"id": ID, "prompt": {"type": ["string", "null"]}}, ("id",)),
}


def _paging(p: dict[str, Any], *filters: str) -> dict[str, Any]:
    return {"limit": p.get("limit", 50), "offset": p.get("offset", 0),
            **{name: p.get(name) for name in filters}}


def register(registry: Registry, services: Services) -> None:
    model = services.model
    handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
        "workspaces.create": model.create_workspace,
        "workspaces.update": model.update_workspace,
        "workspaces.get": lambda p: model.get_workspace(p["id"]),
        "workspaces.list": lambda p: model.list_workspaces(**_paging(p)),
        "agents.create": model.create_agent,
        "agents.update": model.update_agent,
        "agents.get": lambda p: model.get_agent(p["id"]),
        "agents.list": lambda p: model.list_agents(**_paging(p, "workspace_id", "status")),
        "workflows.create": model.create_workflow,
        "workflows.get": lambda p: model.get_workflow(p["id"]),
        "workflows.list": lambda p: model.list_workflows(**_paging(p, "workspace_id", "style")),
        "tasks.create": model.create_task,
        "tasks.update": model.update_task,
        "tasks.move": lambda p: model.move_task(p["id"], p["step_id"]),
        "tasks.get": lambda p: model.get_task(p["id"]),
        "tasks.list": lambda p: model.list_tasks(**_paging(
            p, "workspace_id", "workflow_id", "step_id", "state", "project_id", "runner")),
        "tasks.launch": lambda p: model.launch_task(p["id"], p.get("prompt")),
    }
    for name, handler in handlers.items():
        registry.add(name, handler, SCHEMAS[name])
