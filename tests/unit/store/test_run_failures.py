"""The failure model in the repository: bounded attempts, the dead letter, runs.retry,
keys that hold for 24 h even when coalesced, the claim gate, and after-commit hooks.

Real SQLite files, explicit clocks; the rows are read back as the truth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from kandevd.runs.model import RunConflict, RunNotFound
from kandevd.runs.retry import attempt_limit, retry_decider
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.store.sqlite import Store
from kandevd.timeutil import after
from tests.support.runs import POLICY, T0, enqueue, seed


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    db = open_store(tmp_path / "kandevd.db")
    seed(db, "ws1", "a1", "a2")
    yield db
    db.close()


def repo_of(store: Store, boot: str = "boot-1", **kwargs: Any) -> RunRepository:
    return RunRepository(store, boot, **kwargs)


def claim(repo: RunRepository, at: datetime) -> Any:
    claimed = repo.claim_next(at)
    assert claimed is not None
    return claimed


# -- attempts and the dead letter ------------------------------------------------------


def test_stale_rescues_count_attempts_and_end_in_the_dead_letter(store: Store) -> None:
    repo = repo_of(store, give_up=attempt_limit(3))
    run = enqueue(repo)
    moment = T0
    statuses = []
    for _ in range(3):
        claim(repo, moment)
        moment = after(moment, 100)
        statuses.append(repo.recover_stale(moment, 60, live=())[run.id])
    assert statuses == ["queued", "queued", "failed"]
    stored = repo.get(run.id)
    assert stored.status == "failed"
    assert stored.error_message.startswith("gave up after 3 attempts; last: the claim went")
    assert repo.claim_next(after(moment, 1)) is None  # never executed again


def test_restart_rescues_count_attempts_too(store: Store) -> None:
    run = enqueue(repo_of(store))
    for boot in range(1, 4):
        claim(repo_of(store, f"boot-{boot}", give_up=attempt_limit(3)), after(T0, boot))
        rescuer = repo_of(store, f"boot-{boot + 1}", give_up=attempt_limit(3))
        rescued = rescuer.requeue_foreign_claims(after(T0, boot + 0.5))
    assert rescued == {run.id: "failed"}
    assert "gave up after 3 attempts; last: interrupted" in repo_of(store).get(
        run.id).error_message


def test_failed_attempts_stop_at_max_attempts_even_with_retries_left(store: Store) -> None:
    many_retries = POLICY.__class__(max_retries=50, delays_s=(0.0,), jitter=0.0,
                                    max_age_s=10**6)
    repo = repo_of(store, give_up=attempt_limit(2))
    run = enqueue(repo)
    first = claim(repo, T0)
    updated = repo.fail_attempt(run.id, first.token, now=after(T0, 1), error="boom",
                                decide=retry_decider(many_retries))
    assert updated is not None and updated.status == "queued"
    second = claim(repo, after(T0, 2))
    updated = repo.fail_attempt(run.id, second.token, now=after(T0, 3), error="boom again",
                                decide=retry_decider(many_retries))
    assert updated is not None
    assert (updated.status, updated.error_message) == (
        "failed", "gave up after 2 attempts; last: boom again")


def test_a_start_that_never_happened_gives_its_attempt_back(store: Store) -> None:
    repo = repo_of(store, give_up=attempt_limit(1))
    run = enqueue(repo)
    for second in range(5):
        claimed = claim(repo, after(T0, second))
        assert repo.requeue(run.id, claimed.token, after(T0, second + 0.5))
    assert store.query_one("SELECT attempt FROM runs WHERE id = ?", (run.id,))[0] == 0
    assert repo.get(run.id).status == "queued"


def test_retry_requeues_failed_and_cancelled_runs_with_a_fresh_budget(store: Store) -> None:
    repo = repo_of(store, give_up=attempt_limit(1))
    failed = enqueue(repo)
    claim(repo, T0)
    repo.recover_stale(after(T0, 100), 60, live=())
    assert repo.get(failed.id).status == "failed"
    retried = repo.retry(failed.id, after(T0, 200))
    assert (retried.status, retried.retry_count, retried.finished_at) == (
        "queued", 0, None)
    assert retried.error_message.startswith("gave up")  # the history is kept
    assert retried.seq == failed.seq and retried.id == failed.id
    assert claim(repo, after(T0, 201)).run.id == failed.id  # one more attempt allowed

    cancelled = enqueue(repo, "a2")
    repo.cancel(cancelled.id, "not now", after(T0, 300))
    assert repo.retry(cancelled.id, after(T0, 301)).cancel_reason is None


def test_retry_refuses_live_and_finished_runs(store: Store) -> None:
    repo = repo_of(store)
    queued = enqueue(repo)
    with pytest.raises(RunConflict, match="only a failed or cancelled run"):
        repo.retry(queued.id, T0)
    with pytest.raises(RunNotFound):
        repo.retry("run_nope", T0)


# -- keys ------------------------------------------------------------------------------


def test_a_key_absorbed_by_coalescing_still_deduplicates_later(store: Store) -> None:
    repo = repo_of(store)
    first = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="wake", now=T0).run
    merged = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="wake", now=after(T0, 1),
                          idempotency_key="k-absorbed")
    assert merged.coalesced and merged.run.id == first.id
    claimed = claim(repo, after(T0, 2))
    repo.finish(first.id, claimed.token, now=after(T0, 3), summary=None, cost_cents=None,
                log_path=None)
    again = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="wake", now=after(T0, 60),
                         idempotency_key="k-absorbed")
    assert again.deduplicated and again.run.id == first.id
    later = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="wake",
                         now=after(T0, 24 * 3600 + 5), idempotency_key="k-absorbed")
    assert later.inserted and later.run.id != first.id


def test_expired_keys_are_pruned(store: Store) -> None:
    repo = repo_of(store)
    enqueue(repo, idempotency_key="old")
    enqueue(repo, idempotency_key="new", at=after(T0, 3600))
    assert repo.prune_keys(after(T0, 24 * 3600 + 1)) == 1
    keys = [r[0] for r in store.query("SELECT idempotency_key FROM run_keys")]
    assert keys == ["new"]


# -- the claim gate (hard budgets) --------------------------------------------------------


def test_the_claim_gate_holds_an_agent_back_and_explain_names_it(store: Store) -> None:
    gate: dict[str, str] = {"a1": "budget-1"}
    repo = repo_of(store, claim_gate=lambda conn, now: gate)
    held = enqueue(repo, "a1")
    free = enqueue(repo, "a2")
    assert claim(repo, T0).run.id == free.id
    assert repo.claim_next(T0) is None
    explained = repo.explain(held.id, T0, runtime_full=False)
    assert "budget_exceeded" in explained["blockers"]
    assert explained["details"]["budget_exceeded"] == "budget-1"
    gate.clear()
    assert claim(repo, after(T0, 1)).run.id == held.id


# -- after-commit hooks -----------------------------------------------------------------


def test_after_commit_waits_for_the_outermost_commit_and_drops_on_rollback(
        store: Store) -> None:
    seen: list[str] = []
    with store.transaction():
        with store.transaction():
            store.after_commit(lambda: seen.append("inner"))
        assert seen == []
    assert seen == ["inner"]
    with pytest.raises(RuntimeError), store.transaction():
        store.after_commit(lambda: seen.append("rolled back"))
        raise RuntimeError("boom")
    store.after_commit(lambda: seen.append("now"))
    assert seen == ["inner", "now"]


# -- the attempt journal -------------------------------------------------------------------


def test_the_journal_keeps_only_current_claims_and_round_trips_an_outcome(
        tmp_path: Path) -> None:
    from kandevd.paths import HomeLayout
    from kandevd.runtime import SUCCEEDED, ExecutionResult, attempts

    layout = HomeLayout(tmp_path)
    current = attempts.attempt_dir(layout.attempts, "run_a", "t2")
    stale = [attempts.attempt_dir(layout.attempts, "run_a", "t1"),
             attempts.attempt_dir(layout.attempts, "run_b", "t")]
    result = ExecutionResult(key="run_a", outcome=SUCCEEDED, exit_code=0, summary="s",
                             cost_cents=1.5, error=None, started_at=T0, ended_at=after(T0, 1),
                             log_path=tmp_path / "a.log")
    # Folders of the legacy two-level layout (a daemon before the one-level one).
    legacy_current = attempts.legacy_attempt_dir(layout.attempts, "run_c", "t9")
    legacy_stale = attempts.legacy_attempt_dir(layout.attempts, "run_c", "t8")
    for directory in [current, *stale, legacy_current, legacy_stale]:
        assert attempts.write_outcome(directory, result)
    assert attempts.read_outcome(current, "run_a") == result
    assert attempts.existing_attempt_dir(layout.attempts, "run_c", "t9") == legacy_current
    assert attempts.existing_attempt_dir(layout.attempts, "run_a", "t2") == current
    assert attempts.prune(layout.attempts, {"run_a": "t2", "run_c": "t9"}) == 3
    names = sorted(p.name for p in (tmp_path / "attempts").iterdir())
    free = [name for name in names if name.startswith(".free-")]
    assert [name for name in names if name not in free] == ["run_a.t2", "run_c"]
    assert len(free) == 2  # the stale folders of the current layout, emptied and parked
    for name in free:  # an outcome is never left where a later attempt's folder comes from
        assert all(f.stat().st_size == 0 for f in (tmp_path / "attempts" / name).iterdir())
        assert not (tmp_path / "attempts" / name / attempts.OUTCOME_FILE).exists()
    assert current.is_dir() and not any(d.exists() for d in stale)
    assert legacy_current.is_dir() and not legacy_stale.exists()
    attempts.discard(legacy_current)
    assert (tmp_path / "attempts").is_dir()  # discarding an attempt never takes attempts/
    (current / attempts.OUTCOME_FILE).write_text("{not json")
    assert attempts.read_outcome(current, "run_a") is None  # unreadable: ignored, not fatal


def test_the_exit_file_spares_outcome_json_only_when_a_restart_can_read_it(
        tmp_path: Path) -> None:
    """A restart reads the exit file through the record: no record, no skipping."""
    from datetime import timedelta

    from kandevd.paths import HomeLayout
    from kandevd.runtime import FAILED, SUCCEEDED, ExecutionResult, attempts, records
    from kandevd.runtime.records import ExecutionRecord, write_record

    layout = HomeLayout(tmp_path)
    directory = attempts.attempt_dir(layout.attempts, "run_a", "t1.1")
    directory.mkdir(parents=True)
    ok = ExecutionResult(key="run_a", outcome=SUCCEEDED, exit_code=0, summary=None,
                         cost_cents=None, error=None, started_at=T0, ended_at=T0,
                         log_path=tmp_path / "a.log")
    (directory / "exit").write_text("0\n")
    assert not records.exit_file_tells(directory, ok)  # no record.json yet
    (directory / "record.json").write_text("")  # a rewrite that failed half-way
    assert not records.exit_file_tells(directory, ok)
    record = ExecutionRecord(record_dir=directory, pid=0, pid_start=0, key="run_a",
                             run_id="run_a", session_id="s", started_at=T0,
                             deadline=T0 + timedelta(hours=1), timeout_s=3600.0,
                             log_path=tmp_path / "a.log", input_path=tmp_path / "in",
                             argv=("true",))
    write_record(record, in_place=True)  # truncated file: rewritten whole
    assert records.exit_file_tells(directory, ok)
    assert not records.exit_file_tells(directory, dataclasses.replace(
        ok, outcome=FAILED, exit_code=3))  # the exit file says otherwise


def test_a_legacy_attempt_keeps_its_folder_even_when_the_new_one_exists(
        tmp_path: Path) -> None:
    from kandevd.paths import HomeLayout
    from kandevd.runtime import attempts

    layout = HomeLayout(tmp_path)
    legacy = attempts.legacy_attempt_dir(layout.attempts, "run_a", "t1.1")
    legacy.mkdir(parents=True)
    (legacy / "record.json").write_text("{}")
    current = attempts.attempt_dir(layout.attempts, "run_a", "t1.1")
    current.mkdir(parents=True)
    (current / attempts.OUTCOME_FILE).write_text("{}")  # e.g. written there by mistake
    assert attempts.existing_attempt_dir(layout.attempts, "run_a", "t1.1") == legacy
    (current / "record.json").write_text("{}")
    assert attempts.existing_attempt_dir(layout.attempts, "run_a", "t1.1") == current
