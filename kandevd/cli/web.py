"""``kandevd web url|open``: the web console's address, with its token."""

from __future__ import annotations

import sys
import webbrowser
from pathlib import Path

import click

from kandevd import exits
from kandevd.cli.common import config_option, home_option
from kandevd.config import ConfigError, load_config
from kandevd.paths import resolve_home


def console_url(home: str | None, config_path: str | None) -> str:
    """What the running daemon serves (``<home>/web.url``), else what the config names
    (with the token, made if there is none yet); exits 78 when the console is off."""
    root = resolve_home(home)
    try:
        running = (root / "web.url").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        running = ""
    if running:
        return running
    from kandevd.web.auth import ensure_token
    from kandevd.web.server import console_url as url_of

    try:
        config = load_config(Path(config_path) if config_path else None, home=root)
    except ConfigError as exc:
        click.echo(f"kandevd: {exc}", err=True)
        sys.exit(exits.CONFIG)
    address = config.web.address
    if address is None:
        click.echo("kandevd: the web console is off: set web.listen in the config (for "
                   "example \"127.0.0.1:7878\") and restart the daemon", err=True)
        sys.exit(exits.CONFIG)
    if address[1] == 0:
        click.echo("kandevd: web.listen has port 0 and no daemon serves the console now: "
                   "its port is known once the daemon runs", err=True)
        sys.exit(exits.UNAVAILABLE)
    try:
        token = ensure_token(root)
    except OSError as exc:
        click.echo(f"kandevd: cannot read or create {root / 'web.token'}: {exc}", err=True)
        sys.exit(exits.CANTCREAT)
    return url_of(address[0], address[1], token)


@click.group()
def web() -> None:
    """The web console (docs/console.md)."""


@web.command("url")
@home_option
@config_option("Config file (default: <home>/kandevd.yaml when it exists).")
def url(home: str | None, config_path: str | None) -> None:
    """Print the console's URL; it carries the token (keep it private)."""
    click.echo(console_url(home, config_path))


@web.command("open")
@home_option
@config_option("Config file (default: <home>/kandevd.yaml when it exists).")
def open_(home: str | None, config_path: str | None) -> None:
    """Open the console in a browser (where one exists); else print its URL."""
    address = console_url(home, config_path)
    try:
        opened = webbrowser.open(address)
    except webbrowser.Error:
        opened = False
    if not opened:
        click.echo("kandevd: no browser found here; open this URL (an SSH tunnel reaches "
                   "it from another machine, see docs/console.md):", err=True)
        click.echo(address)
        sys.exit(exits.UNAVAILABLE)
