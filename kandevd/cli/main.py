"""The ``kandevd`` command line (click).

Exit codes follow sysexits where the contract says so: 0 ok, 1 error answer
(or forced stop), 69 no daemon, 73 home cannot be created or written, 75 home
locked, 78 bad config (serve; validate answers 1,, see docs/operations.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kandevd import __version__, exits
from kandevd.cli.common import client_options, config_option, echo_json, home_option, invoke
from kandevd.cli.db import db
from kandevd.cli.events import events
from kandevd.cli.format import json_option, queue_line
from kandevd.cli.init import init
from kandevd.cli.jobs import jobs
from kandevd.cli.methods import methods
from kandevd.cli.metrics import metrics
from kandevd.cli.model import MODEL_GROUPS
from kandevd.cli.runners import runner, runners
from kandevd.cli.runs import runs
from kandevd.cli.scheduler import scheduler, scheduler_lines
from kandevd.cli.validate import validate
from kandevd.cli.wait import wait
from kandevd.cli.web import web
from kandevd.config import ConfigError, load_config
from kandevd.formats import jsonstrict
from kandevd.paths import HomeLayout, resolve_home


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
    from kandevd.app.logsetup import configure_logging, set_level

    configure_logging(log_format, log_level or "INFO")
    root = resolve_home(home)
    try:
        config = load_config(Path(config_path) if config_path else None, home=root)
    except ConfigError as exc:
        click.echo(f"kandevd: bad config: {exc}", err=True)
        sys.exit(exits.CONFIG)
    from kandevd.app.preflight import startup_problem

    problem = startup_problem(config)
    if problem is not None:
        click.echo(f"kandevd: bad config: {config.source or 'config'}: {problem}", err=True)
        sys.exit(exits.CONFIG)
    if log_level is None and config.log_level is not None:
        set_level(config.log_level)
    daemon = Daemon(config, HomeLayout(root),
                    config_path=Path(config_path) if config_path else None,
                    log_level_fixed=log_level is not None)
    sys.exit(daemon.run())


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
        raw = click.get_binary_stream("stdin").read()
        try:
            params_json = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise click.BadParameter(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                                     f"offset {exc.start})", param_hint="PARAMS_JSON") from None
    try:
        params = jsonstrict.loads(params_json)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="PARAMS_JSON") from None
    if not isinstance(params, dict):
        raise click.BadParameter("must be a JSON object", param_hint="PARAMS_JSON")
    echo_json(invoke(home, socket_path, method, params))


@cli.command()
@client_options
@json_option
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
        click.echo(f"queue    {queue_line(runs)}")
    store = result.get("store") or {}
    if store.get("status") == "degraded":
        click.echo(f"store    DEGRADED: {store.get('reason')}")
    if result.get("scheduler") is not None:
        scheduler_lines(result["scheduler"], result.get("cluster"))
    cluster = result.get("cluster")
    if cluster is not None:
        members = cluster.get("daemons") or []
        alive = sum(1 for member in members if member.get("alive"))
        role = "leader" if cluster.get("leader") else "follower"
        click.echo(f"cluster  {role}; {alive} of {len(members)} daemon(s) alive")


cli.add_command(init)
cli.add_command(validate)
cli.add_command(runs)
cli.add_command(jobs)
cli.add_command(scheduler)
cli.add_command(db)
cli.add_command(wait)
cli.add_command(web)
cli.add_command(methods)
cli.add_command(metrics)
cli.add_command(runners)
cli.add_command(runner)
cli.add_command(events)
for group in MODEL_GROUPS:
    cli.add_command(group)


def main() -> None:
    cli(prog_name="kandevd")
