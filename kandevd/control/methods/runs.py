"""``runs.*``: the global queue over the socket."""

from __future__ import annotations

from typing import Any

from kandevd.control.protocol import Conflict, InvalidParams, NotFound
from kandevd.control.registry import Registry, object_schema, paging_properties
from kandevd.services import Services
from kandevd.store.runs import STATUSES, RunConflict, RunNotFound, RunReferenceError

ID = {"type": "string", "minLength": 1, "maxLength": 200}

ENQUEUE = object_schema({
    "workspace_id": ID, "agent_id": ID,
    "reason": {"type": "string", "minLength": 1, "maxLength": 200},
    "task_id": {"type": ["string", "null"], "maxLength": 200},
    "payload": {"type": "object"},
    "idempotency_key": {"type": ["string", "null"], "maxLength": 500},
    "coalesce": {"type": "boolean"},
}, ("workspace_id", "agent_id", "reason"))

LIST = object_schema({
    "status": {"enum": list(STATUSES)}, "agent_id": ID, "workspace_id": ID, "task_id": ID,
    "reason": {"type": "string"}, "order": {"enum": ["asc", "desc"]}, **paging_properties(),
})


def register(registry: Registry, services: Services) -> None:
    queue = services.queue

    def enqueue(p: dict[str, Any]) -> dict[str, Any]:
        try:
            result = queue.enqueue(
                workspace_id=p["workspace_id"], agent_id=p["agent_id"], reason=p["reason"],
                task_id=p.get("task_id"), payload=p.get("payload") or {},
                idempotency_key=p.get("idempotency_key"), coalesce=p.get("coalesce", True))
        except RunReferenceError as exc:
            raise InvalidParams(str(exc)) from None
        return {"run": result.run, "deduplicated": result.deduplicated,
                "coalesced": result.coalesced}

    def get(p: dict[str, Any]) -> dict[str, Any]:
        try:
            return queue.repo.get(p["id"])
        except RunNotFound as exc:
            raise NotFound(str(exc)) from None

    def list_(p: dict[str, Any]) -> dict[str, Any]:
        return queue.repo.list(limit=p.get("limit", 50), offset=p.get("offset", 0),
                               order=p.get("order", "asc"),
                               **{k: p.get(k) for k in ("status", "agent_id", "workspace_id",
                                                        "task_id", "reason")})

    def cancel(p: dict[str, Any]) -> dict[str, Any]:
        try:
            return queue.cancel(p["id"], p.get("reason"))
        except RunNotFound as exc:
            raise NotFound(str(exc)) from None
        except RunConflict as exc:
            raise Conflict(str(exc)) from None

    def retry(p: dict[str, Any]) -> dict[str, Any]:
        try:
            return queue.retry(p["id"])
        except RunNotFound as exc:
            raise NotFound(str(exc)) from None
        except RunConflict as exc:
            raise Conflict(str(exc)) from None

    def explain(p: dict[str, Any]) -> dict[str, Any]:
        try:
            return queue.explain(p["id"])
        except RunNotFound as exc:
            raise NotFound(str(exc)) from None

    registry.add("runs.enqueue", enqueue, ENQUEUE)
    registry.add("runs.get", get, object_schema({"id": ID}, ("id",)))
    registry.add("runs.list", list_, LIST)
    registry.add("runs.cancel", cancel, object_schema(
        {"id": ID, "reason": {"type": ["string", "null"], "maxLength": 500}}, ("id",)))
    registry.add("runs.retry", retry, object_schema({"id": ID}, ("id",)))
    registry.add("runs.explain", explain, object_schema({"id": ID}, ("id",)))
