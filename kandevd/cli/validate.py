"""``kandevd validate``: check the config, every workflow and product file, the profiles."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from kandevd import exits
from kandevd.cli.common import config_option, home_option
from kandevd.cli.scheduler import check_workflows
from kandevd.config import ConfigError, load_config
from kandevd.paths import resolve_home


@click.command()
@home_option
@config_option("Config file to check (default: <home>/kandevd.yaml when it exists).")
def validate(home: str | None, config_path: str | None) -> None:
    """Check the config and every workflow; exit 0 when all are valid, 1 otherwise.

    Checks the config file (every problem of it), each agent profile's command,
    then every Workflow/<name>/workflow.json (with its variables), product.yaml
    and users.yaml under the scheduler root, and that the agent profile each
    names is configured. Each problem is printed on stderr as one `path:
    problem` line; stdout gets `config ok: ...` and a summary (`N workflow(s),
    M schedule(s) ok in ROOT`, or the problem count). Workflows are not checked
    while the config itself is invalid (their root comes from it). Nothing is
    written.
    """
    from kandevd.schedules.settings import scheduler_root

    root = resolve_home(home)
    try:
        config = load_config(Path(config_path) if config_path else None, home=root)
    except ConfigError as exc:
        for problem in (str(exc), *exc.more):  # (serve names the first: one line)
            click.echo(f"invalid: {problem}", err=True)
        click.echo("workflows not checked: the config is invalid", err=True)
        sys.exit(exits.ERROR)
    from kandevd.app.preflight import startup_problem

    problem = startup_problem(config)
    if problem is not None:
        click.echo(f"invalid: {config.source or 'config'}: {problem}", err=True)
        click.echo("workflows not checked: the config is invalid", err=True)
        sys.exit(exits.ERROR)
    click.echo(f"config ok: {config.source or 'built-in defaults'}")
    workflow_root = scheduler_root(config, root)
    for folder, what in ((root, "the home"), (workflow_root, "the workflow root")):
        if not folder.is_dir():  # (a typo in --home would otherwise pass as an empty home)
            click.echo(f"note: {what} {folder} does not exist ({NOT_THERE[what]})", err=True)
            break
    profiles_ok = check_profiles(config, root)
    if not check_workflows(workflow_root, set(config.agents)) or not profiles_ok:
        sys.exit(exits.ERROR)


#: What a folder that is not there means (a note, not a problem: serve starts all the same).
NOT_THERE = {"the home": "serve creates it, with no workflow, product or run in it",
             "the workflow root": "no workflow or product is loaded from it"}


def check_profiles(config: Any, root: Path) -> bool:
    """Say per agent profile whether its command can be executed; False if one cannot.

    Resolved as the agent's start would (a relative path from a run folder, a
    bare name through PATH with the profile's env), so a typo is found here
    instead of failing every attempt of every run.
    """
    from kandevd.agents.profiles import executable_problem

    ok = True
    for name, profile in sorted(config.agents.items()):
        if not profile.command:
            click.echo(f"profile {name}: the built-in echo agent")
            continue
        path_env = dict(profile.env).get("PATH", os.environ.get("PATH"))
        problem = executable_problem(profile.command[0], root / "runs", path_env)
        if problem is None:
            click.echo(f"profile {name}: {profile.command[0]} ok")
        else:
            ok = False
            click.echo(f"profile {name}: {problem}", err=True)
    return ok
