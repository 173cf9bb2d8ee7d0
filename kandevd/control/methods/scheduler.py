"""``scheduler.*``: the file-backed workflow scheduler over the socket."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from kandevd.control.protocol import (
    AlreadyRunning,
    Conflict,
    InvalidParams,
    NotFound,
    NotRunning,
    Refused,
    ShuttingDown,
)
from kandevd.control.registry import Registry, object_schema, paging_properties
from kandevd.control.services import Services
from kandevd.cron import CronError, next_fire_times, parse_cron, parse_timezone
from kandevd.products.jobs import PRODUCT_PREFIX, ProductJob
from kandevd.products.schedule import ScheduleState, decide
from kandevd.scheduler import runner as run
from kandevd.scheduler.registry import AmbiguousJob, AnyJob, Job, JobNotFound
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now
from kandevd.workflows import history as hist
from kandevd.workflows import manifest
from kandevd.workflows.manifest import ManifestError, ManifestUnusable, check_workflow_name

ID = {"type": "string", "minLength": 1, "maxLength": 500}
TEXT = {"type": "string", "maxLength": 10000}

SCHEDULE_FIELDS: dict[str, Any] = {
    "id": {"type": "string", "minLength": 1, "maxLength": 200},
    "name": {"type": "string", "maxLength": 500},
    "description": TEXT,
    "cron_expression": {"type": "string", "minLength": 1, "maxLength": 500},
    "timezone": {"type": "string", "minLength": 1, "maxLength": 100},
    "enabled": {"type": "boolean"},
    "trigger_payload": {"type": "object"},
    "group_ids": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "mode": {"enum": ["workshop", "workflow"]},
    "messages": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "workshop_mode": {"enum": ["run", "workshop", "runner"]},
    "pulse": {"type": "boolean"},
    "overlap_policy": {"enum": ["skip", "buffer_one"]},
}
WORKFLOW_NAME = {"type": "string", "minLength": 1, "maxLength": 200}
USER = {"type": "string", "minLength": 1, "maxLength": 200}
JOB_REF = object_schema({"id": ID, "user_id": USER}, ("id",))
MAX_NEXT = 100


def register(registry: Registry, services: Services) -> None:
    loop = services.cron
    jobs = loop.registry
    runner = loop.runner

    def resolve(job_id: str, user_id: str | None = None) -> AnyJob:
        if job_id.startswith(PRODUCT_PREFIX):
            try:
                product_job = jobs.products.find(job_id, user_id)
            except LookupError as exc:
                raise InvalidParams(f"params.user_id: {exc}") from None
            if product_job is None:
                who = f" for user {user_id!r}" if user_id else ""
                raise NotFound(f"no job {job_id!r}{who}")
            return product_job
        try:
            return jobs.resolve(job_id)
        except JobNotFound as exc:
            raise NotFound(str(exc)) from None
        except AmbiguousJob as exc:
            raise InvalidParams(str(exc)) from None

    def workflow_job(p: dict[str, Any], verb: str) -> Job:
        if p["id"].startswith(PRODUCT_PREFIX):
            raise Refused(f"{p['id']} is declared by its product's product.yaml: a product "
                          f"job cannot be {verb} (switch it off for a user with "
                          "scheduler.jobs.disable)")
        job = resolve(p["id"])
        assert isinstance(job, Job)
        return job

    def paused() -> bool:
        return jobs.pause.get()["globally_paused"]

    def job_dict(job: AnyJob, is_paused: bool | None = None) -> dict[str, Any]:
        is_paused = paused() if is_paused is None else is_paused
        if isinstance(job, ProductJob):
            return jobs.products.as_dict(
                job, running=runner.is_running(job.key),
                ineligible=lambda j: jobs.ineligible_reason(j, is_paused))
        return jobs.as_dict(job, running=runner.is_running(job.key), paused=is_paused)

    # -- config ---------------------------------------------------------------------
    def config_get(_p: dict[str, Any]) -> dict[str, Any]:
        return {**jobs.pause.get(), **jobs.switches.as_dict()}

    def config_put(p: dict[str, Any]) -> dict[str, Any]:
        jobs.pause.put(p["globally_paused"], p.get("paused_by"), utc_now())
        return config_get({})

    # -- reading --------------------------------------------------------------------
    def list_(p: dict[str, Any]) -> dict[str, Any]:
        limit, offset = p.get("limit", 50), p.get("offset", 0)
        chosen: list[AnyJob] = []
        if p.get("entity_type", "workflow") == "workflow":
            chosen += [j for j in jobs.jobs()
                       if "enabled" not in p or j.schedule.enabled == p["enabled"]]
        if p.get("entity_type", "product") == "product":
            chosen += [j for j in jobs.products.jobs(p.get("user_id"))
                       if "enabled" not in p or j.enabled == p["enabled"]]
        is_paused = paused()
        return {"items": [job_dict(j, is_paused) for j in chosen[offset:offset + limit]],
                "total": len(chosen), "limit": limit, "offset": offset}

    def get(p: dict[str, Any]) -> dict[str, Any]:
        return job_dict(resolve(p["id"], p.get("user_id")))

    def runs(p: dict[str, Any]) -> dict[str, Any]:
        job = resolve(p["id"], p.get("user_id"))
        if isinstance(job, ProductJob):
            entries = jobs.products.history(job).entries()
        else:
            entries = jobs.history(job.workflow).entries()
        return hist.page(entries, schedule_id=job.schedule.id, limit=p.get("limit", 50),
                         offset=p.get("offset", 0))

    def next_(p: dict[str, Any]) -> dict[str, Any]:
        if ("id" in p) == ("schedule" in p):
            raise InvalidParams("params: give either 'id' or 'schedule', not both or neither")
        if "id" in p:
            job = resolve(p["id"], p.get("user_id"))
            if isinstance(job, ProductJob) and job.schedule.cron_expression is None:
                return cadence_times(job, p)
            schedule = job.schedule
            expression, zone_name = schedule.cron_expression, schedule.timezone
        else:
            expression = p["schedule"]["cron_expression"]
            zone_name = p["schedule"].get("timezone", "UTC")
        try:
            trigger = parse_cron(expression, zone_name)
            zone = parse_timezone(zone_name)
        except CronError as exc:
            raise InvalidParams(f"params.schedule.{exc}") from None
        after = _time_param(p, "after") or utc_now()
        times = next_fire_times(trigger, after, p.get("count", 5))
        return {"times": [{"utc": rfc3339(t), "local": t.astimezone(zone).isoformat()}
                          for t in times],
                "timezone": zone_name, "cron_expression": expression}

    # -- changing the manifest ------------------------------------------------------
    def edit(name: str, change: Any) -> manifest.Workflow:
        try:
            folder = manifest.workflow_folder(jobs.root, name)
        except ManifestError as exc:
            raise InvalidParams(f"params.workflow: {exc}") from None
        if not (folder / manifest.MANIFEST).is_file():
            raise NotFound(f"no workflow {name!r}: {folder / manifest.MANIFEST} does not exist")
        try:
            workflow = manifest.edit_schedules(folder, change)
        except ManifestUnusable as exc:
            raise Conflict(str(exc)) from None
        except ManifestError as exc:
            raise InvalidParams(f"workflow {name!r}: {exc}") from None
        jobs.reload_workflow(name, utc_now())
        loop.wake()
        return workflow

    def create(p: dict[str, Any]) -> dict[str, Any]:
        schedule = p["schedule"]

        def add(schedules: list[Any]) -> list[Any]:
            if manifest.find_schedule(schedules, schedule["id"]) >= 0:
                raise _Duplicate(f"workflow {p['workflow']!r} already has a schedule "
                                 f"{schedule['id']!r}")
            return [*schedules, schedule]
        try:
            workflow = edit(p["workflow"], add)
        except _Duplicate as exc:
            raise Conflict(str(exc)) from None
        return job_dict(resolve(f"workflow:{workflow.name}:{schedule['id']}"))

    def change_schedule(job: Job, fields: dict[str, Any]) -> dict[str, Any]:
        schedule_id = job.schedule.id

        def merge(schedules: list[Any]) -> list[Any]:
            index = manifest.find_schedule(schedules, schedule_id)
            if index < 0:
                raise _Gone(f"schedule {schedule_id!r} is no longer in the manifest")
            schedules[index] = {**schedules[index], **fields}
            return schedules
        try:
            edit(job.workflow.name, merge)
        except _Gone as exc:
            raise NotFound(str(exc)) from None
        return job_dict(resolve(job.id))

    def update(p: dict[str, Any]) -> dict[str, Any]:
        job = workflow_job(p, "updated")
        fields = dict(p["schedule"])
        if fields.get("id", job.schedule.id) != job.schedule.id:
            raise InvalidParams(f"params.schedule.id: the id of a schedule cannot change "
                                f"({job.schedule.id!r}); create a new schedule instead")
        return change_schedule(job, fields)

    def delete(p: dict[str, Any]) -> dict[str, Any]:
        job = workflow_job(p, "deleted")

        def remove(schedules: list[Any]) -> list[Any]:
            return [s for s in schedules if not (isinstance(s, dict)
                                                 and s.get("id") == job.schedule.id)]
        edit(job.workflow.name, remove)
        return {"id": job.id, "deleted": True}

    def set_enabled(p: dict[str, Any], enabled: bool) -> dict[str, Any]:
        job = resolve(p["id"], p.get("user_id"))
        if isinstance(job, ProductJob):  # the user's override; product.yaml is not touched
            jobs.products.set_enabled(job, enabled, utc_now())
            loop.wake()
            return job_dict(job)
        return change_schedule(job, {"enabled": enabled})

    def enable(p: dict[str, Any]) -> dict[str, Any]:
        return set_enabled(p, True)

    def disable(p: dict[str, Any]) -> dict[str, Any]:
        return set_enabled(p, False)

    def cadence_times(job: ProductJob, p: dict[str, Any]) -> dict[str, Any]:
        """The next slots of a cadence schedule, as if each ran on time."""
        after = _time_param(p, "after") or utc_now()
        zone = parse_timezone(job.schedule.timezone)
        state = job.state.for_decide()
        times: list[datetime] = []
        moment = after
        for _ in range(4 * p.get("count", 5) + 8):  # bounded, whatever the cadence
            if len(times) >= p.get("count", 5):
                break
            try:
                decision = decide(job.schedule, state, moment)
            except (ValueError, OverflowError):
                break
            if decision.next_at > after or (decision.due and decision.next_at >= after):
                times.append(decision.next_at)
            state = ScheduleState(last_run_at=max(decision.next_at, moment),
                                  last_status="success")
            moment = max(decision.next_at, moment)
        return {"times": [{"utc": rfc3339(t), "local": t.astimezone(zone).isoformat()}
                          for t in times],
                "timezone": job.schedule.timezone, "cron_expression": None}

    def activity(p: dict[str, Any]) -> dict[str, Any]:
        try:
            check_workflow_name(p["user_id"])
        except ManifestError as exc:
            raise InvalidParams(f"params.user_id: {str(exc).replace('workflow name', 'user id')}"
                                ) from None
        at = _time_param(p, "at") or utc_now()
        jobs.products.record_activity(p["user_id"], p["profile"], at)
        loop.wake()
        return {"user_id": p["user_id"], "profile": p["profile"], "at": rfc3339(at)}

    # -- sessions -------------------------------------------------------------------
    def trigger(p: dict[str, Any]) -> dict[str, Any]:
        job = resolve(p["id"], p.get("user_id"))
        try:
            plan = runner.start(job, "manual")
        except run.AlreadyRunning as exc:
            raise AlreadyRunning(str(exc)) from None
        except run.RunnerClosed as exc:
            raise ShuttingDown(str(exc)) from None
        return {"id": job.id, "session_id": plan.session_id, "run_id": plan.entry_id,
                "job": job_dict(job)}

    def stop(p: dict[str, Any]) -> dict[str, Any]:
        job = resolve(p["id"], p.get("user_id"))
        try:
            plan = runner.stop(job.key)
        except run.NotRunning as exc:
            raise NotRunning(str(exc)) from None
        return {"id": job.id, "session_id": plan.session_id, "run_id": plan.entry_id,
                "stopping": True}

    def reload(_p: dict[str, Any]) -> dict[str, Any]:
        result = jobs.rescan(utc_now())
        loop.wake()
        return result

    schedule_object = {"type": "object", "properties": SCHEDULE_FIELDS,
                       "additionalProperties": False}
    registry.add("scheduler.config.get", config_get)
    registry.add("scheduler.config.put", config_put, object_schema(
        {"globally_paused": {"type": "boolean"},
         "paused_by": {"type": ["string", "null"], "maxLength": 200}}, ("globally_paused",)))
    registry.add("scheduler.jobs.list", list_, object_schema({
        "entity_type": {"enum": ["workflow", "product"]}, "enabled": {"type": "boolean"},
        "user_id": USER, **paging_properties()}))
    registry.add("scheduler.jobs.get", get, JOB_REF)
    registry.add("scheduler.jobs.create", create, object_schema({
        "workflow": WORKFLOW_NAME,
        "schedule": {**schedule_object, "required": ["id", "cron_expression"]}},
        ("workflow", "schedule")))
    registry.add("scheduler.jobs.update", update, object_schema(
        {"id": ID, "schedule": schedule_object}, ("id", "schedule")))
    registry.add("scheduler.jobs.delete", delete, JOB_REF)
    registry.add("scheduler.jobs.enable", enable, JOB_REF)
    registry.add("scheduler.jobs.disable", disable, JOB_REF)
    registry.add("scheduler.jobs.trigger", trigger, JOB_REF)
    registry.add("scheduler.jobs.stop", stop, JOB_REF)
    registry.add("scheduler.jobs.runs", runs, object_schema(
        {"id": ID, "user_id": USER, **paging_properties()}, ("id",)))
    registry.add("scheduler.jobs.next", next_, object_schema({
        "id": ID,
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


class _Duplicate(Exception):
    pass


class _Gone(Exception):
    pass


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
