"""``kandevd scheduler ...`` (pause, resume, reload, status) and the workflow half of
``kandevd validate``."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
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


#: How a problem's ``kind`` is named when counted.
PROBLEM_KINDS = {"workflow": "workflow", "product": "product", "users": "users.yaml",
                 "state": "state file"}


def print_problems(errors: list[dict[str, Any]]) -> None:
    """Problems counted by whose file they are in, then one line each."""
    if not errors:
        click.echo("0 problems")
        return
    counts: dict[str, int] = {}
    for error in errors:
        kind = PROBLEM_KINDS.get(str(error.get("kind")), "workflow")
        counts[kind] = counts.get(kind, 0) + 1
    click.echo(", ".join(f"{n} {kind} problem(s)" for kind, n in counts.items()) + ":")
    for error in errors:
        click.echo(f"  {one_line(error.get('path', ''))}: {one_line(error.get('message', ''))}")


def scheduler_lines(state: dict[str, Any], cluster: dict[str, Any] | None = None) -> None:
    """The scheduler lines of ``kandevd status``: pause, jobs by state, sessions, problems
    (``cluster``: daemon.status's; only the leader fires)."""
    if state.get("globally_paused"):
        by = f" by {state['paused_by']}" if state.get("paused_by") else ""
        since = f" since {state['paused_at']}" if state.get("paused_at") else ""
        cron = f"PAUSED{by}{since}"
    elif not state.get("execution_enabled", True):
        cron = f"cron execution disabled ({state.get('disabled_reason') or 'no reason given'})"
    elif cluster is not None and not cluster.get("leader"):
        cron = "on (the leader fires; this daemon is not the leader)"
    else:
        cron = "firing"
    click.echo(f"scheduler {cron}")
    states = state.get("states") or {}
    shown = ", ".join(f"{n} {name}" for name, n in states.items()) or "none"
    click.echo(f"jobs     {shown}")
    running = state.get("running") or []
    click.echo(f"sessions {len(running)} running" + (f": {', '.join(running)}" if running
                                                       else ""))
    errors = state.get("errors") or []
    if errors:
        click.echo(f"problems {len(errors)} (kandevd scheduler status lists them)")


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
    states = ", ".join(f"{n} {name}" for name, n in (state.get("states") or {}).items())
    fields([*pairs, ("root", state.get("root")), ("workflows", state.get("workflows")),
            ("jobs", state.get("jobs")), ("products", state.get("products")),
            ("product jobs", state.get("product_jobs")), ("states", states or "none"),
            ("running", state.get("running") or "none")])
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
               f"{result.get('jobs', 0)} job(s), {result.get('products', 0)} product(s), "
               f"{result.get('product_jobs', 0)} product job(s)")
    for key in ("added", "changed", "removed", "invalid"):
        ids = result.get(key) or []
        click.echo(f"{key}: {', '.join(ids) if ids else 'none'}")
    print_problems(result.get("errors") or [])


# -- kandevd validate (the workflow half) -----------------------------------------------

def check_workflows(root: Path, profiles: Collection[str] | None = None) -> bool:
    """Check every workflow folder, product.yaml and users.yaml under ``root``, and the
    files kandevd keeps there; True when all of them are usable.

    With ``profiles`` (the config's agent profiles), a workflow or product whose
    ``agent_profile`` is not among them is a problem for each of its schedules that
    runs here (one with ``runs_on`` runs on a runner, whose own config names its
    profiles): every turn of such a schedule would end in an error. Each problem
    goes to stderr as one ``path: message`` line, nothing else does; the summary
    goes to stdout. Nothing is written or moved.
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
    product_folders = catalog.product_folder_count(root)
    user_problems = catalog.read_users(root)[1]
    problems += product_problems + user_problems
    unknown = [] if profiles is None else _unknown_profiles(workflows, products, profiles)
    problems += unknown
    for problem in problems:
        click.echo(one_line(str(problem)), err=True)
    if problems:
        parts = []
        if folders - len(workflows):
            parts.append(f"{folders - len(workflows)} of {folders} workflow(s) not loaded")
        if product_folders - len(products):
            parts.append(f"{product_folders - len(products)} of {product_folders} product(s) "
                         "not loaded")
        if user_problems:
            parts.append(f"{catalog.USERS_FILE} not usable (no product job runs)")
        if unknown:
            parts.append(f"{len(unknown)} file(s) name an agent profile the config lacks")
        states = sum(1 for p in problems if p.kind == "state")
        if states:
            parts.append(f"{states} state file(s) the daemon would move aside")
        click.echo(f"{len(problems)} problem(s) in {root}: {'; '.join(parts)}")
        return False
    schedules = sum(len(w.schedules) for w in workflows)
    product_schedules = sum(len(p.schedules) for p in products)
    click.echo(f"{len(workflows)} workflow(s), {schedules} schedule(s), {len(products)} "
               f"product(s), {product_schedules} product schedule(s) ok in {root}")
    return True


def _unknown_profiles(workflows: Iterable[Any], products: Iterable[Any],
                      profiles: Collection[str]) -> list[Any]:
    """A problem for each workflow or product whose ``agent_profile`` is not configured,
    naming the schedules that would run it here."""
    from kandevd.schedules.workflows.manifest import Problem

    found = []
    for kind, file, owners in (("workflow", "workflow.json", workflows),
                               ("product", "product.yaml", products)):
        for owner in owners:
            if owner.agent_profile in profiles:
                continue
            local = [s.id for s in owner.schedules if not s.options.runs_on]
            if not local:
                continue
            found.append(Problem(
                str(owner.folder / file),
                f"agent_profile {owner.agent_profile!r} is not configured (configured: "
                f"{', '.join(sorted(profiles))}); every turn of {', '.join(local)} would "
                "end in an error", kind))
    return found
