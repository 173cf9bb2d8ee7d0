"""Unstarted-task recovery on a real store with an injected clock."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kandevd.office.recovery import (
    CANDIDATES,
    MAX_CHAINS_PER_TASK,
    MAX_PER_TICK,
    UnstartedTaskRecovery,
)
from kandevd.office.subscribers import AssignmentSubscriber
from kandevd.timeutil import rfc3339
from tests.support.office import OfficeEnv, seeded_env


@pytest.fixture
def env(tmp_path: Path, store_location: str) -> Iterator[OfficeEnv]:
    with seeded_env(tmp_path, location=store_location) as made:
        yield made


def recovery(env: OfficeEnv, lookback_hours: float = 24) -> UnstartedTaskRecovery:
    return UnstartedTaskRecovery(env.store, env.queue, lookback_hours=lookback_hours)


def test_exactly_one_run_across_ticks_and_restarts(env: OfficeEnv) -> None:
    env.insert_task("t1", "office")                    # no event: the subscriber never saw it
    result = recovery(env).tick(env.clock())
    assert result.scanned and result.acted == 1
    (run,) = env.runs()
    assert (run.reason, run.agent_id, run.task_id) == ("task_assigned", "a1", "t1")
    assert run.payload == {"task_id": "t1"}
    assert run.idempotency_key == "task_assigned:t1:a1"
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


def end_run(env: OfficeEnv, run_id: str, ended: str) -> None:
    """``failed``, or ``cancelled:<reason>`` as the repository would record it."""
    status, _, cancel_reason = ended.partition(":")
    env.set_status(run_id, status)
    if cancel_reason:
        env.store.execute("UPDATE runs SET cancel_reason = ? WHERE id = ?",
                          (cancel_reason, run_id))


@pytest.mark.parametrize("ended", ["failed", "cancelled:run_too_old", "cancelled:reassigned"])
def test_failed_too_old_or_withdrawn_runs_do_not_block(env: OfficeEnv, ended: str) -> None:
    env.insert_task("t1", "office")
    handler = recovery(env)
    handler.tick(env.clock())
    (first,) = env.runs()
    end_run(env, first.id, ended)         # within the 24 h window of its key
    env.clock.advance(minutes=1)
    assert handler.tick(env.clock()).acted == 1
    second = env.runs(status="queued")[0]
    assert second.idempotency_key == "task_assigned:t1:a1:attempt:1"
    assert handler.tick(env.clock()).acted == 0          # the new one blocks again
    end_run(env, second.id, ended)
    assert handler.tick(env.clock()).acted == 1
    assert env.runs(status="queued")[0].idempotency_key == "task_assigned:t1:a1:attempt:2"
    assert len(env.runs()) == 3


@pytest.mark.parametrize("reason", [None, "cancelled", "not needed any more", "RUN_TOO_OLD"])
def test_a_user_cancel_is_never_undone(env: OfficeEnv, reason: str | None) -> None:
    env.insert_task("t1", "office")
    handler = recovery(env)
    assert handler.tick(env.clock()).acted == 1
    (run,) = env.runs()
    env.queue.cancel(run.id, reason)      # runs.cancel, default reason or free text
    assert env.repo.get(run.id).cancel_reason == (reason or "cancelled")
    for _ in range(50):                       # ticks across most of the lookback window
        env.clock.advance(minutes=25)
        assert handler.tick(env.clock()).acted == 0
        assert recovery(env).tick(env.clock()).acted == 0      # nor after a restart
    assert [r.status for r in env.runs()] == ["cancelled"]


def test_the_enqueue_transaction_rechecks_the_rules(env: OfficeEnv) -> None:
    """A user cancel between the scan and the enqueue is not overruled."""
    env.insert_task("t1", "office")
    handler = recovery(env)
    handler.tick(env.clock())
    (run,) = env.runs()
    env.set_status(run.id, "failed")
    cutoff = rfc3339(env.clock() - timedelta(hours=24))
    other = env.queue.enqueue(workspace_id="ws1", agent_id="a2", reason="queue_run",
                              task_id="t1", payload={}).run
    env.queue.cancel(other.id)               # after the scan saw only the failed run
    assert handler._recover("t1", "ws1", "a1", cutoff) is False
    assert len(env.runs()) == 2


def test_a_cancel_without_a_recorded_reason_counts_as_the_users(env: OfficeEnv) -> None:
    env.insert_task("t1", "office")
    recovery(env).tick(env.clock())
    (run,) = env.runs()
    env.set_status(run.id, "cancelled")   # cancel_reason NULL: origin unknown, keep it
    assert recovery(env).tick(env.clock()).acted == 0


def test_only_the_latest_run_decides(env: OfficeEnv) -> None:
    env.insert_task("t1", "office")
    handler = recovery(env)
    handler.tick(env.clock())
    (first,) = env.runs()
    env.queue.cancel(first.id)             # the user cancels ...
    other = env.queue.enqueue(workspace_id="ws1", agent_id="a2", reason="queue_run",
                              task_id="t1", payload={}).run
    env.set_status(other.id, "failed")     # ... later work on the task supersedes it
    assert handler.tick(env.clock()).acted == 1
    latest = env.runs(status="queued")[0]
    env.queue.cancel(latest.id, "stop it")  # and a user cancel of that one holds again
    assert handler.tick(env.clock()).acted == 0


def test_a_withdrawn_run_is_void(env: OfficeEnv) -> None:
    """Reassigned to a2, whose enqueue failed: a1's withdrawn run leaves the task to recovery."""
    env.insert_task("t1", "office", step_id="free", runner="a1")
    handler = recovery(env)
    handler.tick(env.clock())
    AssignmentSubscriber(env.store, env.queue).withdraw("t1", "a1")
    (withdrawn,) = env.runs()
    assert (withdrawn.status, withdrawn.cancel_reason) == ("cancelled", "reassigned")
    env.store.execute("UPDATE tasks SET runner_agent_id = 'a2' WHERE id = 't1'")
    assert handler.tick(env.clock()).acted == 1
    assert [(r.agent_id, r.status) for r in env.runs()] == [
        ("a1", "cancelled"), ("a2", "queued")]


def test_at_most_three_chains_per_task(env: OfficeEnv,
                                       caplog: pytest.LogCaptureFixture) -> None:
    env.insert_task("t1", "office")
    handler = recovery(env)
    with caplog.at_level("INFO", logger="kandevd.office.recovery"):
        for chain in range(1, MAX_CHAINS_PER_TASK + 1):
            assert handler.tick(env.clock()).acted == 1
            (queued,) = env.runs(status="queued")
            env.set_status(queued.id, "failed")
            env.clock.advance(hours=1)
            assert f"chain {chain} of {MAX_CHAINS_PER_TASK}" in caplog.text
    assert MAX_CHAINS_PER_TASK == 3 and len(env.runs()) == 3
    assert "chain 3 of 3; no further recovery for it" in caplog.text
    caplog.clear()
    with caplog.at_level("DEBUG", logger="kandevd.office.recovery"):
        for _ in range(20):                   # not a 4th time, and silent about it
            env.clock.advance(minutes=30)
            assert handler.tick(env.clock()).acted == 0
    assert len(env.runs()) == 3
    assert caplog.text == ""


def test_chains_count_every_agent_and_not_withdrawals(env: OfficeEnv) -> None:
    env.insert_task("t1", "office", step_id="free", runner="a1")
    handler = recovery(env)
    handler.tick(env.clock())
    subscriber = AssignmentSubscriber(env.store, env.queue)
    subscriber.withdraw("t1", "a1")                    # void: not a chain
    env.store.execute("UPDATE tasks SET runner_agent_id = 'a2' WHERE id = 't1'")
    for _ in range(MAX_CHAINS_PER_TASK):
        assert handler.tick(env.clock()).acted == 1
        env.set_status(env.runs(status="queued")[0].id, "failed")
    env.store.execute("UPDATE tasks SET runner_agent_id = 'a1' WHERE id = 't1'")
    assert handler.tick(env.clock()).acted == 0        # 3 chains of the task, whoever ran them
    assert len(env.runs()) == 1 + MAX_CHAINS_PER_TASK


def test_chains_outside_the_lookback_window_do_not_count(env: OfficeEnv) -> None:
    now = env.clock()
    env.insert_task("t1", "office", created_at=now - timedelta(hours=1))
    for n in range(MAX_CHAINS_PER_TASK):
        run = env.queue.enqueue(workspace_id="ws1", agent_id="a1", reason="task_assigned",
                                task_id="t1", payload={"task_id": "t1"},
                                idempotency_key=f"old:{n}", coalesce=False).run
        env.set_status(run.id, "failed")
    env.store.execute("UPDATE runs SET requested_at = ?",
                      (rfc3339(now - timedelta(hours=30)),))
    assert recovery(env).tick(now).acted == 1


def test_exhausted_or_cancelled_tasks_do_not_starve_a_fresh_one(env: OfficeEnv) -> None:
    """More spent tasks than CANDIDATES, all older than the fresh task: the SQL skips them."""
    handler = recovery(env)
    old = env.clock() - timedelta(hours=2)
    spent = [f"x{n:02d}" for n in range(CANDIDATES + 5)]
    for n, task in enumerate(spent):
        env.insert_task(task, "office", created_at=old + timedelta(seconds=n))
        chains = 1 if n % 2 else MAX_CHAINS_PER_TASK  # odd: user-cancelled, even: exhausted
        for c in range(chains):
            run = env.queue.enqueue(workspace_id="ws1", agent_id="a1", reason="task_assigned",
                                    task_id=task, payload={"task_id": task},
                                    idempotency_key=f"{task}:{c}", coalesce=False).run
            if n % 2:
                env.queue.cancel(run.id)
            else:
                env.set_status(run.id, "failed")
    before = len(env.runs())
    env.insert_task("fresh", "office")
    assert handler.tick(env.clock()).acted == 1
    assert [r.task_id for r in env.runs()[before:]] == ["fresh"]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(outcomes=st.lists(st.sampled_from(
    ["failed", "cancelled:run_too_old", "cancelled:reassigned", "cancelled:user"]),
    min_size=1, max_size=8))
def test_property_recovery_is_bounded_and_respects_cancels(tmp_path_factory: pytest.TempPathFactory,
                                                           outcomes: list[str]) -> None:
    """Whatever happens to the runs recovery queues, the rules hold on every tick."""
    with seeded_env(tmp_path_factory.mktemp("prop")) as env:
        env.insert_task("t1", "office")
        handler = recovery(env)
        pending = iter(outcomes)
        for _ in range(len(outcomes) + 3):
            runs = env.runs(task_id="t1")
            latest = runs[-1] if runs else None
            chains = sum(1 for r in runs if r.cancel_reason != "reassigned")
            expected = not (latest is not None and latest.status == "cancelled"
                            and latest.cancel_reason not in ("reassigned", "run_too_old")) \
                and chains < MAX_CHAINS_PER_TASK
            assert handler.tick(env.clock()).acted == int(expected)
            env.clock.advance(minutes=10)
            queued = env.runs(status="queued")
            if not queued:
                continue
            ended = next(pending, "failed")
            end_run(env, queued[0].id, ended.replace(":user", ":no thanks"))
        runs = env.runs(task_id="t1")
        assert sum(1 for r in runs if r.cancel_reason != "reassigned") \
            <= MAX_CHAINS_PER_TASK


@pytest.mark.parametrize("status", ["queued", "claimed", "finished"])
def test_any_live_or_finished_run_for_the_task_blocks(env: OfficeEnv, status: str) -> None:
    env.insert_task("t1", "office")
    other = env.queue.enqueue(workspace_id="ws1", agent_id="a2", reason="queue_run",
                              task_id="t1", payload={})
    if status != "queued":
        env.store.execute("UPDATE runs SET status = ? WHERE id = ?", (status, other.run.id))
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
    assert sorted((r.task_id, r.agent_id) for r in env.runs()) == [
        ("k1", "a1"), ("o1", "a2")]


def test_lookback_window(env: OfficeEnv) -> None:
    now = env.clock()
    env.insert_task("old", "office", created_at=now - timedelta(hours=25))
    env.insert_task("recent", "office", created_at=now - timedelta(hours=23))
    recovery(env).tick(now)
    assert [r.task_id for r in env.runs()] == ["recent"]
    recovery(env, lookback_hours=26).tick(now)
    assert sorted(r.task_id for r in env.runs()) == ["old", "recent"]


def test_at_most_five_per_tick(env: OfficeEnv) -> None:
    for n in range(7):
        env.insert_task(f"t{n}", "office", created_at=env.clock() - timedelta(minutes=10 - n))
    handler = recovery(env)
    assert handler.tick(env.clock()).acted == MAX_PER_TICK == 5
    assert sorted(r.task_id for r in env.runs()) == [f"t{n}" for n in range(5)]  # oldest
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
    assert [r.task_id for r in env.runs()] == ["good"]


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
        assert [r.task_id for r in env.runs()] == ["o1"]
        env.model.update_workspace({"id": "ws1", "office_workflow_id": ""})
        env.insert_project("p1")
        assert handler.tick(env.clock()).scanned
    finally:
        env.close()
