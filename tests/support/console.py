"""The web console of a test daemon: its address, its token, and plain HTTP requests."""

from __future__ import annotations

import http.client
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.support.daemon import FAST_CONFIG
from tests.support.workflows import RECORDER

#: Where screenshots of the console's pages go (kept by CI as artifacts, never committed).
ARTIFACTS = Path(os.environ.get("KANDEVD_TEST_ARTIFACTS",
                                Path(__file__).resolve().parents[2] / "build" /
                                "test-artifacts")) / "console"


@dataclass(frozen=True)
class ConsoleAddress:
    url: str  # with ?token=

    @property
    def base(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def host(self) -> str:
        return urlsplit(self.url).netloc

    @property
    def token(self) -> str:
        return self.url.split("token=", 1)[1]

    @property
    def port(self) -> int:
        return int(urlsplit(self.url).port or 0)

    @property
    def cookie_name(self) -> str:
        """The session cookie's name: the console's own, by its port."""
        return f"kandevd_console_{self.port}"


def console_config(record: Path) -> dict[str, Any]:
    """A daemon serving its console on a free port, without retries; its default agent is
    the recorder (tests/support/agents/recorder.py, writing to ``record``) and its agent
    profile ``broken`` always fails."""
    return {**FAST_CONFIG, "web": {"listen": "127.0.0.1:0"},
            "retry": {"max_retries": 0},
            "agents": {"default": {"command": [sys.executable, RECORDER],
                                   "env": {"RECORD_FILE": str(record)}},
                       "broken": {"command": ["/bin/false"]}}}


def console_of(daemon: Any) -> ConsoleAddress:
    """The console of a started daemon, once it serves (its log says where)."""
    line = daemon.wait_for_line("web console at ")
    url = line.split("web console at ", 1)[1].strip()
    assert (daemon.home / "web.url").read_text().strip() == url
    return ConsoleAddress(url)


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: str


def request(address: ConsoleAddress, method: str, path: str, *, cookie: str | None = None,
            host: str | None = None, body: str | None = None,
            headers: dict[str, str] | None = None) -> Answer:
    parts = urlsplit(address.base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        sent = {"Host": address.host if host is None else host, **(headers or {})}
        if cookie:
            sent["Cookie"] = cookie
        if body is not None:
            sent["Content-Type"] = "application/x-www-form-urlencoded"
        conn.request(method, path, body=body, headers=sent)
        answer = conn.getresponse()
        return Answer(answer.status, answer.headers, answer.read().decode("utf-8", "replace"))
    finally:
        conn.close()


def sign_in(address: ConsoleAddress) -> str:
    """The cookie the token buys (``name=value``)."""
    answer = request(address, "GET", f"/?token={address.token}")
    assert answer.status == 200 and 'http-equiv="refresh"' in answer.body, answer.body
    cookie = answer.headers["Set-Cookie"]
    return cookie.split(";", 1)[0]
