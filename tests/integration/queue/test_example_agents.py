"""The example agents under examples/agents/ work as documented, through the real daemon."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.daemon import FAST_CONFIG, DaemonProcess

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[3] / "kandevd" / "examples" / "agents"


@pytest.mark.parametrize(("profile", "argv", "summary"), [
    ("py", [sys.executable, str(EXAMPLES / "agent.py")], "did 2 steps for run "),
    ("sh", [str(EXAMPLES / "agent.sh")], "handled run "),
])
def test_an_example_agent_runs_and_reports(daemon_factory: Callable[..., DaemonProcess],
                                           profile: str, argv: list[str],
                                           summary: str) -> None:
    config = {**FAST_CONFIG, "agents": {profile: {"command": argv, "timeout_s": 30}}}
    daemon = daemon_factory(config)
    daemon.call("workspaces.create", {"id": "ws", "name": "ws"})
    daemon.call("agents.create", {"id": "a1", "workspace_id": "ws", "name": "a1",
                                  "profile": profile})
    run = daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": "a1",
                                       "reason": "demo", "payload": {"steps": 2}})["run"]

    def finished() -> dict | None:
        got = daemon.call("runs.get", {"id": run["id"]})
        return got if got["status"] in ("finished", "failed") else None

    done = daemon.wait_until(finished, what="the example agent's run")
    assert done["status"] == "finished", done
    assert done["output_summary"] == summary + run["id"]
    assert done["cost_cents"] == 0
    log = Path(done["log_path"]).read_text()
    assert "agent: " in log  # its stderr progress lines are in the log
