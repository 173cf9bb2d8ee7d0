"""Unstarted-task recovery on a real store with an injected clock."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from kandevd.office.recovery import MAX_PER_TICK, UnstartedTaskRecovery
from kandevd.office.subscribers import AssignmentSubscriber
from tests.unit.office_env import OfficeEnv, seeded_env


@pytest.fixture
def env(tmp_path: Path) -> Iterator[OfficeEnv]:
    with seeded_env(tmp_path) as made:
        yield made


def recovery(env: OfficeEnv, lookback_hours: float = 24) -> UnstartedTaskRecovery:
    return UnstartedTaskRecovery(env.store, env.queue, lookback_hours=lookback_hours)


def test_exactly_one_run_across_ticks_and_restarts(env: OfficeEnv) -> None:
    env.insert_task("t1", "office")                    # no event: the subscriber never saw it
    result = recovery(env).tick(env.clock())
    assert result.scanned and result.acted == 1
    (run,) = env.runs()
    assert (run["reason"], run["agent_id"], run["task_id"]) == ("task_assigned", "a1", "t1")
    assert run["payload"] == {"task_id": "t1"}
    assert run["idempotency_key"] == "task_assigned:t1:a1"
    for _ in range(3):
        env.clock.advance(seconds=30)
        assert recovery(env).tick(env.clock()).acted == 0   # a fresh instance = a restart
    assert len(env.runs()) == 1


def test_subscriber_and_recovery_never_both(env: OfficeEnv) -> None:
    AssignmentSubscriber(env.store, env.queue).attach(env.bus)
    env.model.create_task({"id": "t1", "workspace_id": "ws1", "workflow_id": "office",
                           "title": "t1"})
    assert len(env.runs()) == 1
    assert recovery(env).tick(env.clock()).acted == 0
    assert len(env.runs()) == 1


def test_subscriber_key_dedupes_a_recovered_run(env: OfficeEnv) -> None:
    env.insert_task("t1", "office")
    recovery(env).tick(env.clock())
    subscriber = AssignmentSubscriber(env.store, env.queue)
    task = env.model.get_task("t1")
    subscriber.on_task_event("task.created", {"task": task, "changes": list(task)})
    assert len(env.runs()) == 1


@pytest.mark.parametrize("ended", ["failed", "cancelled"])
def test_failed_or_cancelled_runs_do_not_block(env: OfficeEnv, ended: str) -> None:
    env.insert_task("t1", "office")
    handler = recovery(env)
    handler.tick(env.clock())
    (first,) = env.runs()
    env.set_status(first["id"], ended)       # within the 24 h window of its key
    env.clock.advance(minutes=1)
    assert handler.tick(env.clock()).acted == 1
    second = env.runs(status="queued")[0]
    assert second["idempotency_key"] == "task_assigned:t1:a1:attempt:1"
    assert handler.tick(env.clock()).acted == 0          # the new one blocks again
    env.set_status(second["id"], ended)
    assert handler.tick(env.clock()).acted == 1
    assert env.runs(status="queued")[0]["idempotency_key"] == "task_assigned:t1:a1:attempt:2"
    assert len(env.runs()) == 3


@pytest.mark.parametrize("status", ["queued", "claimed", "finished"])
def test_any_live_or_finished_run_for_the_task_blocks(env: OfficeEnv, status: str) -> None:
    env.insert_task("t1", "office")
    other = env.queue.enqueue(workspace_id="ws1", agent_id="a2", reason="queue_run",
                              task_id="t1", payload={})
    if status != "queued":
        env.store.execute("UPDATE runs SET status = ? WHERE id = ?", (status, other.run["id"]))
    assert recovery(env).tick(env.clock()).acted == 0
    assert len(env.runs()) == 1


def test_not_for_kanban_custom_done_or_runnerless_tasks(env: OfficeEnv) -> None:
    env.insert_task("k1", "kanban")
    env.insert_task("k2", "kanban", runner="a2")
    env.insert_task("c1", "custom", runner="a2")
    env.insert_task("o_done", "office", state="DONE")
    env.insert_task("o_free", "office", step_id="free")      # Office, but no runner
    env.insert_task("o_nostep", "office", step_id=None)
    result = recovery(env).tick(env.clock())
    assert result.scanned and result.acted == 0
    assert env.runs() == []


def test_project_tasks_and_explicit_runners_are_recovered(env: OfficeEnv) -> None:
    env.insert_task("k1", "kanban", project_id="p1")
    env.insert_task("o1", "office", step_id="free", runner="a2")
    recovery(env).tick(env.clock())
    assert sorted((r["task_id"], r["agent_id"]) for r in env.runs()) == [
        ("k1", "a1"), ("o1", "a2")]


def test_lookback_window(env: OfficeEnv) -> None:
    now = env.clock()
    env.insert_task("old", "office", created_at=now - timedelta(hours=25))
    env.insert_task("recent", "office", created_at=now - timedelta(hours=23))
    recovery(env).tick(now)
    assert [r["task_id"] for r in env.runs()] == ["recent"]
    recovery(env, lookback_hours=26).tick(now)
    assert sorted(r["task_id"] for r in env.runs()) == ["old", "recent"]


def test_at_most_five_per_tick(env: OfficeEnv) -> None:
    for n in range(7):
        env.insert_task(f"t{n}", "office", created_at=env.clock() - timedelta(minutes=10 - n))
    handler = recovery(env)
    assert handler.tick(env.clock()).acted == MAX_PER_TICK == 5
    assert sorted(r["task_id"] for r in env.runs()) == [f"t{n}" for n in range(5)]  # oldest
    assert handler.tick(env.clock()).acted == 2
    assert handler.tick(env.clock()).acted == 0
    assert len(env.runs()) == 7


def test_unqueueable_tasks_do_not_starve_the_rest(env: OfficeEnv) -> None:
    env.model.create_workspace({"id": "ws2", "name": "Two"})
    env.model.create_agent({"id": "b1", "workspace_id": "ws2", "name": "b1"})
    for n in range(6):  # a runner of another workspace (rows written around the model)
        env.insert_task(f"bad{n}", "office", step_id="free", runner="b1",
                        created_at=env.clock() - timedelta(hours=1))
    env.insert_task("good", "office")
    assert recovery(env).tick(env.clock()).acted == 1
    assert [r["task_id"] for r in env.runs()] == ["good"]


def test_gate_without_adoption_is_one_query_and_no_scan(tmp_path: Path) -> None:
    env = OfficeEnv(tmp_path)
    try:
        env.seed()
        env.model.update_workspace({"id": "ws1", "office_workflow_id": ""})
        env.insert_task("k1", "kanban", project_id="")
        handler = recovery(env)
        results = []
        assert env.statements_during(lambda: results.append(handler.tick(env.clock()))) == 1
        assert results[0].scanned is False
        # adoption created at run time counts on the very next tick
        env.model.update_workspace({"id": "ws1", "office_workflow_id": "office"})
        env.insert_task("o1", "office")
        assert handler.tick(env.clock()).scanned
        assert [r["task_id"] for r in env.runs()] == ["o1"]
        env.model.update_workspace({"id": "ws1", "office_workflow_id": ""})
        env.insert_project("p1")
        assert handler.tick(env.clock()).scanned
    finally:
        env.close()
