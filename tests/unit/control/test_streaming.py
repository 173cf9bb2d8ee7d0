"""A control connection that carries events: the server's side, on a real socket with
a real hub (no daemon): what a client gets, the subscriptions' cap, a disconnect that
frees its subscription, and a close that still sends what was buffered."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.registry import Registry
from kandevd.control.server import KEPT_FOR_REQUESTS, ControlServer
from kandevd.control.streaming import Streaming
from kandevd.events.hub import EventHub

TIMEOUT = 10.0


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ControlServer, EventHub]]:
    hub = EventHub()
    registry = Registry()

    def subscribe(params: dict[str, Any]) -> Streaming:
        subscription = hub.subscribe(params.get("topics", ["*"]))
        return Streaming({"subscription": subscription.id}, subscription,
                         lambda: hub.unsubscribe(subscription))

    registry.add("test.subscribe", subscribe)
    registry.add("test.ping", lambda p: {"pong": True})
    server = ControlServer(tmp_path / "t.sock", registry, max_connections=KEPT_FOR_REQUESTS + 1)
    server.start()
    hub.start()
    yield server, hub
    server.close()
    hub.stop()


def connect(server: ControlServer) -> tuple[socket.socket, Any]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT)
    sock.connect(str(server.path))
    return sock, sock.makefile("rb")


def ask(sock: socket.socket, reader: Any, method: str) -> dict[str, Any]:
    sock.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "method": method,
                             "params": {}}).encode() + b"\n")
    answer: dict[str, Any] = json.loads(reader.readline())
    return answer


def test_a_subscription_carries_events_and_its_disconnect_frees_it(served) -> None:
    server, hub = served
    sock, reader = connect(server)
    assert ask(sock, reader, "test.subscribe")["result"]["subscription"].startswith("sub-")
    hub.deliver("run.queued", "t1", {"id": "r1"})
    assert json.loads(reader.readline())["params"] == {"topic": "run.queued", "at": "t1",
                                                       "data": {"id": "r1"}}
    reader.close()
    sock.close()  # (the server's thread sees the end within WAIT_S and unsubscribes)
    end = time.monotonic() + TIMEOUT
    while (hub.count() or server.connection_count()) and time.monotonic() < end:
        time.sleep(0.05)
    assert hub.count() == 0 and server.connection_count() == 0


def test_subscriptions_never_take_the_connections_other_requests_need(served) -> None:
    server, _hub = served  # (room for KEPT_FOR_REQUESTS + 1 connections: one subscription)
    first, first_reader = connect(server)
    assert "result" in ask(first, first_reader, "test.subscribe")
    second, second_reader = connect(server)
    refused = ask(second, second_reader, "test.subscribe")
    assert refused["error"]["data"]["kind"] == "refused"
    assert "too many subscriptions" in refused["error"]["message"]
    third, third_reader = connect(server)
    assert ask(third, third_reader, "test.ping")["result"] == {"pong": True}
    for reader in (first_reader, second_reader, third_reader):
        reader.close()
    for sock in (first, second, third):
        sock.close()


def test_the_servers_close_still_sends_what_a_subscription_buffered(served) -> None:
    server, hub = served
    sock, reader = connect(server)
    ask(sock, reader, "test.subscribe")
    hub.deliver("daemon.stopping", "t", {"pid": 1})
    hub.stop()  # (the last batch into the subscriptions, as the daemon's stop does)
    server.close()
    lines = reader.read().splitlines()
    assert [json.loads(line)["params"]["topic"] for line in lines] == ["daemon.stopping"]
