"""Option bundles and the call helper shared by every CLI command (sqlite-utils style)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kandevd.control.client import DaemonUnavailable, RpcCallError
from kandevd.control.client import call as rpc_call
from kandevd.paths import HomeLayout, resolve_home

EXIT_ERROR = 1
EXIT_UNAVAILABLE = 69
EXIT_CONFIG = 78


def home_option(func: Callable[..., Any]) -> Callable[..., Any]:
    # Not click.Path(file_okay=False): click's usage error would exit 2, where serve
    # must answer a home it cannot use with 73 and the reason (kandevd.paths.HomeError).
    return click.option("--home", type=click.Path(readable=False), metavar="DIR", default=None,
                        help="Home directory (default: $KANDEVD_HOME, else "
                             "~/.local/share/kandevd).")(func)


def client_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--socket", "socket_path", type=click.Path(dir_okay=False),
                        default=None, help="Control socket (default: <home>/kandevd.sock).")(func)
    return home_option(func)


def _socket(home: str | None, socket_path: str | None) -> Path:
    return Path(socket_path) if socket_path else HomeLayout(resolve_home(home)).socket


def invoke(home: str | None, socket_path: str | None, method: str,
           params: dict[str, Any] | None = None) -> Any:
    """Call the daemon, mapping failures to the contract's exit codes."""
    try:
        return rpc_call(_socket(home, socket_path), method, params or {})
    except DaemonUnavailable as exc:
        click.echo(f"kandevd: {exc}", err=True)
        sys.exit(EXIT_UNAVAILABLE)
    except RpcCallError as exc:
        click.echo(json.dumps(exc.error, indent=2), err=True)
        sys.exit(EXIT_ERROR)


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=False))
