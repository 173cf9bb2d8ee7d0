"""Budget policies and alerts: every statement of :mod:`kandevd.office.budgets`.

Tagged statements: ``office:probe`` the gates' existence checks,
``office:budget-claim`` what the claim's budget gate reads inside the claim's
transaction, ``office:budget-scan`` the maintenance tick's reads.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kandevd.store.base import BaseStore
from kandevd.store.office.predicate import PROBE_TAG
from kandevd.store.runs.retention import KeepRule
from kandevd.timeutil import rfc3339

_PROBE_SQL = f"{PROBE_TAG} SELECT EXISTS(SELECT 1 FROM office_budget_policies)"
#: True when some ``pause_agent`` policy exists: false means no agent is over a hard budget
#: (the claim gate's first look; see ``RunRepository(claim_gate_probe=...)``).
HARD_BUDGET_PROBE_SQL = (f"{PROBE_TAG} SELECT EXISTS(SELECT 1 FROM office_budget_policies"
                         " WHERE action_on_exceed = 'pause_agent')")
_HARD_POLICIES_SQL = (
    "/* office:budget-claim */ SELECT id, workspace_id, scope_type, scope_id, limit_cents,"
    " period FROM office_budget_policies WHERE action_on_exceed = 'pause_agent'")
_COVERING = (" AND ((scope_type = 'agent' AND scope_id = ?)"
             " OR (scope_type = 'workspace' AND scope_id = ?))")
#: the order in which policies are looked at: the first exceeded one names the blocker
_POLICY_ORDER = " ORDER BY created_at, id"
_SCOPE_COLUMN = {"agent": "agent_id", "workspace": "workspace_id"}


def any_policy(store: BaseStore) -> bool:
    """Is there a budget policy at all (the maintenance gate)?"""
    return bool(store.query_one(_PROBE_SQL)[0])


def any_hard_policy(conn: sqlite3.Connection) -> bool:
    """Is there a ``pause_agent`` policy (without one, no agent is over a hard budget)?"""
    return bool(conn.execute(HARD_BUDGET_PROBE_SQL).fetchone()[0])


def hard_policies(conn: sqlite3.Connection, covering: tuple[str, str] | None = None
                  ) -> list[sqlite3.Row]:
    """The ``pause_agent`` policies in the order they are looked at; with ``covering``
    (an agent and its workspace), only those whose scope covers that agent."""
    if covering is None:
        return conn.execute(_HARD_POLICIES_SQL + _POLICY_ORDER).fetchall()
    return conn.execute(_HARD_POLICIES_SQL + _COVERING + _POLICY_ORDER, covering).fetchall()


def workspace_agents(conn: sqlite3.Connection, workspace_id: str) -> list[str]:
    """The ids of the agents of ``workspace_id`` (a workspace budget's scope)."""
    return [row[0] for row in conn.execute(
        "/* office:budget-claim */ SELECT id FROM agents WHERE workspace_id = ?",
        (workspace_id,))]


def spent_cents(conn: sqlite3.Connection, scope_type: str, scope_id: str,
                start: datetime | None) -> float:
    """Sum of ``cost_cents`` of the scope's runs recorded since ``start`` (None: ever)."""
    sql = (f"/* office:budget-scan */ SELECT COALESCE(SUM(cost_cents), 0) FROM runs"
           f" WHERE {_SCOPE_COLUMN[scope_type]} = ? AND cost_cents IS NOT NULL")
    params: list[Any] = [scope_id]
    if start is not None:
        sql += " AND COALESCE(finished_at, requested_at) >= ?"
        params.append(rfc3339(start))
    return float(conn.execute(sql, params).fetchone()[0])


def all_policies(store: BaseStore) -> list[sqlite3.Row]:
    """Every budget policy, oldest first."""
    return store.query(
        "/* office:budget-scan */ SELECT * FROM office_budget_policies ORDER BY created_at, id")


def record_alert(conn: sqlite3.Connection, policy_id: str, period_key: str, pct: float,
                 spent: float, now: datetime) -> bool:
    """Record that ``policy_id`` crossed ``pct`` in ``period_key``; False if it was already."""
    return bool(conn.execute(
        "INSERT INTO office_budget_alerts (policy_id, period_key,"
        " threshold_pct, spent_cents, created_at) VALUES (?, ?, ?, ?, ?)"
        " ON CONFLICT DO NOTHING",
        (policy_id, period_key, pct, spent, rfc3339(now))).rowcount)


def pause_agents(conn: sqlite3.Connection, scope_type: str, scope_id: str,
                 now: datetime) -> list[str]:
    """Pause the active agents of the scope (the agent, or the workspace's); their ids."""
    column = "id" if scope_type == "agent" else "workspace_id"
    rows = conn.execute(
        f"UPDATE agents SET status = 'paused', updated_at = ? WHERE {column} = ?"
        " AND status = 'active' RETURNING id", (rfc3339(now), scope_id)).fetchall()
    return sorted(r["id"] for r in rows)


def counted_runs_rule(month_start: Callable[[datetime], datetime]) -> KeepRule:
    """Retention keeps a costed run while a budget counts it: for a ``lifetime`` budget
    always, for a ``monthly`` one while it ended at or after ``month_start(now)``."""
    return KeepRule(
        sql="r.cost_cents IS NOT NULL AND EXISTS ("
            " SELECT 1 FROM office_budget_policies p"
            " WHERE ((p.scope_type = 'agent' AND p.scope_id = r.agent_id)"
            "        OR (p.scope_type = 'workspace' AND p.scope_id = r.workspace_id))"
            "   AND (p.period != 'monthly'"
            "        OR COALESCE(r.finished_at, r.requested_at) >= :month_start))",
        params=lambda now: {"month_start": rfc3339(month_start(now))})
