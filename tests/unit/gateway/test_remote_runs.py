"""RemoteRuns on a real store (SQLite and PostgreSQL), a real queue and a test clock:
claims for a runner, the log's offsets, outcomes recorded once, silent runners."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kandevd.faults import Faults
from kandevd.gateway.endings import LogGap, UnknownExecution
from kandevd.gateway.protocol import Execution, token_hash
from kandevd.gateway.remote import NotRecorded, RemoteRuns
from kandevd.gateway.turns import TurnBoard
from kandevd.runs.labels import LABEL_PATTERN, bad_label, covers
from kandevd.store.runners import RunnerRow, Runners
from kandevd.store.turns import RemoteTurnRows
from tests.support.office import OfficeEnv


class Ticks:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env(tmp_path: Path, store_location: str) -> Iterator[OfficeEnv]:
    made = OfficeEnv(tmp_path, location=store_location)
    made.model.create_workspace({"id": "w", "name": "w"})
    made.model.create_agent({"id": "gpu1", "workspace_id": "w", "name": "gpu1",
                             "profile": "coder", "runs_on": ["gpu"]})
    made.model.create_agent({"id": "gpu2", "workspace_id": "w", "name": "gpu2",
                             "profile": "coder", "runs_on": ["gpu", "big"]})
    made.model.create_agent({"id": "here", "workspace_id": "w", "name": "here"})
    try:
        yield made
    finally:
        made.close()


def runner(env: OfficeEnv, name: str, *labels: str) -> RunnerRow:
    runners = Runners(env.store)
    runners.add(name, labels, token_hash(f"kdr_{name}"), env.clock())
    found = runners.by_token_hash(token_hash(f"kdr_{name}"))
    assert found is not None
    return found


def remote_runs(env: OfficeEnv, ticks: Ticks, dead_after_s: float = 30) -> RemoteRuns:
    board = TurnBoard(RemoteTurnRows(env.store, "me"), Runners(env.store), env.bus,
                      dead_after_s=dead_after_s, clock=env.clock)
    return RemoteRuns(env.queue, Runners(env.store), board, env.bus, env.layout,
                      dead_after_s=dead_after_s, clock=env.clock, monotonic=ticks)


def handed_run(env: OfficeEnv, ticks: Ticks | None = None
               ) -> tuple[RemoteRuns, RunnerRow, str, Execution]:
    """Runner ``box`` (gpu) with a run of ``gpu1`` handed to it (dead_after_s 30)."""
    remote = remote_runs(env, ticks or Ticks())
    box = runner(env, "box", "gpu")
    run_id = enqueue(env, "gpu1")
    [handed] = remote.poll(box, 0)
    return remote, box, run_id, handed


def last_line(env: OfficeEnv, run_id: str) -> str:
    """The last line of the run's log."""
    return (env.layout.run_logs / f"{run_id}.log").read_text().splitlines()[-1]


def enqueue(env: OfficeEnv, agent: str) -> str:
    return env.queue.enqueue(workspace_id="w", agent_id=agent, reason="r").run.id


def test_a_runner_takes_only_the_agents_its_labels_cover_and_the_queue_only_the_others(
        env: OfficeEnv) -> None:
    remote = remote_runs(env, Ticks())
    small = runner(env, "small", "gpu")
    first, second, local = enqueue(env, "gpu1"), enqueue(env, "gpu2"), enqueue(env, "here")
    # The daemon's own claims leave the labelled agents alone.
    claimed = env.repo.claim_batch(env.clock(), 10)
    assert [c.run.id for c in claimed] == [local]
    [handed] = remote.poll(small, 0, slots=5)
    assert handed["run_id"] == first and handed["profile"] == "coder"
    assert handed["stdin"]["agent_id"] == "gpu1" and handed["attempt"] == 1
    assert remote.poll(small, 0) == []  # gpu2 needs "big" too; gpu1 is busy now
    assert env.queue.get(second).status == "queued"
    assert env.queue.get(first).status == "claimed"


def test_a_poll_takes_up_to_its_free_slots_one_run_per_agent_oldest_first(
        env: OfficeEnv) -> None:
    remote = remote_runs(env, Ticks())
    big = runner(env, "big", "gpu", "big")
    runs = [enqueue(env, "gpu1"), enqueue(env, "gpu1"), enqueue(env, "gpu2")]
    handed = remote.poll(big, 0, slots=3)
    assert [h["run_id"] for h in handed] == [runs[0], runs[2]]  # gpu1's second waits
    assert len({h["id"] for h in handed}) == 2


def test_the_log_takes_each_byte_once_and_says_where_a_gap_starts(env: OfficeEnv) -> None:
    remote, box, run_id, handed = handed_run(env)
    assert remote.append_log(box, handed["id"], run_id, 0, b"hello ") == 6
    assert remote.append_log(box, handed["id"], run_id, 0, b"hello ") == 6  # a retry
    assert remote.append_log(box, handed["id"], run_id, 3, b"lo world\n") == 12
    with pytest.raises(LogGap) as gap:
        remote.append_log(box, handed["id"], run_id, 20, b"later")
    assert gap.value.received == 12
    log = (env.layout.run_logs / f"{run_id}.log").read_text()
    assert log.endswith("on runner box\nhello world\n")
    other = runner(env, "other", "gpu")
    with pytest.raises(UnknownExecution):  # not the other runner's
        remote.append_log(other, handed["id"], run_id, 12, b"x")


def test_an_outcome_is_recorded_once(env: OfficeEnv) -> None:
    remote, box, run_id, handed = handed_run(env)
    ending = {"outcome": "succeeded", "exit_code": 0, "summary": "done", "cost_cents": 2.5}
    assert remote.end(box, handed["id"], run_id, ending) is True
    assert remote.end(box, handed["id"], run_id, ending) is False
    run = env.queue.get(run_id)
    assert (run.status, run.output_summary, run.cost_cents) == ("finished", "done", 2.5)


def test_a_failure_follows_the_retry_policy_and_an_unknown_outcome_is_an_error(
        env: OfficeEnv) -> None:
    remote, box, run_id, handed = handed_run(env)
    assert remote.end(box, handed["id"], run_id, {"outcome": "made-up", "error": "boom"})
    run = env.queue.get(run_id)
    assert run.status == "queued" and run.scheduled_retry_at is not None  # retried later


def test_a_silent_runner_has_its_claims_rescued_and_its_late_report_changes_nothing(
        env: OfficeEnv) -> None:
    ticks = Ticks()
    remote = remote_runs(env, ticks, dead_after_s=30)
    box = runner(env, "box", "gpu")
    run_id = enqueue(env, "gpu1")
    [handed] = remote.poll(box, 0)
    def later(seconds: float) -> None:
        ticks.now += seconds
        env.clock.advance(seconds=seconds)

    later(29)
    assert remote.watch() == 0
    remote.heartbeat(box, [{"id": handed["id"], "run_id": run_id}])
    later(30)
    assert remote.watch() == 1
    run = env.queue.get(run_id)
    assert run.status == "queued" and run.attempt == 1  # the attempt counted
    assert "runner box was silent" in (run.error_message or "")
    # told as an outcome's retry is (events.subscribe's run.retry_scheduled)
    [told] = [payload["run"] for topic, payload in env.events
              if topic == "run.retry_scheduled"]
    assert told == run
    assert remote.end(box, handed["id"], run_id, {"outcome": "succeeded"}) is False
    assert env.queue.get(run_id).status == "queued"
    cancel, unknown = remote.heartbeat(box, [{"id": handed["id"], "run_id": run_id}])
    assert (cancel, unknown) == ([], [handed["id"]])  # stop it: it is not yours


def test_a_poll_held_for_a_runner_gone_silent_hands_it_nothing(env: OfficeEnv) -> None:
    """A poll the server holds is no sign of life: once the runner is silent for
    dead_after_s its runs are rescued, and the poll it left waiting does not take them
    again (they would go into a dead connection and be rescued once more, each time an
    attempt counted)."""
    ticks = Ticks()
    remote = remote_runs(env, ticks, dead_after_s=30)
    box = runner(env, "box", "gpu")
    run_id = enqueue(env, "gpu1")
    [handed] = remote.poll(box, 0)
    answers: list[list[Execution]] = []
    parked = threading.Event()
    waits = remote._work.wait

    def wait_for_a_change(timeout: float | None = None) -> bool:
        parked.set()  # (woken by a change only: the test moves the clock meanwhile)
        return waits(None)

    remote._work.wait = wait_for_a_change  # type: ignore[method-assign]
    held = threading.Thread(target=lambda: answers.append(remote.poll(box, 1000)))
    held.start()  # (its machine dies now: no heartbeat, no end)
    assert parked.wait(timeout=30)
    ticks.now += 31
    env.clock.advance(seconds=31)
    assert remote.watch() == 1
    with remote._work:  # (its look again, a second later at most)
        remote._work.notify_all()
    held.join(timeout=30)
    assert answers == [[]]
    run = env.queue.get(run_id)
    assert (run.status, run.attempt) == ("queued", 1), run
    assert handed["run_id"] == run_id


def test_a_removed_runners_runs_are_taken_back_once_it_is_silent_saying_so(
        env: OfficeEnv) -> None:
    ticks = Ticks()
    remote, _box, run_id, _handed = handed_run(env, ticks)
    assert Runners(env.store).remove("box")
    assert remote.watch() == 0  # (its agent may still run: it has not heard yet)
    ticks.now += 31
    env.clock.advance(seconds=31)
    assert remote.watch() == 1
    run = env.queue.get(run_id)
    assert (run.status, run.error_message) == \
        ("queued", "runner box was removed, then silent for 31s during the execution")


def test_a_poll_held_for_a_process_gone_before_a_new_hello_hands_it_nothing(
        env: OfficeEnv) -> None:
    """A runner killed and started again at once: the poll its killed process left
    waiting here must not take the next run into a dead connection (an attempt lost,
    15 s later)."""
    remote = remote_runs(env, Ticks())
    box = runner(env, "box", "gpu")
    remote.hello(box, [])
    answers: list[list[Execution]] = []
    parked = threading.Event()
    waits = remote._work.wait

    def wait_for_a_change(timeout: float | None = None) -> bool:
        parked.set()
        return waits(None)

    remote._work.wait = wait_for_a_change  # type: ignore[method-assign]
    held = threading.Thread(target=lambda: answers.append(remote.poll(box, 1000)))
    held.start()  # (the process is killed now)
    assert parked.wait(timeout=30)
    remote.hello(box, [])  # (the new process)
    held.join(timeout=30)
    assert answers == [[]]
    run_id = enqueue(env, "gpu1")
    remote._work.wait = waits  # type: ignore[method-assign]
    assert [e["run_id"] for e in remote.poll(box, 0)] == [run_id]  # (the new one's)


def test_a_runner_another_daemon_hears_from_is_not_silent(env: OfficeEnv) -> None:
    """Several daemons: the runner talks to another one, which keeps its last_seen_at."""
    ticks = Ticks()
    here, there = remote_runs(env, ticks), remote_runs(env, ticks)
    box = runner(env, "box", "gpu")
    run_id = enqueue(env, "gpu1")
    [handed] = there.poll(box, 0)
    for _ in range(4):
        ticks.now += 10
        env.clock.advance(seconds=10)
        there.heartbeat(box, [{"id": handed["id"], "run_id": run_id}])
        assert here.watch() == 0  # (this daemon never heard from it)
    assert env.queue.get(run_id).status == "claimed"
    # Silent now. What the other daemon stored may be a write interval old: this one
    # waits that much longer than dead_after_s before it takes the run back.
    ticks.now += 30
    env.clock.advance(seconds=30)
    assert here.watch() == 0
    ticks.now += here._seen_every
    env.clock.advance(seconds=here._seen_every)
    assert here.watch() == 1


def test_a_restarted_runner_that_lost_its_runs_has_them_rescued_at_hello(
        env: OfficeEnv) -> None:
    remote = remote_runs(env, Ticks())
    box = runner(env, "box", "gpu")
    run_id = enqueue(env, "gpu1")
    assert len(remote.poll(box, 0)) == 1
    assert remote.hello(box, []) == []
    assert env.queue.get(run_id).status == "queued"


def test_a_cancelled_run_is_stopped_on_its_runner(env: OfficeEnv) -> None:
    remote, box, run_id, handed = handed_run(env)
    env.queue.cancel(run_id, "not needed")
    cancel, _ = remote.heartbeat(box, [{"id": handed["id"], "run_id": run_id}])
    assert cancel == [handed["id"]]
    assert remote.end(box, handed["id"], run_id, {"outcome": "stopped"}) is True
    assert env.queue.get(run_id).status == "cancelled"


def test_a_run_cancelled_by_another_daemon_is_stopped_and_its_agent_waits_for_it(
        env: OfficeEnv) -> None:
    """Several daemons: one takes the cancel (no event reaches this one), the runner
    talks to this one. Its agent takes no other run until the runner stopped it."""
    remote, box, run_id, handed = handed_run(env)
    held = [{"id": handed["id"], "run_id": run_id}]
    env.queue.repo.cancel(run_id, "not needed", env.clock())  # (another daemon's)
    after = enqueue(env, "gpu1")
    assert remote.poll(box, 0) == []  # (before: handed at once, beside the first)
    explained = env.queue.explain(after)
    assert "agent_busy" in explained["blockers"] and \
        explained["details"]["agent_busy"] == run_id
    assert remote.heartbeat(box, held) == ([handed["id"]], [])  # (before: not told)
    assert remote.poll(box, 0) == []
    remote.end(box, handed["id"], run_id, {"outcome": "stopped"})
    assert env.queue.get(run_id).status == "cancelled"
    assert [e["run_id"] for e in remote.poll(box, 0)] == [after]


def test_a_restarted_daemon_keeps_a_cancelled_runs_agent_busy_until_its_runner_stopped_it(
        env: OfficeEnv) -> None:
    _remote, box, run_id, handed = handed_run(env)
    held = [{"id": handed["id"], "run_id": run_id}]
    env.queue.cancel(run_id, "not needed")
    after = enqueue(env, "gpu1")
    restarted = remote_runs(env, Ticks())  # (nothing in memory of the cancel)
    assert restarted.poll(box, 0) == []
    assert restarted.heartbeat(box, held) == ([handed["id"]], [])
    assert restarted.poll(box, 0) == []
    assert restarted.end(box, handed["id"], run_id, {"outcome": "stopped"}) is False
    assert [e["run_id"] for e in restarted.poll(box, 0)] == [after]
    assert Runners(env.store).stopping() == {}
    assert "ended" in last_line(env, run_id) and \
        "stopped (cancelled; it ended on runner box)" in last_line(env, run_id)


def test_a_cancel_committed_just_before_a_claim_is_seen_by_the_claim(env: OfficeEnv) -> None:
    """The claim itself leaves out an agent being stopped, not a look before it."""
    remote, box, run_id, handed = handed_run(env)
    after = enqueue(env, "gpu1")

    class CancelledMeanwhile(Runners):
        def remote_agents(self) -> dict[str, tuple[str, ...]]:
            if env.queue.get(run_id).status == "claimed":
                env.queue.repo.cancel(run_id, "another daemon's", env.clock())
            return super().remote_agents()

    ticks = Ticks()
    board = TurnBoard(RemoteTurnRows(env.store, "me"), Runners(env.store), env.bus,
                      dead_after_s=30, clock=env.clock)
    racing = RemoteRuns(env.queue, CancelledMeanwhile(env.store), board, env.bus, env.layout,
                        dead_after_s=30, clock=env.clock, monotonic=ticks)
    other = runner(env, "other", "gpu")
    assert racing.poll(other, 0) == []  # (before: the next run, beside the cancelled one)
    assert env.queue.get(run_id).status == "cancelled"
    remote.end(box, handed["id"], run_id, {"outcome": "stopped"})
    assert [e["run_id"] for e in racing.poll(other, 0)] == [after]


@pytest.mark.parametrize("how", ["hello without it", "not named for 15 s", "silent"])
def test_a_cancelled_runs_agent_is_free_once_its_runner_no_longer_holds_it(
        env: OfficeEnv, how: str) -> None:
    ticks = Ticks()
    remote = remote_runs(env, ticks, dead_after_s=30)
    box = runner(env, "box", "gpu")
    run_id = enqueue(env, "gpu1")
    assert len(remote.poll(box, 0)) == 1
    env.queue.cancel(run_id, "not needed")
    after = enqueue(env, "gpu1")
    assert remote.poll(box, 0) == []
    if how == "hello without it":
        remote.hello(box, [])
    elif how == "not named for 15 s":
        ticks.now += 14
        env.clock.advance(seconds=14)
        remote.heartbeat(box, [])
        assert remote.poll(box, 0) == []  # (a poll's answer may still be on its way)
        ticks.now += 2
        env.clock.advance(seconds=2)
        remote.heartbeat(box, [])
    else:
        ticks.now += 31
        env.clock.advance(seconds=31)
        assert remote.watch() == 0  # (nothing to rescue: the run is cancelled)
    assert Runners(env.store).stopping() == {}
    assert [e["run_id"] for e in remote.poll(box, 0)] == [after]
    said = {"hello without it": "restarted without it", "not named for 15 s":
            "no longer runs it", "silent": "was silent for 31s"}[how]
    assert "ended " in last_line(env, run_id) and said in last_line(env, run_id)


def test_another_runners_report_of_an_execution_changes_nothing(env: OfficeEnv) -> None:
    remote, box, run_id, handed = handed_run(env)
    other = runner(env, "other", "gpu")
    with pytest.raises(UnknownExecution):
        remote.append_log(other, handed["id"], run_id, 0, b"not mine")
    assert remote.end(other, handed["id"], run_id, {"outcome": "succeeded"}) is False
    assert env.queue.get(run_id).status == "claimed"
    assert remote.end(box, handed["id"], run_id, {"outcome": "succeeded"}) is True
    assert env.queue.get(run_id).status == "finished"


LABEL = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,8}", fullmatch=True)


@given(st.sets(LABEL, max_size=6), st.sets(LABEL, max_size=6))
def test_a_runner_covers_exactly_the_label_sets_it_includes(carried: set[str],
                                                            needed: set[str]) -> None:
    assert covers(carried, needed) == needed.issubset(carried)
    assert covers(carried | needed, needed)
    assert bad_label(carried) is None


@given(st.text(max_size=70) | st.from_regex(r"[a-z]{1,5}\n?", fullmatch=True))
def test_a_label_is_a_letter_or_digit_then_up_to_62_more(text: str) -> None:
    ok = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", text) is not None
    assert (bad_label([text]) is None) == ok
    schema_ok = re.search(LABEL_PATTERN, text) is not None  # (as jsonschema applies it)
    assert schema_ok == ok


def test_a_run_stopped_on_its_runner_without_a_cancel_is_a_failed_attempt(
        env: OfficeEnv) -> None:
    remote, box, run_id, handed = handed_run(env)
    assert remote.end(box, handed["id"], run_id, {"outcome": "stopped", "error": "fenced"})
    run = env.queue.get(run_id)
    assert run.status == "queued" and "stopped on runner box: fenced" in \
        (run.error_message or "")  # retried under the policy, not left claimed


@pytest.mark.parametrize("ending", [
    {"outcome": []}, {"outcome": "succeeded", "started_at": "0001-01-01T00:00:00+01:00"},
    {"outcome": "succeeded", "cost_cents": 10 ** 400}, {"exit_code": 2 ** 80},
    {"evaluation": "not an object", "summary": {"x": 1}}])
def test_any_end_a_runner_reports_is_recorded_never_raised(env: OfficeEnv,
                                                           ending: dict[str, object]) -> None:
    remote, box, run_id, handed = handed_run(env)
    assert remote.end(box, handed["id"], run_id, ending) is True  # type: ignore[arg-type]
    assert env.queue.get(run_id).status != "claimed"


def test_what_a_runner_no_longer_names_in_its_heartbeats_is_rescued(env: OfficeEnv) -> None:
    ticks = Ticks()
    remote = remote_runs(env, ticks)
    box = runner(env, "box", "gpu")
    run_id = enqueue(env, "gpu1")
    [_lost_answer] = remote.poll(box, 0)  # (the answer never reached the runner)
    remote.heartbeat(box, [])
    assert env.queue.get(run_id).status == "claimed"  # (it may be on its way)
    ticks.now += 16
    remote.heartbeat(box, [])
    run = env.queue.get(run_id)
    assert run.status == "queued" and "no longer holds it" in (run.error_message or "")


def test_an_outcome_the_database_refuses_is_sent_again_by_the_runner_not_kept_here(
        env: OfficeEnv) -> None:
    env.queue.outcomes.faults = Faults(fail_outcome_writes=1)  # the next write is refused
    remote, box, run_id, handed = handed_run(env)
    ending = {"outcome": "succeeded", "summary": "done"}
    with pytest.raises(NotRecorded):
        remote.end(box, handed["id"], run_id, ending)
    assert env.queue.get(run_id).status == "claimed"
    assert env.queue.outcomes.unrecorded() == 0  # (the runner holds it, not memory here)
    assert remote.end(box, handed["id"], run_id, ending) is True  # sent again
    run = env.queue.get(run_id)
    assert (run.status, run.output_summary) == ("finished", "done")
    log = (env.layout.run_logs / f"{run_id}.log").read_text()
    assert log.count("attempt 1 ended") == 1


def test_a_runner_that_gives_a_run_back_as_it_stops_is_handed_nothing_more(
        env: OfficeEnv) -> None:
    """Its poll in flight would take the run it gave back at once (an attempt started and
    ended unstarted in the log): it gets nothing until its next hello, and another runner
    takes the run."""
    remote, box, run_id, handed = handed_run(env)
    assert remote.end(box, handed["id"], run_id, {"outcome": "interrupted",
                                                  "error": "runner shutting down"})
    assert env.queue.get(run_id).status == "queued"
    assert remote.poll(box, 0) == []
    assert env.queue.get(run_id).status == "queued"
    other = runner(env, "other", "gpu")
    [taken] = remote.poll(other, 0)
    assert taken["run_id"] == run_id
    assert remote.end(other, taken["id"], run_id, {"outcome": "succeeded", "exit_code": 0})
    again = enqueue(env, "gpu1")
    assert remote.poll(box, 0) == []  # (still stopping)
    remote.hello(box, [])  # (restarted: it serves again)
    assert [h["run_id"] for h in remote.poll(box, 0)] == [again]
