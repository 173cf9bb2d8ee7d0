"""Option bundles and the call helper shared by every CLI command (sqlite-utils style)."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from kandevd import exits
from kandevd.app.homelock import holder
from kandevd.control.client import Client, DaemonUnavailable, NoAnswer, RpcCallError
from kandevd.control.client import call as rpc_call
from kandevd.paths import HomeLayout, resolve_home


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


def user_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--user USER``: a product job exists once per user of the directory."""
    return click.option("--user", "user_id", metavar="USER", default=None,
                        help="The user of a product job (one exists per user who has the "
                             "product).")(func)


def _socket(home: str | None, socket_path: str | None) -> Path:
    return Path(socket_path) if socket_path else HomeLayout(resolve_home(home)).socket


def _unavailable(home: str | None, socket_path: str | None, exc: DaemonUnavailable) -> None:
    """No daemon answers (exit 69); when one still holds the home (it is stopping: its
    socket goes first, its lock last), say that rather than that none runs."""
    pid = None if socket_path else holder(HomeLayout(resolve_home(home)).lock)
    if isinstance(exc, NoAnswer):  # (busy, or waiting for its database: not stopping)
        click.echo(f"kandevd: {exc}; its log says why (a database out of reach?)", err=True)
    elif pid is None:
        click.echo(f"kandevd: {exc}", err=True)
    else:
        click.echo(f"kandevd: kandevd (pid {pid}) holds this home but takes no requests: "
                   "it is stopping (or still starting); try again in a moment", err=True)
    sys.exit(exits.UNAVAILABLE)


@contextmanager
def connect(home: str | None, socket_path: str | None) -> Iterator[Client]:
    """One connection for many calls; no daemon listening exits 69 as ``invoke`` does."""
    try:
        client = Client(_socket(home, socket_path))
    except DaemonUnavailable as exc:
        _unavailable(home, socket_path, exc)
    try:
        yield client
    except DaemonUnavailable as exc:
        _unavailable(home, socket_path, exc)
    finally:
        client.close()


def invoke(home: str | None, socket_path: str | None, method: str,
           params: dict[str, Any] | None = None) -> Any:
    """Call the daemon, mapping failures to the contract's exit codes."""
    try:
        return rpc_call(_socket(home, socket_path), method, params or {})
    except DaemonUnavailable as exc:
        _unavailable(home, socket_path, exc)
    except RpcCallError as exc:
        ctx = click.get_current_context(silent=True)
        if ctx is None or ctx.params.get("as_json") or ctx.command.name == "call":
            # --json, and the raw `call`, keep the JSON-RPC error object
            click.echo(json.dumps(exc.error, indent=2), err=True)
        else:  # every other command (with a --json option or without): one line
            click.echo(f"kandevd: {error_line(exc.error, ctx.command)}", err=True)
        sys.exit(exits.ERROR)


#: A message's leading parameter: ``params.limit`` before anything, or a bare ``limit``
#: before a ``.`` or ``:`` (a bare word before a space is the sentence's own:
#: "workflow 'digest' already has ...").
_FIELD = re.compile(r"^(?:params\.([A-Za-z_][A-Za-z0-9_]*)(?=[.:\s])"
                    r"|([A-Za-z_][A-Za-z0-9_]*)(?=[.:]))")


#: Parameters whose option is named otherwise in Python (``--from`` fills ``start``).
_PARAM_ALIASES = {"from": "start", "to": "end"}


_PARAMETER = re.compile(r"\bparams\.([A-Za-z_][A-Za-z0-9_]*)\b")


def _shown_as(command: click.Command, name: str) -> str | None:
    """How ``command`` names the parameter ``name``: its option, or its argument."""
    wanted = _PARAM_ALIASES.get(name, name)
    for param in command.params:
        if param.name == wanted and param.name not in ("home", "socket_path"):
            return (param.opts[0] if isinstance(param, click.Option)
                    else param.human_readable_name)
    return None


def error_line(error: dict[str, Any], command: click.Command | None = None) -> str:
    """One readable line for a JSON-RPC error: ``--limit: 600 is greater than ...``.

    A leading ``params.<name>`` (or bare ``<name>:``) naming a parameter that the
    command fills from an option or argument is shown as that option (``--limit``)
    or argument (``ID``). Errors other than invalid params end with their kind.
    """
    message = " ".join(str(error.get("message") or "error").split())
    match = _FIELD.match(message)
    if match and command is not None:
        shown = _shown_as(command, match.group(1) or match.group(2))
        if shown is not None:
            message = shown + message[match.end():]
    if command is not None:  # (another parameter named later: "earlier than params.from")
        message = _PARAMETER.sub(lambda m: _shown_as(command, m.group(1)) or m.group(0),
                                 message)
    if command is not None and any(p.name == "user_id" for p in command.params):
        message = message.replace("give user_id", "give --user")
    kind = (error.get("data") or {}).get("kind")
    if kind and kind != "invalid_params" and kind not in message:
        message = f"{message} ({kind})"
    return message


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=False))


def config_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--config FILE``. Not click.Path(dir_okay=False): click would answer a directory
    with its own usage error (exit 2); load_config reports it like every other bad
    config file (serve 78), with the path and the reason."""
    return click.option("--config", "config_path", type=click.Path(readable=False), metavar="FILE",
                        default=None, help=help_text)


class FiniteFloat(click.ParamType):
    """A number option: ``nan`` and ``inf`` (which Python's float reads) are refused
    here, naming the option, not sent on to be refused as a parse error."""

    name = "number"

    def __init__(self, minimum: float | None = None) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if self.minimum is not None and number < self.minimum:
            self.fail(f"{value!r} is less than {self.minimum:g}", param, ctx)
        return number


FINITE = FiniteFloat()
