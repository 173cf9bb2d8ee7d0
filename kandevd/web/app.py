"""The console's WSGI application: the checks every request passes, then its view.

In order: the ``Host`` must be one the console serves (421 otherwise: no DNS
rebinding); ``/static/`` files are served from the package (a fixed list);
the token signs a browser in, by POST to ``/login`` (the page ``kandevd web
open`` writes, or the sign-in form shown instead of a page) or in the URL
(``?token=``): either way the answer sets the cookie and is a page that moves
on (not a redirect: a ``SameSite=Strict`` cookie set by an answer to a link
from another site would not go with the redirect); without the cookie
nothing else is served (401, with the sign-in form); a POST needs the page's
CSRF token and, when the browser sends one, a same-origin ``Origin`` (403).
Only a signed-in request keeps its connection open (see
:mod:`kandevd.net.httpintake`). A control method's error becomes the message
shown on the page it came from.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from kandevd.control.protocol import RpcError
from kandevd.net.httpintake import KEEP_ALIVE
from kandevd.web import live
from kandevd.web.context import Console, set_flash
from kandevd.web.http import BadRequest, Request, Response, redirect, text
from kandevd.web.views import job, office, overview, runs, schedule_form, schedules

log = logging.getLogger("kandevd.web")

View = Callable[..., Response]

ROUTES: list[tuple[str, str, View]] = [
    ("GET", r"/", overview.page),
    ("GET", r"/fragments/overview", overview.fragment),
    ("GET", r"/events/overview", live.overview_events),
    ("POST", r"/events/leave", live.leave),
    ("GET", r"/schedules", schedules.index),
    ("POST", r"/schedules/pause", schedules.pause),
    ("GET", r"/schedules/new", schedule_form.new),
    ("POST", r"/schedules/new", schedule_form.create),
    ("GET", r"/schedules/preview", schedule_form.preview),
    ("GET", r"/schedules/(?P<job>[^/]+)", job.job),
    ("GET", r"/schedules/(?P<job>[^/]+)/edit", schedule_form.edit),
    ("POST", r"/schedules/(?P<job>[^/]+)/edit", schedule_form.update),
    ("POST", r"/schedules/(?P<job>[^/]+)/(?P<action>trigger|stop|enable|disable)",
     job.act),
    ("POST", r"/schedules/(?P<job>[^/]+)/delete", job.delete),
    ("POST", r"/schedules/(?P<job>[^/]+)/backfill", job.backfill),
    ("GET", r"/schedules/(?P<job>[^/]+)/runs/(?P<entry>[^/]+)", job.entry),
    ("GET", r"/events/turn/(?P<job>[^/]+)/(?P<entry>[^/]+)/(?P<index>[0-9]{1,4})",
     live.turn_log),
    ("GET", r"/runs", runs.index),
    ("GET", r"/fragments/runs", runs.fragment),
    ("GET", r"/events/runs", live.overview_events),
    ("GET", r"/runs/dead", runs.dead),
    ("POST", r"/runs/dead/retry", runs.retry_selected),
    ("POST", r"/runs/dead/retry-all", runs.retry_all),
    ("GET", r"/runs/(?P<run>[^/]+)", runs.run),
    ("POST", r"/runs/(?P<run>[^/]+)/(?P<action>cancel|retry)", runs.act),
    ("GET", r"/events/run/(?P<run>[^/]+)", live.run_log),
    ("GET", r"/agents", office.agents),
    ("POST", r"/agents/(?P<agent>[^/]+)/(?P<action>pause|resume)", office.agent_act),
    ("GET", r"/office", office.index),
]
_COMPILED = [(method, re.compile(pattern + r"\Z"), view) for method, pattern, view in ROUTES]

#: The only files under /static/ (nothing else of the package is reachable).
STATIC = {"console.css": "text/css; charset=utf-8",
          "console.js": "text/javascript; charset=utf-8",
          "sign-in.js": "text/javascript; charset=utf-8",
          "favicon.svg": "image/svg+xml"}


_PARAMETER = re.compile(r"\bparams\.(?:[a-z_]+\.)*([a-z_]+)")


def in_words(message: str) -> str:
    """A method's refusal for the console, which has fields, not params: ``params.to``
    (or ``params.schedule.jitter_s``) is shown as the field's label (“To”, “Jitter s”)."""
    return _PARAMETER.sub(lambda m: f"“{m.group(1).replace('_', ' ').capitalize()}”",
                          message)


class ConsoleApp:
    """The WSGI callable; one per console."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._static: dict[str, bytes] = {}

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        request = Request(environ)
        try:
            response = self.handle(request)
        except BadRequest as exc:
            response = text(str(exc), exc.status)
        except Exception:
            log.exception("console: %s %s failed", request.method, request.path)
            response = text("internal error (logged by the daemon)", 500)
        body = response.wsgi(start_response)
        if request.method == "HEAD":  # the headers only (a body would be read as the
            if hasattr(body, "close"):  # next answer on a kept connection)
                body.close()
            return []
        return body

    def handle(self, request: Request) -> Response:
        guard = self.console.guard
        if not guard.host_allowed(request.header("Host")):
            return text("this console does not serve that host name", 421)
        if request.path.startswith("/static/"):
            return self._static_file(request.path[len("/static/"):])
        if request.path == "/login" and request.method == "POST":
            return self._login(request)
        token = request.query.get("token")
        if token is not None:
            query = {k: v for k, v in request.query.items() if k != "token"}
            target = quote(request.path, safe="/:@") + ("?" + urlencode(query) if query else "")
            return self._sign_in(token, target)
        if not guard.cookie_matches(request.cookie_values(guard.cookie_name)):
            return self.console.fragment("sign_in.html", http_status=401,
                                         target=self._after_sign_in(request))
        request.environ[KEEP_ALIVE] = True
        if request.method == "POST":
            problem = self._csrf_problem(request)
            if problem:
                return text(problem, 403)
        elif request.method not in ("GET", "HEAD"):
            return text("method not allowed", 405)
        if request.method == "HEAD" and request.path.startswith("/events/"):
            return Response(b"", content_type="text/event-stream")  # (no stream opened)
        return self._route(request)

    def _after_sign_in(self, request: Request) -> str:
        """Where a browser signing in goes next: the page asked for; for a form sent while
        signed out, the page it was sent from (its action's address takes only a POST,
        which signing in does not repeat), when the browser says which page of this
        console that was; else the overview."""
        if request.method != "POST":
            return safe_back(request.url())
        referer = urlsplit(request.header("Referer") or "")
        if referer.netloc and referer.netloc == request.header("Host"):
            return safe_back(referer.path + (f"?{referer.query}" if referer.query else ""))
        return "/"

    def _sign_in(self, token: str, target: str, *, code: str | None = None) -> Response:
        guard = self.console.guard
        if not (guard.redeem(code) if code else guard.token_matches(token)):
            return self.console.fragment("sign_in.html", http_status=403, target=target,
                                         wrong="code" if code else "token")
        response = self.console.fragment("signed_in.html", target=target)
        response.set_cookie(guard.cookie_name, guard.cookie_value, secure=guard.secure)
        return response

    def _login(self, request: Request) -> Response:
        """The token by POST (the sign-in form), or a one-time code (``kandevd web open``):
        no URL carries it, so the browser's history does not keep it."""
        origin = request.header("Origin")
        if origin and origin != "null" and not self.console.guard.host_allowed(
                origin.split("://", 1)[-1]):
            return text("cross-origin request refused", 403)
        form = request.form
        return self._sign_in(form.get("token", ""), safe_back(form.get("next") or "/"),
                             code=form.get("code"))

    def _csrf_problem(self, request: Request) -> str | None:
        origin = request.header("Origin")
        if origin == "null":  # (a sandboxed frame, a local file: never the console's pages)
            return "cross-origin request refused"
        if origin:
            host = origin.split("://", 1)[-1]
            if not self.console.guard.host_allowed(host) or host != request.header("Host"):
                return "cross-origin request refused"
        supplied = request.header("X-CSRF-Token") or request.form.get("csrf")
        if not self.console.guard.csrf_matches(supplied):
            return "missing or wrong CSRF token: reload the page and try again"
        return None

    def _route(self, request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        allowed = False
        for route_method, pattern, view in _COMPILED:
            match = pattern.match(request.path)
            if match is None:
                continue
            if route_method != method:
                allowed = True
                continue
            try:
                return view(self.console, request, **match.groupdict())
            except RpcError as exc:
                return self._rpc_error(request, exc)
        if allowed:  # (a form's address opened as a page: say so, in the console's dress)
            return self.console.render(
                "error.html", request, http_status=405, title="Not a page",
                message=f"{request.path} takes a form's submission, not a visit: "
                        "go back to the page the form is on and send it from there.")
        return self.console.render("error.html", request, http_status=404, title="Not found",
                                   message=f"No page at {request.path}.")

    def _rpc_error(self, request: Request, exc: RpcError) -> Response:
        message = in_words(exc.message)
        if request.method == "POST":
            back = request.form.get("back") or request.path
            return set_flash(self.console, redirect(safe_back(back)), "error", message)
        status = 404 if exc.kind == "not_found" else 400
        return self.console.render("error.html", request, http_status=status,
                                   title="Not found" if status == 404 else "Error",
                                   message=message)

    def _static_file(self, name: str) -> Response:
        content_type = STATIC.get(name)
        if content_type is None:
            return text("no such file", 404)
        if name not in self._static:
            self._static[name] = (resources.files("kandevd.web") / "static" / name).read_bytes()
        return Response(self._static[name], content_type=content_type,
                        headers=[("Cache-Control", "max-age=300")])


def safe_back(path: str) -> str:
    """A redirect target of our own (a path on this console, never another site): plain
    printable ASCII starting with one ``/``."""
    if not path.startswith("/") or path.startswith("//") or "\\" in path \
            or not all(33 <= ord(c) < 127 for c in path) or path[1:2] in ("/", "\\"):
        return "/"
    return path
