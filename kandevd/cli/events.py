"""``kandevd events``: the daemon's events as they happen, a line each, until interrupted
(``events.subscribe``; the topics are in docs/protocol.md, "Events")."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from kandevd import exits
from kandevd.cli.common import client_options, connect, error_line
from kandevd.control.client import RpcCallError


def event_line(message: dict[str, Any]) -> str:
    """One readable line for a notification: its time, its topic, what it is about."""
    if message.get("method") == "events.lost":
        count = (message.get("params") or {}).get("count")
        return f"({count} event(s) lost: this client read too slowly)"
    params = message.get("params") or {}
    topic, at, data = params.get("topic", "?"), params.get("at", "?"), params.get("data") or {}
    if topic.startswith(("run.", "office.run.")):
        about = (f"{data.get('id')} agent={data.get('agent_id')} status={data.get('status')}"
                 f" attempt={data.get('attempt')}")
        if data.get("error_message") and data.get("status") != "finished":
            about += f" error={data['error_message']!r}"
    elif topic.startswith("schedule."):
        about = " ".join(f"{key}={data[key]}" for key in
                         ("id", "entry_id", "status", "trigger_source", "reason", "error")
                         if data.get(key) is not None)
    else:
        about = " ".join(f"{key}={value}" for key, value in data.items())
    return f"{at} {topic} {about}".rstrip()


@click.command("events")
@click.option("--topic", "topics", multiple=True, metavar="PATTERN",
              help="A topic or 'prefix.*' (repeat for more; default: every topic).")
@click.option("--json", "as_json", is_flag=True,
              help="Print each notification as it arrives, as JSON (one line each).")
@client_options
def events(topics: tuple[str, ...], as_json: bool, home: str | None,
           socket_path: str | None) -> None:
    """Print the daemon's events as they happen, until interrupted (Ctrl-C).

    Exits 0 when the daemon stops (after its daemon.stopping event), 69 when no
    daemon answers or the connection is lost, 1 for a topic no event has."""
    stopping = False
    try:
        with connect(home, socket_path) as client:
            try:
                _answer, stream = client.subscribe(list(topics) or ["*"])
            except RpcCallError as exc:
                command = click.get_current_context().command
                click.echo(f"kandevd: {error_line(exc.error, command)}", err=True)
                sys.exit(exits.ERROR)
            for message in stream:
                params = message.get("params") or {}
                stopping = stopping or params.get("topic") == "daemon.stopping"
                click.echo(json.dumps(message) if as_json else event_line(message))
    except KeyboardInterrupt:
        return
    except BrokenPipeError:  # (the reader went away: `kandevd events | head`)
        sys.stderr.close()
        return
    if not stopping:
        click.echo("kandevd: the daemon closed the connection", err=True)
        sys.exit(exits.UNAVAILABLE)
