"""The gateway's WSGI application called as a server calls it: what a request's body may
hold (strict JSON), on a real store and queue."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kandevd.gateway import protocol
from kandevd.gateway.app import GatewayApp
from kandevd.store.runners import Runners
from tests.support.office import OfficeEnv
from tests.unit.gateway.test_remote_runs import Ticks, remote_runs, runner


@pytest.fixture
def app(tmp_path: Path) -> Iterator[GatewayApp]:
    env = OfficeEnv(tmp_path)
    runner(env, "box", "gpu")
    try:
        yield GatewayApp(remote_runs(env, Ticks()), Runners(env.store), version="test")
    finally:
        env.close()


def post(app: GatewayApp, path: str, body: bytes) -> tuple[str, dict[str, Any]]:
    said: list[str] = []
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": path, "CONTENT_LENGTH": str(len(body)),
               "wsgi.input": io.BytesIO(body), "HTTP_AUTHORIZATION": "Bearer kdr_box"}
    answer = b"".join(app(environ, lambda status, headers: said.append(status)))
    return said[0], json.loads(answer) if answer else {}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_body_with_a_number_json_has_not_is_refused_at_once(app: GatewayApp,
                                                               constant: str) -> None:
    """(NaN as a poll's wait_s once held a server thread at full CPU for ever.)"""
    status, body = post(app, protocol.POLL, f'{{"wait_s": {constant}, "slots": 1}}'.encode())
    assert status.startswith("400"), (status, body)
    assert f"{constant.lstrip('-')} is not a JSON number" in body["error"]


def test_a_report_with_a_lone_surrogate_or_an_overflowing_number_is_refused(
        app: GatewayApp) -> None:
    """(A lone surrogate in an end's error once made the outcome unwritable: a 503 and a
    run left claimed.)"""
    for body, said in ((b'{"outcome": "failed", "error": "\\ud800"}', "lone surrogate"),
                       (b'{"wait_s": 1e999}', "out of range"),
                       (b'{"running": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                        "nested too deeply")):
        status, answer = post(app, protocol.POLL, body)
        assert status.startswith("400") and said in answer["error"], (status, answer)


def test_a_poll_with_a_finite_wait_is_answered(app: GatewayApp) -> None:
    status, _ = post(app, protocol.POLL, b'{"wait_s": 0, "slots": 1}')
    assert status.startswith("204")
