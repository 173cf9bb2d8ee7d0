"""Budgets: threshold alerts once per period, pause_agent, monthly reset."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kandevd.office.budgets import (
    HARD_BUDGET_PROBE_SQL,
    BudgetGuard,
    budget_blocker,
    exceeded_hard_budgets,
    period_of,
)
from kandevd.store.runs import RunRepository
from tests.support.office import Clock, OfficeEnv, seeded_env


@pytest.fixture
def env(tmp_path: Path, store_location: str) -> Iterator[OfficeEnv]:
    clock = Clock(datetime(2026, 3, 30, 22, 0, tzinfo=UTC))
    with seeded_env(tmp_path, clock, location=store_location) as made:
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
    assert env.repo.get(waiting.id).status == "queued"
    assert env.repo.claim_next(env.clock()) is None       # paused: not claimable
    assert env.queue.explain(waiting.id)["blockers"] == ["agent_paused"]
    assert [r.status for r in env.runs()] == ["finished", "queued"]  # nothing failed

    env.model.update_agent({"id": "a1", "status": "active"})  # the operator resumes it
    assert guard.tick(env.clock()).acted == 0
    assert agent_status(env, "a1") == "active"            # not overruled in this period
    claim = env.repo.claim_next(env.clock())
    assert claim is not None and claim.run.id == waiting.id


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


# -- hard budgets at claim time ------------------------------------------------------------
def hard(env: OfficeEnv) -> dict[str, str]:
    with env.store.connection() as conn:
        return exceeded_hard_budgets(conn, env.clock())


def blocker(env: OfficeEnv, agent_id: str, workspace_id: str = "ws1") -> str | None:
    with env.store.connection() as conn:
        return budget_blocker(conn, agent_id, workspace_id, env.clock())


def test_no_policies_is_one_probe_and_blocks_nobody(env: OfficeEnv) -> None:
    env.spend("a1", 1000)
    results: list[dict[str, str]] = []
    assert env.statements_during(lambda: results.append(hard(env))) == 1
    assert results == [{}] and blocker(env, "a1") is None


def test_notify_only_never_blocks_and_costs_one_probe(env: OfficeEnv) -> None:
    env.insert_budget(limit_cents=10, action="notify_only")
    env.insert_budget("b2", scope_type="workspace", scope_id="ws1", limit_cents=10)
    env.spend("a1", 1000)
    results: list[dict[str, str]] = []
    assert env.statements_during(lambda: results.append(hard(env))) == 1
    assert results == [{}] and blocker(env, "a1") is None


def test_agent_policy_blocks_at_100_percent(env: OfficeEnv) -> None:
    env.insert_budget(limit_cents=100, action="pause_agent")
    env.spend("a1", 99.5)
    assert hard(env) == {} and blocker(env, "a1") is None        # 99.5 %
    env.spend("a1", 0.5)
    assert hard(env) == {"a1": "b1"}                               # exactly 100 %: blocked
    assert blocker(env, "a1") == "b1" and blocker(env, "a2") is None
    env.spend("a2", 500)                                           # another agent's spend
    assert hard(env) == {"a1": "b1"}


def test_workspace_policy_blocks_every_agent_of_it(env: OfficeEnv) -> None:
    env.model.create_workspace({"id": "ws2", "name": "Two"})
    env.model.create_agent({"id": "b1", "workspace_id": "ws2", "name": "b1"})
    env.insert_budget("w1", scope_type="workspace", scope_id="ws1", limit_cents=100,
                      action="pause_agent")
    env.spend("a1", 60)
    assert hard(env) == {}
    env.spend("a2", 40)
    assert hard(env) == {"a1": "w1", "a2": "w1"}                   # not ws2's b1
    assert blocker(env, "a2") == "w1" and blocker(env, "b1", "ws2") is None


def test_first_policy_names_the_blocker(env: OfficeEnv) -> None:
    env.insert_budget("p1", scope_type="workspace", scope_id="ws1", limit_cents=50,
                      action="pause_agent")
    env.clock.advance(seconds=1)
    env.insert_budget("p2", limit_cents=10, action="pause_agent")
    env.spend("a1", 60)
    assert hard(env) == {"a1": "p1", "a2": "p1"}
    assert blocker(env, "a1") == "p1"
    env.store.execute("DELETE FROM office_budget_policies WHERE id = 'p1'")
    assert hard(env) == {"a1": "p2"} and blocker(env, "a1") == "p2"


def test_monthly_boundary_last_months_spend_does_not_count(env: OfficeEnv) -> None:
    env.insert_budget(limit_cents=100, action="pause_agent")
    env.insert_budget("life", scope_id="a2", limit_cents=100, period="lifetime",
                      action="pause_agent")
    env.spend("a1", 150)
    env.spend("a2", 150)
    assert hard(env) == {"a1": "b1", "a2": "life"}
    env.clock.set(datetime(2026, 3, 31, 23, 59, 59, tzinfo=UTC))
    assert hard(env) == {"a1": "b1", "a2": "life"}
    env.clock.set(datetime(2026, 4, 1, 0, 0, 0, tzinfo=UTC))       # the new month starts
    assert hard(env) == {"a2": "life"} and blocker(env, "a1") is None
    env.spend("a1", 100)
    assert hard(env) == {"a1": "b1", "a2": "life"}


def test_the_tick_is_unchanged_by_the_claim_check(env: OfficeEnv) -> None:
    """Reading hard budgets writes nothing: alerts and the pause stay the tick's."""
    env.insert_budget(limit_cents=100, action="pause_agent")
    env.spend("a1", 150)
    assert hard(env) == {"a1": "b1"}
    assert env.store.query_one("SELECT COUNT(*) FROM office_budget_alerts")[0] == 0
    assert agent_status(env, "a1") == "active" and alerts(env) == []
    assert BudgetGuard(env.store, env.bus).tick(env.clock()).acted == 2
    assert agent_status(env, "a1") == "paused"


@pytest.mark.parametrize("probe", [None, HARD_BUDGET_PROBE_SQL])
def test_claim_gate_keeps_a_resumed_agent_from_being_claimed(env: OfficeEnv,
                                                             probe: str | None) -> None:
    """Wired as the repository's claim gate: a resume lifts the pause, not the budget.

    With its probe (as the daemon wires it) PostgreSQL sends the probe inside the
    claim's locking statement: the same claims either way."""
    env.insert_budget(limit_cents=100, action="pause_agent")
    env.spend("a1", 150)
    BudgetGuard(env.store, env.bus).tick(env.clock())
    env.model.update_agent({"id": "a1", "status": "active"})
    gated = RunRepository(env.store, "boot", claim_gate=exceeded_hard_budgets,
                          claim_gate_probe=probe)
    waiting = env.queue.enqueue(workspace_id="ws1", agent_id="a1", reason="later",
                                payload={}).run
    other = env.queue.enqueue(workspace_id="ws1", agent_id="a2", reason="later",
                              payload={}).run
    claims = gated.claim_batch(env.clock(), 5)
    assert [c.run.id for c in claims] == [other.id]
    assert gated.get(waiting.id).status == "queued"
    explained = gated.explain(waiting.id, env.clock(), runtime_full=False)
    assert "budget_exceeded" in explained["blockers"]
    assert explained["details"]["budget_exceeded"] == "b1"
    env.store.execute("UPDATE office_budget_policies SET limit_cents = 1000")
    claim = gated.claim_next(env.clock())
    assert claim is not None and claim.run.id == waiting.id


def test_without_a_hard_budget_the_probed_gate_claims_as_an_ungated_queue(env: OfficeEnv
                                                                          ) -> None:
    env.insert_budget(limit_cents=100, action="notify_only")  # spent, but only an alert
    env.spend("a1", 150)
    gated = RunRepository(env.store, "boot", claim_gate=exceeded_hard_budgets,
                          claim_gate_probe=HARD_BUDGET_PROBE_SQL)
    queued = [env.queue.enqueue(workspace_id="ws1", agent_id=agent, reason=f"r{n}",
                                payload={}).run for n, agent in enumerate(("a1", "a2", "a1"))]
    claims = gated.claim_batch(env.clock(), 5)
    assert [c.run.id for c in claims] == [queued[0].id, queued[1].id]
    assert gated.claim_batch(env.clock(), 5) == []  # both agents busy now
    env.insert_budget("hard", limit_cents=100, action="pause_agent")
    assert gated.finish(claims[0].run.id, claims[0].token, now=env.clock(), summary=None,
                        cost_cents=None, log_path=None)
    assert gated.claim_batch(env.clock(), 5) == []  # a1 is over its new hard budget
    assert gated.get(queued[2].id).status == "queued"


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policies=st.lists(st.tuples(st.sampled_from(["agent:a1", "agent:a2", "workspace:ws1"]),
                                   st.sampled_from([10.0, 50.0, 100.0, 200.0]),
                                   st.sampled_from(["pause_agent", "notify_only"])),
                         max_size=5),
       spend=st.tuples(st.sampled_from([0.0, 10.0, 60.0, 150.0]),
                       st.sampled_from([0.0, 10.0, 60.0, 150.0])))
def test_property_blocker_agrees_with_the_map(tmp_path_factory: pytest.TempPathFactory,
                                              policies: list[tuple[str, float, str]],
                                              spend: tuple[float, float]) -> None:
    clock = Clock(datetime(2026, 3, 30, 22, 0, tzinfo=UTC))
    with seeded_env(tmp_path_factory.mktemp("prop"), clock) as env:
        for n, (scope, limit, action) in enumerate(policies):
            scope_type, scope_id = scope.split(":")
            env.insert_budget(f"p{n}", scope_type=scope_type, scope_id=scope_id,
                              limit_cents=limit, action=action)
            env.clock.advance(seconds=1)
        for agent, cents in zip(("a1", "a2"), spend, strict=True):
            if cents:
                env.spend(agent, cents)
        blocked = hard(env)
        spent = {"a1": spend[0], "a2": spend[1], "ws1": spend[0] + spend[1]}
        for agent in ("a1", "a2"):
            expected = next((f"p{n}" for n, (scope, limit, action) in enumerate(policies)
                             if action == "pause_agent"
                             and scope.split(":")[1] in (agent, "ws1")
                             and spent[scope.split(":")[1]] >= limit), None)
            assert blocked.get(agent) == expected == blocker(env, agent)
