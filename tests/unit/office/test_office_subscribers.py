"""Assignment subscribers, fed by the real workspace model's task events."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kandevd.office.subscribers import AssignmentSubscriber, task_assigned_key
from tests.support.office import OfficeEnv, seeded_env


@pytest.fixture
def env(tmp_path: Path, store_location: str) -> Iterator[OfficeEnv]:
    with seeded_env(tmp_path, location=store_location) as made:
        AssignmentSubscriber(made.store, made.queue).attach(made.bus)
        yield made


def _task(env: OfficeEnv, task_id: str, workflow_id: str, **fields: object) -> dict:
    return env.model.create_task({"id": task_id, "workspace_id": "ws1",
                                  "workflow_id": workflow_id, "title": task_id, **fields})


def test_office_task_with_step_runner_queues_one_task_assigned_run(env: OfficeEnv) -> None:
    _task(env, "t1", "office")
    (run,) = env.runs()
    assert run.reason == "task_assigned" and run.agent_id == "a1"
    assert run.task_id == "t1" and run.payload == {"task_id": "t1"}
    assert run.idempotency_key == task_assigned_key("t1", "a1") == "task_assigned:t1:a1"
    assert run.status == "queued"


def test_project_task_in_a_kanban_workflow_is_office(env: OfficeEnv) -> None:
    _task(env, "t1", "kanban", project_id="p1", runner_agent_id="a2")
    (run,) = env.runs()
    assert (run.agent_id, run.task_id) == ("a2", "t1")


@pytest.mark.parametrize("workflow_id", ["kanban", "custom"])
def test_ordinary_tasks_with_a_runner_get_nothing(env: OfficeEnv, workflow_id: str) -> None:
    _task(env, "t1", workflow_id)                              # step runner a1
    _task(env, "t2", workflow_id, runner_agent_id="a2")
    env.model.update_task({"id": "t1", "runner_agent_id": "a2"})
    env.model.move_task("t2", "free")
    env.model.move_task("t2", "todo")
    env.model.update_task({"id": "t2", "state": "DOING"})
    env.model.update_task({"id": "t2", "state": "TODO"})
    assert env.runs() == []
    assert len(env.topics("task.updated")) >= 5  # the events were there; Office ignored them


def test_not_todo_then_todo(env: OfficeEnv) -> None:
    _task(env, "t1", "office", state="DOING")
    assert env.runs() == []
    env.model.update_task({"id": "t1", "state": "TODO"})
    (run,) = env.runs()
    assert run.task_id == "t1" and run.agent_id == "a1"


def test_runner_assigned_later(env: OfficeEnv) -> None:
    _task(env, "t1", "office", step_id="free")
    assert env.runs() == []
    env.model.update_task({"id": "t1", "runner_agent_id": "a2"})
    (run,) = env.runs()
    assert run.agent_id == "a2"


def test_reassignment_queues_for_the_new_agent_and_replays_dedupe(env: OfficeEnv) -> None:
    _task(env, "t1", "office")
    env.model.update_task({"id": "t1", "runner_agent_id": "a2"})
    runs = env.runs()
    assert [(r.agent_id, r.idempotency_key) for r in runs] == [
        ("a1", "task_assigned:t1:a1"), ("a2", "task_assigned:t1:a2")]
    # The old runner's assignment that had not started is withdrawn.
    assert [(r.agent_id, r.status, r.cancel_reason) for r in env.runs()] == [
        ("a1", "cancelled", "reassigned"), ("a2", "queued", None)]
    env.model.update_task({"id": "t1", "runner_agent_id": "a1"})   # back to a1: new work
    runs = env.runs()
    assert [(r.agent_id, r.status, r.idempotency_key) for r in runs] == [
        ("a1", "cancelled", "task_assigned:t1:a1"), ("a2", "cancelled", "task_assigned:t1:a2"),
        ("a1", "queued", "task_assigned:t1:a1:attempt:1")]
    env.model.update_task({"id": "t1", "title": "renamed"})  # replays and edits add nothing
    assert len(env.runs()) == 3


def test_reassignment_leaves_a_started_assignment_to_finish(env: OfficeEnv) -> None:
    _task(env, "t1", "office")
    (first,) = env.runs()
    env.set_status(first.id, "claimed")
    env.model.update_task({"id": "t1", "runner_agent_id": "a2"})
    assert [(r.agent_id, r.status) for r in env.runs()] == [
        ("a1", "claimed"), ("a2", "queued")]


def test_unrelated_edit_of_an_assigned_task_queues_nothing_new(env: OfficeEnv) -> None:
    _task(env, "t1", "office")
    (first,) = env.runs()
    env.set_status(first.id, "finished")
    env.clock.advance(hours=30)  # past the key's 24 h window: only the filter prevents a rerun
    env.model.update_task({"id": "t1", "title": "renamed"})
    assert [r.id for r in env.runs()] == [first.id]


def test_task_moved_into_the_office_workflow_scope_by_a_project(env: OfficeEnv) -> None:
    _task(env, "t1", "kanban")
    assert env.runs() == []
    env.model.update_task({"id": "t1", "project_id": "p1"})
    (run,) = env.runs()
    assert run.agent_id == "a1" and run.task_id == "t1"


def test_runner_in_another_workspace_is_logged_not_raised(env: OfficeEnv,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    subscriber = AssignmentSubscriber(env.store, env.queue)
    env.model.create_workspace({"id": "ws2", "name": "Two"})
    env.model.create_agent({"id": "b1", "workspace_id": "ws2", "name": "b1"})
    task = {"id": "tx", "workspace_id": "ws1", "workflow_id": "office", "project_id": "",
            "state": "TODO", "runner": "b1"}
    with caplog.at_level("WARNING", logger="kandevd.office.assign"):
        subscriber.on_task_event("task.created", {"task": task, "changes": list(task)})
    assert env.runs() == []
    assert "cannot queue task_assigned for b1" in caplog.text
