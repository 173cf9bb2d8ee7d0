"""``kandevd jobs ...``: friendly wrappers over the ``scheduler.jobs.*`` methods.

Tables and aligned fields by default, the raw result with ``--json``. Errors
keep ``invoke()``'s behaviour (the JSON-RPC error on stderr, exit 1; exit 69
when no daemon listens).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from kandevd.cli.common import client_options, echo_json, invoke
from kandevd.cli.format import (
    NONE,
    duration,
    fields,
    json_option,
    one_line,
    relative,
    shown,
    table,
    when,
)
from kandevd.timeutil import parse_rfc3339, utc_now

ERROR_WIDTH = 60


def print_job(job: dict[str, Any]) -> None:
    """Every JOB field, with the instants also shown in the schedule's zone."""
    tz = job.get("timezone")
    extra = {"next_run_at": when(job.get("next_run_at"), tz),
             "last_run_at": when(job.get("last_run_at"), tz),
             "last_duration_ms": duration(job.get("last_duration_ms"))}
    pairs = []
    for key, value in job.items():
        if key in extra and value is not None:
            value = f"{value}  [{extra[key]}]"
        pairs.append((key, value))
    fields(pairs)


# -- options ----------------------------------------------------------------------------

def json_object(text: str | None, hint: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint=hint) from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint=hint)
    return value


SCHEDULE_OPTIONS: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
    click.option("--cron", "cron_expression", default=None,
                 help="Cron expression, 5 fields (minute hour day month weekday)."),
    click.option("--timezone", "--tz", "timezone", default=None,
                 help="IANA time zone of the cron expression (default UTC)."),
    click.option("--group", "group_ids", multiple=True,
                 help="Variable group to run with (repeatable; replaces the list)."),
    click.option("--message", "messages", multiple=True,
                 help="Message sent as a turn (repeatable; replaces the list)."),
    click.option("--name", default=None, help="Display name."),
    click.option("--description", default=None, help="Free-text description."),
    click.option("--mode", type=click.Choice(["workshop", "workflow"]), default=None,
                 help="Session mode ('workflow' is stored as 'workshop')."),
    click.option("--workshop-mode", type=click.Choice(["run", "workshop", "runner"]),
                 default=None, help="Workshop mode of the turns ('runner' means 'run')."),
    click.option("--pulse/--no-pulse", default=None, help="Send a pulse turn."),
    click.option("--overlap", "overlap_policy", type=click.Choice(["skip", "buffer_one"]),
                 default=None, help="What a fire does while the previous session runs."),
    click.option("--payload", "trigger_payload", default=None,
                 help="Trigger payload as a JSON object."),
    click.option("--enabled/--disabled", "enabled", default=None,
                 help="Whether cron fires it (a new schedule is enabled unless --disabled)."),
    click.option("--from-json", "from_json", default=None,
                 help="Schedule fields as a JSON object; the other options override it."),
]


def schedule_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(SCHEDULE_OPTIONS):
        func = option(func)
    return func


def schedule_fields(options: dict[str, Any]) -> dict[str, Any]:
    """The schedule object: ``--from-json`` first, then every option that was given."""
    schedule = json_object(options.pop("from_json"), "--from-json") or {}
    payload = json_object(options.pop("trigger_payload"), "--payload")
    if payload is not None:
        schedule["trigger_payload"] = payload
    for key in ("group_ids", "messages"):
        values = options.pop(key)
        if values:
            schedule[key] = list(values)
    schedule.update({k: v for k, v in options.items() if v is not None})
    return schedule


def show_changed(verb: str, job: dict[str, Any]) -> None:
    state = "enabled" if job.get("enabled") else "disabled"
    click.echo(f"{verb} {job['id']} ({state}, {job.get('cron_expression')} "
               f"{job.get('timezone')})")
    if job.get("enabled"):
        click.echo(f"next run {when(job.get('next_run_at'), job.get('timezone'))}")
    if job.get("cron_ineligible_reason"):
        click.echo(f"note: cron will not fire it now: {job['cron_ineligible_reason']}")


# -- kandevd jobs -----------------------------------------------------------------------

@click.group()
def jobs() -> None:
    """Manage the scheduled jobs of the workflow root (workflow.json schedules).

    A job id is `workflow:<workflow>:<schedule_id>`; a bare schedule id works
    when it is unique. Every command takes --json for the raw result.
    """


@jobs.command("list")
@click.option("--enabled/--disabled", "enabled", default=None,
              help="Only enabled (or only disabled) jobs.")
@click.option("--entity-type", type=click.Choice(["workflow", "product"]), default=None,
              help="Only jobs of this kind.")
@click.option("--user", "user_id", default=None, help="Only this user's jobs (products).")
@click.option("--limit", type=int, default=50, show_default=True, help="Page size (max 500).")
@click.option("--offset", type=int, default=0, show_default=True, help="Rows to skip.")
@json_option
@client_options
def list_jobs(enabled: bool | None, entity_type: str | None, user_id: str | None, limit: int,
              offset: int, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """List jobs with their next run (in the schedule's zone) and last status."""
    params = {k: v for k, v in {"enabled": enabled, "entity_type": entity_type,
                                "user_id": user_id, "limit": limit,
                                "offset": offset}.items() if v is not None}
    result = invoke(home, socket_path, "scheduler.jobs.list", params)
    if as_json:
        echo_json(result)
        return
    now = utc_now()
    rows = [(job["id"], job.get("user_id") or NONE, shown(job.get("enabled")),
             job.get("cron_expression") or (f"every {job['cadence_hours']}h"
                                            if job.get("cadence_hours") else NONE),
             job.get("timezone") or NONE,
             when(job.get("next_run_at"), job.get("timezone"), now=now),
             job.get("last_status") or NONE, shown(job.get("running")))
            for job in result["items"]]
    table(("ID", "USER", "ENABLED", "CRON", "TZ", "NEXT RUN", "LAST STATUS", "RUNNING"), rows)
    click.echo(f"{len(result['items'])} of {result['total']} job(s)")


@jobs.command("get")
@click.argument("job_id")
@click.option("--user", "user_id", default=None, help="User of a product job.")
@json_option
@client_options
def get_job(job_id: str, user_id: str | None, as_json: bool, home: str | None,
            socket_path: str | None) -> None:
    """Show one job: its definition and runtime state."""
    params = {"id": job_id, **({"user_id": user_id} if user_id else {})}
    job = invoke(home, socket_path, "scheduler.jobs.get", params)
    echo_json(job) if as_json else print_job(job)


@jobs.command("create")
@click.argument("workflow")
@click.option("--id", "schedule_id", default=None,
              help="Schedule id, unique in the workflow (required unless in --from-json).")
@schedule_options
@json_option
@client_options
def create_job(workflow: str, schedule_id: str | None, as_json: bool, home: str | None,
               socket_path: str | None, **options: Any) -> None:
    """Add a schedule to WORKFLOW's workflow.json (its other keys are kept).

    Either give --id and --cron (plus any other option), or the whole schedule
    with --from-json '{"id": ..., "cron_expression": ..., "group_ids": [...]}'.
    """
    schedule = schedule_fields(options)
    if schedule_id is not None:
        schedule["id"] = schedule_id
    missing = [o for o, k in (("--id", "id"), ("--cron", "cron_expression"))
               if k not in schedule]
    if missing:
        raise click.UsageError(f"missing {' and '.join(missing)} (or give them in --from-json)")
    job = invoke(home, socket_path, "scheduler.jobs.create",
                 {"workflow": workflow, "schedule": schedule})
    echo_json(job) if as_json else show_changed("created", job)


@jobs.command("update")
@click.argument("job_id")
@schedule_options
@json_option
@client_options
def update_job(job_id: str, as_json: bool, home: str | None, socket_path: str | None,
               **options: Any) -> None:
    """Change fields of a schedule; only the options given are sent."""
    schedule = schedule_fields(options)
    if not schedule:
        raise click.UsageError("nothing to change: give at least one option")
    job = invoke(home, socket_path, "scheduler.jobs.update", {"id": job_id, "schedule": schedule})
    echo_json(job) if as_json else show_changed("updated", job)


@jobs.command("delete")
@click.argument("job_id")
@json_option
@client_options
def delete_job(job_id: str, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Remove a schedule from its workflow.json (its history file is kept)."""
    result = invoke(home, socket_path, "scheduler.jobs.delete", {"id": job_id})
    echo_json(result) if as_json else click.echo(f"deleted {result['id']}")


@jobs.command("enable")
@click.argument("job_id")
@json_option
@client_options
def enable_job(job_id: str, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Let cron fire a schedule again (sets enabled: true in workflow.json)."""
    job = invoke(home, socket_path, "scheduler.jobs.enable", {"id": job_id})
    echo_json(job) if as_json else show_changed("enabled", job)


@jobs.command("disable")
@click.argument("job_id")
@json_option
@client_options
def disable_job(job_id: str, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Stop cron from firing a schedule (sets enabled: false; trigger still works)."""
    job = invoke(home, socket_path, "scheduler.jobs.disable", {"id": job_id})
    echo_json(job) if as_json else show_changed("disabled", job)


@jobs.command("trigger")
@click.argument("job_id")
@json_option
@client_options
def trigger_job(job_id: str, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Start a session now and print its session id.

    Works while the scheduler is paused or disabled; a job already running
    answers already_running (exit 1).
    """
    result = invoke(home, socket_path, "scheduler.jobs.trigger", {"id": job_id})
    echo_json(result) if as_json else click.echo(result["session_id"])


@jobs.command("stop")
@click.argument("job_id")
@json_option
@client_options
def stop_job(job_id: str, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Stop the running session of a job and print its session id.

    A job that is not running answers not_running (exit 1).
    """
    result = invoke(home, socket_path, "scheduler.jobs.stop", {"id": job_id})
    echo_json(result) if as_json else click.echo(result["session_id"])


@jobs.command("runs")
@click.argument("job_id")
@click.option("--user", "user_id", default=None, help="User of a product job.")
@click.option("--limit", type=int, default=50, show_default=True, help="Page size (max 500).")
@click.option("--offset", type=int, default=0, show_default=True, help="Entries to skip.")
@json_option
@client_options
def job_runs(job_id: str, user_id: str | None, limit: int, offset: int, as_json: bool,
             home: str | None, socket_path: str | None) -> None:
    """Show a job's run history, newest first."""
    params: dict[str, Any] = {"id": job_id, "limit": limit, "offset": offset}
    if user_id:
        params["user_id"] = user_id
    result = invoke(home, socket_path, "scheduler.jobs.runs", params)
    if as_json:
        echo_json(result)
        return
    now = utc_now()
    rows = [(when(e.get("started_at"), "UTC", now=now), e.get("trigger_source") or NONE,
             e.get("status") or NONE, duration(e.get("duration_ms")),
             e.get("session_id") or NONE,
             one_line(e["error"], ERROR_WIDTH) if e.get("error") else NONE)
            for e in result["items"]]
    table(("STARTED", "TRIGGER", "STATUS", "DURATION", "SESSION", "ERROR"), rows)
    click.echo(f"{len(result['items'])} of {result['total']} run(s)")


@jobs.command("next")
@click.argument("job_id", required=False)
@click.option("--cron", "cron_expression", default=None,
              help="Dry run: a cron expression instead of a job id.")
@click.option("--timezone", "--tz", "timezone", default=None,
              help="Time zone of --cron (default UTC).")
@click.option("--count", type=click.IntRange(1, 100), default=5, show_default=True,
              help="How many fire times.")
@click.option("--after", default=None,
              help="Start after this RFC 3339 instant (default now).")
@json_option
@client_options
def next_times(job_id: str | None, cron_expression: str | None, timezone: str | None,
               count: int, after: str | None, as_json: bool, home: str | None,
               socket_path: str | None) -> None:
    """Print the next fire times of a job, or of --cron EXPR, in UTC and local time."""
    if (job_id is None) == (cron_expression is None):
        raise click.UsageError("give either a JOB_ID or --cron EXPR (not both)")
    if timezone is not None and cron_expression is None:
        raise click.UsageError("--timezone goes with --cron (a job has its own zone)")
    params: dict[str, Any] = {"count": count}
    if job_id is not None:
        params["id"] = job_id
    else:
        params["schedule"] = {"cron_expression": cron_expression,
                              **({"timezone": timezone} if timezone else {})}
    if after is not None:
        params["after"] = after
    result = invoke(home, socket_path, "scheduler.jobs.next", params)
    if as_json:
        echo_json(result)
        return
    zone_name = result.get("timezone") or timezone or "UTC"
    now = utc_now()
    rows = []
    for item in result["times"]:
        try:
            moment = parse_rfc3339(item["utc"])
        except ValueError:
            rows.append((item["utc"], item["local"], NONE))
            continue
        rows.append((item["utc"], item["local"], relative(moment, now)))
    if result.get("cron_expression"):
        click.echo(f"cron {result['cron_expression']!r} in {zone_name}")
    table(("UTC", f"LOCAL ({zone_name})", "FROM NOW"), rows)
