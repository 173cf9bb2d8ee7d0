"""The ``kandevd`` command line (click).

Exit codes follow sysexits where the contract says so: 0 ok, 1 error answer
(or forced stop), 69 no daemon, 73 home cannot be created or written, 75 home
locked, 78 bad config (serve; validate answers 1, as CONTRACT.md section 1 says).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kandevd import __version__, exits
from kandevd.cli_common import client_options, echo_json, home_option, invoke
from kandevd.cli_db import db
from kandevd.cli_jobs import jobs
from kandevd.cli_methods import methods
from kandevd.cli_metrics import metrics
from kandevd.cli_model import MODEL_GROUPS
from kandevd.cli_runs import runs
from kandevd.cli_scheduler import check_workflows, scheduler
from kandevd.cli_wait import wait
from kandevd.config import ConfigError, load_config
from kandevd.paths import HomeError, HomeLayout, resolve_home
from kandevd.timeutil import parse_rfc3339, utc_now

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def config_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--config FILE``. Not click.Path(dir_okay=False): click would answer a directory
    with its own usage error (exit 2); load_config reports it like every other bad
    config file (serve 78), with the path and the reason."""
    return click.option("--config", "config_path", type=click.Path(readable=False), metavar="FILE",
                        default=None, help=help_text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kandevd")
def cli() -> None:
    """kandevd schedules autonomous AI-agent work reliably.

    Start the daemon with `kandevd serve`; talk to it with `kandevd status`,
    `kandevd runs ...`, `kandevd jobs ...`, `kandevd scheduler ...` or the raw
    `kandevd call METHOD PARAMS_JSON`.
    """


@cli.command()
@home_option
@config_option("Config file (default: <home>/kandevd.yaml when it exists).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="Log line format on stderr.")
@click.option("--log-level", default=None,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="Lowest level that is logged (default: the config's log.level, else "
                   "INFO). Given here, SIGHUP does not change it.")
def serve(home: str | None, config_path: str | None, log_format: str,
          log_level: str | None) -> None:
    """Run the daemon in the foreground until SIGINT/SIGTERM or `daemon.shutdown`."""
    from kandevd.app.daemon import Daemon
    from kandevd.logsetup import configure_logging, set_level

    configure_logging(log_format, log_level or "INFO")
    root = resolve_home(home)
    try:
        config = load_config(Path(config_path) if config_path else None, home=root)
    except ConfigError as exc:
        click.echo(f"kandevd: bad config: {exc}", err=True)
        sys.exit(exits.CONFIG)
    from kandevd.store.backend import backend_problem

    problem = backend_problem(config)
    if problem is not None:
        click.echo(f"kandevd: bad config: {config.source or 'config'}: {problem}", err=True)
        sys.exit(exits.CONFIG)
    if log_level is None and config.log_level is not None:
        set_level(config.log_level)
    daemon = Daemon(config, HomeLayout(root),
                    config_path=Path(config_path) if config_path else None,
                    log_level_fixed=log_level is not None)
    sys.exit(daemon.run())


def copy_example(source: Path, root: Path, *, force: bool) -> tuple[list[Path], list[Path]]:
    """Copy the example ``source`` into ``root``; ``(written, kept)`` relative paths.

    A file that already exists in the home is kept as it is (the user may have
    edited it) unless ``force``. What is written is private: new folders 0700,
    files 0600 (0700 when executable); the home itself and everything else in
    it keep their modes.
    """
    written: list[Path] = []
    kept: list[Path] = []
    for folder, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = Path(folder).relative_to(source)
        target_dir = root / rel
        if not target_dir.exists():
            target_dir.mkdir(mode=0o700, parents=True)
        for name in sorted(files):
            origin = Path(folder) / name
            target = target_dir / name
            if target.exists() and not force:
                kept.append(rel / name)
                continue
            shutil.copyfile(origin, target)
            os.chmod(target, 0o700 if os.access(origin, os.X_OK) else 0o600)
            written.append(rel / name)
    return written, kept


@cli.command()
@home_option
@click.option("--example", default=None, help="Copy examples/NAME into the home (e.g. demo).")
@click.option("--force", is_flag=True, help="Overwrite files of the example that exist already.")
def init(home: str | None, example: str | None, force: bool) -> None:
    """Lay out a home directory (new folders 0700), optionally from an example.

    Nothing that exists is overwritten (it says what it kept; --force
    overwrites the example's files). Bad arguments fail before anything is
    created. An existing home keeps its mode (a warning says so when it is not
    0700); a home that cannot be created or written exits 73.
    """
    root = resolve_home(home)
    layout = HomeLayout(root)
    source: Path | None = None
    if example:
        from kandevd.paths import check_safe_name

        try:
            check_safe_name(example, "example")
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        source = EXAMPLES_DIR / example
        if not source.is_dir():
            known = sorted(p.name for p in EXAMPLES_DIR.iterdir()) if EXAMPLES_DIR.is_dir() else []
            raise click.ClickException(f"no example named {example!r} (known: {known})")
    try:
        layout.prepare(warn=lambda message: click.echo(f"kandevd: warning: {message}", err=True))
        layout.workspace.mkdir(mode=0o700, exist_ok=True)
        written, kept = copy_example(source, root, force=force) if source else ([], [])
    except HomeError as exc:
        click.echo(f"kandevd: cannot use home {root}: {exc}", err=True)
        sys.exit(exits.CANTCREAT)
    except OSError as exc:
        click.echo(f"kandevd: cannot use home {root}: {exc.strerror or exc}", err=True)
        sys.exit(exits.CANTCREAT)
    for path in kept:
        click.echo(f"kept {root / path} (it exists; --force overwrites it)")
    if written:
        click.echo(f"wrote {len(written)} file(s) of example {example!r}")
    click.echo(f"home ready: {root}")
    click.echo(f"next: kandevd serve --home {root}")


@cli.command()
@home_option
@config_option("Config file to check (default: <home>/kandevd.yaml when it exists).")
def validate(home: str | None, config_path: str | None) -> None:
    """Check the config and every workflow; exit 0 when all are valid, 1 otherwise.

    Checks the config file, then every Workflow/<name>/workflow.json (with its
    variables/variables.json) under the scheduler root. Each problem is printed
    on stderr as one `path: problem` line; stdout gets `config ok: ...` and a
    summary (`N workflow(s), M schedule(s) ok in ROOT`, or the problem count).
    Workflows are not checked while the config itself is invalid (their root
    comes from it). Nothing is written.
    """
    from kandevd.schedules.build import scheduler_root

    root = resolve_home(home)
    try:
        config = load_config(Path(config_path) if config_path else None, home=root)
    except ConfigError as exc:
        click.echo(f"invalid: {exc}", err=True)
        click.echo("workflows not checked: the config is invalid", err=True)
        sys.exit(exits.ERROR)
    from kandevd.store.backend import backend_problem

    problem = backend_problem(config)
    if problem is not None:
        click.echo(f"invalid: {config.source or 'config'}: {problem}", err=True)
        click.echo("workflows not checked: the config is invalid", err=True)
        sys.exit(exits.ERROR)
    click.echo(f"config ok: {config.source or 'built-in defaults'}")
    profiles_ok = check_profiles(config, root)
    if not check_workflows(scheduler_root(config, root)) or not profiles_ok:
        sys.exit(exits.ERROR)


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


@cli.command()
@click.argument("method")
@click.argument("params_json", required=False, default="{}")
@client_options
def call(method: str, params_json: str, home: str | None, socket_path: str | None) -> None:
    """Send one raw JSON-RPC request and print the result as JSON.

    PARAMS_JSON is a JSON object (default {}); `-` reads it from stdin. An
    error answer prints the JSON-RPC error object on stderr (exit 1).
    """
    if params_json == "-":
        params_json = click.get_text_stream("stdin").read()
    try:
        params = json.loads(params_json)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="PARAMS_JSON") from None
    if not isinstance(params, dict):
        raise click.BadParameter("must be a JSON object", param_hint="PARAMS_JSON")
    echo_json(invoke(home, socket_path, method, params))


@cli.command()
@client_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
def status(home: str | None, socket_path: str | None, as_json: bool) -> None:
    """Show the daemon's state, its loops and the runtime."""
    result = invoke(home, socket_path, "daemon.status")
    if as_json:
        echo_json(result)
        return
    click.echo(f"kandevd {result['version']}  pid {result['pid']}  state {result['state']}")
    click.echo(f"home     {result['home']}")
    click.echo(f"started  {result['started_at']}")
    loops = "  ".join(f"{name}={state}" for name, state in result["loops"].items())
    click.echo(f"loops    {loops}")
    runtime = result["runtime"]
    click.echo(f"runtime  {runtime['active']}/{runtime['max_concurrent']} slots busy")
    runs = result.get("runs")
    if runs:
        oldest = ""
        if runs.get("oldest_queued_at"):
            age = (utc_now() - parse_rfc3339(runs["oldest_queued_at"])).total_seconds()
            oldest = f" (oldest waiting {max(age, 0):.0f}s)"
        click.echo(f"queue    {runs['queued']} queued{oldest}, {runs['claimed']} claimed, "
                   f"{runs['failed']} failed (dead letter), {runs['finished']} finished")
    store = result.get("store") or {}
    if store.get("status") == "degraded":
        click.echo(f"store    DEGRADED: {store.get('reason')}")
    cluster = result.get("cluster")
    if cluster is not None:
        members = cluster.get("daemons") or []
        alive = sum(1 for member in members if member.get("alive"))
        role = "leader" if cluster.get("leader") else "follower"
        click.echo(f"cluster  {role}; {alive} of {len(members)} daemon(s) alive")


cli.add_command(runs)
cli.add_command(jobs)
cli.add_command(scheduler)
cli.add_command(db)
cli.add_command(wait)
cli.add_command(methods)
cli.add_command(metrics)
for group in MODEL_GROUPS:
    cli.add_command(group)


def main() -> None:
    cli(prog_name="kandevd")
