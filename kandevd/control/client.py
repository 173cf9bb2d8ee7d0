"""A small synchronous client for the control socket (used by the CLI and tests)."""

from __future__ import annotations

import itertools
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kandevd.net import unixaddr


class DaemonUnavailable(Exception):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"no kandevd is listening on {path}: {reason}")


class NoAnswer(DaemonUnavailable):
    """Connected and sent, but no answer came within the client's timeout."""

    def __init__(self, path: Path, timeout: float | None) -> None:
        Exception.__init__(self, f"kandevd on {path} took the request but gave no answer "
                                 f"within {timeout:g}s")


class RpcCallError(Exception):
    """The daemon answered with a JSON-RPC error object."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "error"))
        self.error = error
        self.code = error.get("code")
        self.kind = (error.get("data") or {}).get("kind")


class Client:
    """One connection; ``call`` sends a request and waits for its answer.

    The daemon closes a connection that stays idle (``control.idle_timeout_s``)
    or that it needs to make room at its connection cap, and it does so only
    between requests: a request it read is always answered. So when a
    connection that already served a call turns out closed before any answer
    byte arrives, the request was not run, and it is sent again once on a
    fresh connection.
    """

    def __init__(self, path: Path | str, *, timeout: float | None = 60.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._used = False
        self._connect()

    def _connect(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(self.timeout)
        try:
            with unixaddr.address(Path(self.path)) as where:
                self._sock.connect(where)
        except OSError as exc:
            self._sock.close()
            raise DaemonUnavailable(self.path, exc.strerror or str(exc)) from None
        self._reader = self._sock.makefile("rb")

    def _exchange(self, line: bytes) -> bytes | None:
        """Send ``line`` and read one answer line; None when closed before any byte."""
        try:
            self._sock.sendall(line)
            raw = self._reader.readline()
        except (BrokenPipeError, ConnectionResetError):
            return None
        except TimeoutError:
            raise NoAnswer(self.path, self.timeout) from None
        except OSError as exc:
            raise DaemonUnavailable(self.path, exc.strerror or str(exc)) from None
        return raw or None

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        request_id = next(self._ids)
        line = (json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method,
                            "params": params or {}}) + "\n").encode("utf-8")
        raw = self._exchange(line)
        if raw is None and self._used:  # closed while idle: the request was not run
            self.close()
            self._connect()
            raw = self._exchange(line)
        if raw is None:
            raise DaemonUnavailable(self.path, "connection closed before an answer")
        if not raw.endswith(b"\n"):
            raise DaemonUnavailable(self.path, "connection closed in the middle of an answer")
        self._used = True
        response = json.loads(raw)
        if "error" in response:
            raise RpcCallError(response["error"])
        return response.get("result")

    def subscribe(self, topics: list[str]) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
        """``events.subscribe``: its answer, and the notifications that follow it (the
        connection carries nothing else from then on; the iterator ends when the daemon
        closes it)."""
        answer = self.call("events.subscribe", {"topics": topics})
        self._sock.settimeout(None)  # (a quiet stream is no failure)

        def notifications() -> Iterator[dict[str, Any]]:
            while True:
                try:
                    raw = self._reader.readline()
                except OSError:
                    return
                if not raw.endswith(b"\n"):
                    return
                yield json.loads(raw)
        return answer, notifications()

    def close(self) -> None:
        self._reader.close()
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def call(path: Path | str, method: str, params: dict[str, Any] | None = None,
         *, timeout: float | None = 60.0) -> Any:
    with Client(path, timeout=timeout) as client:
        return client.call(method, params)
