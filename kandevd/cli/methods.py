"""``kandevd methods [NAME]``: the control methods and their params, without a daemon.

The registry is built in-process exactly as the daemon builds it (with stand-in
services: registering a method never calls them), so this works with no daemon
running and shows the schemas the daemon checks.
"""

from __future__ import annotations

import sys

import click

from kandevd import exits
from kandevd.cli.common import echo_json, home_option
from kandevd.cli.format import json_option
from kandevd.control.openrpc import discover
from kandevd.control.reference import build_registry, param_lines, param_summary


@click.command("methods")
@click.argument("name", required=False)
@json_option
@home_option
def methods(name: str | None, as_json: bool, home: str | None) -> None:
    """List every control method, or show one method's params (no daemon needed).

    --home is accepted as every command accepts it, and changes nothing.

    Without NAME: one line per method with its params (`?` marks optional ones).
    With NAME: its summary, result and each param's type, range and default.
    --json prints the `rpc.discover` document, or the method's entry in it.
    """
    document = discover(build_registry())
    if name is None:
        if as_json:
            echo_json(document)
            return
        width = max(len(e["name"]) for e in document["methods"])
        for entry in document["methods"]:
            line = f"{entry['name']:<{width}}  {param_summary(entry)}"
            if entry.get("summary"):
                line += f"  {entry['summary']}"
            click.echo(line)
        return
    entry = next((e for e in document["methods"] if e["name"] == name), None)
    if entry is None:
        click.echo(f"kandevd: unknown method: {name} (see `kandevd methods`)", err=True)
        sys.exit(exits.ERROR)
    if as_json:
        echo_json(entry)
        return
    click.echo(entry["name"])
    if entry.get("summary"):
        click.echo(f"  {entry['summary']}")
    if entry["result"].get("description"):
        click.echo(f"  result: {entry['result']['description']}")
    lines = param_lines(entry)
    click.echo("params:" if lines else "params: none")
    for line in lines:
        click.echo(f"  {line}")
