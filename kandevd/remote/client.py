"""The runner's side of the runner protocol (kandevd.gateway.protocol), over urllib3.

urllib3 keeps the connections (kept alive by the gateway for a known runner)
and does the HTTP; TLS is the standard library's ``ssl`` (the system's CAs, or
``--ca-file``). Every call raises one of three errors a runner acts on:
:class:`TokenRefused` (401: stop, exit 77), :class:`Unreachable` (network,
5xx: try again later) and :class:`Rejected` (any other refusal: give up on that
request).
"""

from __future__ import annotations

import json
import ssl
from typing import Any
from urllib.parse import quote, urlsplit

import urllib3

from kandevd import __version__
from kandevd.gateway import protocol
from kandevd.gateway.protocol import Ending, Execution, Held

#: Seconds to connect; a poll's read waits longer than the server holds it; every other
#: request's read is short (a heartbeat must fail fast in a partition).
CONNECT_S = 5.0
POLL_READ_S = 30.0
READ_S = 10.0


class TokenRefused(Exception):
    """The server does not know this runner's token (revoked, or never registered)."""


class NameTaken(TokenRefused):
    """Another runner home serves this runner's name (one token, one runner process):
    the token is not this process's to use now, as when it is refused."""


class Unreachable(Exception):
    """The server could not be reached or could not answer now."""


class Rejected(Exception):
    """The server refused this one request (``status``: its HTTP status)."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body or {}


class GatewayClient:
    def __init__(self, server: str, token: str, *, ca_file: str | None = None) -> None:
        parts = urlsplit(server)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--server {server!r}: an http:// or https:// URL is needed")
        try:
            port = parts.port  # (a port out of range or not a number raises)
        except ValueError as exc:
            raise ValueError(f"--server {server!r}: {exc}") from None
        if not parts.hostname or port == 0:
            raise ValueError(f"--server {server!r}: a host (and a port from 1 to 65535) "
                             "is needed")
        if ca_file is not None and parts.scheme != "https":
            raise ValueError(f"--ca-file is for an https:// server, not {server!r}")
        self.base = f"{parts.scheme}://{parts.netloc}"
        self._headers = {"Authorization": f"Bearer {token}",
                         "User-Agent": f"kandevd-runner/{__version__}"}
        context = None
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=ca_file)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._pool = urllib3.PoolManager(
            maxsize=8, block=False, retries=False, ssl_context=context,
            timeout=urllib3.Timeout(connect=CONNECT_S, read=READ_S))
        self._poll_timeout = urllib3.Timeout(connect=CONNECT_S, read=POLL_READ_S)

    def serve_as(self, home_id: str) -> None:
        """Every request says it comes from runner home ``home_id`` (see ``NameTaken``)."""
        self._headers[protocol.HOME_HEADER] = home_id

    def hello(self, held: list[Held]) -> dict[str, Any]:
        return self._post(protocol.HELLO, {"version": __version__, "running": held})

    def bye(self) -> None:
        """This runner stops, holding nothing: the server shows it offline at once."""
        self._post(protocol.BYE, {})

    def heartbeat(self, held: list[Held]) -> dict[str, Any]:
        return self._post(protocol.HEARTBEAT, {"running": held})

    def poll(self, wait_s: float, slots: int = 1) -> list[Execution]:
        """Up to ``slots`` executions, the server waiting up to ``wait_s`` for the first."""
        answer = self._post(protocol.POLL, {"wait_s": wait_s, "slots": slots},
                            timeout=self._poll_timeout)
        handed = answer.get("executions") if answer else None
        return [e for e in handed if isinstance(e, dict)] \
            if isinstance(handed, list) else []  # type: ignore[misc]

    def send_log(self, execution_id: str, run_id: str, offset: int, data: bytes) -> int:
        """Append ``data`` at ``offset``; how much the server has (a 409 says so too)."""
        path = f"{self._execution(execution_id, run_id, 'log')}&offset={offset}"
        try:
            answer = self._request(path, data, "application/octet-stream")
        except Rejected as exc:
            if exc.status == 409 and isinstance(exc.body.get("received"), int):
                return int(exc.body["received"])
            raise
        return int(answer.get("received", offset + len(data)))

    def end(self, execution_id: str, run_id: str, ending: Ending) -> bool:
        answer = self._post(self._execution(execution_id, run_id, "end"), dict(ending))
        return bool(answer.get("recorded"))

    def close(self) -> None:
        self._pool.clear()

    # -- inside -------------------------------------------------------------------------
    @staticmethod
    def _execution(execution_id: str, run_id: str, what: str) -> str:
        return (f"{protocol.EXECUTIONS}{quote(execution_id, safe='')}/{what}"
                f"?run_id={quote(run_id, safe='')}")

    def _post(self, path: str, body: dict[str, Any], timeout: Any = None) -> dict[str, Any]:
        return self._request(path, json.dumps(body).encode("utf-8"), "application/json",
                             timeout)

    def _request(self, path: str, data: bytes, content_type: str, timeout: Any = None
                 ) -> dict[str, Any]:
        try:
            response = self._pool.request("POST", self.base + path, body=data,
                                          headers={**self._headers,
                                                   "Content-Type": content_type},
                                          **({"timeout": timeout} if timeout else {}))
        except urllib3.exceptions.HTTPError as exc:
            hint = ""
            if self.base.startswith("http://") and \
                    isinstance(exc, urllib3.exceptions.ProtocolError):
                # (a TLS gateway drops a request sent in the clear without a word, as
                # does a network that fails: said as a question)
                hint = "; if the gateway has tls_cert set, use an https:// URL"
            raise Unreachable(f"{self.base}: {exc}{hint}") from None
        if response.status == 204:
            return {}
        try:
            answer = json.loads(response.data.decode("utf-8")) if response.data else {}
        except (UnicodeDecodeError, ValueError):
            answer = {}
        answer = answer if isinstance(answer, dict) else {}
        message = str(answer.get("error") or f"HTTP {response.status}")
        if response.status == 401:
            raise TokenRefused(message)
        if response.status >= 500:
            raise Unreachable(f"{self.base}: {message}")
        if response.status == 409 and answer.get("name_taken") is True:
            raise NameTaken(message)
        if response.status >= 300:
            raise Rejected(response.status, message, answer)
        return answer
