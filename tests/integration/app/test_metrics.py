"""Metrics of a real daemon: ``daemon.metrics``, ``kandevd metrics``, /metrics and /health."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.daemon import FAST_CONFIG, DaemonProcess, assert_graceful, run_cli, seed_agents
from tests.support.metrics import http_get, samples

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_metrics_over_http_and_socket(daemon_factory: Callable[..., DaemonProcess]) -> None:
    port = free_port()
    daemon = daemon_factory({**FAST_CONFIG, "metrics": {"listen": f"127.0.0.1:{port}"}})
    seed_agents(daemon, "ws1", ["a1"])
    run = daemon.call("runs.enqueue", {"workspace_id": "ws1", "agent_id": "a1",
                                       "reason": "manual", "payload": {}})["run"]
    daemon.wait_until(lambda: daemon.call("runs.get", {"id": run["id"]})["status"]
                      == "finished", what="the run finished")
    base = f"http://127.0.0.1:{port}"
    # The execution's duration is observed once its outcome is settled, after the commit.
    finished_key = ("kandevd_execution_duration_seconds_count", (("outcome", "succeeded"),))
    daemon.wait_until(lambda: samples(http_get(base + "/metrics")[2]).get(finished_key) == 1,
                      what="the execution's duration observed")
    code, ctype, body = http_get(base + "/metrics")
    assert code == 200 and ctype.startswith("text/plain; version=")
    got = samples(body)
    assert got[("kandevd_up", ())] == 1
    assert got[("kandevd_runs", (("status", "finished"),))] == 1
    assert got[("kandevd_claims_total", ())] >= 1
    assert got[("kandevd_runtime_slots_max", ())] == 4
    assert got[finished_key] == 1
    assert http_get(base + "/health")[::2] == (200, "ok\n")

    over_socket = daemon.call("daemon.metrics")
    assert isinstance(over_socket, str)
    assert samples(over_socket)[("kandevd_runs", (("status", "finished"),))] == 1
    cli = run_cli(daemon.home, "metrics")
    assert cli.returncode == 0, cli.stderr
    assert ("kandevd_up", ()) in samples(cli.stdout)

    assert_graceful(daemon, daemon.stop())
    with pytest.raises(OSError):  # the listener is gone with its thread
        urllib.request.urlopen(base + "/health", timeout=2)


def test_port_in_use_is_exit_73(daemon_factory: Callable[..., DaemonProcess]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config: dict[str, Any] = {**FAST_CONFIG, "metrics": {"listen": f"127.0.0.1:{port}"}}
        daemon = daemon_factory(config, start=False)
        daemon.start(wait_ready=False)
        assert daemon.wait() == 73, daemon.log_text
    assert "metrics.listen" in daemon.log_text
    assert "Traceback" not in daemon.log_text
    assert not daemon.socket.exists()


def test_metrics_cli_without_daemon_is_69(tmp_path: Any) -> None:
    result = run_cli(tmp_path / "home", "metrics")
    assert result.returncode == 69


def test_bad_listen_is_exit_78(daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory({"metrics": {"listen": "127.0.0.1:70000"}}, start=False)
    daemon.start(wait_ready=False)
    assert daemon.wait() == 78
    assert "metrics.listen" in daemon.log_text
