"""``kandevd jobs`` commands that change a job: create, update, delete, enable, disable,
trigger, stop, backfill (each over its ``scheduler.jobs.*`` method)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from kandevd.cli.common import client_options, echo_json, invoke, user_option
from kandevd.cli.format import NONE, json_option, when
from kandevd.formats import jsonstrict
from kandevd.timeutil import parse_rfc3339

# -- schedule options ----------------------------------------------------------------------------

def json_object(text: str | None, hint: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = jsonstrict.loads(text)
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
    click.option("--overlap", "overlap_policy",
                 type=click.Choice(["skip", "buffer_one", "replace"]),
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
    onoff = "enabled" if job.get("enabled") else "disabled"
    who = f" for {job['user_id']}" if job.get("user_id") else ""
    click.echo(f"{verb} {job['id']}{who} ({onoff}, {timing(job)} {job.get('timezone')})")
    click.echo(f"state {job.get('state')}: {job.get('state_reason')}")
    if job.get("next_run_at"):
        click.echo(f"next run {when(job.get('next_run_at'), job.get('timezone'))}")


def timing(job: dict[str, Any]) -> str:
    """When a job fires, as the lists show it: its cron, or a product's cadence."""
    if job.get("cron_expression"):
        return str(job["cron_expression"])
    return f"every {job['cadence_hours']}h" if job.get("cadence_hours") else NONE


def job_ref(job_id: str, user_id: str | None) -> dict[str, Any]:
    return {"id": job_id, **({"user_id": user_id} if user_id else {})}


@click.command("create")
@click.argument("workflow")
@click.option("--id", "schedule_id", default=None,
              help="Schedule id, unique in the workflow: letters, digits, '.', '_' and '-' "
              "(required unless in --from-json).")
@schedule_options
@user_option
@json_option
@client_options
def create_job(workflow: str, schedule_id: str | None, user_id: str | None, as_json: bool,
               home: str | None, socket_path: str | None, **options: Any) -> None:
    """Add a schedule to WORKFLOW's workflow.json (its other keys are kept).

    Either give --id and --cron (plus any other option), or the whole schedule
    with --from-json '{"id": ..., "cron_expression": ..., "group_ids": [...]}'.
    Product schedules are declared in their product.yaml, so --user is refused.
    """
    if user_id is not None:
        raise click.UsageError("--user: create adds a workflow schedule; a product's "
                               "schedules are declared in its product.yaml")
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


@click.command("update")
@click.argument("job_id")
@schedule_options
@user_option
@json_option
@client_options
def update_job(job_id: str, user_id: str | None, as_json: bool, home: str | None,
               socket_path: str | None, **options: Any) -> None:
    """Change fields of a schedule; only the options given are sent."""
    schedule = schedule_fields(options)
    if not schedule:
        raise click.UsageError("nothing to change: give at least one option")
    job = invoke(home, socket_path, "scheduler.jobs.update",
                 {**job_ref(job_id, user_id), "schedule": schedule})
    echo_json(job) if as_json else show_changed("updated", job)


@click.command("delete")
@click.argument("job_id")
@user_option
@json_option
@client_options
def delete_job(job_id: str, user_id: str | None, as_json: bool, home: str | None,
               socket_path: str | None) -> None:
    """Remove a schedule from its workflow.json (its history file is kept)."""
    result = invoke(home, socket_path, "scheduler.jobs.delete", job_ref(job_id, user_id))
    echo_json(result) if as_json else click.echo(f"deleted {result['id']}")


@click.command("enable")
@click.argument("job_id")
@user_option
@json_option
@client_options
def enable_job(job_id: str, user_id: str | None, as_json: bool, home: str | None,
               socket_path: str | None) -> None:
    """Let cron fire a job again (workflow.json's enabled: true; a product job: the
    user's override)."""
    job = invoke(home, socket_path, "scheduler.jobs.enable", job_ref(job_id, user_id))
    echo_json(job) if as_json else show_changed("enabled", job)


@click.command("disable")
@click.argument("job_id")
@user_option
@json_option
@client_options
def disable_job(job_id: str, user_id: str | None, as_json: bool, home: str | None,
                socket_path: str | None) -> None:
    """Stop cron from firing a job (trigger still works)."""
    job = invoke(home, socket_path, "scheduler.jobs.disable", job_ref(job_id, user_id))
    echo_json(job) if as_json else show_changed("disabled", job)


@click.command("trigger")
@click.argument("job_id")
@user_option
@json_option
@client_options
def trigger_job(job_id: str, user_id: str | None, as_json: bool, home: str | None,
                socket_path: str | None) -> None:
    """Start a session now and print its session id.

    Works while the scheduler is paused or disabled; a job already running
    answers already_running (exit 1).
    """
    result = invoke(home, socket_path, "scheduler.jobs.trigger", job_ref(job_id, user_id))
    echo_json(result) if as_json else click.echo(result["session_id"])


@click.command("stop")
@click.argument("job_id")
@user_option
@json_option
@client_options
def stop_job(job_id: str, user_id: str | None, as_json: bool, home: str | None,
             socket_path: str | None) -> None:
    """Stop the running session of a job and print its session id.

    A job that is not running answers not_running (exit 1).
    """
    result = invoke(home, socket_path, "scheduler.jobs.stop", job_ref(job_id, user_id))
    if as_json:
        echo_json(result)
        return
    if result.get("session_id"):
        click.echo(result["session_id"])
    if result.get("backfill"):
        click.echo("backfill stopped", err=True)


@click.command("backfill")
@click.argument("job_id")
@click.option("--from", "start", required=True, help="First moment (RFC 3339 with offset).")
@click.option("--to", "end", required=True, help="Last moment (RFC 3339 with offset).")
@click.option("--dry-run", is_flag=True, help="List the fire times; run nothing.")
@user_option
@json_option
@client_options
def backfill_job(job_id: str, start: str, end: str, dry_run: bool, user_id: str | None,
                 as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Run a job once per fire time of a past range, one after another.

    Each run is recorded with trigger_source backfill and the fire time it
    stands for (intended_at); at most 1000 fire times. `kandevd jobs stop JOB`
    stops a backfill.
    """
    for text, option in ((start, "--from"), (end, "--to")):
        try:
            parse_rfc3339(text)
        except (ValueError, OverflowError):
            raise click.BadParameter(f"{text!r} is not an RFC 3339 time with an offset "
                                     "(e.g. 2026-03-28T00:00:00Z)", param_hint=option
                                     ) from None
    result = invoke(home, socket_path, "scheduler.jobs.backfill",
                    {**job_ref(job_id, user_id), "from": start, "to": end,
                     "dry_run": dry_run})
    if as_json:
        echo_json(result)
        return
    for item in result["times"]:
        click.echo(f"{item['utc']}  {item['local']}")
    what = "started" if result["started"] else "dry run: nothing run" if dry_run \
        else "nothing to run"
    click.echo(f"{len(result['times'])} fire time(s); {what}")


COMMANDS = (create_job, update_job, delete_job, enable_job, disable_job, trigger_job, stop_job,
            backfill_job)
