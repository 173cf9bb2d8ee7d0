"""``kandevd jobs ...``: friendly wrappers over the ``scheduler.jobs.*`` methods.

Tables and aligned fields by default, the raw result with ``--json``. Errors
keep ``invoke()``'s behaviour (one ``kandevd: ...`` line on stderr, the JSON-RPC
error object with ``--json``; exit 1, or 69 when no daemon listens). ``jobs next
--cron`` needs no daemon: it is computed here, as the daemon would. The commands
that change a job are in jobs_change.py, ``jobs logs`` in jobs_logs.py.
"""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

import click

from kandevd import exits
from kandevd.cli.common import client_options, echo_json, invoke, user_option
from kandevd.cli.format import (
    NONE,
    duration,
    fields,
    json_option,
    one_line,
    relative,
    table,
    when,
)
from kandevd.cli.jobs_change import COMMANDS, job_ref, timing
from kandevd.cli.jobs_logs import job_logs
from kandevd.cron import CronError, describe_times, next_fire_times, parse_cron
from kandevd.timeutil import parse_rfc3339, utc_now

ERROR_WIDTH = 60
STATE_CHOICES = ("scheduled", "running", "held", "buffered", "disabled", "paused", "blocked",
                 "invalid", "ended")


def print_job(job: dict[str, Any]) -> None:
    """Every JOB field, with the instants also shown in the schedule's zone."""
    tz = job.get("timezone")
    extra = {"next_run_at": when(job.get("next_run_at"), tz),
             "last_run_at": when(job.get("last_run_at"), tz),
             "held_until": when(job.get("held_until"), tz),
             "last_duration_ms": duration(job.get("last_duration_ms"))}
    pairs = []
    for key, value in job.items():
        if key in extra and value is not None:
            value = f"{value}  [{extra[key]}]"
        pairs.append((key, value))
    fields(pairs)


@click.group()
def jobs() -> None:
    """Scheduled jobs: the workflow.json and product.yaml schedules.

    A workflow job id is `workflow:<workflow>:<schedule_id>` (a bare schedule id
    works when it is unique); a product job id is `product:<profile>:<schedule>`,
    one per user who has the product: name the user with --user. Every command
    but logs (which prints the log itself) takes --json for the raw result.
    """


for _command in COMMANDS:
    jobs.add_command(_command)
jobs.add_command(job_logs)


@jobs.command("list")
@click.option("--enabled/--disabled", "enabled", default=None,
              help="Only enabled (or only disabled) jobs.")
@click.option("--entity-type", type=click.Choice(["workflow", "product"]), default=None,
              help="Only jobs of this kind.")
@click.option("--state", type=click.Choice(STATE_CHOICES), default=None,
              help="Only jobs in this state.")
@user_option
@click.option("--limit", type=int, default=50, show_default=True, help="Page size (max 500).")
@click.option("--offset", type=int, default=0, show_default=True, help="Rows to skip.")
@json_option
@client_options
def list_jobs(enabled: bool | None, entity_type: str | None, state: str | None,
              user_id: str | None, limit: int, offset: int, as_json: bool, home: str | None,
              socket_path: str | None) -> None:
    """List jobs: their state, next run (in the schedule's zone) and last status."""
    params = {k: v for k, v in {"enabled": enabled, "entity_type": entity_type,
                                "state": state, "user_id": user_id, "limit": limit,
                                "offset": offset}.items() if v is not None}
    result = invoke(home, socket_path, "scheduler.jobs.list", params)
    if as_json:
        echo_json(result)
        return
    now = utc_now()
    rows = [(job["id"], job.get("user_id") or NONE, job.get("state") or NONE,
             timing(job),
             job.get("timezone") or NONE,
             when(job.get("next_run_at"), job.get("timezone"), now=now),
             job.get("last_status") or NONE)
            for job in result["items"]]
    table(("ID", "USER", "STATE", "CRON", "TZ", "NEXT RUN", "LAST STATUS"), rows)
    click.echo(f"{len(result['items'])} of {result['total']} job(s)")


@jobs.command("get")
@click.argument("job_id")
@user_option
@json_option
@client_options
def get_job(job_id: str, user_id: str | None, as_json: bool, home: str | None,
            socket_path: str | None) -> None:
    """Show one job: its definition, its state and why, and its run-time counters."""
    job = invoke(home, socket_path, "scheduler.jobs.get", job_ref(job_id, user_id))
    echo_json(job) if as_json else print_job(job)


@jobs.command("runs")
@click.argument("job_id")
@user_option
@click.option("--limit", type=int, default=50, show_default=True, help="Page size (max 500).")
@click.option("--offset", type=int, default=0, show_default=True, help="Entries to skip.")
@json_option
@client_options
def job_runs(job_id: str, user_id: str | None, limit: int, offset: int, as_json: bool,
             home: str | None, socket_path: str | None) -> None:
    """Show a job's run history, newest first.

    `kandevd jobs logs JOB ENTRY` prints one entry's turns and their logs.
    """
    params: dict[str, Any] = {**job_ref(job_id, user_id), "limit": limit, "offset": offset}
    result = invoke(home, socket_path, "scheduler.jobs.runs", params)
    if as_json:
        echo_json(result)
        return
    now = utc_now()
    rows = [(e.get("id") or NONE, when(e.get("started_at"), "UTC", now=now),
             e.get("trigger_source") or NONE, e.get("status") or NONE,
             duration(e.get("duration_ms")),
             one_line(e["error"], ERROR_WIDTH) if e.get("error") else NONE)
            for e in result["items"]]
    table(("ENTRY", "STARTED", "TRIGGER", "STATUS", "DURATION", "ERROR"), rows)
    click.echo(f"{len(result['items'])} of {result['total']} run(s)")
    if result.get("history_problem"):
        click.echo(f"history: {result['history_problem']}")


@jobs.command("next")
@click.argument("job_id", required=False)
@user_option
@click.option("--cron", "cron_expression", default=None,
              help="Dry run: a cron expression instead of a job id (needs no daemon).")
@click.option("--timezone", "--tz", "timezone", default=None,
              help="Time zone of --cron (default UTC).")
@click.option("--count", type=click.IntRange(1, 100), default=5, show_default=True,
              help="How many fire times.")
@click.option("--after", default=None,
              help="Start after this RFC 3339 instant (default now).")
@json_option
@client_options
def next_times(job_id: str | None, user_id: str | None, cron_expression: str | None,
               timezone: str | None, count: int, after: str | None, as_json: bool,
               home: str | None, socket_path: str | None) -> None:
    """Print the next fire times of a job, or of --cron EXPR, in UTC and local time."""
    if (job_id is None) == (cron_expression is None):
        raise click.UsageError("give either a JOB_ID or --cron EXPR (not both)")
    if timezone is not None and cron_expression is None:
        raise click.UsageError("--timezone goes with --cron (a job has its own zone)")
    if after is not None:
        _after_time(after)  # (a malformed time is a usage error, daemon or not)
    if cron_expression is not None:
        result = _dry_run(cron_expression, timezone or "UTC", count, after)
    else:
        params: dict[str, Any] = {**job_ref(job_id or "", user_id), "count": count}
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
    if not rows:
        click.echo("no fire time ahead (past the schedule's end_at, or an expression that "
                   "never fires again)")
        return
    table(("UTC", f"LOCAL ({zone_name})", "FROM NOW"), rows)


def _after_time(after: str) -> datetime:
    try:
        return parse_rfc3339(after)
    except (ValueError, OverflowError):
        raise click.BadParameter(f"{after!r} is not an RFC 3339 timestamp with an offset "
                                 "(e.g. 2026-12-02T13:00:00Z)", param_hint="--after") from None


def _dry_run(expression: str, zone_name: str, count: int, after: str | None
             ) -> dict[str, Any]:
    """What ``scheduler.jobs.next {schedule}`` answers, computed here without a daemon."""
    try:
        trigger = parse_cron(expression, zone_name)
    except CronError as exc:
        click.echo(f"kandevd: {exc}", err=True)
        sys.exit(exits.ERROR)
    start = _after_time(after) if after is not None else utc_now()
    times = next_fire_times(trigger, start, count)
    return {"times": describe_times(times, trigger.timezone), "timezone": zone_name,
            "cron_expression": expression}
