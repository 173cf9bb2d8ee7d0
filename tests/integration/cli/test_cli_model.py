"""``kandevd workspaces|agents|workflows|tasks|office`` and ``call METHOD -`` on a real daemon.

Tables by default, the raw result with ``--json``; a human command's error is
one line naming the option, ``--json`` keeps the JSON-RPC error object.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import DaemonProcess, cli_json, cli_ok, run_cli

pytestmark = pytest.mark.integration

CONFIG: dict[str, Any] = {
    "queue": {"safety_interval_s": 60},
    "runtime": {"max_concurrent": 2, "stop_grace_s": 1},
    "office": {"interval_s": 30},
}

Factory = Callable[..., DaemonProcess]

STEPS = [{"id": "todo", "name": "To do"},
         {"id": "doing", "name": "Doing", "agent_id": "a1",
          "on_enter": [{"action": "queue_run", "reason": "work",
                        "payload": {"summary": "did it"}}]}]


def test_model_commands_round_trip(daemon_factory: Factory, tmp_path: Path) -> None:
    daemon = daemon_factory(CONFIG)
    home = daemon.home

    # workspaces: create / list / get / update
    assert "ws1" in cli_ok(home, "workspaces", "create", "--id", "ws1", "--name", "One")
    generated = cli_json(home, "workspaces", "create", "--name", "Other")
    assert generated["id"].startswith("ws_")
    listing = cli_ok(home, "workspaces", "list").splitlines()
    assert listing[0].split()[:2] == ["ID", "NAME"] and listing[-1] == "2 of 2 workspace(s)"
    assert any(line.startswith("ws1 ") for line in listing)
    assert cli_json(home, "workspaces", "list", "--limit", "1")["limit"] == 1
    assert cli_json(home, "workspaces", "get", "ws1")["name"] == "One"
    assert "Renamed" in cli_ok(home, "workspaces", "update", "ws1", "--name", "Renamed")
    assert daemon.call("workspaces.get", {"id": "ws1"})["name"] == "Renamed"

    # agents
    agent = cli_json(home, "agents", "create", "--workspace", "ws1", "--name", "A1",
                     "--id", "a1", "--cooldown", "0", "--status", "active")
    assert (agent["id"], agent["workspace_id"], agent["status"]) == ("a1", "ws1", "active")
    updated = cli_json(home, "agents", "update", "a1", "--cooldown", "2.5")
    assert updated["cooldown_s"] == 2.5
    shown = cli_ok(home, "agents", "get", "a1")
    assert any(line.split()[:2] == ["cooldown_s", "2.5"] for line in shown.splitlines())
    table = cli_ok(home, "agents", "list", "--workspace", "ws1")
    assert "a1" in table and table.splitlines()[-1] == "1 of 1 agent(s)"
    assert cli_json(home, "agents", "list")["total"] == 1
    # routed to runners on other machines, and back (docs/runners.md)
    routed = cli_json(home, "agents", "create", "--workspace", "ws1", "--name", "G",
                      "--id", "g1", "--runs-on", "gpu", "--runs-on", "big")
    assert routed["runs_on"] == ["gpu", "big"]
    assert cli_json(home, "agents", "update", "a1", "--runs-on", "gpu")["runs_on"] == ["gpu"]
    assert cli_json(home, "agents", "update", "g1", "--here")["runs_on"] is None
    assert cli_json(home, "agents", "update", "g1", "--cooldown", "1")["runs_on"] is None
    both = run_cli(home, "agents", "update", "g1", "--here", "--runs-on", "gpu")
    assert both.returncode == 2 and "--runs-on and --here exclude each other" in both.stderr
    bad = run_cli(home, "agents", "update", "g1", "--runs-on", "no spaces")
    assert bad.returncode == 1 and "--runs-on.0: 'no spaces' is not a label" in bad.stderr

    # a workflow with a queue_run step, from a file; a task moved into it queues a run
    steps_file = tmp_path / "flow.json"
    steps_file.write_text(json.dumps({"steps": STEPS}))
    made = cli_ok(home, "workflows", "create", "--workspace", "ws1", "--name", "Flow",
                  "--id", "wf1", "--from-file", str(steps_file))
    assert "doing" in made and "queue_run" in made
    other = cli_json(home, "workflows", "create", "--workspace", "ws1", "--name", "Inline",
                     "--style", "kanban", "--steps-json", json.dumps(STEPS[:1]))
    assert other["style"] == "kanban" and [s["id"] for s in other["steps"]] == ["todo"]
    assert cli_json(home, "workflows", "get", "wf1")["steps"][1]["agent_id"] == "a1"
    assert cli_json(home, "workflows", "list", "--workspace", "ws1")["total"] == 2

    task = cli_json(home, "tasks", "create", "--workspace", "ws1", "--workflow", "wf1",
                    "--title", "Write", "--id", "t1")
    assert task["step_id"] == "todo"
    moved = run_cli(home, "tasks", "move", "t1", "--step", "doing")
    assert moved.returncode == 0, moved.stderr
    head, action = moved.stdout.splitlines()
    assert head == "t1 -> doing (runner a1)" and action.startswith("queue_run: ")
    run_id = action.split()[1]
    run = daemon.call("runs.get", {"id": run_id})
    assert (run["agent_id"], run["task_id"]) == ("a1", "t1")
    assert cli_json(home, "tasks", "get", "t1")["step_id"] == "doing"
    assert "t1" in cli_ok(home, "tasks", "list", "--workflow", "wf1")
    assert cli_json(home, "tasks", "update", "t1", "--title", "Rewrite")["title"] == "Rewrite"

    # office: a project and a budget
    project = cli_json(home, "office", "projects", "create", "--workspace", "ws1",
                       "--name", "P", "--id", "p1")
    assert project["id"] == "p1"
    assert "p1" in cli_ok(home, "office", "projects", "list", "--workspace", "ws1")
    budget = cli_json(home, "office", "budgets", "create", "--workspace", "ws1",
                      "--scope-type", "agent", "--scope-id", "a1", "--limit-cents", "500",
                      "--period", "monthly", "--id", "b1")
    assert (budget["id"], budget["period"]) == ("b1", "monthly")
    budgets = cli_ok(home, "office", "budgets", "list", "--workspace", "ws1")
    assert "b1" in budgets and budgets.splitlines()[-1] == "1 of 1 budget(s)"
    assert cli_json(home, "office", "routines", "list")["total"] == 0


def test_errors_name_the_option_and_json_keeps_the_rpc_error(
        daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)
    home = daemon.home

    too_many = run_cli(home, "workspaces", "list", "--limit", "600")
    assert too_many.returncode == 1 and too_many.stdout == ""
    (line,) = too_many.stderr.splitlines()
    assert line.startswith("kandevd: --limit: ") and "500" in line, line

    raw = run_cli(home, "workspaces", "list", "--limit", "600", "--json")
    assert raw.returncode == 1
    error = json.loads(raw.stderr)
    assert error["code"] == -32602 and error["message"].startswith("params.limit")

    missing = run_cli(home, "agents", "get", "nobody")
    assert missing.returncode == 1
    (line,) = missing.stderr.splitlines()
    assert line.startswith("kandevd: ") and line.endswith("(not_found)"), line

    daemon.call("workspaces.create", {"id": "ws1", "name": "One"})
    no_workflow = run_cli(home, "tasks", "create", "--workspace", "ws1", "--workflow", "x",
                          "--title", "t")
    assert no_workflow.stderr.strip() == "kandevd: --workflow: workflow 'x' does not exist"

    no_steps = run_cli(home, "workflows", "create", "--workspace", "ws1", "--name", "n")
    assert no_steps.returncode == 2 and "--steps-json" in no_steps.stderr
    no_file = run_cli(home, "workflows", "create", "--workspace", "ws1", "--name", "n",
                      "--from-file", str(home / "no-such-steps.json"))
    assert no_file.returncode == 2 and "Traceback" not in no_file.stderr
    assert "Invalid value for '--from-file'" in no_file.stderr


def test_call_reads_params_from_stdin(daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)

    def call(method: str, stdin: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kandevd", "call", method, "-",
                               "--home", str(daemon.home)], input=stdin,
                              capture_output=True, text=True, timeout=60)

    made = call("workspaces.create", json.dumps({"id": "ws1", "name": "One"}))
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["id"] == "ws1"
    bad = call("workspaces.get", json.dumps({"id": "nope"}))
    assert bad.returncode == 1 and json.loads(bad.stderr)["data"]["kind"] == "not_found"
    not_json = call("workspaces.get", "{oops")
    assert not_json.returncode == 2 and "not valid JSON" in not_json.stderr
