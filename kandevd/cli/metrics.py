"""``kandevd metrics``: print the Prometheus text exposition (``daemon.metrics``)."""

from __future__ import annotations

import click

from kandevd.cli.common import client_options, invoke


@click.command()
@client_options
def metrics(home: str | None, socket_path: str | None) -> None:
    """Print the daemon's metrics in the Prometheus text format."""
    click.echo(invoke(home, socket_path, "daemon.metrics"), nl=False)
