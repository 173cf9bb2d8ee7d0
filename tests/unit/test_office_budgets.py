"""Budgets: threshold alerts once per period, pause_agent, monthly reset."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kandevd.office.budgets import BudgetGuard, period_of
from tests.unit.office_env import Clock, OfficeEnv, seeded_env


@pytest.fixture
def env(tmp_path: Path) -> Iterator[OfficeEnv]:
    with seeded_env(tmp_path, Clock(datetime(2026, 3, 30, 22, 0, tzinfo=UTC))) as made:
        yield made


def agent_status(env: OfficeEnv, agent_id: str) -> str:
    return env.store.query_one("SELECT status FROM agents WHERE id = ?", (agent_id,))[0]


def alerts(env: OfficeEnv) -> list[tuple[str, float]]:
    return [(a["period_key"], a["threshold_pct"]) for a in env.topics("budget.alert")]


def test_period_keys() -> None:
    assert period_of("monthly", datetime(2026, 12, 31, 23, 59, tzinfo=UTC)) == (
        "2026-12", datetime(2026, 12, 1, tzinfo=UTC))
    assert period_of("lifetime", datetime(2026, 12, 31, tzinfo=UTC)) == ("lifetime", None)


def test_threshold_alerts_once_per_period(env: OfficeEnv,
                                          caplog: pytest.LogCaptureFixture) -> None:
    env.insert_budget(limit_cents=100, alert_pct=80)
    guard = BudgetGuard(env.store, env.bus)
    env.spend("a1", 50)
    assert guard.tick(env.clock()).acted == 0 and alerts(env) == []
    env.spend("a1", 35)                                   # 85 %: crosses 80
    with caplog.at_level("WARNING", logger="kandevd.office.budgets"):
        assert guard.tick(env.clock()).acted == 1
    assert "budget b1: agent a1 spent 85.00 of 100.00 cents in 2026-03 (80% threshold" \
        in caplog.text
    (alert,) = env.topics("budget.alert")
    assert alert["policy_id"] == "b1" and alert["threshold_pct"] == 80.0
    assert alert["spent_cents"] == 85.0 and alert["limit_cents"] == 100.0
    assert alert["paused_agents"] == []
    for _ in range(3):
        assert guard.tick(env.clock()).acted == 0         # no repeat in this period
    assert BudgetGuard(env.store, env.bus).tick(env.clock()).acted == 0   # nor after restart
    env.spend("a1", 20)                                   # 105 %: crosses 100
    assert guard.tick(env.clock()).acted == 1
    assert alerts(env) == [("2026-03", 80.0), ("2026-03", 100.0)]
    assert agent_status(env, "a1") == "active"            # notify_only
    rows = env.store.query("SELECT policy_id, period_key, threshold_pct, spent_cents"
                           " FROM office_budget_alerts ORDER BY threshold_pct")
    assert [tuple(r) for r in rows] == [("b1", "2026-03", 80.0, 85.0),
                                        ("b1", "2026-03", 100.0, 105.0)]


def test_pause_agent_pauses_and_keeps_queued_runs_queued(env: OfficeEnv) -> None:
    env.insert_budget(limit_cents=100, action="pause_agent")
    guard = BudgetGuard(env.store, env.bus)
    env.spend("a1", 150)                                  # both thresholds in one go
    waiting = env.queue.enqueue(workspace_id="ws1", agent_id="a1", reason="later",
                                payload={}).run
    assert guard.tick(env.clock()).acted == 2
    assert alerts(env) == [("2026-03", 80.0), ("2026-03", 100.0)]
    assert env.topics("budget.alert")[1]["paused_agents"] == ["a1"]
    assert agent_status(env, "a1") == "paused" and agent_status(env, "a2") == "active"
    assert env.repo.get(waiting["id"])["status"] == "queued"
    assert env.repo.claim_next(env.clock()) is None       # paused: not claimable
    assert env.queue.explain(waiting["id"])["blockers"] == ["agent_paused"]
    assert [r["status"] for r in env.runs()] == ["finished", "queued"]  # nothing failed

    env.model.update_agent({"id": "a1", "status": "active"})  # the operator resumes it
    assert guard.tick(env.clock()).acted == 0
    assert agent_status(env, "a1") == "active"            # not overruled in this period
    claim = env.repo.claim_next(env.clock())
    assert claim is not None and claim.run["id"] == waiting["id"]


def test_monthly_reset(env: OfficeEnv) -> None:
    env.insert_budget(limit_cents=100, alert_pct=50, action="pause_agent")
    guard = BudgetGuard(env.store, env.bus)
    env.spend("a1", 120)
    guard.tick(env.clock())
    assert alerts(env) == [("2026-03", 50.0), ("2026-03", 100.0)]
    env.model.update_agent({"id": "a1", "status": "active"})
    env.clock.set(datetime(2026, 4, 1, 0, 0, 1, tzinfo=UTC))   # a new month: spend resets
    assert guard.tick(env.clock()).acted == 0
    env.spend("a1", 60)
    assert guard.tick(env.clock()).acted == 1
    env.spend("a1", 45)
    assert guard.tick(env.clock()).acted == 1
    assert alerts(env)[2:] == [("2026-04", 50.0), ("2026-04", 100.0)]
    assert env.topics("budget.alert")[-1]["spent_cents"] == 105.0   # March not counted
    assert agent_status(env, "a1") == "paused"


def test_lifetime_counts_everything(env: OfficeEnv) -> None:
    env.insert_budget(limit_cents=100, period="lifetime")
    guard = BudgetGuard(env.store, env.bus)
    env.spend("a1", 70)
    env.clock.set(datetime(2026, 6, 2, tzinfo=UTC))
    env.spend("a1", 40)
    assert guard.tick(env.clock()).acted == 2
    assert alerts(env) == [("lifetime", 80.0), ("lifetime", 100.0)]


def test_workspace_scope_sums_every_agent_and_pauses_them(env: OfficeEnv) -> None:
    env.insert_budget(scope_type="workspace", scope_id="ws1", limit_cents=100,
                      alert_pct=100, action="pause_agent")
    guard = BudgetGuard(env.store, env.bus)
    env.spend("a1", 60)
    assert guard.tick(env.clock()).acted == 0
    env.spend("a2", 40)
    assert guard.tick(env.clock()).acted == 1
    assert alerts(env) == [("2026-03", 100.0)]
    assert agent_status(env, "a1") == agent_status(env, "a2") == "paused"


def test_agent_scope_ignores_other_agents(env: OfficeEnv) -> None:
    env.insert_budget(scope_id="a1", limit_cents=100)
    env.spend("a2", 500)
    assert BudgetGuard(env.store, env.bus).tick(env.clock()).acted == 0


def test_gate_without_policies_is_one_query(env: OfficeEnv) -> None:
    env.spend("a1", 1000)
    guard = BudgetGuard(env.store, env.bus)
    results = []
    assert env.statements_during(lambda: results.append(guard.tick(env.clock()))) == 1
    assert results[0].scanned is False
    env.insert_budget(limit_cents=100)                    # created at run time
    assert guard.tick(env.clock()).acted == 2
