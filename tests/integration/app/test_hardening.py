"""Bad input and odd homes, through the real daemon: precise errors, nothing lost."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kandevd.control.client import RpcCallError
from tests.support.daemon import DaemonProcess, run_cli

pytestmark = pytest.mark.integration


def test_missing_folders_and_an_example_home_are_private(tmp_path: Path) -> None:
    home = tmp_path / "a" / "b" / "home"
    result = run_cli(home, "init", "--example", "demo")
    assert result.returncode == 0, result.stderr
    for folder in (tmp_path / "a", tmp_path / "a" / "b", home):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE((home / "kandevd.yaml").stat().st_mode) == 0o600


def test_a_regular_file_where_the_socket_goes_is_never_deleted(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    precious = home / "kandevd.sock"
    precious.write_text("not a socket")
    daemon = DaemonProcess(home, {})
    daemon.start(wait_ready=False)
    assert daemon.wait() == 73
    assert "is not a socket" in daemon.log_text
    assert precious.read_text() == "not a socket"


def test_huge_offsets_nested_json_and_unknown_profiles_get_precise_errors(
        daemon_factory, tmp_path: Path) -> None:
    daemon = daemon_factory({"agents": {"default": {"timeout_s": 30},
                                        "gone": {"timeout_s": 30}}})
    with pytest.raises(RpcCallError) as huge:
        daemon.call("runs.list", {"offset": 2**63})
    assert huge.value.code == -32602 and "params.offset" in str(huge.value)
    assert daemon.call("runs.list", {"limit": 2.0})["limit"] == 2

    with daemon.client() as client:
        sock = client._sock
        sock.sendall(b"[" * 50_000 + b"\n")
        answer = client._reader.readline()
    assert b"-32700" in answer
    assert daemon.call("daemon.status")["state"] == "running"
    assert "Traceback" not in daemon.log_text


def test_an_agent_whose_profile_was_removed_fails_visibly(daemon_factory,
                                                           tmp_path: Path) -> None:
    home = tmp_path / "home"
    cfg = {"retry": {"max_retries": 0}, "agents": {"special": {"timeout_s": 30}}}
    daemon = daemon_factory(cfg, home=home)
    daemon.call("workspaces.create", {"id": "w", "name": "W",
                                      "office_workflow_id": "office-later"})
    daemon.call("agents.create", {"id": "a", "workspace_id": "w", "name": "A",
                                  "profile": "special", "status": "paused"})
    run = daemon.call("runs.enqueue", {"workspace_id": "w", "agent_id": "a",
                                       "reason": "r"})["run"]
    assert daemon.stop() == 0

    restarted = daemon_factory({"retry": {"max_retries": 0}}, home=home)  # 'special' removed
    restarted.call("agents.update", {"id": "a", "status": "active"})
    final = restarted.wait_until(
        lambda: (r := restarted.call("runs.get", {"id": run["id"]}))["status"] == "failed"
        and r, what="the run to fail")
    assert "agent profile 'special' is not configured" in final["error_message"]
    assert not os.path.exists(home / "logs" / "runs" / f"{run['id']}.log") or \
        "echo:" not in (home / "logs" / "runs" / f"{run['id']}.log").read_text()
    assert restarted.call("workspaces.get", {"id": "w"})["office_workflow_id"] == "office-later"
