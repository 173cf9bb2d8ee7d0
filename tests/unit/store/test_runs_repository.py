"""RunRepository against a real SQLite file: the queue's rules, one transaction at a time.

Every test drives the repository with an explicit ``now`` so the time
windows (idempotency 24 h, coalescing 5 s, cooldown, retry, stale claims)
are exact, and reads the rows back from the database, which is the truth.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kandevd.config import RetryConfig
from kandevd.runs.model import (
    IDEMPOTENCY_WINDOW_S,
    BatchItemError,
    RunConflict,
    RunNotFound,
    RunReferenceError,
)
from kandevd.runs.retry import retry_decider
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.store.sqlite import Store
from kandevd.timeutil import after, parse_rfc3339, rfc3339
from tests.support.runs import POLICY, T0, add_task, count_runs, enqueue, row, seed, set_agent
from tests.support.stores import sqlite_only


@pytest.fixture
def store(store_location: str) -> Iterator[Store]:
    db = open_store(store_location)
    seed(db, "ws1", "a1", "a2")
    seed(db, "ws2", "b1")
    yield db
    db.close()


@pytest.fixture
def repo(store: Store) -> RunRepository:
    return RunRepository(store, "boot-1")


# -- enqueue ---------------------------------------------------------------------------


def test_enqueue_persists_a_queued_run_in_request_order(repo: RunRepository,
                                                        store: Store) -> None:
    first = enqueue(repo, "a1", payload={"n": 1}, task_id="t1")
    second = enqueue(repo, "b1")
    assert second.seq > first.seq
    stored = repo.get(first.id)
    assert stored == first
    assert stored.status == "queued"
    assert stored.payload == {"n": 1}
    assert stored.task_id == "t1"
    assert stored.requested_at == rfc3339(T0)
    assert (stored.retry_count, stored.coalesced_count) == (0, 0)
    assert stored.claimed_at is None and stored.finished_at is None


def test_the_run_enqueue_returns_is_the_stored_row(repo: RunRepository) -> None:
    """enqueue builds its answer without reading the row back: it must equal the row."""
    keyed = enqueue(repo, "a2", idempotency_key="k-1", payload={"b": [1, 2], "a": None})
    assert repo.get(keyed.id) == keyed
    add_task(repo.store, "ws2", "t9")
    many = repo.enqueue_many([{"workspace_id": "ws2", "agent_id": "b1", "reason": "x",
                               "task_id": "t9", "idempotency_key": "k-2"}], now=T0)
    assert repo.get(many[0].run.id) == many[0].run


def test_enqueue_many_is_one_transaction_in_order_with_keys_and_coalescing(
        repo: RunRepository, store: Store) -> None:
    results = repo.enqueue_many([
        {"workspace_id": "ws1", "agent_id": "a1", "reason": "r", "idempotency_key": "k"},
        {"workspace_id": "ws1", "agent_id": "a1", "reason": "r", "idempotency_key": "k"},
        {"workspace_id": "ws1", "agent_id": "a2", "reason": "s"},
        {"workspace_id": "ws1", "agent_id": "a2", "reason": "s"},  # coalesces into the third
        {"workspace_id": "ws2", "agent_id": "b1", "reason": "s", "coalesce": False},
    ], now=T0)
    flags = [(r.deduplicated, r.coalesced) for r in results]
    assert flags == [(False, False), (True, False), (False, False), (False, True),
                     (False, False)]
    assert results[1].run.id == results[0].run.id
    assert results[3].run.id == results[2].run.id
    seqs = [r.run.seq for r in results if r.inserted]
    assert seqs == sorted(seqs) and count_runs(store) == 3


@pytest.mark.parametrize("bad", [
    {"workspace_id": "nope", "agent_id": "a1", "reason": "r"},
    {"workspace_id": "ws2", "agent_id": "a1", "reason": "r"},
    {"workspace_id": "ws1", "agent_id": "ghost", "reason": "r"},
])
def test_enqueue_many_is_all_or_nothing_and_names_the_failing_index(
        repo: RunRepository, store: Store, bad: dict[str, Any]) -> None:
    from kandevd.runs.model import BatchItemError

    good = {"workspace_id": "ws1", "agent_id": "a1", "reason": "r", "idempotency_key": "kk"}
    statements = store.statements
    with pytest.raises(BatchItemError) as info:
        repo.enqueue_many([good, good, bad, good], now=T0)
    assert info.value.index == 2 and str(info.value).startswith("runs.2.")
    assert count_runs(store) == 0  # the first two were rolled back with the batch
    assert store.query_one("SELECT COUNT(*) FROM run_keys")[0] == 0
    assert store.statements > statements
    # The key was never taken: the same good item alone is a new run.
    assert repo.enqueue_many([good], now=T0)[0].inserted


@pytest.mark.parametrize(("workspace", "agent", "task", "field"), [
    ("nope", "a1", None, "workspace_id"),
    ("ws1", "ghost", None, "agent_id"),
    ("ws2", "a1", None, "agent_id"),  # the agent lives in another workspace
    ("ws1", "a1", "no-such-task", "task_id"),
    ("ws1", "a1", "t-ws2", "task_id"),  # the task lives in another workspace
])
def test_enqueue_validates_its_references(repo: RunRepository, store: Store, workspace: str,
                                          agent: str, task: str | None, field: str) -> None:
    add_task(store, "ws2", "t-ws2")
    with pytest.raises(RunReferenceError, match=field):
        repo.enqueue(workspace_id=workspace, agent_id=agent, reason="manual", now=T0,
                     task_id=task)
    with pytest.raises(BatchItemError, match=f"runs.1.{field}"):
        repo.enqueue_many([{"workspace_id": "ws1", "agent_id": "a1", "reason": "ok"},
                           {"workspace_id": workspace, "agent_id": agent, "reason": "manual",
                            "task_id": task}], now=T0)
    assert count_runs(store) == 0


def test_idempotency_key_within_24h_returns_the_existing_run(repo: RunRepository,
                                                             store: Store) -> None:
    first = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="r", now=T0,
                         idempotency_key="evt-1", payload={"v": 1})
    assert first.inserted
    # Even once the run is terminal, the key still answers with it inside the window.
    store.execute("UPDATE runs SET status = 'finished' WHERE id = ?", (first.run.id,))
    again = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="r",
                         now=after(T0, IDEMPOTENCY_WINDOW_S - 1), idempotency_key="evt-1",
                         payload={"v": 2})
    assert again.deduplicated and not again.coalesced and not again.inserted
    assert again.run.id == first.run.id
    assert again.run.payload == {"v": 1}  # nothing was written
    assert count_runs(store) == 1


def test_idempotency_key_older_than_24h_can_be_reused(repo: RunRepository, store: Store) -> None:
    old = enqueue(repo, idempotency_key="evt-1")
    later = after(T0, IDEMPOTENCY_WINDOW_S + 1)
    fresh = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="manual", now=later,
                         idempotency_key="evt-1", coalesce=False)
    assert fresh.inserted  # the unique index on keys in force did not make the insert fail
    assert fresh.run.id != old.id
    assert fresh.run.idempotency_key == "evt-1"
    assert row(store, old.id)["idempotency_key"] == "evt-1"  # history is kept
    assert count_runs(store) == 2
    # From now on the key points at the new run.
    third = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="manual",
                         now=after(later, 5), idempotency_key="evt-1")
    assert third.deduplicated and third.run.id == fresh.run.id


def test_coalescing_merges_a_recent_queued_run_of_same_agent_and_reason(
        repo: RunRepository, store: Store) -> None:
    first = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="heartbeat", now=T0,
                         payload={"v": 1})
    merged = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="heartbeat",
                          now=after(T0, 4.999), payload={"v": 2})
    assert merged.coalesced and not merged.deduplicated
    assert merged.run.id == first.run.id
    assert merged.run.coalesced_count == 1
    assert repo.get(first.run.id).payload == {"v": 2}  # payload replaced
    assert count_runs(store) == 1


@pytest.mark.parametrize("case", [
    "window_passed", "other_reason", "other_agent", "coalesce_false", "already_claimed",
])
def test_coalescing_does_not_apply(repo: RunRepository, store: Store, case: str) -> None:
    first = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="heartbeat", now=T0)
    params: dict[str, Any] = {"workspace_id": "ws1", "agent_id": "a1", "reason": "heartbeat",
                              "now": after(T0, 1)}
    if case == "window_passed":
        params["now"] = after(T0, 5.0)  # "less than 5 s ago" is strict
    elif case == "other_reason":
        params["reason"] = "manual"
    elif case == "other_agent":
        params["agent_id"] = "a2"
    elif case == "coalesce_false":
        params["coalesce"] = False
    elif case == "already_claimed":
        assert repo.claim_next(T0) is not None
    second = repo.enqueue(**params)
    assert second.inserted
    assert second.run.id != first.run.id
    assert repo.get(first.run.id).coalesced_count == 0
    assert count_runs(store) == 2


def test_task_assigned_coalesces_only_for_the_same_task(repo: RunRepository,
                                                        store: Store) -> None:
    def assigned(task: str, at: float) -> Any:
        add_task(store, "ws1", task)
        return repo.enqueue(workspace_id="ws1", agent_id="a1", reason="task_assigned",
                            task_id=task, now=after(T0, at))

    t1 = assigned("t1", 0)
    t2 = assigned("t2", 1)
    assert t2.inserted  # another task: its own run
    again_t1 = assigned("t1", 2)
    assert again_t1.coalesced and again_t1.run.id == t1.run.id
    again_t2 = assigned("t2", 3)
    assert again_t2.coalesced and again_t2.run.id == t2.run.id
    assert count_runs(store) == 2


def test_task_comment_keys_are_never_coalesced(repo: RunRepository, store: Store) -> None:
    def comment(key: str | None, at: float) -> Any:
        return repo.enqueue(workspace_id="ws1", agent_id="a1", reason="task_comment",
                            idempotency_key=key, now=after(T0, at))

    first = comment("task_comment:c1", 0)
    second = comment("task_comment:c2", 1)  # a new comment never merges into the queued one
    assert first.inserted and second.inserted
    plain = comment(None, 2)  # nor does anything merge into a task_comment run
    assert plain.inserted
    assert count_runs(store) == 3
    assert {r.coalesced_count for r in repo.list().items} == {0}


# -- claim -----------------------------------------------------------------------------


def test_claim_takes_the_oldest_eligible_run_across_workspaces(repo: RunRepository) -> None:
    order = [enqueue(repo, agent, at=after(T0, i)) for i, agent in enumerate(["b1", "a1", "a2"])]
    claimed = []
    while (claim := repo.claim_next(after(T0, 10))) is not None:
        claimed.append(claim.run.id)
        assert claim.run.status == "claimed"
        assert claim.profile == "default"
    assert claimed == [r.id for r in order]


def test_claim_records_token_and_boot_id(repo: RunRepository, store: Store) -> None:
    run = enqueue(repo)
    claim = repo.claim_next(after(T0, 1))
    assert claim is not None and claim.run.id == run.id
    stored = row(store, run.id)
    assert stored["claim_token"] == claim.token
    assert stored["claimed_by"] == "boot-1"
    assert stored["claimed_at"] == rfc3339(after(T0, 1))
    assert stored["attempt"] == 1


def test_a_claim_relaxes_sync_for_itself_only(repo: RunRepository, store: Store) -> None:
    """The claim skips its fsync (see claim_batch); every other write keeps FULL."""
    sqlite_only(store, "PRAGMA synchronous")
    enqueue(repo)
    assert store.query_one("PRAGMA synchronous")[0] == 2
    assert repo.claim_next(T0) is not None
    assert store.query_one("PRAGMA synchronous")[0] == 2  # restored after the claim
    with store.transaction():  # inside a caller's transaction the claim shares its commit
        assert repo.claim_next(T0) is None
    assert store.query_one("PRAGMA synchronous")[0] == 2


def test_one_claimed_run_per_agent(repo: RunRepository, store: Store) -> None:
    first = enqueue(repo, "a1")
    second = enqueue(repo, "a1", at=after(T0, 1))
    other = enqueue(repo, "b1", at=after(T0, 2))
    claim = repo.claim_next(after(T0, 3))
    assert claim is not None and claim.run.id == first.id
    # a1 is busy: its second run is skipped, b1's later run is claimed instead.
    next_claim = repo.claim_next(after(T0, 3))
    assert next_claim is not None and next_claim.run.id == other.id
    assert repo.claim_next(after(T0, 3)) is None
    assert repo.finish(first.id, claim.token, now=after(T0, 4), summary="ok",
                       cost_cents=1.5, log_path="/x.log")
    last = repo.claim_next(after(T0, 5))
    assert last is not None and last.run.id == second.id


def test_database_refuses_a_second_claimed_run_for_an_agent(repo: RunRepository,
                                                            store: Store) -> None:
    enqueue(repo, "a1")
    waiting = enqueue(repo, "a1")
    assert repo.claim_next(T0) is not None
    with pytest.raises(sqlite3.IntegrityError):
        store.execute("UPDATE runs SET status = 'claimed' WHERE id = ?", (waiting.id,))


def test_paused_agent_keeps_its_runs_queued(repo: RunRepository, store: Store) -> None:
    set_agent(store, "a1", status="paused")
    paused_run = enqueue(repo, "a1")
    other = enqueue(repo, "b1", at=after(T0, 1))
    claim = repo.claim_next(after(T0, 2))
    assert claim is not None and claim.run.id == other.id
    assert repo.claim_next(after(T0, 2)) is None
    assert repo.get(paused_run.id).status == "queued"
    set_agent(store, "a1", status="active")
    resumed = repo.claim_next(after(T0, 3))
    assert resumed is not None and resumed.run.id == paused_run.id


def test_cooldown_after_a_finished_run(repo: RunRepository, store: Store) -> None:
    set_agent(store, "a1", cooldown_s=30.0)
    enqueue(repo, "a1")
    second = enqueue(repo, "a1", at=after(T0, 1))
    claim = repo.claim_next(T0)
    assert claim is not None
    done_at = after(T0, 10)
    assert repo.finish(claim.run.id, claim.token, now=done_at, summary=None,
                       cost_cents=None, log_path=None)
    agent = store.query_one("SELECT * FROM agents WHERE id = 'a1'")
    assert agent["last_finished_at"] == rfc3339(done_at)
    assert agent["cooldown_until"] == rfc3339(after(done_at, 30))
    assert repo.next_due(after(done_at, 1)) == after(done_at, 30)
    assert repo.claim_next(after(done_at, 29.999)) is None
    claim2 = repo.claim_next(after(done_at, 30))
    assert claim2 is not None and claim2.run.id == second.id


@pytest.mark.parametrize("cooldown_s", [0.000001, 0.1234565, 7.5, 86_400.25, 315_360_000,
                                        10**12, 10**15])
def test_a_finished_run_ends_its_cooldown_at_the_same_instant_on_every_backend(
        repo: RunRepository, store: Store, cooldown_s: float) -> None:
    # PostgreSQL computes the end in SQL (one statement per outcome); it must be the
    # instant, and the very string, that Python's after() and rfc3339() make of it.
    set_agent(store, "a1", cooldown_s=cooldown_s)
    enqueue(repo, "a1")
    claim = repo.claim_next(T0)
    assert claim is not None
    done_at = datetime(2026, 3, 1, 12, 0, 10, 654321, tzinfo=UTC)
    assert repo.finish(claim.run.id, claim.token, now=done_at, summary=None,
                       cost_cents=None, log_path=None)
    agent = store.query_one("SELECT * FROM agents WHERE id = 'a1'")
    assert agent["last_finished_at"] == rfc3339(done_at)
    assert agent["cooldown_until"] == rfc3339(after(done_at, cooldown_s))


def test_a_superseded_finish_changes_neither_the_run_nor_the_agent(
        repo: RunRepository, store: Store) -> None:
    set_agent(store, "a1", cooldown_s=30.0)
    run = enqueue(repo, "a1")
    claim = repo.claim_next(T0)
    assert claim is not None
    assert not repo.finish(run.id, "not-the-token", now=after(T0, 5), summary="x",
                           cost_cents=3.0, log_path="/l")
    agent = store.query_one("SELECT * FROM agents WHERE id = 'a1'")
    assert agent["last_finished_at"] is None and agent["cooldown_until"] is None
    row = repo.get(run.id)
    assert row.status == "claimed" and row.cost_cents is None


# -- attempt outcomes ------------------------------------------------------------------


def test_finish_records_the_outcome(repo: RunRepository, store: Store) -> None:
    run = enqueue(repo)
    claim = repo.claim_next(T0)
    assert claim is not None
    assert repo.finish(run.id, claim.token, now=after(T0, 2), summary="done",
                       cost_cents=3.0, log_path="/logs/x.log")
    stored = repo.get(run.id)
    assert stored.status == "finished"
    assert stored.finished_at == rfc3339(after(T0, 2))
    assert (stored.output_summary, stored.cost_cents, stored.log_path) == \
        ("done", 3.0, "/logs/x.log")
    assert row(store, run.id)["claim_token"] is None
    assert repo.finish(run.id, claim.token, now=after(T0, 3), summary="again",
                       cost_cents=None, log_path=None) is False  # finishes once


def test_failed_attempt_is_scheduled_for_retry(repo: RunRepository, store: Store) -> None:
    run = enqueue(repo)
    claim = repo.claim_next(T0)
    assert claim is not None
    failed_at = after(T0, 5)
    updated = repo.fail_attempt(run.id, claim.token, now=failed_at, error="exit code 1",
                                decide=retry_decider(POLICY, draw=0.5))
    assert updated is not None
    assert updated.status == "queued"
    assert updated.retry_count == 1
    expected = after(failed_at, POLICY.delays_s[0] * (1 + POLICY.jitter * 0.5))
    assert updated.scheduled_retry_at == rfc3339(expected)
    assert updated.claimed_at is None and updated.finished_at is None
    assert updated.error_message == "exit code 1"
    assert updated.seq == run.seq
    assert repo.next_due(failed_at) == expected
    assert repo.claim_next(after(expected, -0.001)) is None
    again = repo.claim_next(expected)
    assert again is not None and again.run.id == run.id
    assert again.token != claim.token


def test_exhaustion_within_max_age_is_failed(repo: RunRepository) -> None:
    policy = RetryConfig(max_retries=2, delays_s=(1.0,), jitter=0.0, max_age_s=86_400.0)
    run = enqueue(repo)
    now = T0
    statuses = []
    for _ in range(3):
        claim = repo.claim_next(now)
        assert claim is not None
        result = repo.fail_attempt(run.id, claim.token, now=now, error="exit code 7",
                                   decide=retry_decider(policy))
        assert result is not None
        statuses.append((result.status, result.retry_count))
        now = after(now, 1.0)
    assert statuses == [("queued", 1), ("queued", 2), ("failed", 2)]
    final = repo.get(run.id)
    assert final.error_message == "exit code 7"
    assert final.finished_at is not None
    assert repo.claim_next(after(now, 100)) is None


def test_failed_run_older_than_max_age_is_cancelled_too_old(repo: RunRepository) -> None:
    run = enqueue(repo)
    late = after(T0, POLICY.max_age_s + 1)
    claim = repo.claim_next(late)
    assert claim is not None
    result = repo.fail_attempt(run.id, claim.token, now=late, error="exit code 1",
                               decide=retry_decider(POLICY))
    assert result is not None
    assert result.status == "cancelled"
    assert result.cancel_reason == "run_too_old"
    assert result.retry_count == 0


def test_failure_also_starts_the_cooldown(repo: RunRepository, store: Store) -> None:
    set_agent(store, "a1", cooldown_s=20.0)
    enqueue(repo)
    claim = repo.claim_next(T0)
    assert claim is not None
    repo.fail_attempt(claim.run.id, claim.token, now=after(T0, 1), error="x",
                      decide=retry_decider(POLICY))
    cooldown = store.query_one("SELECT cooldown_until FROM agents WHERE id = 'a1'")[0]
    assert cooldown == rfc3339(after(T0, 21))


# -- recovery and fencing --------------------------------------------------------------


def test_stale_claim_is_requeued_unless_live(repo: RunRepository) -> None:
    run = enqueue(repo)
    claim = repo.claim_next(T0)
    assert claim is not None
    assert repo.recover_stale(after(T0, 59), 60, live=()) == {}
    assert repo.recover_stale(after(T0, 61), 60, live={run.id}) == {}
    assert repo.recover_stale(after(T0, 61), 60, live=()) == {run.id: "queued"}
    stored = repo.get(run.id)
    assert stored.status == "queued"
    assert stored.seq == run.seq and stored.claimed_at is None


def test_startup_recovery_requeues_claims_of_another_boot_keeping_seq(store: Store) -> None:
    old = RunRepository(store, "boot-old")
    runs = [enqueue(old, agent, at=after(T0, i)) for i, agent in enumerate(["a1", "a2", "b1"])]
    enqueue(old, "a1", at=after(T0, 5))  # stays queued throughout
    claims = [old.claim_next(after(T0, 10)) for _ in runs]
    assert all(c is not None for c in claims)
    assert old.requeue_foreign_claims(after(T0, 11)) == {}  # its own claims are not foreign
    new = RunRepository(store, "boot-new")
    recovered = new.requeue_foreign_claims(after(T0, 20))
    assert recovered == {r.id: "queued" for r in runs}
    for original in runs:
        stored = new.get(original.id)
        assert (stored.status, stored.seq) == ("queued", original.seq)
    order = []
    while (claim := new.claim_next(after(T0, 21))) is not None:
        order.append(claim.run.seq)
    assert order == [r.seq for r in runs]  # request order survives the restart
    assert {r["claimed_by"] for r in store.query(
        "SELECT claimed_by FROM runs WHERE status = 'claimed'")} == {"boot-new"}


def test_completion_with_a_superseded_token_changes_nothing(repo: RunRepository,
                                                            store: Store) -> None:
    run = enqueue(repo)
    stale = repo.claim_next(T0)
    assert stale is not None
    repo.recover_stale(after(T0, 100), 60, live=())
    current = repo.claim_next(after(T0, 101))
    assert current is not None and current.token != stale.token
    before = dict(row(store, run.id))
    assert repo.finish(run.id, stale.token, now=after(T0, 102), summary="late",
                       cost_cents=9.0, log_path=None) is False
    assert repo.fail_attempt(run.id, stale.token, now=after(T0, 102), error="late",
                             decide=retry_decider(POLICY)) is None
    assert repo.requeue(run.id, stale.token, after(T0, 102)) is False
    assert dict(row(store, run.id)) == before
    assert repo.finish(run.id, current.token, now=after(T0, 103), summary="ok",
                       cost_cents=None, log_path=None)


def test_requeue_puts_a_claim_back_without_touching_retries(repo: RunRepository) -> None:
    run = enqueue(repo)
    claim = repo.claim_next(T0)
    assert claim is not None
    assert repo.requeue(run.id, claim.token, after(T0, 1))
    stored = repo.get(run.id)
    assert (stored.status, stored.retry_count, stored.seq) == ("queued", 0, run.seq)


# -- cancel ----------------------------------------------------------------------------


def test_cancel_queued_and_claimed_runs(repo: RunRepository, store: Store) -> None:
    queued = enqueue(repo, "a1")
    claimed_run = enqueue(repo, "b1")
    claim = repo.claim_next(T0)
    assert claim is not None and claim.run.id == queued.id
    # a1's run is the claimed one now; cancel b1's queued run and a1's claimed run.
    run, previous = repo.cancel(claimed_run.id, None, after(T0, 1))
    assert (run.status, run.cancel_reason, previous) == ("cancelled", "cancelled", "queued")
    run, previous = repo.cancel(queued.id, "operator", after(T0, 2))
    assert (run.status, run.cancel_reason, previous) == ("cancelled", "operator", "claimed")
    assert run.finished_at == rfc3339(after(T0, 2))
    # The cancelled attempt's completion cannot resurrect it.
    assert repo.finish(queued.id, claim.token, now=after(T0, 3), summary=None,
                       cost_cents=None, log_path=None) is False
    assert repo.get(queued.id).status == "cancelled"


@pytest.mark.parametrize("terminal", ["finished", "failed", "cancelled"])
def test_cancel_of_a_terminal_run_is_a_conflict(repo: RunRepository, store: Store,
                                                terminal: str) -> None:
    run = enqueue(repo)
    store.execute("UPDATE runs SET status = ? WHERE id = ?", (terminal, run.id))
    before = dict(row(store, run.id))
    with pytest.raises(RunConflict, match=terminal):
        repo.cancel(run.id, None, after(T0, 1))
    assert dict(row(store, run.id)) == before


def test_unknown_runs_are_not_found(repo: RunRepository) -> None:
    with pytest.raises(RunNotFound):
        repo.get("run_missing")
    with pytest.raises(RunNotFound):
        repo.cancel("run_missing", None, T0)
    with pytest.raises(RunNotFound):
        repo.explain("run_missing", T0, runtime_full=False)


# -- reads -----------------------------------------------------------------------------


def test_list_filters_and_pages_in_request_order(repo: RunRepository) -> None:
    made = [enqueue(repo, agent, at=after(T0, i), reason=reason)
            for i, (agent, reason) in enumerate([("a1", "x"), ("b1", "y"), ("a1", "y"),
                                                 ("a2", "x"), ("b1", "x")])]
    everything = repo.list()
    assert [r.id for r in everything.items] == [r.id for r in made]
    assert (everything.total, everything.limit, everything.offset) == (5, 50, 0)
    page = repo.list(limit=2, offset=1)
    assert [r.id for r in page.items] == [made[1].id, made[2].id]
    assert page.total == 5
    assert [r.id for r in repo.list(agent_id="a1").items] == [made[0].id, made[2].id]
    assert repo.list(workspace_id="ws2").total == 2
    assert repo.list(reason="x", agent_id="b1").items[0].id == made[4].id
    claim = repo.claim_next(after(T0, 10))
    assert claim is not None
    assert [r.id for r in repo.list(status="claimed").items] == [made[0].id]


# -- explain ---------------------------------------------------------------------------


def test_explain_an_eligible_run(repo: RunRepository) -> None:
    run = enqueue(repo)
    assert repo.explain(run.id, T0, runtime_full=False) == {
        "eligible": True, "blockers": [], "details": {}}


def test_explain_names_every_blocker(repo: RunRepository, store: Store) -> None:
    set_agent(store, "a1", cooldown_s=50.0)
    busy = enqueue(repo, "a1")
    waiting = enqueue(repo, "a1", at=after(T0, 1))
    claim = repo.claim_next(after(T0, 2))
    assert claim is not None and claim.run.id == busy.id
    result = repo.explain(waiting.id, after(T0, 3), runtime_full=True)
    assert result["eligible"] is False
    assert set(result["blockers"]) == {"agent_busy", "runtime_full"}
    assert result["details"]["agent_busy"] == busy.id

    # Fail the busy run: it is queued for retry and the agent cools down.
    repo.fail_attempt(busy.id, claim.token, now=after(T0, 4), error="x",
                      decide=retry_decider(POLICY, draw=0.0))
    set_agent(store, "a1", status="paused")
    result = repo.explain(busy.id, after(T0, 5), runtime_full=False)
    assert set(result["blockers"]) == {"agent_paused", "cooldown_until", "retry_at"}
    assert result["details"]["cooldown_until"] == rfc3339(after(T0, 54))
    assert result["details"]["retry_at"] == rfc3339(after(T0, 14))

    # Once every window has passed and the agent is active again, it is eligible.
    set_agent(store, "a1", status="active")
    assert repo.explain(busy.id, after(T0, 60), runtime_full=False)["eligible"] is True
    assert parse_rfc3339(result["details"]["retry_at"]) == after(T0, 14)


def test_explain_of_a_claimed_run_names_its_status(repo: RunRepository) -> None:
    run = enqueue(repo)
    assert repo.claim_next(T0) is not None
    result = repo.explain(run.id, T0, runtime_full=False)
    assert result["eligible"] is False and result["blockers"] == ["status_claimed"]


def test_concurrent_claimers_on_two_connections_never_share_an_agent(tmp_path: Path) -> None:
    """Two stores (two connections, as two daemons would have) claim from one file at once.

    The claimers go in lockstep rounds: both claim at the same moment, both
    hold their claim at the barrier (so two claims are outstanding at once),
    then both finish. Every run is claimed exactly once and the two claims
    of a round never belong to the same agent.
    """
    path = tmp_path / "shared.db"
    first, second = open_store(path, synchronous="OFF"), open_store(path, synchronous="OFF")
    try:
        agents = [f"a{i}" for i in range(4)]
        seed(first, "ws1", *agents)
        seeder = RunRepository(first, "seed")
        for i in range(60):
            enqueue(seeder, agents[i % len(agents)], at=after(T0, i / 1000))
        rounds, barrier = 30, threading.Barrier(2, timeout=30)
        held: list[tuple[int, str, str]] = []  # (round, agent, run id) while both hold one
        errors: list[BaseException] = []

        def claimer(store: Store, boot: str) -> None:
            repo = RunRepository(store, boot)
            try:
                for n in range(rounds):
                    barrier.wait()
                    claim = repo.claim_next(after(T0, 1))
                    assert claim is not None, f"{boot} found nothing in round {n}"
                    held.append((n, claim.run.agent_id, claim.run.id))
                    barrier.wait()  # both claims are outstanding now
                    assert repo.finish(claim.run.id, claim.token, now=after(T0, 2),
                                       summary=None, cost_cents=None, log_path=None)
            except BaseException as exc:  # surfaced below, in the test's thread
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=claimer, args=(store, boot))
                   for store, boot in ((first, "boot-a"), (second, "boot-b"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        assert len({run_id for _n, _agent, run_id in held}) == 60  # each claimed exactly once
        for n in range(rounds):
            assert len({agent for r, agent, _id in held if r == n}) == 2, f"round {n}"
        assert first.query_one("SELECT COUNT(*) FROM runs WHERE status = 'finished'")[0] == 60
        by = dict(first.query("SELECT claimed_by, COUNT(*) FROM runs GROUP BY claimed_by"))
        assert by == {"boot-a": 30, "boot-b": 30}
    finally:
        first.close()
        second.close()


# -- costs and stale fields ------------------------------------------------------------


def test_cost_of_every_attempt_is_kept_and_terminal_runs_keep_no_retry_time(
        repo: RunRepository, store: Store) -> None:
    run = enqueue(repo, "a1")
    for attempt, cost in enumerate((3.0, None, 4.5)):
        now = after(T0, 100 * (attempt + 1))
        claim = repo.claim_next(now)
        assert claim is not None and claim.run.id == run.id
        repo.fail_attempt(run.id, claim.token, now=now, error="boom",
                          decide=retry_decider(POLICY, draw=0.0),
                          cost_cents=cost)
    final = row(store, run.id)
    assert final["status"] == "failed"
    assert final["cost_cents"] == 7.5  # budgets see what all three attempts cost
    assert final["scheduled_retry_at"] is None

    second = enqueue(repo, "a2")
    claim = repo.claim_next(T0)
    assert claim is not None and claim.run.id == second.id
    repo.fail_attempt(second.id, claim.token, now=T0, error="x",
                      decide=retry_decider(POLICY, draw=0.0),
                      cost_cents=2.0)
    retry = repo.claim_next(after(T0, 100))
    assert retry is not None
    assert repo.finish(second.id, retry.token, now=after(T0, 100), summary="ok",
                       cost_cents=1.0, log_path=None)
    assert row(store, second.id)["cost_cents"] == 3.0


def test_coalescing_absorbs_a_request_with_another_key_but_not_task_comments(
        repo: RunRepository, store: Store) -> None:
    first = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="ping", now=T0,
                         idempotency_key="k1")
    second = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="ping",
                          now=after(T0, 1), idempotency_key="k2", payload={"n": 2})
    assert second.coalesced and second.run.id == first.run.id
    assert second.run.payload == {"n": 2} and second.run.coalesced_count == 1
    comment = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="ping",
                           now=after(T0, 2), idempotency_key="task_comment:c1")
    assert comment.inserted
    assert count_runs(store) == 2


def test_list_orders_by_request_either_way(repo: RunRepository) -> None:
    runs = [enqueue(repo, at=after(T0, i)) for i in range(3)]
    ids = [r.id for r in runs]
    assert [r.id for r in repo.list().items] == ids
    assert [r.id for r in repo.list(order="desc").items] == ids[::-1]
    assert [r.id for r in repo.list(order="desc", limit=1, offset=1).items] == [ids[1]]


def test_the_counts_by_status_follow_every_write(repo: RunRepository, store: Store) -> None:
    """run_counts is kept by triggers: inserts, status changes, deletes, all paths."""
    def truth() -> dict[str, int]:
        counts = {name: 0 for name in repo.count_by_status()}
        for found in store.query("SELECT status, COUNT(*) AS n FROM runs GROUP BY status"):
            counts[found["status"]] = found["n"]
        return counts

    runs = [enqueue(repo, agent) for agent in ("a1", "a2", "b1", "a1")]
    repo.enqueue_many([{"workspace_id": "ws1", "agent_id": "a2", "reason": "m",
                        "coalesce": False}], now=T0)
    assert repo.count_by_status() == truth() and truth()["queued"] == 5
    claims = repo.claim_batch(T0, 3)
    repo.finish(claims[0].run.id, claims[0].token, now=T0, summary=None, cost_cents=None,
                log_path=None)
    repo.cancel(runs[3].id, "no", T0)
    assert repo.count_by_status() == truth()
    store.execute("DELETE FROM runs WHERE id = ?", (claims[0].run.id,))
    store.execute("UPDATE runs SET reason = 'x'")  # not a status change: no count moves
    assert repo.count_by_status() == truth()
    assert sum(truth().values()) == count_runs(store) == 4
    # A run written behind the repository's back (no trigger counts inserts) is found
    # by the check against COUNT(*), and the counts are rebuilt.
    store.execute("INSERT INTO runs (id, workspace_id, agent_id, reason, status,"
                  " requested_at, updated_at) VALUES ('run_x', 'ws1', 'a1', 'm', 'failed',"
                  " 'x', 'x')")
    assert repo.count_by_status() == truth() and truth()["failed"] == 1
