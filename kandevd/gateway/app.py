"""The gateway's WSGI application: the runner protocol's routes (kandevd.gateway.protocol).

Each request is authenticated first: the bearer token's hash must name a
registered runner (compared in constant time after the lookup), so a removed
runner's next request is refused. Bodies are bounded by the intake
(:mod:`kandevd.net.httpintake`); a JSON body must be an object, and every field
is checked before use. Nothing a runner sends is executed here.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from kandevd.formats import jsonstrict
from kandevd.gateway import protocol
from kandevd.gateway.directory import home_problem
from kandevd.gateway.endings import LogGap, UnknownExecution
from kandevd.gateway.protocol import Held
from kandevd.gateway.remote import NotRecorded, RemoteRuns
from kandevd.net.httpintake import KEEP_ALIVE, MAX_BODY
from kandevd.store.base import is_environmental
from kandevd.store.runners import RunnerRow, Runners

log = logging.getLogger("kandevd.gateway")

StartResponse = Callable[..., Any]


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class GatewayApp:
    """``__call__(environ, start_response)``; one instance serves every request."""

    def __init__(self, remote: RemoteRuns, runners: Runners, *, version: str) -> None:
        self.remote = remote
        self.runners = runners
        self.version = version

    def __call__(self, environ: dict[str, Any], start_response: StartResponse
                 ) -> Iterable[bytes]:
        try:
            status, body = self._route(environ)
        except Refused as exc:
            status, body = exc.status, {"error": str(exc)}
        except Exception as exc:  # never a traceback to a runner; the log has it
            if isinstance(exc, OSError) or is_environmental(exc):
                log.warning("gateway: %s %s failed: %s", environ.get("REQUEST_METHOD"),
                            environ.get("PATH_INFO"), exc)
            else:
                log.exception("gateway: %s %s failed", environ.get("REQUEST_METHOD"),
                              environ.get("PATH_INFO"))
            status, body = 503, {"error": "the server could not do that now; try again"}
        if status == 204:
            start_response("204 No Content", [("Content-Length", "0")])
            return [b""]
        data = json.dumps(body).encode("utf-8")
        start_response(f"{status} {_REASONS.get(status, 'Error')}",
                       [("Content-Type", "application/json"),
                        ("Content-Length", str(len(data))), ("Cache-Control", "no-store")])
        return [data]

    def _route(self, environ: dict[str, Any]) -> tuple[int, Any]:
        if environ.get("REQUEST_METHOD") != "POST":
            raise Refused(405, "the runner protocol takes POST only")
        path = str(environ.get("PATH_INFO") or "")
        runner = self._runner(environ)
        environ[KEEP_ALIVE] = True  # a known runner's connection is kept
        home_id = str(environ.get(protocol.HOME_HEADER_ENVIRON) or "")[:64]
        taken = home_problem(self.remote.runners, runner, home_id,
                             hello=path == protocol.HELLO,
                             dead_after_s=self.remote.dead_after_s, now=self.remote.clock())
        if taken is not None:
            log.warning("gateway: %s refused: %s", path, taken)
            return 409, {"error": taken, "name_taken": True}
        if path == protocol.HELLO:
            body = _json(environ)
            gone = self.remote.hello(runner, _held(body))
            log.info("runner %s connected (labels %s, version %s)", runner.name,
                     ",".join(runner.labels) or "-", str(body.get("version", "?"))[:40])
            return 200, {"runner": runner.name, "labels": list(runner.labels),
                         "server_version": self.version,
                         "heartbeat_s": min(protocol.HEARTBEAT_S, self.remote.dead_after_s / 4),
                         "dead_after_s": self.remote.dead_after_s, "gone": gone}
        if path == protocol.BYE:
            self.remote.bye(runner)
            return 204, None
        if path == protocol.HEARTBEAT:
            cancel, unknown = self.remote.heartbeat(runner, _held(_json(environ)))
            return 200, {"cancel": cancel, "unknown": unknown}
        if path == protocol.POLL:
            body = _json(environ)
            wait, slots = body.get("wait_s", protocol.MAX_POLL_WAIT_S), body.get("slots", 1)
            if not isinstance(wait, int | float) or isinstance(wait, bool) or wait < 0:
                raise Refused(400, "wait_s: a number of seconds")
            if not isinstance(slots, int) or isinstance(slots, bool) or \
                    not 1 <= slots <= protocol.MAX_POLL_SLOTS:
                raise Refused(400, f"slots: 1 to {protocol.MAX_POLL_SLOTS}")
            handed = self.remote.poll(runner, min(float(wait), protocol.MAX_POLL_WAIT_S), slots)
            return (200, {"executions": handed}) if handed else (204, None)
        if path.startswith(protocol.EXECUTIONS):
            return self._execution(environ, runner, path[len(protocol.EXECUTIONS):])
        raise Refused(404, f"no such path: {path[:200]}")

    def _execution(self, environ: dict[str, Any], runner: RunnerRow, rest: str
                   ) -> tuple[int, Any]:
        execution_id, _, what = rest.partition("/")
        query = parse_qs(str(environ.get("QUERY_STRING") or ""))
        run_id = (query.get("run_id") or [""])[0]
        if not execution_id or not run_id:
            raise Refused(400, "an execution id and ?run_id= are needed")
        try:
            if what == "log":
                try:
                    offset = int((query.get("offset") or [""])[0])
                except ValueError:
                    raise Refused(400, "offset: a number of bytes") from None
                if offset < 0:
                    raise Refused(400, "offset: a number of bytes")
                data = _body(environ, protocol.MAX_LOG_CHUNK)
                try:
                    size = self.remote.append_log(runner, execution_id, run_id, offset, data)
                except LogGap as gap:
                    return 409, {"error": str(gap), "received": gap.received}
                return 200, {"received": size}
            if what == "end":
                try:
                    recorded = self.remote.end(runner, execution_id, run_id, _json(environ))
                except NotRecorded:
                    return 503, {"error": "the outcome could not be written now; send it "
                                          "again"}
                return 200, {"recorded": recorded}
        except UnknownExecution:
            raise Refused(404, f"no execution {execution_id[:80]} of runner "
                               f"{runner.name}") from None
        raise Refused(404, f"no such path: .../{what[:40]}")

    def _runner(self, environ: dict[str, Any]) -> RunnerRow:
        header = str(environ.get("HTTP_AUTHORIZATION") or "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.startswith(protocol.TOKEN_PREFIX):
            raise Refused(401, "a runner token is needed (Authorization: Bearer kdr_...)")
        wanted = protocol.token_hash(token.strip())
        runner = self.runners.by_token_hash(wanted)
        if runner is None or not hmac.compare_digest(runner.token_hash, wanted):
            raise Refused(401, "this runner token is not (or no longer) registered")
        return runner


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 409: "Conflict", 413: "Payload Too Large",
            503: "Service Unavailable"}


def _body(environ: dict[str, Any], limit: int = MAX_BODY) -> bytes:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise Refused(400, "a Content-Length is needed") from None
    if length > limit:
        raise Refused(413, f"the body is larger than {limit} bytes")
    return environ["wsgi.input"].read(length) if length > 0 else b""


def _json(environ: dict[str, Any]) -> dict[str, Any]:
    raw = _body(environ)
    try:  # (strict: no NaN, no number that overflows, no lone surrogate in a string)
        value = jsonstrict.loads(raw.decode("utf-8")) if raw else {}
    except RecursionError:
        raise Refused(400, "the body is not JSON (nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as exc:
        why = f" ({exc})" if isinstance(exc, jsonstrict.StrictJsonError) else ""
        raise Refused(400, f"the body is not JSON{why}") from None
    if not isinstance(value, dict):
        raise Refused(400, "the body must be a JSON object")
    return value


def _held(body: dict[str, Any]) -> list[Held]:
    items = body.get("running", [])
    if not isinstance(items, list) or len(items) > 1000:
        raise Refused(400, "running: a list of {id, run_id}")
    held: list[Held] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) \
                or not isinstance(item.get("run_id"), str):
            raise Refused(400, "running: a list of {id, run_id}")
        held.append({"id": item["id"][:200], "run_id": item["run_id"][:200]})
    return held
