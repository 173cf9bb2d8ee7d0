"""JSON-RPC 2.0 envelope, error codes and the application error classes.

Errors are values from a closed set (the supervisor habit): a handler raises
one of the :class:`RpcError` subclasses below, the server turns it into the
``error`` member of the response. A ``sqlite3.DatabaseError`` that escapes a
handler is :class:`Unavailable`, and so is an ``OSError`` (a file the method
needed: a full disk, an I/O error), with the file's path; anything else a
handler raises is logged with its traceback and answered as -32603 "internal
error" without one.

Every request line gets a precise answer: text that is not UTF-8 or holds an
unpaired surrogate (raw or as a ``\\ud800`` escape), ``NaN``/``Infinity``,
numbers that overflow to infinity and nesting deeper than
:data:`MAX_DEPTH` are -32700 before any method sees them, and
:func:`encode` never writes anything but standard JSON.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from kandevd.formats import jsonstrict

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
APPLICATION_ERROR = -32000

MAX_LINE_BYTES = 1024 * 1024
MAX_DEPTH = 64
"""Deepest nesting of arrays and objects in a request, the envelope included.

Far beyond any real payload, and far from Python's recursion limit, so that
nothing downstream (schema checks, ``json.dumps`` of a stored payload, the
response) can hit a RecursionError on a value the parser accepted."""
MAX_MESSAGE_CHARS = 2000
"""Error messages are cut there: one may quote a 1 MiB parameter."""


class RpcError(Exception):
    code = APPLICATION_ERROR
    kind = "error"

    def __init__(self, message: str, *, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.extra = data or {}

    def to_error(self) -> dict[str, Any]:
        message = self.message
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + "... (truncated)"
        return {"code": self.code, "message": message,
                "data": {"kind": self.kind, **self.extra}}


class ParseError(RpcError):
    code, kind = PARSE_ERROR, "parse_error"


class InvalidRequest(RpcError):
    code, kind = INVALID_REQUEST, "invalid_request"


class MethodNotFound(RpcError):
    code, kind = METHOD_NOT_FOUND, "method_not_found"


class InvalidParams(RpcError):
    code, kind = INVALID_PARAMS, "invalid_params"


class InternalError(RpcError):
    code, kind = INTERNAL_ERROR, "internal"


class NotFound(RpcError):
    kind = "not_found"


class Conflict(RpcError):
    kind = "conflict"


class Refused(RpcError):
    kind = "refused"


class ShuttingDown(RpcError):
    kind = "shutting_down"


class NotRunning(RpcError):
    kind = "not_running"


class AlreadyRunning(RpcError):
    kind = "already_running"


class Unavailable(RpcError):
    """The store failed (locked, corrupt, disk full, gone): nothing the caller did."""

    kind = "unavailable"


def file_unavailable(exc: OSError, *, writing: bool = False) -> Unavailable:
    """A file the method needed that the file system refused (a full disk, an I/O error,
    a read-only mount): ``unavailable`` with its path (also as ``data.path``), never
    -32603, since the file system failed, not the daemon. ``writing``: the method wrote
    it, atomically, so the file and the daemon's view of it are as they were."""
    path = str(exc.filename) if exc.filename else None
    reason = exc.strerror or str(exc) or type(exc).__name__
    if writing:
        message = f"cannot write{f' {path}' if path else ''}: {reason}; nothing was changed"
    else:
        message = f"{reason} ({path})" if path else reason
    return Unavailable(message, data={"path": path})


def success(request_id: Any, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def failure(request_id: Any, error: RpcError) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": error.to_error()}


def encode(message: dict[str, Any]) -> bytes:
    """One response line: standard JSON in UTF-8, or ValueError/TypeError.

    ``allow_nan=False`` and strict UTF-8 make a NaN or a lone surrogate that
    reached a result fail here, loudly, instead of going out as a line no
    strict reader can take back.
    """
    return (_ENCODER.encode(message) + "\n").encode("utf-8")


#: One encoder for every response (``json.dumps`` with options builds a new one each time).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


_BAD_TEXT = "invalid UTF-8 or unpaired surrogate"


def depth_exceeds(value: Any, limit: int) -> bool:
    """True when arrays/objects nest deeper than ``limit`` (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def loads_line(line: bytes) -> Any:
    """Decode and parse one request line strictly; ParseError when it is bad."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParseError(f"parse error: {_BAD_TEXT}: byte 0x{line[exc.start]:02x} at offset "
                         f"{exc.start} is not UTF-8") from None
    try:
        value = jsonstrict.loads(text)
    except jsonstrict.UnpairedSurrogate as exc:
        raise ParseError(f"parse error: {_BAD_TEXT}: {exc}") from None
    except RecursionError:
        raise ParseError(f"parse error: the JSON is nested too deeply (more than {MAX_DEPTH} "
                         "levels)") from None
    except ValueError as exc:  # JSONDecodeError, StrictJsonError, int digits limit
        raise ParseError(f"parse error: {exc}") from None
    # Depth can only exceed the limit when there are that many openers at all.
    if line.count(b"[") + line.count(b"{") > MAX_DEPTH and depth_exceeds(value, MAX_DEPTH):
        raise ParseError(f"parse error: the JSON is nested too deeply (more than {MAX_DEPTH} "
                         "levels)")
    return value


def parse_request(line: bytes) -> tuple[Any, str, dict[str, Any], bool]:
    """Validate one request line; return ``(id, method, params, is_notification)``.

    Raises ParseError / InvalidRequest (carrying the id when one was readable).
    """
    message = loads_line(line)
    if not isinstance(message, dict):
        raise InvalidRequest("invalid request: a request must be a JSON object")
    request_id = message.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int, float, type(None))):
        raise InvalidRequest("invalid request: id must be a string, a number or null")
    if message.get("jsonrpc") != "2.0":
        raise InvalidRequest('invalid request: "jsonrpc" must be "2.0"', data={"id": request_id})
    method = message.get("method")
    if not isinstance(method, str) or not method:
        raise InvalidRequest('invalid request: "method" must be a non-empty string',
                             data={"id": request_id})
    params = message.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise InvalidParams("invalid params: params must be a JSON object",
                            data={"id": request_id})
    extra = set(message) - {"jsonrpc", "id", "method", "params"}
    if extra:
        raise InvalidRequest(f"invalid request: unknown member(s) {sorted(extra)}",
                             data={"id": request_id})
    return request_id, method, params, "id" not in message


def reject(conn: socket.socket, message: str) -> None:
    """Tell a connection turned away why (``refused``, within a second), and close it."""
    try:
        conn.settimeout(1.0)
        conn.sendall(encode(failure(None, Refused(message))))
    except OSError:
        pass
    conn.close()
