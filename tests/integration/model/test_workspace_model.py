"""The workspace model over the real socket of a real daemon.

CRUD with its error codes, a step's ``queue_run`` processed by the global
queue loop (with the safety pass far away, so only the in-process signal can
explain a prompt claim), replayed moves that queue nothing new, and the
Kanban launch path running the echo agent without touching ``runs``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import RpcCallError
from tests.support.daemon import DaemonProcess, run_cli

pytestmark = pytest.mark.integration

# The safety pass is a minute away: anything claimed sooner was signalled.
CONFIG: dict[str, Any] = {
    "queue": {"safety_interval_s": 60},
    "runtime": {"max_concurrent": 4, "stop_grace_s": 1},
    "office": {"interval_s": 30},
}
WAIT_S = 20.0

Factory = Callable[..., DaemonProcess]


def error_of(daemon: DaemonProcess, method: str, params: dict[str, Any]) -> RpcCallError:
    with pytest.raises(RpcCallError) as caught:
        daemon.call(method, params)
    return caught.value


def seed(daemon: DaemonProcess, style: str = "custom") -> None:
    """ws1, agents a1 a2, workflow wf1: todo -> doing (a1, queue_run) -> review (to a2)."""
    daemon.call("workspaces.create", {"id": "ws1", "name": "One"})
    daemon.call("agents.create", {"id": "a1", "workspace_id": "ws1", "name": "A1"})
    daemon.call("agents.create", {"id": "a2", "workspace_id": "ws1", "name": "A2"})
    daemon.call("workflows.create", {
        "id": "wf1", "workspace_id": "ws1", "name": "Flow", "style": style,
        "steps": [
            {"id": "todo", "name": "To do"},
            {"id": "doing", "name": "Doing", "agent_id": "a1",
             "on_enter": [{"action": "queue_run", "reason": "work",
                           "payload": {"summary": "did it"}}]},
            {"id": "review", "name": "Review",
             "on_enter": [{"action": "queue_run", "target": "agent:a2"}]},
            {"id": "done", "name": "Done", "on_enter": [{"action": "queue_run"}]},
        ]})


def wait_run(daemon: DaemonProcess, run_id: str, status: str) -> dict[str, Any]:
    return daemon.wait_until(
        lambda: (lambda run: run if run["status"] == status else None)(
            daemon.call("runs.get", {"id": run_id})),
        timeout=WAIT_S, what=f"run {run_id} {status}")


def test_crud_round_trip_and_errors(daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)
    ws = daemon.call("workspaces.create", {"name": "Generated"})
    assert ws["id"].startswith("ws_") and ws["office_workflow_id"] == ""
    seed(daemon, "kanban")
    assert daemon.call("workspaces.get", {"id": "ws1"})["name"] == "One"
    page = daemon.call("workspaces.list", {"limit": 1, "offset": 1})
    assert page["total"] == 2 and page["limit"] == 1 and page["offset"] == 1
    assert [w["id"] for w in page["items"]] == ["ws1"]

    agent = daemon.call("agents.get", {"id": "a1"})
    assert (agent["profile"], agent["cooldown_s"], agent["status"]) == ("default", 0, "active")
    updated = daemon.call("agents.update", {"id": "a2", "status": "paused", "cooldown_s": 2.5})
    assert (updated["status"], updated["cooldown_s"]) == ("paused", 2.5)
    agents = daemon.call("agents.list", {"workspace_id": "ws1"})
    assert [a["id"] for a in agents["items"]] == ["a1", "a2"] and agents["total"] == 2
    assert daemon.call("agents.list", {"workspace_id": ws["id"]})["total"] == 0

    workflow = daemon.call("workflows.get", {"id": "wf1"})
    assert [s["id"] for s in workflow["steps"]] == ["todo", "doing", "review", "done"]
    assert workflow["steps"][1]["agent_id"] == "a1" and workflow["style"] == "kanban"
    assert daemon.call("workflows.list", {"workspace_id": "ws1"})["items"] == [workflow]

    task = daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws1",
                                        "workflow_id": "wf1", "title": "Write"})
    assert (task["step_id"], task["state"], task["project_id"], task["runner"]) == \
        ("todo", "TODO", "", None)
    task = daemon.call("tasks.update", {"id": "t1", "state": "IN_PROGRESS",
                                        "runner_agent_id": "a2"})
    assert task["runner"] == "a2" and task["state"] == "IN_PROGRESS"
    task = daemon.call("tasks.update", {"id": "t1", "runner_agent_id": None})
    assert task["runner"] is None and task["runner_agent_id"] is None
    assert daemon.call("tasks.get", {"id": "t1"}) == task
    assert daemon.call("tasks.list", {"workspace_id": "ws1"})["items"] == [task]

    office = daemon.call("workspaces.update", {"id": "ws1", "office_workflow_id": "wf1"})
    assert office["office_workflow_id"] == "wf1"
    assert daemon.call("workspaces.update", {"id": "ws1", "office_workflow_id": ""}
                       )["office_workflow_id"] == ""

    # unknown parameter / wrong type -> -32602
    bad = error_of(daemon, "agents.create", {"workspace_id": "ws1", "name": "x", "bogus": 1})
    assert bad.code == -32602 and bad.kind == "invalid_params" and "bogus" in str(bad)
    bad = error_of(daemon, "workflows.create", {"workspace_id": "ws1", "name": "x",
                                                "style": "waterfall", "steps": []})
    assert bad.code == -32602 and "style" in str(bad)
    bad = error_of(daemon, "workflows.create", {"workspace_id": "ws1", "name": "x",
                                                "style": "custom", "steps": [
                                                    {"id": "s", "name": "s", "on_enter": [
                                                        {"action": "queue_run",
                                                         "target": "nobody"}]}]})
    assert bad.code == -32602 and "params.steps.0.on_enter.0.target" in str(bad)
    # bad references -> -32602 naming the field
    bad = error_of(daemon, "tasks.create", {"workspace_id": "ws1", "workflow_id": "x",
                                            "title": "t"})
    assert bad.code == -32602 and str(bad) == "workflow_id: workflow 'x' does not exist"
    bad = error_of(daemon, "agents.create", {"workspace_id": "ws1", "name": "x",
                                             "profile": "gpu"})
    assert bad.kind == "invalid_params" and str(bad).startswith("profile: ")
    bad = error_of(daemon, "tasks.update", {"id": "t1", "runner_agent_id": "ghost"})
    assert bad.kind == "invalid_params" and str(bad).startswith("runner_agent_id: ")
    bad = error_of(daemon, "tasks.move", {"id": "t1", "step_id": "nowhere"})
    assert bad.kind == "invalid_params" and str(bad).startswith("step_id: ")
    bad = error_of(daemon, "workflows.create", {"workspace_id": "ws1", "name": "x",
                                                "style": "custom", "steps": [
                                                    {"id": "s", "name": "s",
                                                     "agent_id": "ghost"}]})
    assert bad.kind == "invalid_params" and str(bad).startswith("steps.0.agent_id: ")
    bad = error_of(daemon, "workspaces.update", {"id": ws["id"], "office_workflow_id": "wf1"})
    assert bad.kind == "invalid_params" and str(bad).startswith("office_workflow_id: ")
    # unknown ids -> not_found; a taken id -> conflict
    for method in ("workspaces.get", "agents.get", "workflows.get", "tasks.get"):
        missing = error_of(daemon, method, {"id": "zz"})
        assert missing.code == -32000 and missing.kind == "not_found"
    assert error_of(daemon, "agents.update", {"id": "zz", "status": "active"}).kind == \
        "not_found"
    assert error_of(daemon, "tasks.move", {"id": "zz", "step_id": "todo"}).kind == "not_found"
    taken = error_of(daemon, "tasks.create", {"id": "t1", "workspace_id": "ws1",
                                              "workflow_id": "wf1", "title": "again"})
    assert taken.code == -32000 and taken.kind == "conflict"

    # the same over `kandevd call`
    cli = run_cli(daemon.home, "call", "tasks.get", json.dumps({"id": "t1"}))
    assert cli.returncode == 0 and json.loads(cli.stdout) == task
    cli = run_cli(daemon.home, "call", "tasks.get", json.dumps({"id": "zz"}))
    assert cli.returncode == 1 and "not_found" in cli.stderr


def test_queue_run_of_a_custom_step_is_processed_by_the_global_loop(
        daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)
    seed(daemon, "custom")
    daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                                 "title": "Write"})
    moved = daemon.call("tasks.move", {"id": "t1", "step_id": "doing"})
    assert moved["task"]["step_id"] == "doing" and moved["task"]["runner"] == "a1"
    (entry,) = moved["actions"]
    assert entry["action"] == "queue_run" and entry["deduplicated"] is False
    run = wait_run(daemon, entry["run_id"], "finished")
    assert (run["agent_id"], run["task_id"], run["reason"]) == ("a1", "t1", "work")
    assert run["payload"] == {"summary": "did it", "task_id": "t1", "workflow_step_id": "doing"}
    assert run["output_summary"] == "did it"
    assert run["idempotency_key"].startswith("queue_run:t1:doing:1:a1:")

    replay = daemon.call("tasks.move", {"id": "t1", "step_id": "doing"})
    assert replay["actions"][0]["run_id"] == run["id"]
    assert replay["actions"][0]["deduplicated"] is True
    runs = daemon.call("runs.list", {"task_id": "t1"})
    assert runs["total"] == 1

    skipped = daemon.call("tasks.move", {"id": "t1", "step_id": "done"})
    assert skipped["task"]["runner"] is None
    assert skipped["actions"] == [{"action": "queue_run", "target": "runner",
                                   "skipped": "no_runner"}]
    daemon.wait_for_line("queue_run skipped", timeout=WAIT_S)
    assert daemon.call("runs.list", {})["total"] == 1


@pytest.mark.parametrize("style", ["kanban", "custom"])
def test_explicit_action_is_honoured_for_each_style(daemon_factory: Factory, style: str) -> None:
    daemon = daemon_factory(CONFIG)
    seed(daemon, style)
    daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                                 "title": "Write", "runner_agent_id": "a1"})
    # the runner target: the task's own runner_agent_id
    first = daemon.call("tasks.move", {"id": "t1", "step_id": "done"})["actions"][0]
    # an explicit agent target, not the runner
    second = daemon.call("tasks.move", {"id": "t1", "step_id": "review"})["actions"][0]
    assert (first["agent_id"], second["agent_id"]) == ("a1", "a2")
    for entry, agent in ((first, "a1"), (second, "a2")):
        run = wait_run(daemon, entry["run_id"], "finished")
        assert run["agent_id"] == agent and run["reason"] == "queue_run"
    assert daemon.call("runs.list", {"task_id": "t1"})["total"] == 2


def test_resuming_a_paused_agent_drains_its_queued_run_at_once(daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)
    seed(daemon)
    daemon.call("agents.update", {"id": "a1", "status": "paused"})
    daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                                 "title": "Write"})
    run_id = daemon.call("tasks.move", {"id": "t1", "step_id": "doing"})["actions"][0]["run_id"]
    explained = daemon.wait_until(
        lambda: (lambda e: e if "agent_paused" in e["blockers"] else None)(
            daemon.call("runs.explain", {"id": run_id})), timeout=WAIT_S, what="agent_paused")
    assert explained["eligible"] is False
    assert daemon.call("runs.get", {"id": run_id})["status"] == "queued"
    daemon.call("agents.update", {"id": "a1", "status": "active"})
    wait_run(daemon, run_id, "finished")


def test_launch_runs_the_echo_agent_and_leaves_runs_untouched(daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)
    seed(daemon, "kanban")
    daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                                 "title": "Write", "step_id": "doing"})
    session_id = daemon.call("tasks.launch", {"id": "t1", "prompt": "hello there"})["session_id"]
    log_path = daemon.home / "logs" / "runs" / f"{session_id}.log"
    text = daemon.wait_until(
        lambda: log_path.exists() and "echoed launch" in log_path.read_text() and
        log_path.read_text(), timeout=WAIT_S, what="the launch log")
    assert f"echo: launch {session_id}" in text
    assert 'echo: message "hello there"' in text
    assert f"KANDEVD_SESSION_ID={session_id}" in text
    daemon.wait_for_line(f"launch {session_id} of task t1 (agent a1) succeeded", timeout=WAIT_S)
    assert (daemon.home / "runs" / session_id).is_dir()
    assert daemon.call("runs.list", {}) == {"items": [], "total": 0, "limit": 50, "offset": 0}

    daemon.call("tasks.create", {"id": "t2", "workspace_id": "ws1", "workflow_id": "wf1",
                                 "title": "Nobody"})
    bad = error_of(daemon, "tasks.launch", {"id": "t2"})
    assert bad.kind == "invalid_params" and "no runner" in str(bad)
    assert error_of(daemon, "tasks.launch", {"id": "zz"}).kind == "not_found"
    with daemon.db() as conn:
        assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


def test_launch_is_refused_when_the_runtime_is_full(daemon_factory: Factory,
                                                    tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    # A launch that stays running until the daemon stops it.
    hold = ("import pathlib, sys, time; sys.stdin.read(); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    config = {**CONFIG, "runtime": {"max_concurrent": 1, "stop_grace_s": 0.5},
              "agents": {"default": {"command": None},
                         "hold": {"command": [sys.executable, "-c", hold]}}}
    daemon = daemon_factory(config)
    seed(daemon)
    daemon.call("agents.update", {"id": "a1", "profile": "hold"})
    daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                                 "title": "Write", "step_id": "doing"})
    daemon.call("tasks.launch", {"id": "t1"})
    daemon.wait_until(ready.exists, timeout=WAIT_S, what="the held launch")
    assert daemon.call("daemon.status")["runtime"]["active"] == 1
    full = error_of(daemon, "tasks.launch", {"id": "t1"})
    assert full.code == -32000 and full.kind == "refused" and str(full) == "runtime is full"
    assert daemon.stop() == 0
    assert "Graceful shutdown complete" in daemon.log_text.splitlines()[-1]
