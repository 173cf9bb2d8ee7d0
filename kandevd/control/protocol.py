"""JSON-RPC 2.0 envelope, error codes and the application error classes.

Errors are values from a closed set (the supervisor habit): a handler raises
one of the :class:`RpcError` subclasses below, the server turns it into the
``error`` member of the response. Anything else a handler raises is logged
with its traceback and answered as -32603 "internal error" without one.
"""

from __future__ import annotations

import json
from typing import Any

from kandevd import jsonstrict

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
APPLICATION_ERROR = -32000

MAX_LINE_BYTES = 1024 * 1024


class RpcError(Exception):
    code = APPLICATION_ERROR
    kind = "error"

    def __init__(self, message: str, *, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.extra = data or {}

    def to_error(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message,
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


def success(request_id: Any, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def failure(request_id: Any, error: RpcError) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": error.to_error()}


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")


def parse_request(line: bytes) -> tuple[Any, str, dict[str, Any], bool]:
    """Validate one request line; return ``(id, method, params, is_notification)``.

    Raises ParseError / InvalidRequest (carrying the id when one was readable).
    """
    try:
        message = jsonstrict.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ParseError(f"parse error: {exc}") from None
    except RecursionError:
        raise ParseError("parse error: the JSON is nested too deeply") from None
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
