"""``kandevd runners add|list|remove`` (the daemon's registry of runners) and
``kandevd runner`` (a runner on this machine, serving a daemon's gateway)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kandevd.cli.common import client_options, echo_json, invoke
from kandevd.cli.format import json_option


@click.group()
def runners() -> None:
    """Runners on other machines, for the agents routed to them.

    See docs/runners.md."""


@runners.command("add")
@click.argument("name")
@click.option("--label", "labels", multiple=True, metavar="LABEL",
              help="A label the runner carries (repeat for more).")
@client_options
@json_option
def add(name: str, labels: tuple[str, ...], home: str | None, socket_path: str | None,
        as_json: bool) -> None:
    """Register a runner; its token is the last line printed, and is shown only once."""
    added = invoke(home, socket_path, "runners.add", {"name": name, "labels": list(labels)})
    if as_json:
        echo_json(added)
        return
    click.echo(f"runner {added['name']} added (labels: {', '.join(added['labels']) or '-'}); "
               "its token (shown only now; keep it in a file of mode 0600 on the runner):")
    click.echo(added["token"])


@runners.command("list")
@client_options
@json_option
def listed(home: str | None, socket_path: str | None, as_json: bool) -> None:
    """Every runner: labels, online or not, last seen, what it runs now."""
    answer = invoke(home, socket_path, "runners.list")
    if as_json:
        echo_json(answer)
        return
    items = answer["items"]
    if not items:
        click.echo("no runners (add one with `kandevd runners add NAME --label L`)")
        return
    for item in items:
        click.echo(f"{item['name']:<20} {'online ' if item['online'] else 'offline'} "
                   f"running {item['running']:<3} labels {','.join(item['labels']) or '-'}"
                   f"  last seen {item['last_seen_at'] or 'never'}")


@runners.command("remove")
@click.argument("name")
@client_options
def remove(name: str, home: str | None, socket_path: str | None) -> None:
    """Forget a runner: its token is refused from its next request on."""
    invoke(home, socket_path, "runners.remove", {"name": name})
    click.echo(f"runner {name} removed")


@click.command()
@click.option("--server", required=True, metavar="URL",
              help="The daemon's gateway, e.g. https://server.example:7879.")
@click.option("--token-file", required=True, type=click.Path(path_type=Path), metavar="FILE",
              help="The file holding this runner's token (from `kandevd runners add`).")
@click.option("--home", "home", required=True, type=click.Path(path_type=Path), metavar="DIR",
              help="The runner's own home (its keeper, records and logs; made if missing).")
@click.option("--config", "config_path", type=click.Path(path_type=Path), metavar="FILE",
              default=None, help="The runner's config: its agent profiles, "
                                 "runtime.max_concurrent (default: <home>/kandevd.yaml).")
@click.option("--ca-file", default=None, metavar="FILE",
              help="Trust this CA (PEM) for an https server (default: the system's).")
@click.option("--log-level", default="INFO",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="Lowest level that is logged.")
def runner(server: str, token_file: Path, home: Path, config_path: Path | None,
           ca_file: str | None, log_level: str) -> None:
    """Run what a daemon's gateway routes to this machine, until SIGINT/SIGTERM.

    Exit 77 when the server refuses the token (docs/runners.md)."""
    from kandevd.app.logsetup import configure_logging
    from kandevd.remote.main import run_runner

    configure_logging("text", log_level.upper())
    sys.exit(run_runner(server, token_file, home.expanduser().absolute(),
                        config_path, ca_file))
