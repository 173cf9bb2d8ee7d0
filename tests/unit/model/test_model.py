"""The workspace model in-process: the queue_run key, runner resolution, the service rules.

The service tests use a real SQLite file, the real RunQueue and a real
AgentRuntime whose runner is an in-process function (no child process), and
no queue loop: what a move queues stays queued, so the rows can be read back.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kandevd.bus import EventBus
from kandevd.config import build_config
from kandevd.model import (
    ConflictError,
    InvalidReference,
    LaunchRefused,
    NotFoundError,
    WorkspaceService,
    effective_runner,
    queue_run_key,
)
from kandevd.model.actions import ActionError, action_digest, validate_action
from kandevd.paths import HomeLayout
from kandevd.runqueue.live import Waker
from kandevd.runqueue.service import RunQueue
from kandevd.runtime import AgentRuntime, ExecutionSpec, InProcessRunner
from kandevd.runtime.specs import ECHO_AGENT
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.store.sqlite import Store

WAIT_S = 10.0


# -- the idempotency key ---------------------------------------------------------------

def test_queue_run_key_is_deterministic_and_independent_of_key_order() -> None:
    action = {"action": "queue_run", "reason": "review", "payload": {"b": 2, "a": 1}}
    reordered = {"payload": {"a": 1, "b": 2}, "reason": "review", "action": "queue_run"}
    key = queue_run_key("t1", "doing", "a1", action)
    assert key == queue_run_key("t1", "doing", "a1", dict(action))
    assert key == queue_run_key("t1", "doing", "a1", reordered)
    canonical = '{"action":"queue_run","payload":{"a":1,"b":2},"reason":"review"}'
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert key == f"queue_run:t1:doing:0:a1:{digest}"
    assert action_digest(action) == digest


@pytest.mark.parametrize("change", [
    {"task": "t2"}, {"step": "review"}, {"agent": "a2"},
    {"action": {"action": "queue_run", "reason": "other"}},
    {"action": {"action": "queue_run", "payload": {"n": 1}}},
    {"action": {"action": "queue_run", "target": "agent:a1"}},
])
def test_queue_run_key_changes_with_task_step_agent_and_action(change: dict[str, Any]) -> None:
    base = {"task": "t1", "step": "doing", "agent": "a1", "action": {"action": "queue_run"}}
    varied = {**base, **change}
    assert queue_run_key(base["task"], base["step"], base["agent"], base["action"]) != \
        queue_run_key(varied["task"], varied["step"], varied["agent"], varied["action"])


# -- runner resolution and action validation ---------------------------------------------

@pytest.mark.parametrize(("runner_agent_id", "step_agent_id", "expected"), [
    ("a1", "a2", "a1"), ("a1", None, "a1"), (None, "a2", "a2"), ("", "a2", "a2"),
    (None, None, None), ("", "", None),
])
def test_effective_runner(runner_agent_id: str | None, step_agent_id: str | None,
                          expected: str | None) -> None:
    assert effective_runner(runner_agent_id, step_agent_id) == expected


def test_validate_action_accepts_the_contract_shape_and_names_the_bad_path() -> None:
    full = {"action": "queue_run", "reason": "r", "payload": {"x": 1}, "target": "agent:a1"}
    assert validate_action(full) == full
    assert validate_action({"action": "queue_run", "target": "runner"})["target"] == "runner"
    for bad, where in [({"action": "launch"}, "step.action"),
                       ({"action": "queue_run", "target": "someone"}, "step.target"),
                       ({"action": "queue_run", "payload": []}, "step.payload"),
                       ({"action": "queue_run", "extra": 1}, "step")]:
        with pytest.raises(ActionError, match=rf"^{where}: "):
            validate_action(bad, "step")


# -- the service over a real store ----------------------------------------------------------

class Launched:
    """The in-process 'agent' of the launch tests: records specs, may block until released."""

    def __init__(self) -> None:
        self.specs: list[ExecutionSpec] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, spec: ExecutionSpec) -> tuple[int, str | None, float | None]:
        self.specs.append(spec)
        self.started.set()
        assert self.release.wait(WAIT_S)
        return 0, "done", 0.0


class Env:
    def __init__(self, tmp_path: Path, max_concurrent: int = 2,
                 location: str | None = None) -> None:
        self.config = build_config({"agents": {"fast": {"command": ["/bin/true"],
                                                        "timeout_s": 7, "env": {"X": "1"}}}},
                                   environ={})
        self.layout = HomeLayout(tmp_path / "home")
        self.store: Store = open_store(location or tmp_path / "kandevd.db")
        self.bus = EventBus()
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.bus.subscribe("*", lambda topic, payload: self.events.append((topic, payload)))
        self.agent = Launched()
        self.runtime = AgentRuntime(max_concurrent, 1.0, runner=InProcessRunner(self.agent))
        self.signals = 0
        self.queue = RunQueue(RunRepository(self.store, "boot"), self.runtime, self.config,
                              self.layout, self.bus, waker=Waker(self._count_signal))
        self.model = WorkspaceService(self.store, self.bus, self.queue, self.runtime,
                                      self.config, self.layout)

    def _count_signal(self) -> None:
        self.signals += 1

    def topics(self, prefix: str) -> list[dict[str, Any]]:
        return [payload for topic, payload in self.events if topic == prefix]

    def runs(self) -> list[dict[str, Any]]:
        return self.queue.repo.list(limit=500).items

    def seed(self, style: str = "custom") -> None:
        """ws1 with agents a1, a2; workflow wf1: todo (no agent) -> doing (a1, queue_run)."""
        m = self.model
        m.create_workspace({"id": "ws1", "name": "One"})
        m.create_agent({"id": "a1", "workspace_id": "ws1", "name": "A1"})
        m.create_agent({"id": "a2", "workspace_id": "ws1", "name": "A2", "profile": "fast"})
        m.create_workflow({"id": "wf1", "workspace_id": "ws1", "name": "Flow", "style": style,
                           "steps": [{"id": "todo", "name": "To do"},
                                     {"id": "doing", "name": "Doing", "agent_id": "a1",
                                      "on_enter": [{"action": "queue_run",
                                                    "payload": {"n": 1}}]},
                                     {"id": "review", "name": "Review",
                                      "on_enter": [{"action": "queue_run", "reason": "review",
                                                    "target": "agent:a2"}]},
                                     {"id": "done", "name": "Done",
                                      "on_enter": [{"action": "queue_run"}]}]})


@pytest.fixture
def env(tmp_path: Path, store_location: str) -> Iterator[Env]:
    made = Env(tmp_path, location=store_location)
    yield made
    made.agent.release.set()
    made.runtime.stop()
    made.store.close()


def test_task_events_carry_task_previous_and_changes(env: Env) -> None:
    env.seed()
    task = env.model.create_task({"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                                  "title": "Write"})
    assert task["step_id"] == "todo" and task["runner"] is None and task["state"] == "TODO"
    (created,) = env.topics("task.created")
    assert created["task"] == task and set(created["changes"]) == set(task)

    updated = env.model.update_task({"id": "t1", "runner_agent_id": "a2", "title": "Write"})
    (event,) = env.topics("task.updated")
    assert event["previous"] == task and event["task"] == updated
    assert sorted(event["changes"]) == ["runner", "runner_agent_id"]

    env.model.update_task({"id": "t1", "title": "Write"})  # nothing changed: no event
    assert len(env.topics("task.updated")) == 1


def test_move_publishes_step_and_runner_change_then_queues_once(env: Env) -> None:
    env.seed()
    env.model.create_task({"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                           "title": "Write"})
    first = env.model.move_task("t1", "doing")
    event = env.topics("task.updated")[-1]
    assert event["task"]["step_id"] == "doing" and event["previous"]["step_id"] == "todo"
    assert sorted(event["changes"]) == ["runner", "step_id"]
    (entry,) = first["actions"]
    assert entry["agent_id"] == "a1" and not entry["deduplicated"]
    (run,) = env.runs()
    assert run.id == entry["run_id"] and run.task_id == "t1"
    assert run.reason == "queue_run"
    assert run.payload == {"n": 1, "task_id": "t1", "workflow_step_id": "doing"}
    assert run.idempotency_key == queue_run_key(
        "t1", "doing", "a1", {"action": "queue_run", "payload": {"n": 1}}, 1)
    assert env.signals >= 1

    replay = env.model.move_task("t1", "doing")
    assert replay["actions"][0]["run_id"] == run.id and replay["actions"][0]["deduplicated"]
    assert len(env.runs()) == 1
    assert env.topics("task.updated")[-1]["changes"] == ["step_id"]


@pytest.mark.parametrize("style", ["kanban", "office", "custom"])
def test_explicit_target_is_honoured_for_every_style(env: Env, style: str) -> None:
    env.seed(style)
    env.model.create_task({"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                           "title": "Write", "runner_agent_id": "a1"})
    result = env.model.move_task("t1", "review")
    assert result["task"]["runner"] == "a1"
    (entry,) = result["actions"]
    assert entry["target"] == "agent:a2" and entry["agent_id"] == "a2"
    (run,) = env.runs()
    assert run.agent_id == "a2" and run.reason == "review"


def test_queue_run_without_runner_is_skipped_and_reported(
        env: Env, caplog: pytest.LogCaptureFixture) -> None:
    env.seed()
    env.model.create_task({"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                           "title": "Write"})
    with caplog.at_level("WARNING", logger="kandevd.model.actions"):
        result = env.model.move_task("t1", "done")
    assert result["actions"] == [{"action": "queue_run", "target": "runner",
                                  "skipped": "no_runner"}]
    assert env.runs() == []
    assert "queue_run skipped" in caplog.text


def test_runner_sql_agrees_with_python(env: Env) -> None:
    env.seed()
    env.model.create_task({"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                           "title": "On doing", "step_id": "doing"})
    env.model.create_task({"id": "t2", "workspace_id": "ws1", "workflow_id": "wf1",
                           "title": "Own runner", "step_id": "doing", "runner_agent_id": "a2"})
    env.model.create_task({"id": "t3", "workspace_id": "ws1", "workflow_id": "wf1",
                           "title": "Nobody"})
    tasks = env.model.list_tasks()["items"]
    assert {t["id"]: t["runner"] for t in tasks} == {"t1": "a1", "t2": "a2", "t3": None}
    assert [t["id"] for t in env.model.list_tasks(runner="a1")["items"]] == ["t1"]
    assert env.model.list_tasks(runner="a2", limit=1)["total"] == 1


def test_references_are_checked_and_named(env: Env) -> None:
    env.seed()
    env.model.create_workspace({"id": "ws2", "name": "Two"})
    env.model.create_agent({"id": "b1", "workspace_id": "ws2", "name": "B1"})
    cases = [
        (lambda: env.model.create_agent({"workspace_id": "nope", "name": "x"}),
         r"^workspace_id: workspace 'nope' does not exist"),
        (lambda: env.model.create_agent({"workspace_id": "ws1", "name": "x", "profile": "gpu"}),
         r"^profile: agent profile 'gpu' is not configured"),
        (lambda: env.model.create_task({"workspace_id": "ws1", "workflow_id": "wfx",
                                        "title": "x"}),
         r"^workflow_id: workflow 'wfx' does not exist"),
        (lambda: env.model.create_task({"workspace_id": "ws2", "workflow_id": "wf1",
                                        "title": "x"}),
         r"^workflow_id: workflow 'wf1' belongs to workspace 'ws1'"),
        (lambda: env.model.create_task({"workspace_id": "ws1", "workflow_id": "wf1",
                                        "title": "x", "step_id": "gone"}),
         r"^step_id: step 'gone' does not exist in workflow 'wf1'"),
        (lambda: env.model.create_task({"workspace_id": "ws1", "workflow_id": "wf1",
                                        "title": "x", "runner_agent_id": "b1"}),
         r"^runner_agent_id: agent 'b1' belongs to workspace 'ws2'"),
        (lambda: env.model.create_workflow({"workspace_id": "ws1", "name": "x",
                                            "style": "kanban",
                                            "steps": [{"id": "s", "name": "s"},
                                                      {"id": "s", "name": "again"}]}),
         r"^steps\.1\.id: step id 's' is used twice"),
        (lambda: env.model.create_workflow({"workspace_id": "ws1", "name": "x",
                                            "style": "kanban",
                                            "steps": [{"id": "s", "name": "s",
                                                       "agent_id": "b1"}]}),
         r"^steps\.0\.agent_id: agent 'b1' belongs to workspace 'ws2'"),
        (lambda: env.model.create_workflow({"workspace_id": "ws1", "name": "x",
                                            "style": "kanban",
                                            "steps": [{"id": "s", "name": "s", "on_enter": [
                                                {"action": "queue_run", "target": "agent:b1"}]}]}),
         r"^steps\.0\.on_enter\.0\.target: agent 'b1' belongs to workspace 'ws2'"),
        (lambda: env.model.update_workspace({"id": "ws2", "office_workflow_id": "wf1"}),
         r"^office_workflow_id: workflow 'wf1' is not a workflow of workspace 'ws2'"),
    ]
    for attempt, message in cases:
        with pytest.raises(InvalidReference, match=message):
            attempt()
    with pytest.raises(ConflictError, match="workspace 'ws1' already exists"):
        env.model.create_workspace({"id": "ws1", "name": "Again"})
    with pytest.raises(NotFoundError, match="task 'zz' does not exist"):
        env.model.move_task("zz", "doing")
    assert env.model.list_workflows()["total"] == 1  # nothing half-created


def test_office_workflow_id_set_and_cleared(env: Env) -> None:
    env.seed()
    set_ = env.model.update_workspace({"id": "ws1", "office_workflow_id": "wf1"})
    assert set_["office_workflow_id"] == "wf1"
    cleared = env.model.update_workspace({"id": "ws1", "office_workflow_id": ""})
    assert cleared["office_workflow_id"] == ""
    assert [e["changes"] for e in env.topics("workspace.updated")] == [
        ["office_workflow_id"], ["office_workflow_id"]]


def test_resuming_an_agent_signals_the_queue(env: Env) -> None:
    env.seed()
    paused = env.model.update_agent({"id": "a1", "status": "paused"})
    assert paused["status"] == "paused"
    before = env.signals
    resumed = env.model.update_agent({"id": "a1", "status": "active", "cooldown_s": 3})
    assert resumed["status"] == "active" and resumed["cooldown_s"] == 3.0
    assert env.signals == before + 1
    event = env.topics("agent.updated")[-1]
    assert sorted(event["changes"]) == ["cooldown_s", "status"] and event["agent"] == resumed


def test_launch_starts_the_runner_with_a_launch_spec_and_no_run(env: Env) -> None:
    env.seed()
    env.model.create_task({"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                           "title": "Write", "runner_agent_id": "a2"})
    done = threading.Event()
    env.bus.subscribe("task.launch_finished", lambda _t, _p: done.set())
    session_id = env.model.launch_task("t1", "hello")["session_id"]
    assert done.wait(WAIT_S)
    (spec,) = env.agent.specs
    assert spec.kind == "launch" and spec.key == session_id == spec.session_id
    assert dict(spec.stdin) == {"kind": "launch", "session_id": session_id, "agent_id": "a2",
                                "task_id": "t1", "workspace_id": "ws1", "message": "hello"}
    assert spec.cwd == env.layout.runs / session_id
    assert spec.log_path == env.layout.run_logs / f"{session_id}.log"
    assert spec.argv == ("/bin/true",) and spec.timeout_s == 7 and dict(spec.env) == {"X": "1"}
    assert env.runs() == []
    (finished,) = env.topics("task.launch_finished")
    assert finished["outcome"] == "succeeded" and finished["session_id"] == session_id


def test_launch_uses_the_echo_agent_for_a_profile_without_command(env: Env) -> None:
    env.seed()
    env.model.create_task({"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                           "title": "Write", "step_id": "doing"})
    env.model.launch_task("t1")
    assert env.agent.started.wait(WAIT_S)
    assert env.agent.specs[0].argv == ECHO_AGENT
    assert "message" not in env.agent.specs[0].stdin


def test_launch_refusals(env: Env) -> None:
    env.seed()
    env.model.create_task({"id": "t0", "workspace_id": "ws1", "workflow_id": "wf1",
                           "title": "No runner"})
    with pytest.raises(InvalidReference, match="has no runner"):
        env.model.launch_task("t0")
    env.model.create_task({"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                           "title": "Write", "runner_agent_id": "a1"})
    env.agent.release.clear()
    env.model.launch_task("t1")
    env.model.launch_task("t1")  # two slots: both start
    assert env.runtime.active == 2
    with pytest.raises(LaunchRefused, match=r"^runtime is full$"):
        env.model.launch_task("t1")
    env.agent.release.set()
    env.model.update_agent({"id": "a1", "status": "paused"})
    with pytest.raises(LaunchRefused, match="paused"):
        env.model.launch_task("t1")

