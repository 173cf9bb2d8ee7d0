"""RunQueue + AgentRuntime (in-process runner) + QueueLoop.tick(now), stepped by hand.

No loop thread is started (except in the one test about the thread's start
and stop): the test calls ``tick(now)`` with the time it wants. The only
threads are the runtime's own workers; the in-process agent below can hold
an execution open until the test releases it, so "agent busy" is a real
state, not a timing accident. Every wait is on a condition the runtime or
the agent signals. The group-commit tests at the end start writer threads
on purpose: concurrency is what they are about.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from kandevd.bus import EventBus
from kandevd.config import AgentProfile, Config, build_config
from kandevd.paths import HomeLayout
from kandevd.runqueue.live import Waker
from kandevd.runqueue.loop import QueueLoop
from kandevd.runqueue.service import RunQueue
from kandevd.runs.model import RunConflict
from kandevd.runtime import AgentRuntime, ExecutionSpec, InProcessRunner
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.store.sqlite import Store
from kandevd.timeutil import after, parse_rfc3339
from tests.support.runs import T0, seed, set_agent

WAIT_S = 10.0
SAFETY_S = 5.0


class Clock:
    """The time every component sees; tests move it."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now = after(self.now, seconds)
        return self.now


class Agents:
    """The in-process agent: payload ``hold`` blocks until released, ``fail_times`` fails.

    It records the start order and the most executions it ever saw at once
    per agent, which must never exceed one.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.started: list[str] = []
        self.running: dict[str, str] = {}
        self.overlap: dict[str, int] = {}
        self.attempts: dict[str, int] = {}
        self._gates: dict[str, threading.Event] = {}
        self._all_released = False

    def gate(self, run_id: str) -> threading.Event:
        with self._cond:
            gate = self._gates.setdefault(run_id, threading.Event())
            if self._all_released:
                gate.set()
            return gate

    def release(self, run_id: str) -> None:
        self.gate(run_id).set()

    def release_all(self) -> None:
        """Release every execution, also those whose thread has not reached its gate
        yet (a claim's execution starts on a thread of its own)."""
        with self._cond:
            self._all_released = True
            gates = list(self._gates.values())
        for gate in gates:
            gate.set()

    def __call__(self, spec: ExecutionSpec) -> tuple[int, str | None, float | None]:
        payload, agent, run_id = spec.stdin["payload"], spec.stdin["agent_id"], spec.run_id
        with self._cond:
            self.started.append(run_id)
            self.attempts[run_id] = self.attempts.get(run_id, 0) + 1
            attempt = self.attempts[run_id]
            self.running[run_id] = agent
            same = sum(1 for a in self.running.values() if a == agent)
            self.overlap[agent] = max(self.overlap.get(agent, 0), same)
            self._cond.notify_all()
        try:
            if payload.get("hold"):
                assert self.gate(run_id).wait(WAIT_S), f"{run_id} was never released"
            code = 1 if attempt <= payload.get("fail_times", 0) else 0
            return code, payload.get("summary"), payload.get("cost")
        finally:
            with self._cond:
                del self.running[run_id]
                self._cond.notify_all()

    def wait_running(self, run_id: str) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: run_id in self.running, WAIT_S)


@dataclass
class Rig:
    store: Store
    repo: RunRepository
    runtime: AgentRuntime
    queue: RunQueue
    loop: QueueLoop
    clock: Clock
    agents: Agents
    events: list[tuple[str, dict[str, Any]]]
    signals: list[float]
    slot_cond: threading.Condition

    def enqueue(self, agent: str = "a1", **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("coalesce", False)
        kwargs.setdefault("reason", "manual")
        workspace = "ws2" if agent.startswith("b") else "ws1"
        return self.queue.enqueue(workspace_id=workspace, agent_id=agent, **kwargs).run

    def tick(self) -> float:
        return self.loop.tick(self.clock())

    def status(self, run_id: str) -> str:
        return self.repo.get(run_id).status

    def wait_until(self, predicate: Callable[[], bool], what: str = "condition") -> None:
        """Re-check whenever a runtime slot frees (the runtime's own signal)."""
        with self.slot_cond:
            assert self.slot_cond.wait_for(predicate, WAIT_S), f"timed out: {what}"

    def settle(self) -> None:
        """Wait until every execution that is not held open has ended."""
        self.wait_until(lambda: self.runtime.active == len(self.agents.running) and
                        all(self.agents.gate(r).is_set() is False
                            for r in self.agents.running), "executions to end")
        self.wait_until(lambda: self.runtime.active == self._held(), "slots to free")

    def _held(self) -> int:
        return sum(1 for r in self.agents.running if not self.agents.gate(r).is_set())


def make_config(**sections: Any) -> Config:
    document: dict[str, Any] = {
        "queue": {"safety_interval_s": SAFETY_S, "max_claims_per_tick": 10,
                  "stale_claim_s": 600},
        "retry": {"max_retries": 2, "delays_s": [10, 60], "jitter": 0.0, "max_age_s": 3600},
    }
    for name, values in sections.items():
        document.setdefault(name, {}).update(values)
    return build_config(document, environ={})


@pytest.fixture
def rig_factory(tmp_path: Path, store_location: str) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(max_concurrent: int = 4, config: Config | None = None) -> Rig:
        config = config or make_config()
        # The first rig on the test's backend; any further one on a SQLite file of its own.
        store = open_store(store_location if not made else tmp_path / f"kandevd-{len(made)}.db")
        seed(store, "ws1", "a1", "a2")
        seed(store, "ws2", "b1")
        repo = RunRepository(store, "boot-1")
        agents = Agents()
        slot_cond = threading.Condition()

        def slot_freed() -> None:
            queue.signal()  # as the daemon wires it
            with slot_cond:
                slot_cond.notify_all()

        runtime = AgentRuntime(max_concurrent, 5.0, runner=InProcessRunner(agents),
                               on_slot_free=slot_freed)
        clock = Clock(T0)
        bus = EventBus()
        events: list[tuple[str, dict[str, Any]]] = []
        bus.subscribe("*", lambda topic, data: events.append((topic, data)))
        signals: list[float] = []

        def waker() -> None:
            signals.append(1.0)
            loop.wake()

        queue = RunQueue(repo, runtime, config, HomeLayout(tmp_path / "home"), bus, clock=clock,
                         waker=Waker(waker))
        loop = QueueLoop(queue, safety_interval_s=config.queue.safety_interval_s,
                         max_claims_per_tick=config.queue.max_claims_per_tick)
        rig = Rig(store, repo, runtime, queue, loop, clock, agents, events, signals, slot_cond)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.agents.release_all()
        rig.runtime.stop()
        rig.store.close()


@pytest.fixture
def rig(rig_factory: Callable[..., Rig]) -> Rig:
    return rig_factory()


# -- dispatch --------------------------------------------------------------------------


def test_tick_claims_and_hands_runs_to_the_runtime_without_waiting(rig: Rig) -> None:
    a = rig.enqueue("a1", payload={"hold": True, "summary": "A", "cost": 2.5})
    b = rig.enqueue("b1", payload={"hold": True})
    assert rig.tick() == SAFETY_S  # returns while both agents are still running
    assert rig.runtime.active == 2
    assert rig.status(a.id) == rig.status(b.id) == "claimed"
    rig.agents.wait_running(a.id)
    rig.agents.release(a.id)
    rig.agents.release(b.id)
    rig.settle()
    finished = rig.repo.get(a.id)
    assert finished.status == "finished"
    assert (finished.output_summary, finished.cost_cents) == ("A", 2.5)
    assert finished.log_path.endswith(f"{a.id}.log")
    topics = [topic for topic, _ in rig.events]
    assert topics.count("run.queued") == 2
    assert topics.count("run.claimed") == 2
    assert topics.count("run.finished") == 2


def test_runs_are_executed_in_request_order_across_workspaces(rig_factory: Callable[..., Rig]
                                                              ) -> None:
    rig = rig_factory(max_concurrent=1)
    order = [rig.enqueue(agent).id for agent in ["b1", "a1", "a2", "b1", "a1"]]
    while rig.repo.list(status="queued").total:
        rig.tick()
        rig.settle()
    assert rig.agents.started == order
    assert {rig.status(r) for r in order} == {"finished"}


def test_an_agent_runs_one_run_at_a_time(rig: Rig) -> None:
    first = rig.enqueue("a1", payload={"hold": True})
    second = rig.enqueue("a1")
    other = rig.enqueue("b1")
    rig.tick()
    assert rig.status(first.id) == "claimed"
    assert rig.status(second.id) == "queued"  # a1 is busy
    rig.settle()
    assert rig.status(other.id) == "finished"  # b1 was not held up by a1
    assert "agent_busy" in rig.queue.explain(second.id)["blockers"]
    rig.tick()
    assert rig.status(second.id) == "queued"
    before = len(rig.signals)
    rig.agents.release(first.id)
    rig.settle()
    assert len(rig.signals) > before  # a finished run signals the loop
    rig.tick()
    rig.settle()
    assert rig.status(second.id) == "finished"
    assert rig.agents.overlap == {"a1": 1, "b1": 1}


def test_max_claims_per_tick_bounds_a_tick(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(config=make_config(queue={"max_claims_per_tick": 2}))
    runs = [rig.enqueue(agent, payload={"hold": True}) for agent in ["a1", "a2", "b1"]]
    assert rig.tick() == 0.0  # there may be more work right now
    assert [rig.status(r.id) for r in runs] == ["claimed", "claimed", "queued"]
    assert rig.tick() == SAFETY_S
    assert rig.status(runs[2].id) == "claimed"


def test_a_full_runtime_claims_nothing(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(max_concurrent=1)
    busy = rig.enqueue("a1", payload={"hold": True})
    waiting = rig.enqueue("b1")
    rig.tick()
    rig.tick()
    row = rig.store.query_one("SELECT status, attempt FROM runs WHERE id = ?", (waiting.id,))
    assert (row["status"], row["attempt"]) == ("queued", 0)  # never claimed, not even briefly
    assert rig.queue.explain(waiting.id)["blockers"] == ["runtime_full"]
    rig.agents.release(busy.id)
    rig.settle()
    assert rig.queue.explain(waiting.id) == {"eligible": True, "blockers": [], "details": {}}
    rig.tick()
    rig.settle()
    assert rig.status(waiting.id) == "finished"


def test_a_full_runtime_waits_for_its_freed_slot_not_for_a_due_cooldown(
        rig_factory: Callable[..., Rig]) -> None:
    """While every slot runs, a pass neither claims nor looks up the next due time: the
    freed slot wakes the loop, and the cooldown is looked up then."""
    rig = rig_factory(max_concurrent=1)
    set_agent(rig.store, "b1", cooldown_s=2.0)
    rig.enqueue("b1")
    rig.tick()
    rig.settle()  # b1 ran once: its cooldown is running, with a second run waiting
    rig.enqueue("b1")
    busy = rig.enqueue("a1", payload={"hold": True})
    rig.tick()
    rig.agents.wait_running(busy.id)
    before = rig.store.statements
    assert rig.tick() == SAFETY_S  # not the 2 s of b1's cooldown: a1 holds the one slot
    assert rig.store.statements - before <= 1  # "anything queued?" only
    rig.agents.release(busy.id)
    rig.settle()
    assert 0 < rig.tick() <= 2.0  # a free slot: the cooldown's end is the next wake-up


def test_no_work_is_not_an_error(rig: Rig) -> None:
    assert rig.tick() == SAFETY_S
    before = rig.store.statements
    assert rig.tick() == SAFETY_S
    # An idle tick only reads ("anything queued?", "anything due?"): no write lock, and
    # no runtime slot is reserved, so daemon.status never sees a phantom execution.
    assert rig.store.statements - before <= 2
    assert rig.runtime.active == 0


def test_enqueue_signals_the_loop_only_for_new_runs(rig: Rig) -> None:
    first = rig.queue.enqueue(workspace_id="ws1", agent_id="a1", reason="hb",
                              idempotency_key="k1")
    assert len(rig.signals) == 1
    assert rig.queue.enqueue(workspace_id="ws1", agent_id="a1", reason="hb",
                             idempotency_key="k1").deduplicated
    rig.clock.advance(1)
    assert rig.queue.enqueue(workspace_id="ws1", agent_id="a1", reason="hb").coalesced
    assert len(rig.signals) == 1
    assert [t for t, _ in rig.events] == ["run.queued"]
    assert rig.events[0][1]["run"].id == first.run.id


# -- agent state -----------------------------------------------------------------------


def test_paused_agent_is_skipped_until_resumed(rig: Rig) -> None:
    set_agent(rig.store, "a1", status="paused")
    paused = rig.enqueue("a1")
    other = rig.enqueue("b1")
    rig.tick()
    rig.settle()
    assert (rig.status(paused.id), rig.status(other.id)) == ("queued", "finished")
    assert rig.queue.explain(paused.id)["blockers"] == ["agent_paused"]
    set_agent(rig.store, "a1", status="active")
    rig.tick()
    rig.settle()
    assert rig.status(paused.id) == "finished"


def test_cooldown_delays_the_next_run_and_sets_the_wait(rig: Rig) -> None:
    set_agent(rig.store, "a1", cooldown_s=10.0)
    first = rig.enqueue("a1")
    second = rig.enqueue("a1")
    rig.tick()
    rig.settle()
    finished_at = parse_rfc3339(rig.repo.get(first.id).finished_at)
    rig.clock.now = after(finished_at, 7)
    assert rig.tick() == pytest.approx(3.0)  # wakes exactly when the cooldown ends
    assert rig.status(second.id) == "queued"
    assert "cooldown_until" in rig.queue.explain(second.id)["blockers"]
    rig.clock.now = after(finished_at, 10)
    rig.tick()
    rig.settle()
    assert rig.status(second.id) == "finished"


# -- retries ---------------------------------------------------------------------------


def test_failed_run_is_retried_on_schedule_then_finishes(rig: Rig) -> None:
    run = rig.enqueue("a1", payload={"fail_times": 1})
    rig.tick()
    rig.settle()
    queued = rig.repo.get(run.id)
    assert (queued.status, queued.retry_count) == ("queued", 1)
    retry_at = parse_rfc3339(queued.scheduled_retry_at)
    assert retry_at == after(T0, 10)  # delays_s[0] with jitter 0, failed at T0
    assert queued.error_message == "exit code 1"
    rig.clock.advance(6)
    assert rig.tick() == pytest.approx(4.0)  # the loop wakes for the retry
    assert rig.status(run.id) == "queued"
    rig.clock.now = retry_at
    rig.tick()
    rig.settle()
    done = rig.repo.get(run.id)
    assert (done.status, done.retry_count) == ("finished", 1)
    assert rig.agents.attempts[run.id] == 2
    assert "run.retry_scheduled" in [t for t, _ in rig.events]


def test_exhausted_retries_fail_the_run(rig: Rig) -> None:
    run = rig.enqueue("a1", payload={"fail_times": 99})
    for _ in range(3):  # max_retries = 2: three attempts in all
        rig.tick()
        rig.settle()
        rig.clock.advance(120)
    failed = rig.repo.get(run.id)
    assert (failed.status, failed.retry_count) == ("failed", 2)
    assert failed.error_message == "exit code 1"
    assert rig.agents.attempts[run.id] == 3
    rig.tick()
    rig.settle()
    assert rig.agents.attempts[run.id] == 3
    assert "run.failed" in [t for t, _ in rig.events]


def test_a_failure_after_max_age_cancels_the_run(rig: Rig) -> None:
    run = rig.enqueue("a1", payload={"fail_times": 1})
    rig.clock.advance(3601)
    rig.tick()
    rig.settle()
    cancelled = rig.repo.get(run.id)
    assert (cancelled.status, cancelled.cancel_reason) == ("cancelled", "run_too_old")


# -- recovery --------------------------------------------------------------------------


def test_stale_claim_without_a_live_execution_is_requeued_and_run(rig: Rig) -> None:
    run = rig.enqueue("a1")
    orphan = rig.repo.claim_next(rig.clock())  # claimed, but nothing here executes it
    assert orphan is not None
    rig.clock.advance(599)
    rig.tick()  # the stale check runs (at most once per safety interval): not stale yet
    assert rig.status(run.id) == "claimed"
    rig.clock.advance(2)
    rig.tick()  # stale now, but the check already ran less than an interval ago
    assert rig.status(run.id) == "claimed"
    rig.clock.advance(SAFETY_S)
    assert rig.tick() == 0.0  # re-queues the stale claim and asks to run again at once ...
    assert rig.status(run.id) == "queued"
    rig.tick()  # ... and the next tick runs it
    rig.settle()
    assert rig.status(run.id) == "finished"
    assert rig.agents.started == [run.id]
    assert not rig.repo.finish(run.id, orphan.token, now=rig.clock(), summary=None,
                               cost_cents=None, log_path=None)


def test_a_restart_reads_an_attempt_record_only_for_the_run_it_names(
        rig: Rig, tmp_path: Path) -> None:
    """An earlier instance's claims, each with an exit status 0 on disk: the one whose
    record names its run is recorded; the one whose record names another run (a recycled
    folder whose emptying a power cut lost) is left to recovery, never finished."""
    from datetime import timedelta

    from kandevd.runtime import attempts
    from kandevd.runtime.records import ExecutionRecord, write_record

    rig.enqueue("a1")
    rig.enqueue("b1")
    earlier = RunRepository(rig.store, "boot-0")
    claims = earlier.claim_batch(rig.clock(), 2)
    names = {claims[0].run.id: claims[0].run.id, claims[1].run.id: "run_someone_else"}
    for claim in claims:
        directory = attempts.attempt_dir(rig.queue.layout.attempts, claim.run.id, claim.token)
        directory.mkdir(parents=True)
        named = names[claim.run.id]
        write_record(ExecutionRecord(
            record_dir=directory, pid=0, pid_start=0, key=named, run_id=named, session_id="s",
            started_at=T0, deadline=T0 + timedelta(hours=1), timeout_s=3600.0,
            log_path=tmp_path / f"{named}.log", input_path=tmp_path / "in", argv=("true",)))
        (directory / "exit").write_text("0\n")
    rig.queue.restore_after_restart(adopt=False)
    assert rig.status(claims[0].run.id) == "finished"
    assert rig.status(claims[1].run.id) == "claimed"  # rescued by recovery, run again


def test_a_long_live_execution_is_not_stale(rig: Rig) -> None:
    run = rig.enqueue("a1", payload={"hold": True})
    rig.tick()
    token = rig.store.query_one("SELECT claim_token FROM runs WHERE id = ?", (run.id,))[0]
    rig.clock.advance(10_000)
    rig.tick()
    row = rig.store.query_one("SELECT status, claim_token FROM runs WHERE id = ?", (run.id,))
    assert (row["status"], row["claim_token"]) == ("claimed", token)
    rig.agents.release(run.id)
    rig.settle()
    assert rig.status(run.id) == "finished"


def test_restart_recovery_requeues_foreign_claims_in_request_order(rig: Rig) -> None:
    old = RunRepository(rig.store, "boot-0")
    runs = [rig.enqueue(agent) for agent in ["b1", "a1", "a2"]]
    for _ in runs:
        assert old.claim_next(rig.clock()) is not None
    assert rig.tick() == SAFETY_S and rig.agents.started == []  # all agents look busy
    assert sorted(rig.queue.recover_after_restart()) == sorted(r.id for r in runs)
    rig.tick()
    rig.settle()
    assert sorted(rig.agents.started) == sorted(r.id for r in runs)
    assert [r.seq for r in rig.repo.list().items] == [r.seq for r in runs]
    assert {rig.status(r.id) for r in runs} == {"finished"}


# -- cancel ----------------------------------------------------------------------------


def test_cancel_queued_run_never_executes(rig: Rig) -> None:
    run = rig.enqueue("a1")
    assert rig.queue.cancel(run.id, "no longer needed").status == "cancelled"
    rig.tick()
    rig.settle()
    assert rig.agents.started == []
    assert rig.repo.get(run.id).cancel_reason == "no longer needed"
    with pytest.raises(RunConflict):
        rig.queue.cancel(run.id)


def test_cancel_claimed_run_stops_it_and_its_late_completion_is_ignored(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    run = rig.enqueue("a1", payload={"hold": True})
    after_it = rig.enqueue("a1")
    rig.tick()
    rig.agents.wait_running(run.id)
    cancelled = rig.queue.cancel(run.id)
    assert cancelled.status == "cancelled"
    rig.tick()
    # The stopped agent still holds its slot until its execution really ends:
    # the agent's next run must wait for that, not just for the row change.
    assert rig.status(after_it.id) == "queued"
    with caplog.at_level(logging.WARNING, logger="kandevd.queue"):
        rig.agents.release(run.id)  # the in-process agent cannot be interrupted
        rig.settle()
    assert rig.status(run.id) == "cancelled"  # the late success changed nothing
    assert any("superseded" in r.message for r in caplog.records)
    rig.tick()
    rig.settle()
    assert rig.status(after_it.id) == "finished"
    assert rig.agents.overlap["a1"] == 1


# -- dispatch failures -----------------------------------------------------------------


def test_a_run_whose_agent_cannot_start_is_retried_and_frees_its_slot(
        rig_factory: Callable[..., Rig]) -> None:
    # The schema refuses timeout_s: 0, so build the profile directly: any failure while
    # preparing or starting an execution must neither leak the claim nor the slot.
    config = make_config()
    broken = AgentProfile(name="broken", command=None, timeout_s=0.0)
    config = dataclasses.replace(config, agents=MappingProxyType({**config.agents,
                                                                  "broken": broken}))
    rig = rig_factory(config=config)
    set_agent(rig.store, "a1", profile="broken")
    bad = rig.enqueue("a1")
    fine = rig.enqueue("b1")
    rig.tick()
    rig.settle()
    assert rig.runtime.active == 0
    row = rig.repo.get(bad.id)
    assert (row.status, row.retry_count) == ("queued", 1)
    assert "timeout_s" in row.error_message
    assert rig.status(fine.id) == "finished"


# -- batched claims and group commit ---------------------------------------------------


def test_a_tick_claims_one_run_per_agent_in_one_transaction(rig: Rig) -> None:
    runs = [rig.enqueue(agent, payload={"hold": True}) for agent in ["a1", "a1", "b1", "a2"]]
    before = rig.store.statements
    rig.tick()
    used = rig.store.statements - before
    claimed = [r.id for r in rig.repo.list(status="claimed").items]
    assert claimed == [runs[0].id, runs[2].id, runs[3].id]  # a1's second run waits
    # "anything queued?" + "anything claimable?" (a read) + BEGIN + the queue's front and
    # its agents (SQLite) + UPDATE ... RETURNING + profile lookup + COMMIT (+ the sync
    # pragmas), plus the tick's stale-claim and next-due reads: not one per claim.
    assert used <= 14  # (+1: the hard-budget probe of the claim)
    rig.agents.release_all()
    rig.settle()


def test_group_commit_shares_one_transaction_between_waiting_writers(store_path: Path) -> None:
    from kandevd.runqueue.groupcommit import GroupCommit

    store = open_store(store_path)
    try:
        seed(store, "ws1", "a1")
        commits = GroupCommit(store)
        inside = threading.Event()
        release = threading.Event()

        def slow() -> str:
            with store.transaction() as conn:
                conn.execute("UPDATE agents SET name = 'slow' WHERE id = 'a1'")
            inside.set()
            assert release.wait(WAIT_S)
            return "slow"

        def quick(value: str) -> Callable[[], str]:
            def op() -> str:
                with store.transaction() as conn:
                    conn.execute("UPDATE agents SET name = ? WHERE id = 'a1'", (value,))
                return value
            return op

        def failing() -> str:
            with store.transaction() as conn:
                conn.execute("UPDATE agents SET name = 'bad' WHERE id = 'a1'")
            raise ValueError("this one is broken")

        results: dict[str, Any] = {}

        def submit(name: str, fn: Callable[[], str]) -> None:
            try:
                results[name] = commits.submit(fn)
            except ValueError as exc:
                results[name] = exc

        leader = threading.Thread(target=submit, args=("slow", slow))
        leader.start()
        assert inside.wait(WAIT_S)
        followers = [threading.Thread(target=submit, args=(name, fn)) for name, fn in
                     [("q1", quick("q1")), ("bad", failing), ("q2", quick("q2"))]]
        for thread in followers:
            thread.start()
        # Nothing signals "blocked on a lock": poll the queue of waiting writers.
        deadline = time.monotonic() + WAIT_S
        while commits.pending < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert commits.pending == 3  # all three wait behind the leader's commit
        release.set()
        for thread in [leader, *followers]:
            thread.join(WAIT_S)
        assert results["slow"] == "slow"
        assert (results["q1"], results["q2"]) == ("q1", "q2")
        assert isinstance(results["bad"], ValueError)
        # The failed batch was re-applied one by one: the good writes are committed.
        assert commits.operations == 4
        assert store.query_one("SELECT name FROM agents WHERE id = 'a1'")[0] == "q2"
        assert not store._conn.in_transaction
    finally:
        store.close()


def test_group_commit_batches_without_failures(store_path: Path) -> None:
    from kandevd.runqueue.groupcommit import GroupCommit

    store = open_store(store_path)
    try:
        commits = GroupCommit(store)
        gate = threading.Event()
        entered = threading.Event()

        def hold() -> int:
            entered.set()
            assert gate.wait(WAIT_S)
            return 0

        def write(n: int) -> Callable[[], int]:
            def op() -> int:
                with store.transaction() as conn:
                    conn.execute("INSERT INTO workspaces (id, name, office_workflow_id,"
                                 " created_at, updated_at) VALUES (?, 'w', '', 't', 't')",
                                 (f"w{n}",))
                return n
            return op

        threads = [threading.Thread(target=commits.submit, args=(hold,))]
        threads[0].start()
        assert entered.wait(WAIT_S)
        threads += [threading.Thread(target=commits.submit, args=(write(n),)) for n in range(5)]
        for thread in threads[1:]:
            thread.start()
        deadline = time.monotonic() + WAIT_S
        while commits.pending < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert commits.pending == 5
        gate.set()
        for thread in threads:
            thread.join(WAIT_S)
        assert (commits.commits, commits.operations) == (2, 6)  # 5 writers, one commit
        assert store.query_one("SELECT COUNT(*) FROM workspaces")[0] == 5
    finally:
        store.close()


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "commit.db"


# -- outcomes written by the loop --------------------------------------------------------


def transactions(trace: Path, since: int) -> int:
    lines = trace.read_text().splitlines()[since:]
    return sum(1 for line in lines if line.startswith("BEGIN"))


def trace_length(trace: Path) -> int:
    return len(trace.read_text().splitlines()) if trace.exists() else 0


def test_deferred_outcome_and_the_next_claim_share_one_commit(
        rig_factory: Callable[..., Rig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.sql"
    monkeypatch.setenv("KANDEVD_TRACE_SQL", str(trace))
    rig = rig_factory()
    rig.queue.defer_outcomes(True)  # what QueueLoop.start() does
    first = rig.enqueue("a1", payload={"summary": "one"})
    second = rig.enqueue("a1")
    rig.tick()
    rig.settle()  # the execution ended and gave its slot back ...
    assert rig.runtime.active == 0
    assert rig.status(first.id) == "claimed"  # ... but its outcome waits for the loop
    assert rig.queue.live_agents() == {"a1"}  # so the agent is still busy here
    assert rig.signals  # and the loop was told
    mark = trace_length(trace)
    rig.tick()
    assert transactions(trace, mark) == 1  # outcome + next claim: one BEGIN ... COMMIT
    assert rig.repo.get(first.id).output_summary == "one"
    assert rig.status(first.id) == "finished"
    assert rig.status(second.id) == "claimed"
    rig.settle()
    rig.queue.defer_outcomes(False)  # what the loop's last act does: flush what is pending
    assert rig.status(second.id) == "finished"
    assert [t for t, _ in rig.events].count("run.finished") == 2


def test_deferred_failures_follow_the_retry_policy(rig: Rig) -> None:
    rig.queue.defer_outcomes(True)
    run = rig.enqueue("a1", payload={"fail_times": 1})
    rig.tick()
    rig.settle()
    rig.tick()  # writes the failure
    queued = rig.repo.get(run.id)
    assert (queued.status, queued.retry_count) == ("queued", 1)
    assert parse_rfc3339(queued.scheduled_retry_at) == after(T0, 10)
    rig.clock.advance(10)
    rig.tick()
    rig.settle()
    rig.tick()
    assert rig.status(run.id) == "finished"
    rig.queue.defer_outcomes(False)


def test_one_bad_outcome_does_not_hold_back_the_others(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.queue.defer_outcomes(True)
    bad, good = rig.enqueue("a1"), rig.enqueue("b1")
    rig.tick()
    rig.settle()
    real_finish = rig.repo.finish

    def finish(run_id: str, token: str, **kwargs: Any) -> bool:
        if run_id == bad.id:
            raise RuntimeError("injected: this outcome cannot be written")
        return real_finish(run_id, token, **kwargs)

    monkeypatch.setattr(rig.repo, "finish", finish)
    rig.queue.outcomes.monotonic = lambda: rig.clock().timestamp()
    rig.tick()
    assert rig.status(good.id) == "finished"
    # The refused outcome is kept: the run stays claimed and its agent busy (so neither
    # a claim nor stale-claim recovery runs it again) until the write goes through.
    assert rig.status(bad.id) == "claimed"
    assert rig.queue.live_agents() == frozenset({"a1"})
    assert rig.queue.unrecorded() == 1
    assert rig.tick() == pytest.approx(0.1)  # the loop comes back for the retry
    monkeypatch.undo()
    rig.tick()  # not due yet
    assert rig.status(bad.id) == "claimed"
    rig.clock.advance(0.1)
    rig.tick()
    assert rig.status(bad.id) == "finished"
    assert rig.queue.live_agents() == frozenset() and rig.queue.unrecorded() == 0
    assert sorted(rig.agents.started) == sorted([bad.id, good.id])  # each ran once
    rig.queue.defer_outcomes(False)


def test_an_outcome_refused_for_good_is_recorded_as_a_plain_failed_attempt(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.queue.defer_outcomes(True)
    rig.queue.outcomes.monotonic = lambda: rig.clock().timestamp()
    run = rig.enqueue("a1")
    rig.tick()
    rig.settle()

    def finish(run_id: str, token: str, **kwargs: Any) -> bool:
        raise RuntimeError("injected: this summary cannot be stored")

    monkeypatch.setattr(rig.repo, "finish", finish)
    for _ in range(12):
        rig.tick()
        rig.clock.advance(2.0)
        if rig.status(run.id) != "claimed":
            break
    row = rig.repo.get(run.id)
    assert row.status == "queued" and row.retry_count == 1  # settled, retried later
    assert row.error_message.startswith("its outcome could not be recorded: RuntimeError")
    assert rig.queue.live_agents() == frozenset() and rig.queue.unrecorded() == 0
    assert rig.agents.started == [run.id]  # never run again to learn it
    rig.queue.defer_outcomes(False)


def test_stopping_the_loop_thread_flushes_and_ends_deferral(rig: Rig) -> None:
    """The real loop thread: outcomes while it runs, and after it has stopped."""
    finished: list[str] = []
    done = threading.Condition()

    def on_finished(_topic: str, data: dict[str, Any]) -> None:
        with done:
            finished.append(data["run_id"])
            done.notify_all()

    rig.queue.bus.subscribe("run.finished", on_finished)
    rig.loop.start()
    try:
        quick = rig.enqueue("a1")
        with done:
            assert done.wait_for(lambda: quick.id in finished, WAIT_S)
        held = rig.enqueue("b1", payload={"hold": True})
        rig.agents.wait_running(held.id)
    finally:
        rig.loop.stop()
    assert rig.status(held.id) == "claimed"
    rig.agents.release(held.id)  # ends after the loop: recorded by its own worker
    with done:
        assert done.wait_for(lambda: held.id in finished, WAIT_S)
    assert rig.status(held.id) == "finished"


def test_an_enqueue_wakes_the_loop_unless_every_slot_runs_and_a_freed_slot_does(
        rig_factory: Callable[..., Rig]) -> None:
    """No wake-up is lost: skipped only while every slot runs an execution."""
    rig = rig_factory(max_concurrent=1)
    first = rig.enqueue("a1", payload={"hold": True})
    assert rig.signals  # a free runtime: the loop is woken
    rig.tick()
    rig.agents.wait_running(first.id)
    before = len(rig.signals)
    second = rig.enqueue("a2")
    assert len(rig.signals) == before  # the one slot runs: a pass could claim nothing
    rig.agents.gate(first.id).set()  # the execution ends; its slot frees
    rig.wait_until(lambda: len(rig.signals) > before, "the freed slot's wake-up")
    rig.tick()  # records the outcome and claims the second run
    rig.wait_until(lambda: rig.status(second.id) == "finished", "the second run")
    rig.wait_until(lambda: rig.runtime.active == 0, "the second run's slot to free")
    # A reservation held by a pass in progress is not a running slot: it may have
    # looked for work already, so the enqueue still wakes the loop.
    reservation = rig.runtime.try_reserve()
    assert reservation is not None
    before = len(rig.signals)
    rig.enqueue("b1")
    assert len(rig.signals) == before + 1
    rig.runtime.release(reservation)


def test_an_outage_is_said_once_not_at_every_pass_and_its_end_too(
        rig: Rig, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass a second during a database outage logged a warning a second."""
    from kandevd.store.base import StoreUnavailable

    failing = [StoreUnavailable("PostgreSQL unavailable: connection refused")] * 3

    def drain(now: datetime, limit: int) -> int:
        if failing:
            raise failing.pop()
        return 0
    monkeypatch.setattr(rig.queue, "drain", drain)
    caplog.set_level(logging.DEBUG, logger="kandevd.queue.loop")
    waits = [rig.loop.tick(T0) for _ in range(4)]
    assert waits[:3] == [rig.loop.error_backoff_s] * 3 and waits[3] > 0
    said = [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "kandevd.queue.loop"]
    assert [level for level, _ in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG,
                                            logging.INFO]
    assert said[0][1].startswith("queue pass failed (PostgreSQL unavailable")
    assert said[3][1] == "queue passes succeed again, after 3 that failed"
