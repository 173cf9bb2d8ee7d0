"""Office budgets: spend alerts, and pausing an agent that went over its limit.

A policy covers a scope (``agent``: the runs of that agent; ``workspace``:
the runs of that workspace) over a period (``monthly``: from the 1st of the
month 00:00 UTC; ``lifetime``). Spend is the sum of ``cost_cents`` of the
scope's runs whose cost was recorded in the period (``finished_at``, else
``requested_at``, is inside it).

Each tick, for every policy, every threshold crossed (``alert_threshold_pct``
and 100 %) is recorded once per period in ``office_budget_alerts`` (primary
key policy, period, threshold) - the insert (``ON CONFLICT DO NOTHING``) that succeeds is
the one that publishes ``budget.alert`` on the bus and logs a warning, so an
alert is never repeated within its period, across ticks or restarts.

At 100 % with ``action_on_exceed: pause_agent`` the scope's agents (the
agent, or every agent of the workspace) become ``paused`` in the same
transaction as the alert row. Their queued runs stay queued (the claim query
skips paused agents), nothing is failed or cancelled, and a run already
executing finishes. The pause happens at the crossing only, so an operator
who resumes the agent (``agents.update {status: "active"}``) is not
overruled by the next tick; the next period's crossing pauses it again.

Hard budgets at claim time: the tick is periodic, so on its own a spent
``pause_agent`` budget would still let runs be claimed until the next tick
(and again after an operator's resume). :func:`exceeded_hard_budgets` is the
run queue's claim gate (``RunRepository(claim_gate=...)``): inside the claim's
transaction it names every agent in the scope of a ``pause_agent`` policy
whose spend in the current period (:func:`spent_cents`, the tick's own
definition) is at or over 100 % of its limit, and those agents' runs are not
claimed - they stay ``queued``, nothing fails - until the limit is raised,
the policy is removed or changed to ``notify_only``, or the period rolls
over. A resume therefore lifts the *pause*, not the *budget*. A run already
claimed finishes, so spend may still overshoot by what is running.
``notify_only`` policies never block. :func:`budget_blocker` answers the
same question for one agent (``runs.explain``'s ``budget_exceeded``).

Gate: without a policy a tick costs one tiny existence query; without a
``pause_agent`` policy so does a claim's :func:`exceeded_hard_budgets`.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from kandevd.bus import EventBus
from kandevd.store.base import BaseStore
from kandevd.store.office import budgets as sql
from kandevd.store.office.budgets import HARD_BUDGET_PROBE_SQL, spent_cents

from . import HandlerResult

__all__ = ["HARD_BUDGET_PROBE_SQL", "RETENTION_KEEPS_COUNTED_RUNS", "BudgetGuard",
           "budget_blocker", "exceeded_hard_budgets", "period_of", "spent_cents"]

log = logging.getLogger("kandevd.office.budgets")

SCOPE_TYPES = ("agent", "workspace")
PERIODS = ("monthly", "lifetime")
ACTIONS = ("notify_only", "pause_agent")
ALERT_TOPIC = "budget.alert"


def period_of(period: str, now: datetime) -> tuple[str, datetime | None]:
    """``(period_key, start)`` of the period holding ``now``; lifetime has no start."""
    if period == "monthly":
        moment = now.astimezone(UTC)
        return f"{moment.year:04d}-{moment.month:02d}", datetime(moment.year, moment.month, 1,
                                                                 tzinfo=UTC)
    return "lifetime", None


#: Retention keeps a costed run while a budget counts it: deleting it would lower what
#: an agent or workspace has spent and could lift a hard budget. For a ``lifetime``
#: budget always, for a ``monthly`` one while it ended in the current (UTC) month.
RETENTION_KEEPS_COUNTED_RUNS = sql.counted_runs_rule(
    lambda now: period_of("monthly", now)[1] or now)


def thresholds(policy: Mapping[str, Any]) -> list[float]:
    return sorted({float(policy["alert_threshold_pct"]), 100.0})


def _exceeded(conn: sqlite3.Connection, now: datetime, covering: tuple[str, str] | None = None
              ) -> Iterator[Mapping[str, Any]]:
    """The ``pause_agent`` policies (those covering an agent, with ``covering``) spent to
    100 % or more, in order.

    One existence probe first: without a ``pause_agent`` policy nothing else runs.
    """
    if not sql.any_hard_policy(conn):
        return
    for policy in sql.hard_policies(conn, covering):
        _, start = period_of(policy["period"], now)
        if spent_cents(conn, policy["scope_type"], policy["scope_id"], start) \
                >= float(policy["limit_cents"]):
            yield policy


def exceeded_hard_budgets(conn: sqlite3.Connection, now: datetime) -> dict[str, str]:
    """``{agent_id: policy_id}``: agents a spent ``pause_agent`` budget keeps from being claimed.

    Every agent in the scope (the agent; for ``workspace``, every agent of the
    workspace) of a ``pause_agent`` policy whose spend in the period holding
    ``now`` is >= its ``limit_cents``. When several policies block an agent it
    names the first (by ``created_at``, ``id``). Read-only on ``conn``, so it
    can run inside the claim's transaction; without any ``pause_agent`` policy
    it is one tiny existence query returning ``{}``.
    """
    blocked: dict[str, str] = {}
    for policy in _exceeded(conn, now):
        if policy["scope_type"] == "agent":
            agents = [policy["scope_id"]]
        else:
            agents = sql.workspace_agents(conn, policy["scope_id"])
        for agent in agents:
            blocked.setdefault(agent, policy["id"])
    return blocked


def budget_blocker(conn: sqlite3.Connection, agent_id: str, workspace_id: str,
                   now: datetime) -> str | None:
    """The id of the spent ``pause_agent`` policy that blocks ``agent_id``, or None.

    The same answer as ``exceeded_hard_budgets(conn, now).get(agent_id)`` for
    an agent of ``workspace_id``, but only the policies whose scope covers the
    agent are evaluated.
    """
    for policy in _exceeded(conn, now, (agent_id, workspace_id)):
        return str(policy["id"])
    return None


class BudgetGuard:
    name = "budgets"

    def __init__(self, store: BaseStore, bus: EventBus) -> None:
        self.store = store
        self.bus = bus

    def active(self) -> bool:
        return sql.any_policy(self.store)

    def tick(self, now: datetime) -> HandlerResult:
        if not self.active():
            return HandlerResult(scanned=False)
        alerts = 0
        for policy in sql.all_policies(self.store):
            alerts += self.evaluate(policy, now)
        return HandlerResult(scanned=True, acted=alerts)

    def evaluate(self, policy: Mapping[str, Any], now: datetime) -> int:
        """Record and publish the thresholds this policy newly crossed; return how many."""
        period_key, start = period_of(policy["period"], now)
        events: list[dict[str, Any]] = []
        with self.store.transaction() as conn:
            spent = spent_cents(conn, policy["scope_type"], policy["scope_id"], start)
            limit = float(policy["limit_cents"])
            for pct in thresholds(policy):
                if spent < limit * pct / 100.0:
                    break
                if not sql.record_alert(conn, policy["id"], period_key, pct, spent, now):
                    continue
                paused: list[str] = []
                if pct >= 100.0 and policy["action_on_exceed"] == "pause_agent":
                    paused = sql.pause_agents(conn, policy["scope_type"], policy["scope_id"],
                                              now)
                events.append({
                    "policy_id": policy["id"], "workspace_id": policy["workspace_id"],
                    "scope_type": policy["scope_type"], "scope_id": policy["scope_id"],
                    "period": policy["period"], "period_key": period_key,
                    "threshold_pct": pct, "spent_cents": spent, "limit_cents": limit,
                    "action_on_exceed": policy["action_on_exceed"], "paused_agents": paused,
                })
        for event in events:
            log.warning("budget %s: %s %s spent %.2f of %.2f cents in %s (%g%% threshold "
                        "crossed)%s", event["policy_id"], event["scope_type"], event["scope_id"],
                        event["spent_cents"], event["limit_cents"], event["period_key"],
                        event["threshold_pct"],
                        f"; paused agent(s) {', '.join(event['paused_agents'])}"
                        if event["paused_agents"] else "")
            self.bus.publish(ALERT_TOPIC, event)
        return len(events)
