"""``scheduler.*``: the file-backed workflow scheduler over the socket."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, cast

from kandevd.control.protocol import (
    Conflict,
    InvalidParams,
    NotRunning,
    Refused,
    Unavailable,
    file_unavailable,
)
from kandevd.control.registry import Registry, object_schema, paging_properties
from kandevd.control.services import Services
from kandevd.cron import (
    MAX_EXPRESSION,
    CronError,
    describe_times,
    next_fire_times,
    parse_cron,
    parse_timezone,
)
from kandevd.schedules import history as hist
from kandevd.schedules.catchup.backfill import fire_times
from kandevd.schedules.jobs import Job, JobNotFound
from kandevd.schedules.products.catalog import LOCAL_USER
from kandevd.schedules.products.source import ProductSource
from kandevd.schedules.rules.options import option_properties
from kandevd.schedules.rules.states import STATES
from kandevd.schedules.sessions import runner as run
from kandevd.schedules.workflows.manifest import (
    ManifestError,
    check_workflow_name,
)
from kandevd.schedules.workflows.source import (
    WorkflowSource,
)
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now

ID = {"type": "string", "minLength": 1, "maxLength": 500}
TEXT = {"type": "string", "maxLength": 10000}

SCHEDULE_FIELDS: dict[str, Any] = {
    "id": {"type": "string", "minLength": 1, "maxLength": 200},
    "name": {"type": "string", "maxLength": 500},
    "description": TEXT,
    "cron_expression": {"type": "string", "minLength": 1, "maxLength": MAX_EXPRESSION},
    "timezone": {"type": "string", "minLength": 1, "maxLength": 100},
    "enabled": {"type": "boolean"},
    "trigger_payload": {"type": "object"},
    "group_ids": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "mode": {"enum": ["workshop", "workflow"]},
    "messages": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "workshop_mode": {"enum": ["run", "workshop", "runner"]},
    "pulse": {"type": "boolean"},
    "overlap_policy": {"enum": ["skip", "buffer_one", "replace"]},
    **option_properties(),
}
WORKFLOW_NAME = {"type": "string", "minLength": 1, "maxLength": 200}
USER = {"type": "string", "minLength": 1, "maxLength": 200}
JOB_REF = object_schema({"id": ID, "user_id": USER}, ("id",))
MAX_NEXT = 100
_ENTITY = {"workflows": "workflow", "products": "product"}

log = logging.getLogger("kandevd.control.scheduler")


def register(registry: Registry, services: Services) -> None:
    loop = services.cron
    jobs = loop.registry
    runner = loop.runner
    workflows = cast(WorkflowSource, jobs.sources["workflows"])
    products = cast(ProductSource, jobs.sources["products"])

    def resolve(job_id: str, user_id: str | None = None) -> Job:
        return jobs.resolve(job_id, user_id)

    def editable(p: dict[str, Any], verb: str) -> Job:
        if not jobs.source_of(p["id"]).editable:
            raise Refused(f"{p['id']} is declared by its product's product.yaml: a product "
                          f"job cannot be {verb} (switch it off for a user with "
                          "scheduler.jobs.disable)")
        return resolve(p["id"])

    def job_dict(job: Job) -> dict[str, Any]:
        return loop.describe(job)

    def changing(change: Callable[[], Job | None]) -> Job | None:
        """A change of a workflow's manifest; a refused write says nothing changed."""
        try:
            changed = change()
        except OSError as exc:
            raise unwritable(exc) from None
        except JobNotFound as exc:  # looked up after the write: the file did not load again
            loop.wake()
            raise Conflict(f"the manifest was written, but its job is not loaded ({exc}): "
                           "scheduler.reload lists the workflow's problems") from None
        loop.wake()
        return changed

    # -- config ---------------------------------------------------------------------
    def config_get(_p: dict[str, Any]) -> dict[str, Any]:
        return {**jobs.pause.get(), **jobs.switches.as_dict()}

    def config_put(p: dict[str, Any]) -> dict[str, Any]:
        before = jobs.pause.get()
        was = before["globally_paused"]
        try:
            jobs.pause.put(p["globally_paused"], p.get("paused_by"), utc_now())
        except OSError as exc:
            raise unwritable(exc) from None
        by = p.get("paused_by") or "an operator"
        if p["globally_paused"] != was:  # (said in the daemon's log, as each skip is)
            log.info("scheduler %s by %s: %s", "paused" if p["globally_paused"] else "resumed",
                     by, "no schedule fires until it is resumed" if p["globally_paused"]
                     else "schedules fire again")
        elif was and p.get("paused_by") != before["paused_by"]:
            log.info("scheduler still paused, now by %s (was by %s)", by,
                     before["paused_by"] or "an operator")
        if p["globally_paused"] and not was:
            services.bus.publish("schedule.paused", {
                "id": None, "entry_id": None, "status": "paused", "reason": f"paused by {by}"})
        elif was and not p["globally_paused"]:
            services.bus.publish("schedule.resumed", {
                "id": None, "entry_id": None, "status": "resumed", "reason": f"resumed by {by}"})
        return config_get({})

    # -- reading --------------------------------------------------------------------
    def list_(p: dict[str, Any]) -> dict[str, Any]:
        limit, offset = p.get("limit", 50), p.get("offset", 0)
        chosen: list[Job] = []
        for name in ("workflows", "products"):
            if p.get("entity_type", _ENTITY[name]) == _ENTITY[name]:
                chosen += [j for j in jobs.jobs(source=name, user_id=p.get("user_id")
                                                if name == "products" else None)
                           if "enabled" not in p or j.enabled == p["enabled"]]
        around = loop.surroundings()
        if "state" in p:
            chosen = [j for j in chosen if loop.status_of(j, around).state == p["state"]]
        return {"items": [loop.describe(j, around) for j in chosen[offset:offset + limit]],
                "total": len(chosen), "limit": limit, "offset": offset}

    def get(p: dict[str, Any]) -> dict[str, Any]:
        return job_dict(resolve(p["id"], p.get("user_id")))

    def runs(p: dict[str, Any]) -> dict[str, Any]:
        job = resolve(p["id"], p.get("user_id"))
        history = job.source.history(job)
        answer = hist.page(history.entries(), schedule_id=job.spec.schedule.id,
                           limit=p.get("limit", 50), offset=p.get("offset", 0))
        answer["items"] = [shaped(item) for item in answer["items"]]
        # A history that did not parse was moved aside and started afresh: say so, or the
        # runs it held would read as never having been.
        path = str(history.file.path)
        moved = [problem["message"] for problem in jobs.problems()
                 if problem.get("kind") == "state" and problem.get("path") == path]
        if moved:
            answer["history_problem"] = moved[-1]
        return answer

    def next_(p: dict[str, Any]) -> dict[str, Any]:
        if ("id" in p) == ("schedule" in p):
            raise InvalidParams("params: give either 'id' or 'schedule', not both or neither")
        after = _time_param(p, "after") or utc_now()
        if "id" in p:
            job = resolve(p["id"], p.get("user_id"))
            schedule = job.spec.schedule
            zone_name = schedule.timezone
            times = job.source.next_times(job, after, p.get("count", 5))
            expression = schedule.cron_expression
        else:
            expression = p["schedule"]["cron_expression"]
            zone_name = p["schedule"].get("timezone", "UTC")
            try:
                trigger = parse_cron(expression, zone_name)
            except CronError as exc:
                raise InvalidParams(f"params.schedule.{exc}") from None
            times = next_fire_times(trigger, after, p.get("count", 5))
        return {"times": describe_times(times, parse_timezone(zone_name)),
                "timezone": zone_name, "cron_expression": expression}

    # -- changing the manifest ------------------------------------------------------
    def create(p: dict[str, Any]) -> dict[str, Any]:
        try:
            check_workflow_name(p["workflow"])
        except ManifestError as exc:
            raise InvalidParams(f"params.workflow: {exc}") from None
        job = changing(lambda: workflows.create(p["workflow"], p["schedule"], utc_now()))
        assert job is not None
        return job_dict(job)

    def update(p: dict[str, Any]) -> dict[str, Any]:
        job = editable(p, "updated")
        fields = dict(p["schedule"])
        if fields.get("id", job.spec.schedule.id) != job.spec.schedule.id:
            raise InvalidParams(f"params.schedule.id: the id of a schedule cannot change "
                                f"({job.spec.schedule.id!r}); create a new schedule instead")
        changed = changing(lambda: job.source.change(job, fields, utc_now()))
        assert changed is not None
        return job_dict(changed)

    def delete(p: dict[str, Any]) -> dict[str, Any]:
        job = editable(p, "deleted")
        changing(lambda: job.source.change(job, None, utc_now()))
        return {"id": job.id, "deleted": True}

    def set_enabled(p: dict[str, Any], enabled: bool) -> dict[str, Any]:
        job = resolve(p["id"], p.get("user_id"))
        changed = changing(lambda: job.source.set_enabled(job, enabled, utc_now()))
        assert changed is not None
        return job_dict(changed)

    def enable(p: dict[str, Any]) -> dict[str, Any]:
        return set_enabled(p, True)

    def disable(p: dict[str, Any]) -> dict[str, Any]:
        return set_enabled(p, False)

    def activity(p: dict[str, Any]) -> dict[str, Any]:
        try:
            check_workflow_name(p["user_id"])
        except ManifestError as exc:
            raise InvalidParams(f"params.user_id: {str(exc).replace('workflow name', 'user id')}"
                                ) from None
        at = _time_param(p, "at") or utc_now()
        try:
            products.record_activity(p["user_id"], p["profile"], at)
        except OSError as exc:
            raise unwritable(exc) from None
        loop.wake()
        return {"user_id": p["user_id"], "profile": p["profile"], "at": rfc3339(at)}

    # -- sessions -------------------------------------------------------------------
    def trigger(p: dict[str, Any]) -> dict[str, Any]:
        job = resolve(p["id"], p.get("user_id"))
        if job.state.invalid is not None:
            raise Conflict(f"{job.id} cannot run while its file has a problem: "
                           f"{job.state.invalid}")
        try:
            plan = runner.start(job, "manual")
        except run.StartNotRecorded as exc:  # named with the job, which only this knows
            raise Unavailable(f"{job.id} not started: {exc}", data={"path": exc.path}) from None
        return {"id": job.id, "session_id": plan.session_id, "run_id": plan.entry_id,
                "job": job_dict(job)}

    def stop(p: dict[str, Any]) -> dict[str, Any]:
        try:
            job = resolve(p["id"], p.get("user_id"))
        except JobNotFound as missing:
            # A session whose schedule was removed meanwhile ends under the definition it
            # started with: its full id still stops it.
            # (a product job without users.yaml is its one user's, unnamed)
            keys = [f"{p['id']}@{p['user_id']}"] if p.get("user_id") else \
                [p["id"], f"{p['id']}@{LOCAL_USER}"]
            for key in keys:
                try:
                    plan = runner.stop(key)
                    break
                except run.NotRunning:
                    continue
            else:
                raise missing from None
            return {"id": p["id"], "session_id": plan.session_id, "run_id": plan.entry_id,
                    "stopping": True, "backfill": False}
        backfill = loop.backfills.stop(job.key)
        try:
            plan = runner.stop(job.key)
        except run.NotRunning as exc:
            if backfill:  # between two of its sessions
                return {"id": job.id, "session_id": None, "run_id": None, "stopping": True,
                        "backfill": True}
            raise NotRunning(str(exc)) from None
        return {"id": job.id, "session_id": plan.session_id, "run_id": plan.entry_id,
                "stopping": True, "backfill": backfill}

    def backfill(p: dict[str, Any]) -> dict[str, Any]:
        job = resolve(p["id"], p.get("user_id"))
        start, end = _time_param(p, "from"), _time_param(p, "to")
        assert start is not None and end is not None
        if end < start:
            raise InvalidParams("params.to: must not be earlier than params.from")
        dry_run = p.get("dry_run", False)
        if not dry_run and end > utc_now():
            raise InvalidParams("params.to: a backfill runs past fire times; this one is in "
                                "the future (a dry run may look ahead)")
        times = fire_times(job, start, end)
        zone = parse_timezone(job.spec.schedule.timezone)
        started = False
        if times and not dry_run:
            if job.state.invalid is not None:
                raise Conflict(f"{job.id} is invalid: {job.state.invalid}")
            loop.backfills.start(job, times)
            started = True
        return {"id": job.id, "times": describe_times(times, zone), "started": started}

    def reload(_p: dict[str, Any]) -> dict[str, Any]:
        result = jobs.rescan(utc_now())
        loop.wake()
        return result

    schedule_object = {"type": "object", "properties": SCHEDULE_FIELDS,
                       "additionalProperties": False}
    registry.add("scheduler.config.get", config_get)
    registry.add("scheduler.config.put", config_put, object_schema(
        {"globally_paused": {"type": "boolean"},
         "paused_by": {"type": ["string", "null"], "maxLength": 200,
                       "pattern": "^[^\\x00-\\x1f\\x7f]*$",
                       "x-message": "holds a control character (a line break, a tab...)"}},
        ("globally_paused",)))
    registry.add("scheduler.jobs.list", list_, object_schema({
        "entity_type": {"enum": ["workflow", "product"]}, "enabled": {"type": "boolean"},
        "state": {"enum": list(STATES)}, "user_id": USER, **paging_properties()}))
    registry.add("scheduler.jobs.get", get, JOB_REF)
    registry.add("scheduler.jobs.create", create, object_schema({
        "workflow": WORKFLOW_NAME,
        "schedule": {**schedule_object, "required": ["id", "cron_expression"]}},
        ("workflow", "schedule")))
    registry.add("scheduler.jobs.update", update, object_schema(
        {"id": ID, "user_id": USER, "schedule": schedule_object}, ("id", "schedule")))
    registry.add("scheduler.jobs.delete", delete, JOB_REF)
    registry.add("scheduler.jobs.enable", enable, JOB_REF)
    registry.add("scheduler.jobs.disable", disable, JOB_REF)
    registry.add("scheduler.jobs.trigger", trigger, JOB_REF)
    registry.add("scheduler.jobs.stop", stop, JOB_REF)
    registry.add("scheduler.jobs.backfill", backfill, object_schema({
        "id": ID, "user_id": USER, "from": {"type": "string", "minLength": 1, "maxLength": 64},
        "to": {"type": "string", "minLength": 1, "maxLength": 64},
        "dry_run": {"type": "boolean"}}, ("id", "from", "to")))
    registry.add("scheduler.jobs.runs", runs, object_schema(
        {"id": ID, "user_id": USER, **paging_properties()}, ("id",)))
    registry.add("scheduler.jobs.next", next_, object_schema({
        "id": ID, "user_id": USER,
        "schedule": {"type": "object", "additionalProperties": False,
                     "required": ["cron_expression"],
                     "properties": {"cron_expression": SCHEDULE_FIELDS["cron_expression"],
                                    "timezone": SCHEDULE_FIELDS["timezone"]}},
        "count": {"type": "integer", "minimum": 1, "maximum": MAX_NEXT},
        "after": {"type": "string", "minLength": 1, "maxLength": 64}}))
    registry.add("scheduler.reload", reload)
    registry.add("products.activity", activity, object_schema(
        {"user_id": USER, "profile": WORKFLOW_NAME,
         "at": {"type": "string", "minLength": 1, "maxLength": 64}}, ("user_id", "profile")))


def unwritable(exc: OSError) -> Unavailable:
    """A file the method writes (atomically) that the file system refused."""
    return file_unavailable(exc, writing=True)


_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|z|[+-]\d{2}:\d{2})")
_EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
_LATEST = datetime(9000, 1, 1, tzinfo=UTC)


def _time_param(p: dict[str, Any], name: str) -> datetime | None:
    if name not in p:
        return None
    try:
        if not _RFC3339.fullmatch(p[name]):
            raise ValueError(p[name])
        moment = parse_rfc3339(p[name])
    except (ValueError, OverflowError):
        raise InvalidParams(f"params.{name}: {p[name]!r} is not an RFC 3339 timestamp with "
                            "an offset (e.g. 2026-12-02T13:00:00Z)") from None
    if not _EARLIEST <= moment < _LATEST:
        raise InvalidParams(f"params.{name}: {p[name]!r} is out of range (1970 to 8999)")
    return moment


# -- history entries as answered ---------------------------------------------------------
# ``schedule-runs.json`` is the operator's file too: a hand edit may put a number where a
# time belongs or text where a duration does. What the methods answer holds each field
# the format names with its documented type (a field of the wrong type is ``null``; the
# file itself is never changed here), so a client, the CLI or the console never meets a
# value its type does not allow. Fields the format does not name are answered as they are.

def _text(value: Any) -> bool:
    return isinstance(value, str)


def _number(value: Any) -> bool:  # (finite, and a duration a timedelta can hold)
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and abs(value) <= 1e15


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _texts(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _object(value: Any) -> bool:
    return isinstance(value, dict)


#: What each named field of a turn may hold (``null`` is always allowed).
TURN_FIELDS: dict[str, Callable[[Any], bool]] = {
    "index": _whole, "kind": _text, "message": _text, "workshop_mode": _text,
    "status": _text, "started_at": _text, "completed_at": _text, "duration_ms": _number,
    "log_path": _text, "cost_cents": _number, "error": _text, "exit_code": _whole,
    "output": _text, "adopted_at": _text}

#: What each named field of an entry may hold (``turns``: a list of turn objects).
ENTRY_FIELDS: dict[str, Callable[[Any], bool]] = {
    "id": _text, "schedule_id": _text, "product": _text, "user_id": _text,
    "run_folder": _text, "session_id": _text, "status": _text, "error": _text,
    "duration_ms": _number, "group_ids": _texts, "started_at": _text,
    "completed_at": _text, "trigger_source": _text, "intended_at": _text,
    "late_s": _number, "fire_times": _texts, "notified": _object, "cost_cents": _number,
    "first_message": _whole}


def _fields(item: dict[str, Any], kinds: dict[str, Callable[[Any], bool]]) -> dict[str, Any]:
    return {key: value if value is None or key not in kinds or kinds[key](value) else None
            for key, value in item.items()}


def shaped(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with each named field of the wrong type as ``None``; its turns likewise
    (a turn that is not an object is left out; ``turns`` that is not a list is ``None``)."""
    shown = _fields(entry, ENTRY_FIELDS)
    if "turns" in entry:
        turns = entry["turns"]
        shown["turns"] = [_fields(turn, TURN_FIELDS) for turn in turns
                          if isinstance(turn, dict)] if isinstance(turns, list) else None
    return shown
