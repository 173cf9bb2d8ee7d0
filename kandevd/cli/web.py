"""``kandevd web url|open``: the web console's address, with its token."""

from __future__ import annotations

import os
import sys
import webbrowser
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

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
    return url_of(address[0], address[1], token, tls=config.web.tls)


@click.group()
def web() -> None:
    """The web console (docs/console.md)."""


@web.command("url")
@home_option
@config_option("Config file (default: <home>/kandevd.yaml when it exists).")
def url(home: str | None, config_path: str | None) -> None:
    """Print the console's URL; it carries the token (keep it private)."""
    click.echo(console_url(home, config_path))


#: The page ``web open`` writes (mode 0600): it hands the token over by POST.
OPEN_FILE = "web-open.html"


def write_open_page(root: Path, address: str) -> Path:
    """``<home>/web-open.html``: a local page that posts a one-time code of the token to
    the console's ``/login`` at once: no URL carries the token, and what the browser keeps
    of the POST (to restore the page) is a spent code (mode 0600, as the token's own
    file; rewritten at each ``web open``)."""
    from kandevd.web.auth import login_code
    from kandevd.web.context import make_environment

    parts = urlsplit(address)
    token = parse_qs(parts.query).get("token", [""])[0]
    page = make_environment().get_template("web_open.html").render(
        login_url=f"{parts.scheme}://{parts.netloc}/login", code=login_code(token))
    path = root / OPEN_FILE
    spare = path.with_name(f".{OPEN_FILE}.{os.getpid()}")
    fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(page)
    os.replace(spare, path)
    return path


@web.command("open")
@home_option
@config_option("Config file (default: <home>/kandevd.yaml when it exists).")
def open_(home: str | None, config_path: str | None) -> None:
    """Open the console in a browser, signed in.

    A local page posts a one-time code, so the token stays out of the browser's history;
    with no browser at hand, print the console's URL."""
    address = console_url(home, config_path)
    root = resolve_home(home)
    try:
        page = write_open_page(root, address)
    except OSError as exc:
        click.echo(f"kandevd: cannot write {root / OPEN_FILE}: {exc.strerror or exc}", err=True)
        sys.exit(exits.CANTCREAT)
    try:
        opened = webbrowser.open(page.as_uri())
    except webbrowser.Error:
        opened = False
    if opened:
        click.echo(f"opened {page} in a browser (it signs the browser in to "
                   f"{address.split('?', 1)[0]})")
    else:
        click.echo("kandevd: no browser found here; open this URL (an SSH tunnel reaches "
                   "it from another machine, see docs/console.md):", err=True)
        click.echo(address)
        sys.exit(exits.UNAVAILABLE)
