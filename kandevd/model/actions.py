"""Workflow step actions: what entering a step does (``on_enter``).

There is one action, ``queue_run``: it asks the global run queue for a run
of the step's runner (or an explicit ``agent:<id>``). It works the same for
every workflow style; an explicit action is always honoured, so a Kanban
board that wants autonomy says so in its workflow, and merely assigning a
runner never does.

Replaying a move must not queue twice, while coming back into a step later
is new work; so the run's idempotency key is derived from what the move
means, including which entry of the task into the step it is (the task's
entry counter, raised by every move into a different step)::

    queue_run:<task>:<step>:<entry>:<agent>:<first 16 hex of sha256(canonical JSON of the action)>

Canonical JSON is ``json.dumps(action, sort_keys=True, separators=(",", ":"),
ensure_ascii=False)``: key order and whitespace never change the key.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import jsonschema

from kandevd.runs.model import RunReferenceError

log = logging.getLogger("kandevd.model.actions")

DEFAULT_REASON = "queue_run"
DEFAULT_TARGET = "runner"
AGENT_TARGET_PREFIX = "agent:"

#: The JSON Schema of one ``on_enter`` action (docs/protocol.md, workflows.create).
ACTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "action": {"const": "queue_run"},
        "reason": {"type": "string", "minLength": 1, "maxLength": 200},
        "payload": {"type": "object"},
        "target": {"type": "string", "pattern": r"^(runner|agent:\S+)$", "maxLength": 300},
    },
    "required": ["action"],
    "additionalProperties": False,
}

_VALIDATOR = jsonschema.Draft202012Validator(ACTION_SCHEMA)


class Action(TypedDict, total=False):
    """A step's ``on_enter`` action, as :data:`ACTION_SCHEMA` allows it."""

    action: str
    reason: str
    payload: dict[str, Any]
    target: str


class ActionOutcome(TypedDict, total=False):
    """What one action did when a task entered its step (``tasks.move``'s ``actions``)."""

    action: str
    target: str
    agent_id: str
    run_id: str
    deduplicated: bool
    coalesced: bool
    skipped: str


class ActionError(ValueError):
    """An action that does not match :data:`ACTION_SCHEMA`."""


def validate_action(action: Any, where: str = "action") -> Action:
    """Return ``action`` when it is valid; raise ActionError naming the path otherwise."""
    errors = sorted(_VALIDATOR.iter_errors(action), key=lambda e: list(e.absolute_path))
    if errors:
        error = jsonschema.exceptions.best_match(errors) or errors[0]
        path = ".".join([where, *(str(p) for p in error.absolute_path)])
        raise ActionError(f"{path}: {error.message}")
    return Action(**action)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def action_digest(action: Mapping[str, Any]) -> str:
    """First 16 hex digits of the SHA-256 of the action's canonical JSON."""
    return hashlib.sha256(canonical_json(dict(action)).encode("utf-8")).hexdigest()[:16]


def queue_run_key(task_id: str, step_id: str, agent_id: str, action: Mapping[str, Any],
                  entry: int = 0) -> str:
    """The deterministic idempotency key of one ``queue_run`` (see the module docstring)."""
    return f"queue_run:{task_id}:{step_id}:{entry}:{agent_id}:{action_digest(action)}"


def target_agent_id(action: Mapping[str, Any]) -> str | None:
    """The agent an ``agent:<id>`` target names; None for the ``runner`` target."""
    target = action.get("target") or DEFAULT_TARGET
    if target.startswith(AGENT_TARGET_PREFIX):
        return target[len(AGENT_TARGET_PREFIX):]
    return None


Enqueue = Callable[..., Any]
AgentLookup = Callable[[str], Mapping[str, Any] | None]


def run_queue_run(action: Mapping[str, Any], task: Mapping[str, Any], step_id: str, *,
                  enqueue: Enqueue, lookup_agent: AgentLookup, step_entry: int = 0
                  ) -> ActionOutcome:
    """Execute one ``queue_run`` for ``task`` (as it is after the move) entering ``step_id``.

    ``step_entry`` counts the task's entries into steps (part of the key).
    ``enqueue`` is :meth:`kandevd.runqueue.service.RunQueue.enqueue`;
    ``lookup_agent(id)`` returns the agent or None. Returns the entry of the
    move result: ``run_id``/``deduplicated``/``coalesced``, or ``skipped``.
    """
    target = action.get("target") or DEFAULT_TARGET
    entry: ActionOutcome = {"action": "queue_run", "target": target}
    explicit = target_agent_id(action)
    agent_id = explicit if explicit is not None else task.get("runner")
    if not agent_id:
        log.warning("task %s entered step %s: queue_run skipped, the task has no runner "
                    "and the action names no target agent", task["id"], step_id)
        return {**entry, "skipped": "no_runner"}
    agent = lookup_agent(agent_id)
    if agent is None or agent["workspace_id"] != task["workspace_id"]:
        log.warning("task %s entered step %s: queue_run skipped, agent %r is not an agent of "
                    "workspace %r", task["id"], step_id, agent_id, task["workspace_id"])
        return {**entry, "agent_id": agent_id, "skipped": "unknown_agent"}
    payload = {**(action.get("payload") or {}), "task_id": task["id"],
               "workflow_step_id": step_id}
    key = queue_run_key(task["id"], step_id, agent_id, action, step_entry)
    try:
        result = enqueue(workspace_id=task["workspace_id"], agent_id=agent_id,
                         reason=action.get("reason") or DEFAULT_REASON, task_id=task["id"],
                         payload=payload, idempotency_key=key,
                         # Each task's step entry is its own piece of work: merging it into
                         # another task's queued run would drop this task's payload.
                         coalesce=False)
    except RunReferenceError as exc:
        log.warning("task %s entered step %s: queue_run skipped: %s", task["id"], step_id, exc)
        return {**entry, "agent_id": agent_id, "skipped": "unknown_agent"}
    run_id = result.run.id
    if result.deduplicated:
        log.info("task %s entered step %s: queue_run for agent %s already queued as run %s",
                 task["id"], step_id, agent_id, run_id)
    else:
        log.info("task %s entered step %s: queue_run queued run %s for agent %s%s",
                 task["id"], step_id, run_id, agent_id,
                 " (coalesced)" if result.coalesced else "")
    return {**entry, "agent_id": agent_id, "run_id": run_id,
            "deduplicated": result.deduplicated, "coalesced": result.coalesced}
