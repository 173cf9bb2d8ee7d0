"""Property test: the real queue (RunRepository on a SQLite file) against a tiny model.

Hypothesis interleaves enqueue, claim, finish, fail (with a drawn jitter),
a late completion with a superseded token, cancel, pause, resume and the
passing of time. After every step the database must agree with the model:

* a claim takes exactly the run the model says is the oldest eligible one
  (FIFO in request order among runs whose agent is active, not busy, not
  cooling down and whose retry time has come);
* no agent ever has two claimed runs;
* a failed attempt lands exactly on the policy's schedule
  (``now + delays_s[retry_count] * (1 + jitter * draw)``), or fails / is
  cancelled as too old when the policy says so.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kandevd.config import RetryConfig
from kandevd.runs.model import TERMINAL, RunConflict
from kandevd.runs.retry import retry_decider
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.timeutil import parse_rfc3339
from tests.support.runs import T0, seed

POLICY = RetryConfig(max_retries=2, delays_s=(4.0, 30.0), jitter=0.5, max_age_s=120.0)
AGENTS = {"a1": "ws1", "a2": "ws1", "b1": "ws2"}
COOLDOWN = {"a1": 0.0, "a2": 3.0, "b1": 0.0}


@dataclass
class ModelRun:
    run_id: str
    seq: int
    agent: str
    requested_at: datetime
    status: str = "queued"
    retry_count: int = 0
    retry_at: datetime | None = None
    token: str | None = None


class QueueMachine(RuleBasedStateMachine):
    claims = Bundle("claims")

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="kandevd-model-"))
        # synchronous=OFF: this checks logic, not durability, and keeps examples fast.
        self.store = open_store(self.folder / "kandevd.db", synchronous="OFF")
        for agent, workspace in AGENTS.items():
            seed(self.store, workspace, agent, cooldown_s=COOLDOWN[agent])
        self.repo = RunRepository(self.store, "boot-model")
        self.now = T0
        self.runs: dict[str, ModelRun] = {}
        self.paused: set[str] = set()
        self.cooldown_until: dict[str, datetime] = {}
        self.old_tokens: list[tuple[str, str]] = []

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- the model --------------------------------------------------------------
    def eligible(self) -> list[ModelRun]:
        busy = {r.agent for r in self.runs.values() if r.status == "claimed"}
        return sorted(
            (r for r in self.runs.values()
             if r.status == "queued" and r.agent not in busy and r.agent not in self.paused
             and (r.retry_at is None or r.retry_at <= self.now)
             and self.cooldown_until.get(r.agent, self.now) <= self.now),
            key=lambda r: r.seq)

    def ended(self, run: ModelRun) -> None:
        cooldown = COOLDOWN[run.agent]
        if cooldown:
            self.cooldown_until[run.agent] = self.now + timedelta(seconds=cooldown)

    # -- rules ------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        assert self.repo.claim_next(self.now) is None

    @rule(agent=st.sampled_from(sorted(AGENTS)))
    def enqueue(self, agent: str) -> None:
        run = self.repo.enqueue(workspace_id=AGENTS[agent], agent_id=agent, reason="model",
                                now=self.now, coalesce=False).run
        assert all(run.seq > r.seq for r in self.runs.values())
        self.runs[run.id] = ModelRun(run.id, run.seq, agent, self.now)

    @rule(target=claims)
    def claim(self) -> tuple[str, str] | None:
        expected = self.eligible()
        claim = self.repo.claim_next(self.now)
        if not expected:
            assert claim is None
            return None
        assert claim is not None, f"expected {expected[0].run_id} to be claimed"
        assert claim.run.id == expected[0].run_id  # FIFO among the eligible
        run = self.runs[claim.run.id]
        run.status, run.token = "claimed", claim.token
        return (run.run_id, claim.token)

    def _current(self, handle: tuple[str, str] | None) -> ModelRun | None:
        if handle is None:
            return None
        run = self.runs[handle[0]]
        if run.status != "claimed" or run.token != handle[1]:
            self.old_tokens.append(handle)
            return None
        return run

    @rule(handle=consumes(claims))
    def finish(self, handle: tuple[str, str] | None) -> None:
        run = self._current(handle)
        if run is None:
            return
        assert self.repo.finish(run.run_id, handle[1], now=self.now, summary="ok",
                                cost_cents=None, log_path=None)
        run.status, run.token = "finished", None
        self.old_tokens.append(handle)
        self.ended(run)

    @rule(handle=consumes(claims), draw=st.floats(min_value=0, max_value=1, exclude_max=True))
    def fail(self, handle: tuple[str, str] | None, draw: float) -> None:
        run = self._current(handle)
        if run is None:
            return
        updated = self.repo.fail_attempt(run.run_id, handle[1], now=self.now, error="boom",
                                         decide=retry_decider(POLICY, draw=draw))
        assert updated is not None
        self.old_tokens.append(handle)
        run.token = None
        if (self.now - run.requested_at).total_seconds() > POLICY.max_age_s:
            assert (updated.status, updated.cancel_reason) == ("cancelled", "run_too_old")
            run.status = "cancelled"
        elif run.retry_count >= POLICY.max_retries:
            assert updated.status == "failed"
            assert updated.error_message == "boom"
            run.status = "failed"
        else:
            delay = POLICY.delays_s[run.retry_count] * (1 + POLICY.jitter * draw)
            expected = self.now + timedelta(seconds=delay)
            assert updated.status == "queued"
            assert updated.retry_count == run.retry_count + 1
            got = parse_rfc3339(updated.scheduled_retry_at)
            assert abs(got - expected) <= timedelta(microseconds=1)
            run.status, run.retry_count, run.retry_at = "queued", run.retry_count + 1, got
        self.ended(run)

    @precondition(lambda self: self.old_tokens)
    @rule(data=st.data())
    def late_completion(self, data: st.DataObject) -> None:
        run_id, token = data.draw(st.sampled_from(self.old_tokens))
        if self.runs[run_id].token == token:
            return  # still this attempt's token; not a superseded one
        before = self.repo.get(run_id)
        assert not self.repo.finish(run_id, token, now=self.now, summary="late",
                                    cost_cents=None, log_path=None)
        assert self.repo.fail_attempt(run_id, token, now=self.now, error="late",
                                      decide=retry_decider(POLICY)) is None
        assert self.repo.get(run_id) == before

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        # Request order, not the (random) ids: a replayed example must draw the same run.
        run = self.runs[data.draw(st.sampled_from(list(self.runs)))]
        if run.status in TERMINAL:
            try:
                self.repo.cancel(run.run_id, None, self.now)
            except RunConflict:
                return
            raise AssertionError(f"cancel of a {run.status} run did not conflict")
        cancelled, previous = self.repo.cancel(run.run_id, "model", self.now)
        assert (cancelled.status, previous) == ("cancelled", run.status)
        run.status, run.token = "cancelled", None

    @rule(agent=st.sampled_from(sorted(AGENTS)))
    def pause(self, agent: str) -> None:
        self.store.execute("UPDATE agents SET status = 'paused' WHERE id = ?", (agent,))
        self.paused.add(agent)

    @rule(agent=st.sampled_from(sorted(AGENTS)))
    def resume(self, agent: str) -> None:
        self.store.execute("UPDATE agents SET status = 'active' WHERE id = ?", (agent,))
        self.paused.discard(agent)

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 5.0, 20.0, 60.0]))
    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    # -- invariants -------------------------------------------------------------
    @invariant()
    def database_matches_the_model(self) -> None:
        rows = {r["id"]: r for r in self.store.query(
            "SELECT id, seq, status, retry_count, agent_id FROM runs")}
        assert set(rows) == set(self.runs)
        for run in self.runs.values():
            got = rows[run.run_id]
            assert (got["status"], got["retry_count"], got["seq"]) == \
                (run.status, run.retry_count, run.seq), run

    @invariant()
    def at_most_one_claim_per_agent(self) -> None:
        counts = self.store.query(
            "SELECT agent_id, COUNT(*) FROM runs WHERE status = 'claimed' GROUP BY agent_id")
        assert all(n <= 1 for _agent, n in counts)


QueueMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40,
                                          deadline=None)
TestQueueModel = QueueMachine.TestCase
