"""``kandevd wait``: block until the daemon answers on its socket (scripts, READMEs, CI)."""

from __future__ import annotations

import sys
import time

import click

from kandevd import exits
from kandevd.cli.common import FiniteFloat, client_options
from kandevd.control.client import DaemonUnavailable, RpcCallError, call
from kandevd.paths import HomeLayout, resolve_home

POLL_S = 0.05


@click.command("wait")
@click.option("--timeout", "timeout_s", type=FiniteFloat(minimum=0), default=30.0,
              show_default=True, help="Give up after this many seconds (exit 69).")
@client_options
def wait(timeout_s: float, home: str | None, socket_path: str | None) -> None:
    """Return 0 as soon as the daemon answers on its socket; 69 at the timeout.

    `kandevd serve &` returns before the socket listens: `kandevd wait` between
    the two makes the next command safe.
    """
    path = socket_path or str(HomeLayout(resolve_home(home)).socket)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = call(path, "daemon.status", {},
                          timeout=max(deadline - time.monotonic(), 1.0))
        except RpcCallError as exc:  # it answered (an error is an answer too)
            click.echo(f"kandevd answers on {path} ({exc})")
            return
        except DaemonUnavailable as exc:
            if time.monotonic() >= deadline:
                click.echo(f"kandevd: no daemon answered on {path} within {timeout_s:g}s "
                           f"({exc})", err=True)
                sys.exit(exits.UNAVAILABLE)
            # A socket that is not there yet cannot be waited on with select(); poll briefly.
            time.sleep(POLL_S)
            continue
        click.echo(f"kandevd {status.get('version', '?')} is {status.get('state', 'running')} "
                   f"(pid {status.get('pid', '?')})")
        return
