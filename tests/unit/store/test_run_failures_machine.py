"""A hypothesis state machine over the queue's failure model.

Runs are enqueued, claimed, finished, failed, cancelled, rescued as stale,
"crashed" (a new daemon instance re-queues the old one's claims) and retried,
in any order, against a real SQLite file. After every step:

- no run is lost: every enqueued run exists, in a known status;
- at most one claimed run per agent;
- attempts are bounded: no run was ever claimed more than ``max_attempts``
  times since it was last (re)queued by a user;
- a terminal run stays terminal unless ``runs.retry`` brought it back.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kandevd.config import RetryConfig
from kandevd.runs.model import STATUSES, TERMINAL, RunConflict
from kandevd.runs.retry import attempt_limit, retry_decider
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.timeutil import after
from tests.support.runs import T0, seed

AGENTS = ("a1", "a2", "a3")
MAX_ATTEMPTS = 3
POLICY = RetryConfig(max_retries=10, delays_s=(0.0,), jitter=0.0, max_age_s=10**9)


class FailureModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.store = open_store(Path(self.tmp.name) / "kandevd.db")
        seed(self.store, "ws1", *AGENTS)
        self.boot = 0
        self.repo = self._instance()
        self.now = T0
        self.enqueued: list[str] = []
        self.claims: dict[str, Any] = {}  # run id -> the claim this instance holds
        self.executions: dict[str, int] = {}  # claims since the last user (re)queue
        self.terminal: dict[str, str] = {}  # run id -> the terminal status it reached

    def _instance(self) -> RunRepository:
        self.boot += 1
        return RunRepository(self.store, f"boot-{self.boot}", give_up=attempt_limit(MAX_ATTEMPTS))

    def teardown(self) -> None:
        self.store.close()
        self.tmp.cleanup()

    def _in_order(self, ids: Any) -> list[str]:
        """``ids`` in enqueue order (run ids are random; their order must not steer draws)."""
        return [run_id for run_id in self.enqueued if run_id in ids]

    def _tick(self, seconds: float = 1.0) -> None:
        self.now = after(self.now, seconds)

    def _status(self, run_id: str) -> str:
        return self.repo.get(run_id).status

    def _settle(self) -> None:
        """Learn terminal states from the rows (after rules that may end runs)."""
        for run_id in self.enqueued:
            status = self._status(run_id)
            if status in TERMINAL:
                self.terminal.setdefault(run_id, status)
                self.claims.pop(run_id, None)

    # -- rules --------------------------------------------------------------------------
    @rule(agent=st.sampled_from(AGENTS))
    def enqueue(self, agent: str) -> None:
        self._tick()
        run = self.repo.enqueue(workspace_id="ws1", agent_id=agent, reason="r", now=self.now,
                                coalesce=False).run
        self.enqueued.append(run.id)
        self.executions[run.id] = 0

    @rule()
    def claim(self) -> None:
        self._tick()
        for claimed in self.repo.claim_batch(self.now, 2):
            self.claims[claimed.run.id] = claimed
            self.executions[claimed.run.id] += 1

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self._in_order(self.claims)))
        self._tick()
        claimed = self.claims.pop(run_id)
        self.repo.finish(run_id, claimed.token, now=self.now, summary=None, cost_cents=None,
                         log_path=None)
        self._settle()

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self._in_order(self.claims)))
        self._tick()
        claimed = self.claims.pop(run_id)
        self.repo.fail_attempt(run_id, claimed.token, now=self.now, error="boom",
                               decide=retry_decider(POLICY))
        self._settle()

    @precondition(lambda self: self.enqueued)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.enqueued))
        self._tick()
        try:
            self.repo.cancel(run_id, "user", self.now)
        except RunConflict:
            assert run_id in self.terminal
        self._settle()

    @rule()
    def stale(self) -> None:
        self._tick(100)
        self.repo.recover_stale(self.now, 60, live=())
        self.claims.clear()  # every claim of ours is older than 60 s now
        self._settle()

    @rule()
    def crash_and_restart(self) -> None:
        self._tick()
        self.repo = self._instance()
        self.repo.requeue_foreign_claims(self.now)
        self.claims.clear()
        self._settle()

    @precondition(lambda self: self.terminal)
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self._in_order(self.terminal)))
        self._tick()
        try:
            self.repo.retry(run_id, self.now)
        except RunConflict:
            assert self.terminal[run_id] == "finished"
            return
        del self.terminal[run_id]
        self.executions[run_id] = 0

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def no_run_is_lost(self) -> None:
        statuses = dict(self.store.query("SELECT id, status FROM runs"))
        assert set(statuses) == set(self.enqueued)
        assert set(statuses.values()) <= set(STATUSES)

    @invariant()
    def one_claimed_run_per_agent(self) -> None:
        rows = self.store.query("SELECT agent_id, COUNT(*) FROM runs WHERE status = 'claimed'"
                                " GROUP BY agent_id HAVING COUNT(*) > 1")
        assert rows == []

    @invariant()
    def attempts_are_bounded(self) -> None:
        assert all(n <= MAX_ATTEMPTS for n in self.executions.values()), self.executions
        for run_id, attempt in self.store.query("SELECT id, attempt FROM runs"):
            assert attempt <= MAX_ATTEMPTS, (run_id, attempt)

    @invariant()
    def terminal_states_are_final(self) -> None:
        for run_id, status in self.terminal.items():
            assert self._status(run_id) == status


TestFailureModel = FailureModel.TestCase
TestFailureModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
