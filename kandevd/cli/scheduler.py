"""``kandevd scheduler ...`` (pause, resume, reload, status) and the workflow half of
``kandevd validate``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from kandevd.cli.common import client_options, echo_json, invoke
from kandevd.cli.format import fields, json_option, one_line


@click.group()
def scheduler() -> None:
    """Inspect and control the workflow scheduler as a whole (pause, resume, reload)."""


def config_pairs(config: dict[str, Any]) -> list[tuple[str, Any]]:
    if config.get("globally_paused"):
        by = f" by {config['paused_by']}" if config.get("paused_by") else ""
        since = f" since {config['paused_at']}" if config.get("paused_at") else ""
        paused = f"yes{by}{since}"
    else:
        paused = "no"
    if config.get("execution_enabled", True):
        execution = "enabled"
    else:
        execution = f"disabled ({config.get('disabled_reason') or 'no reason given'})"
    pairs: list[tuple[str, Any]] = [("paused", paused), ("cron execution", execution)]
    for key in ("allowed_workflows", "blocked_workflows", "allowed_users", "blocked_users"):
        if config.get(key):
            pairs.append((key.replace("_", " "), config[key]))
    return pairs


def print_problems(errors: list[dict[str, Any]]) -> None:
    click.echo(f"{len(errors)} workflow problem(s)" + (":" if errors else ""))
    for error in errors:
        click.echo(f"  {one_line(error.get('path', ''))}: {one_line(error.get('message', ''))}")


@scheduler.command("status")
@json_option
@client_options
def scheduler_status(as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Show pause state, whether cron executes, allow/block lists, counts and errors.

    --json prints {"config": <scheduler.config.get>, "status": <daemon.status scheduler>}.
    """
    config = invoke(home, socket_path, "scheduler.config.get")
    state = invoke(home, socket_path, "daemon.status").get("scheduler")
    if as_json:
        echo_json({"config": config, "status": state})
        return
    pairs = config_pairs(config)
    if state is None:
        fields([*pairs, ("cron loop", "not running in this daemon")])
        return
    fields([*pairs, ("root", state.get("root")), ("workflows", state.get("workflows")),
            ("jobs", state.get("jobs")), ("running", state.get("running") or "none")])
    print_problems(state.get("errors") or [])


@scheduler.command("pause")
@click.option("--by", "paused_by", default=lambda: os.environ.get("USER"),
              show_default="$USER", help="Who pauses (recorded as paused_by).")
@json_option
@client_options
def scheduler_pause(paused_by: str | None, as_json: bool, home: str | None,
                    socket_path: str | None) -> None:
    """Pause every cron fire (manual triggers still work); persists across restarts."""
    params: dict[str, Any] = {"globally_paused": True}
    if paused_by:
        params["paused_by"] = paused_by
    config = invoke(home, socket_path, "scheduler.config.put", params)
    if as_json:
        echo_json(config)
        return
    by = f" by {config['paused_by']}" if config.get("paused_by") else ""
    click.echo(f"scheduler paused{by} at {config.get('paused_at')}")


@scheduler.command("resume")
@json_option
@client_options
def scheduler_resume(as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Lift the global pause: cron fires run again."""
    config = invoke(home, socket_path, "scheduler.config.put", {"globally_paused": False})
    if as_json:
        echo_json(config)
        return
    click.echo("scheduler resumed")
    if not config.get("execution_enabled", True):
        click.echo(f"note: cron execution is disabled ({config.get('disabled_reason')})")


@scheduler.command("reload")
@json_option
@client_options
def scheduler_reload(as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Rescan the workflow root (as SIGHUP does) and print what changed."""
    result = invoke(home, socket_path, "scheduler.reload")
    if as_json:
        echo_json(result)
        return
    click.echo(f"reloaded: {result.get('workflows', 0)} workflow(s), "
               f"{result.get('jobs', 0)} job(s)")
    for key in ("added", "changed", "removed"):
        ids = result.get(key) or []
        click.echo(f"{key}: {', '.join(ids) if ids else 'none'}")
    print_problems(result.get("errors") or [])


# -- kandevd validate (the workflow half) -----------------------------------------------

def check_workflows(root: Path) -> bool:
    """Check every workflow folder, product.yaml and users.yaml under ``root``, and the
    files kandevd keeps there; True when all of them are usable.

    Each problem goes to stderr as one ``path: message`` line, nothing else
    does; the summary goes to stdout. Nothing is written or moved.
    """
    from kandevd.schedules.products import catalog
    from kandevd.schedules.workflows import manifest

    workflows, problems = manifest.scan(root)
    try:
        folders = len(manifest.workflow_folders(root))
    except OSError:
        folders = 0
    problems += manifest.state_file_problems(root)
    products, product_problems = catalog.scan_products(root)
    problems += product_problems + catalog.read_users(root)[1]
    for problem in problems:
        click.echo(one_line(str(problem)), err=True)
    if problems:
        click.echo(f"{len(problems)} problem(s) in {root}: "
                   f"{folders - len(workflows)} of {folders} workflow(s) not loaded")
        return False
    schedules = sum(len(w.schedules) for w in workflows)
    product_schedules = sum(len(p.schedules) for p in products)
    click.echo(f"{len(workflows)} workflow(s), {schedules} schedule(s), {len(products)} "
               f"product(s), {product_schedules} product schedule(s) ok in {root}")
    return True
