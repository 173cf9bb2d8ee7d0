"""The web console in the daemon: built from the parts, its URL kept in the home.

``<home>/web.url`` (mode 0600: it carries the token) holds the address the
console really listens on while it runs, so ``kandevd web url`` prints it
even when the config asks for port 0; it is removed at the stop.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kandevd import __version__
from kandevd.config import Config
from kandevd.fsutil import replace_atomically
from kandevd.net.httpintake import LazyTlsAdapter, tls_adapter
from kandevd.schedules.settings import scheduler_root
from kandevd.web.server import WebConsole

log = logging.getLogger("kandevd.web")

URL_FILE = "web.url"


class ConsoleTlsError(Exception):
    """``web.tls_cert`` or ``web.tls_key`` cannot be used (a config error: exit 78)."""


def load_tls(config: Config) -> LazyTlsAdapter | None:
    """The console's TLS (None when it serves plain HTTP); ConsoleTlsError when the
    certificate or key cannot be read or do not belong together."""
    web = config.web
    if web.tls_cert is None or web.tls_key is None:
        return None
    try:
        return tls_adapter(web.tls_cert, web.tls_key)
    except (OSError, ValueError) as exc:  # (ssl.SSLError is an OSError)
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise ConsoleTlsError(f"web.tls_cert {web.tls_cert!r} / web.tls_key "
                              f"{web.tls_key!r}: cannot be used: {reason}") from None


def start_console(config: Config, home: Path, parts: Any) -> WebConsole | None:
    """Serve the console when ``web.listen`` is set (OSError when it cannot bind,
    ConsoleTlsError when its certificate cannot be used)."""
    address = config.web.address
    if address is None:
        return None
    adapter = load_tls(config)
    store = parts.store

    def reads(fn: Any) -> Any:
        with store.reading():
            return fn(store)

    console = WebConsole(address, home=home, dispatch=parts.server.dispatch, reads=reads,
                         version=__version__, workflow_root=scheduler_root(config, home),
                         allowed_hosts=config.web.allowed_hosts, tls=adapter,
                         events=parts.events)
    console.start()
    try:
        replace_atomically(Path(home) / URL_FILE, console.url + "\n", durable=False)
    except OSError as exc:  # the console works; only `kandevd web url` cannot read it
        log.warning("cannot write %s: %s", Path(home) / URL_FILE, exc)
    log.info("web console at %s", console.url)
    return console


def stop_console(console: WebConsole | None, home: Path) -> None:
    if console is None:
        return
    console.stop()
    (Path(home) / URL_FILE).unlink(missing_ok=True)
