"""What every view works with: the control methods, the store's reads, the templates."""

from __future__ import annotations

import base64
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape

from kandevd.events.hub import Subscription
from kandevd.web.auth import Guard
from kandevd.web.http import Request, Response

Dispatch = Callable[[str, dict[str, Any]], Any]


@dataclass
class Console:
    """The console's view of the daemon (built by :mod:`kandevd.web.server`)."""

    dispatch: Dispatch
    #: ``reads(fn)``: ``fn(repo)`` on the store's read connections (charts, counts).
    reads: Callable[[Callable[[Any], Any]], Any]
    guard: Guard
    stopping: threading.Event
    version: str
    #: ``subscribe(patterns)``: the daemon's events for a live page (as
    #: ``events.subscribe`` carries them); ``unsubscribe`` when the page's stream ends.
    subscribe: Callable[[Sequence[str]], Subscription]
    unsubscribe: Callable[[Subscription], None]
    #: Where the scheduler reads workflows (the schedule form lists them).
    workflow_root: Path
    #: The daemon's home (logs are read from its ``logs/`` folder only).
    home: Path
    env: Environment | None = None

    def __post_init__(self) -> None:
        if self.env is None:
            self.env = make_environment()

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """A control method, in-process, with its validation and errors (RpcError)."""
        return self.dispatch(method, params or {})

    def render(self, template: str, request: Request, http_status: int = 200,
               **context: Any) -> Response:
        assert self.env is not None
        flash = take_flash(request, self.guard)
        body = self.env.get_template(template).render(
            request=request, csrf=self.guard.csrf_token, flash=flash,
            version=self.version, **context)
        response = Response(body, http_status)
        if flash is not None:
            response.set_cookie(self.guard.flash_cookie, "", max_age=0,
                                secure=self.guard.secure)
        return response

    def fragment(self, template: str, http_status: int = 200, **context: Any) -> Response:
        assert self.env is not None
        return Response(self.env.get_template(template).render(
            csrf=self.guard.csrf_token, **context), http_status)


def make_environment() -> Environment:
    env = Environment(loader=PackageLoader("kandevd.web", "templates"),
                      autoescape=select_autoescape(default=True, default_for_string=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["t"] = time_element
    env.filters["times_in"] = times_in
    env.filters["field_value"] = field_value
    env.filters["dur"] = duration
    env.filters["pretty"] = lambda value: json.dumps(value, indent=2, sort_keys=True,
                                                     ensure_ascii=False)
    env.filters["cents"] = lambda c: "—" if c is None else f"${(c or 0) / 100:,.2f}"
    return env


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def time_element(value: Any) -> Markup:
    """A ``<time>`` the browser shows in its own zone (the script), UTC on hover."""
    moment = parse_time(value)
    if moment is None:
        return Markup("—")
    utc = moment.astimezone(UTC)
    iso = utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    shown = utc.strftime("%Y-%m-%d %H:%M:%S UTC")
    return Markup('<time datetime="{0}" title="{1}">{1}</time>').format(iso, shown)


#: An RFC 3339 moment inside a sentence (a state's reason, a run's explanation).
_MOMENT = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})")


def times_in(text: Any) -> Markup:
    """``text`` escaped, each RFC 3339 moment in it shown as the console shows times."""
    if text is None:
        return Markup("")
    raw = str(text)
    parts: list[Markup] = []
    last = 0
    for match in _MOMENT.finditer(raw):
        parts.append(escape(raw[last:match.start()]))
        shown = time_element(match.group(0))
        parts.append(shown if str(shown) != "—" else escape(match.group(0)))
        last = match.end()
    parts.append(escape(raw[last:]))
    return Markup("").join(parts)


def field_value(value: Any) -> Any:
    """A value as a form field shows it: "" for none, 0 as 0, 30.0 as 30."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def duration(seconds: Any) -> str:
    """``3.2s``, ``4m 05s``, ``2h 10m``, ``3d 4h`` (``—`` when unknown)."""
    if not isinstance(seconds, int | float) or seconds < 0:
        return "—"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h"


#: A cookie's value stays well under the 4 KiB browsers keep.
FLASH_MAX = 3000


def set_flash(console: Console, response: Response, kind: str, message: str) -> Response:
    """A message the next page shows once (what an action did, or why it failed); signed,
    so another program on this host cannot plant one."""
    while True:
        raw = json.dumps({"kind": kind, "text": message}).encode()
        value = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        if len(value) <= FLASH_MAX:
            break
        message = message[: len(message) * 3 // 4] + "…"
    response.set_cookie(console.guard.flash_cookie, f"{value}.{console.guard.sign(value)}",
                        max_age=60, secure=console.guard.secure)
    return response


def take_flash(request: Request, guard: Guard) -> dict[str, str] | None:
    raw = request.cookies.get(guard.flash_cookie)
    if not raw or "." not in raw:
        return None
    value, _, mac = raw.rpartition(".")
    if not guard.signed(value, mac):
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
        return {"kind": str(data["kind"]), "text": str(data["text"])}
    except Exception:  # (signed by us: only a bug gets here; no message then)
        return None


__all__ = ["Console", "duration", "escape", "parse_time", "set_flash", "take_flash",
           "times_in"]
