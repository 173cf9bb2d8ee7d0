"""``/schedules/<job id>``: one job (its definition, next fires, history, actions), and one
of its sessions drilled into down to each turn's log.

Actions are the ``scheduler.jobs.*`` control methods: trigger, stop (the page
waits a moment for the session to end, then says "stopping" until it has),
enable, disable, delete (workflow schedules: product schedules are the
product's file's, the method refuses them), and backfill (a dry run first,
the real one on confirmation).
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from kandevd.control.protocol import InvalidParams, RpcError
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now
from kandevd.web.context import Console, parse_time, set_flash
from kandevd.web.http import Request, Response, redirect
from kandevd.web.logs import readable_log, turn_stdout_path, with_output
from kandevd.web.views.schedules import _int, job_params, job_url

#: How long a stop waits for the session to end before the page says "stopping".
STOP_WAIT_S = 3.0
#: States in which a job's expression has times but none of them fires.
NOT_FIRING = ("disabled", "paused", "blocked", "invalid", "ended")
DEFINITION_KEYS = ("id", "entity_type", "workflow", "workflow_label", "product", "user_id",
                   "schedule_id", "name", "description", "cron_expression", "timezone",
                   "cadence_hours", "preferred_hour", "quiet_minutes", "enabled", "group_ids",
                   "mode", "messages", "workshop_mode", "trigger_payload", "overlap_policy",
                   "pulse", "notify", "pause_after_failures", "catchup_window_s", "timeout_s",
                   "jitter_s", "start_at", "end_at")


def _context(console: Console, params: dict[str, Any], offset: int) -> dict[str, Any]:
    """What the job's page shows (also under a backfill's dry run)."""
    found = console.call("scheduler.jobs.get", params)
    history = console.call("scheduler.jobs.runs", {**params, "limit": 20, "offset": offset})
    upcoming: list[dict[str, Any]] = []
    if found.get("cron_expression") or found.get("entity_type") == "workflow":
        try:
            upcoming = console.call("scheduler.jobs.next", {**params, "count": 10})["times"]
        except RpcError:  # an invalid job has none; its state says why
            upcoming = []
    definition = {k: found.get(k) for k in DEFINITION_KEYS
                  if found.get(k) not in (None, "", [], {})}
    running = next((e for e in history["items"] if e.get("status") == "running"), None)
    return {"title": found.get("name") or found["id"], "nav": "schedules", "job": found,
            "definition": definition, "upcoming": upcoming, "history": history,
            "offset": offset, "job_url": job_url, "preview": None,
            "not_firing": found.get("state") in NOT_FIRING, "running_entry": running}


def job(console: Console, request: Request, job: str) -> Response:
    context = _context(console, job_params(job, request), _int(request.query.get("offset")))
    context["stopping"] = bool(request.query.get("stopping")) and context["job"]["running"]
    return console.render("job.html", request, **context)


def act(console: Console, request: Request, job: str, action: str) -> Response:
    params = job_params(job, request)
    result = console.call(f"scheduler.jobs.{action}", params)
    found = {"id": job, "user_id": params.get("user_id")}
    back = _back_to(request, job_url(found))
    if action == "stop":
        session = result.get("session_id")
        if _ended_soon(console, params):
            return set_flash(console, redirect(back), "ok",
                             f"Stopped {job}: session {session} ended")
        back += ("&" if "?" in back else "?") + "stopping=1"
        return set_flash(console, redirect(back), "ok",
                         f"Stop requested for {job}: session {session} is ending")
    message = {
        "trigger": f"Triggered {job}: session {result.get('session_id')}",
        "enable": f"Enabled {job}",
        "disable": f"Disabled {job}",
    }[action]
    return set_flash(console, redirect(back), "ok", message)


def _back_to(request: Request, default: str) -> str:
    """The page an action came from, when it is this job's own (its page or a run's)."""
    back = request.form.get("back", "")
    base = default.split("?", 1)[0]
    if back == base or back.startswith(base + "?") or back.startswith(base + "/runs/"):
        return back if "//" not in back else default
    return default


def _ended_soon(console: Console, params: dict[str, Any]) -> bool:
    """Has the stopped session ended within :data:`STOP_WAIT_S`? (Most agents exit at
    once; one that ignores the signal is killed after the runtime's stop grace.)"""
    deadline = time.monotonic() + STOP_WAIT_S
    while True:
        try:
            if not console.call("scheduler.jobs.get", params).get("running"):
                return True
        except RpcError:
            return True
        if time.monotonic() >= deadline or console.stopping.wait(0.1):
            return False


def delete(console: Console, request: Request, job: str) -> Response:
    """``scheduler.jobs.delete``: the schedule leaves its ``workflow.json`` (its history
    stays in the workflow's folder). Product jobs: refused by the method."""
    params = job_params(job, request)
    found = console.call("scheduler.jobs.get", params)
    console.call("scheduler.jobs.delete", params)
    where = f" from {found['workflow']}/workflow.json" if found.get("workflow") else ""
    return set_flash(console, redirect("/schedules"), "ok", f"Deleted {found['id']}{where}")


_LOCAL = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?")


def moment(value: str, zone: str, field: str) -> str:
    """A date and time from the form's picker (``YYYY-MM-DDTHH:MM``, in ``zone``: the
    browser's, UTC without script) as RFC 3339 UTC; an RFC 3339 time as typed (the
    method checks it). InvalidParams naming ``field`` (``params.to``: shown as the
    field's label) for anything else, a date that does not exist (February 30th) too."""
    value = value.strip()
    if not _LOCAL.fullmatch(value):
        try:
            parse_rfc3339(value)
        except ValueError:
            raise InvalidParams(f"params.{field}: {value!r} is not a date and time "
                                "(2026-12-01T09:00)") from None
        return value
    try:
        where = ZoneInfo(zone or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidParams(f"unknown time zone {zone!r} for the backfill's range") from None
    try:
        return rfc3339(datetime.fromisoformat(value).replace(tzinfo=where).astimezone(UTC))
    except (ValueError, OverflowError) as exc:
        raise InvalidParams(f"params.{field}: {value!r} is not a date and time that "
                            f"exists ({exc})") from None


def _in_the_future(moment_utc: str) -> bool:
    """Does the range end after now? A dry run may look ahead; a backfill may not."""
    try:
        return parse_rfc3339(moment_utc) > utc_now()
    except ValueError:
        return False


def backfill(console: Console, request: Request, job: str) -> Response:
    """A dry run first (the page lists the fire times); the real one on confirmation."""
    params = job_params(job, request)
    form = request.form
    zone = form.get("zone", "").strip() or "UTC"
    body = {**params, "from": moment(form.get("from", ""), zone, "from"),
            "to": moment(form.get("to", ""), zone, "to"), "dry_run": form.get("confirm") != "yes"}
    result = console.call("scheduler.jobs.backfill", body)
    if body["dry_run"]:
        context = _context(console, params, 0)
        context["preview"] = {"from": form.get("from", ""), "to": form.get("to", ""),
                              "zone": zone, "from_utc": body["from"], "to_utc": body["to"],
                              "result": result, "future": _in_the_future(body["to"])}
        return console.render("job.html", request, stopping=False, **context)
    count = len(result.get("fire_times") or result.get("times") or [])
    back = job_url({"id": job, "user_id": params.get("user_id")})
    return set_flash(console, redirect(back), "ok",
                     f"Backfill of {job} started: {count} fire time(s), one after another")


def entry(console: Console, request: Request, job: str, entry: str) -> Response:
    params = job_params(job, request)
    found = console.call("scheduler.jobs.get", params)
    record = _find_entry(console, params, entry)
    if record is None:
        return console.render("error.html", request, http_status=404, title="Not found",
                              message=f"Job {job} has no run {entry}.")
    now = datetime.now(UTC)
    turns = [t for t in record.get("turns") or [] if isinstance(t, dict)]
    shown = []
    previous_end = parse_time(record.get("started_at"))
    for number, turn in enumerate(turns, start=1):
        started = parse_time(turn.get("started_at")) or previous_end
        running = turn.get("status") == "running"
        log = readable_log(console, turn.get("log_path"))
        if running:  # its stdout joins the log when it ends
            log = with_output(log, turn_stdout_path(console, record.get("id"),
                                                    turn.get("index", number - 1)))
        shown.append({**turn, "number": number, "log_text": log,
                      "since": rfc3339(started) if running and started else None,
                      "running_s": (now - started).total_seconds()
                      if running and started else None})
        if started is not None and turn.get("duration_ms") is not None:
            previous_end = started + timedelta(milliseconds=turn["duration_ms"])
    began = parse_time(record.get("started_at"))
    running = record.get("status") == "running"
    return console.render(
        "entry.html", request, title=f"Run {entry[:8]} of {job}", nav="schedules", job=found,
        entry=record, turns=shown, job_url=job_url, running=running,
        stopping=running and bool(request.query.get("stopping")),
        elapsed_s=(now - began).total_seconds() if running and began else None,
        here=job_url(found, "/runs/" + str(record.get("id"))))


def _find_entry(console: Console, params: dict[str, Any], entry_id: str
                ) -> dict[str, Any] | None:
    offset = 0
    while True:
        page = console.call("scheduler.jobs.runs", {**params, "limit": 500, "offset": offset})
        for item in page["items"]:
            if item.get("id") == entry_id or item.get("session_id") == entry_id:
                return item
        offset += len(page["items"])
        if not page["items"] or offset >= page["total"]:
            return None
