"""``runs.*``: the global queue over the socket."""

from __future__ import annotations

from typing import Any

import jsonschema

from kandevd.control.protocol import InvalidParams
from kandevd.control.registry import Registry, object_schema, paging_properties
from kandevd.control.services import Services
from kandevd.formats.schemacheck import format_validation_error
from kandevd.runs.model import STATUSES, EnqueueRequest

ID = {"type": "string", "minLength": 1, "maxLength": 200}

ENQUEUE = object_schema({
    "workspace_id": ID, "agent_id": ID,
    "reason": {"type": "string", "minLength": 1, "maxLength": 200},
    "task_id": {"type": ["string", "null"], "maxLength": 200},
    "payload": {"type": "object"},
    "idempotency_key": {"type": ["string", "null"], "maxLength": 500},
    "coalesce": {"type": "boolean"},
}, ("workspace_id", "agent_id", "reason"))

#: Most runs one ``runs.enqueue_many`` takes (one transaction, one fsync).
MAX_BATCH = 1000

ENQUEUE_MANY = object_schema({
    # Items are checked one by one in the handler, so an error can name its index.
    "runs": {"type": "array", "minItems": 1, "maxItems": MAX_BATCH},
}, ("runs",))

_ENQUEUE_ITEM = jsonschema.Draft202012Validator(ENQUEUE)

LIST = object_schema({
    "status": {"enum": list(STATUSES)}, "agent_id": ID, "workspace_id": ID, "task_id": ID,
    "reason": {"type": "string"}, "order": {"enum": ["asc", "desc"]}, **paging_properties(),
})


def register(registry: Registry, services: Services) -> None:
    queue = services.queue

    def enqueue(p: dict[str, Any]) -> dict[str, Any]:
        result = queue.enqueue(
            workspace_id=p["workspace_id"], agent_id=p["agent_id"], reason=p["reason"],
            task_id=p.get("task_id"), payload=p.get("payload") or {},
            idempotency_key=p.get("idempotency_key"), coalesce=p.get("coalesce", True))
        return result.to_dict()

    def enqueue_many(p: dict[str, Any]) -> dict[str, Any]:
        check_items(p["runs"])
        items: list[EnqueueRequest] = []
        for item in p["runs"]:
            items.append({
                "workspace_id": item["workspace_id"], "agent_id": item["agent_id"],
                "reason": item["reason"], "task_id": item.get("task_id"),
                "payload": item.get("payload") or {},
                "idempotency_key": item.get("idempotency_key"),
                "coalesce": item.get("coalesce", True)})
        results = queue.enqueue_many(items)
        return {"results": [result.to_dict() for result in results]}

    def get(p: dict[str, Any]) -> dict[str, Any]:
        return queue.get(p["id"]).to_dict()

    def list_(p: dict[str, Any]) -> dict[str, Any]:
        return queue.page(limit=p.get("limit", 50), offset=p.get("offset", 0),
                          order=p.get("order", "asc"),
                          **{k: p.get(k) for k in ("status", "agent_id", "workspace_id",
                                                   "task_id", "reason")}).to_dict()

    def cancel(p: dict[str, Any]) -> dict[str, Any]:
        return queue.cancel(p["id"], p.get("reason")).to_dict()

    def retry(p: dict[str, Any]) -> dict[str, Any]:
        return queue.retry(p["id"]).to_dict()

    def explain(p: dict[str, Any]) -> dict[str, Any]:
        return queue.explain(p["id"])

    registry.add("runs.enqueue", enqueue, ENQUEUE, quick_check=_plainly_valid)
    registry.add(
        "runs.enqueue_many", enqueue_many, ENQUEUE_MANY,
        summary=f"Queue up to {MAX_BATCH} runs in one transaction: all or nothing, in order.",
        result="{results: [{run: RUN, deduplicated, coalesced}]}, one per item in order; an "
               "invalid item fails the whole batch with data.index naming it")
    registry.add("runs.get", get, object_schema({"id": ID}, ("id",)))
    registry.add("runs.list", list_, LIST)
    registry.add("runs.cancel", cancel, object_schema(
        {"id": ID, "reason": {"type": ["string", "null"], "maxLength": 500}}, ("id",)))
    registry.add("runs.retry", retry, object_schema({"id": ID}, ("id",)))
    registry.add("runs.explain", explain, object_schema({"id": ID}, ("id",)), reads=True)


_ITEM_KEYS = frozenset(ENQUEUE["properties"])
_ITEM_IDS = ("workspace_id", "agent_id", "reason")


def _plainly_valid(item: dict[str, Any]) -> bool:
    """A quick check that accepts only items the ENQUEUE schema accepts.

    The common item (three short strings, perhaps a payload object) passes
    here in a few microseconds, a twentieth of a full jsonschema validation,
    which a batch of a thousand would otherwise spend most of its time on.
    Anything else, valid or not, is left to the schema (which also words the
    errors): this may say False for a valid item, never True for an invalid one.
    """
    if not _ITEM_KEYS.issuperset(item):
        return False
    for name in _ITEM_IDS:
        value = item.get(name)
        if type(value) is not str or not 0 < len(value) <= 200:
            return False
    if "payload" in item and type(item["payload"]) is not dict:
        return False
    return len(item) == 3 or (
        item.get("task_id") is None and item.get("idempotency_key") is None
        and type(item.get("coalesce", True)) is bool)


#: Items whose problems one error lists (the message stays readable).
MAX_ITEMS_REPORTED = 10


def check_items(items: list[Any]) -> None:
    """Every item's params problems at once, as InvalidParams naming the first bad index.

    The message lists the problems of up to ten bad items, in order. (References to
    workspaces and agents are checked afterwards, in the transaction: a batch whose
    params are all well-formed fails at its first item that names nothing.)
    """
    problems: list[InvalidParams] = []
    for index, item in enumerate(items):
        try:
            check_item(index, item)
        except InvalidParams as exc:
            problems.append(exc)
            if len(problems) == MAX_ITEMS_REPORTED:
                break
    if problems:
        first = problems[0].extra["index"]
        raise InvalidParams("; ".join(problem.message for problem in problems),
                            data={"index": first,
                                  "indexes": [problem.extra["index"] for problem in problems]})


def check_item(index: int, item: Any) -> None:
    """Every problem of one ``runs.enqueue_many`` item, as InvalidParams naming its index."""
    prefix = f"params.runs.{index}"
    if not isinstance(item, dict):
        raise InvalidParams(f"{prefix}: {type(item).__name__} is not an object",
                            data={"index": index})
    if _plainly_valid(item):
        return
    errors = sorted(_ENQUEUE_ITEM.iter_errors(item),
                    key=lambda e: [str(part) for part in e.absolute_path])
    if errors:
        messages: list[str] = []
        for error in errors:
            best = jsonschema.exceptions.best_match([error]) or error
            message = format_validation_error(best, prefix=prefix, noun="parameter")
            if message not in messages:
                messages.append(message)
        raise InvalidParams("; ".join(messages), data={"index": index})
