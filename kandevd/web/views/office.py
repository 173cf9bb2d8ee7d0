"""``/agents`` and ``/office``: agents with their queue, cooldown and current run (pause
and resume, as a queue is paused), routines with their next fires, budgets as bars."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kandevd.office.budgets import period_of, spent_cents
from kandevd.store.runs.activity import queued_by_agent
from kandevd.web.charts import spend_bar
from kandevd.web.context import Console, parse_time, set_flash
from kandevd.web.http import Request, Response, redirect


def agents(console: Console, request: Request) -> Response:
    found = console.call("agents.list", {"limit": 500})["items"]
    now = datetime.now(UTC)
    claimed = {r["agent_id"]: r for r in
               console.call("runs.list", {"status": "claimed", "limit": 500})["items"]}
    queued = console.reads(queued_by_agent)
    for agent in found:
        agent["queued"] = queued.get(agent["id"], 0)
        agent["current"] = claimed.get(agent["id"])
        until = parse_time(agent.get("cooldown_until"))
        agent["cooling"] = until is not None and until > now
    runners = console.call("runners.list")["items"]
    return console.render("agents.html", request, title="Agents", nav="agents",
                          agents=found, runners=runners)


def agent_act(console: Console, request: Request, agent: str, action: str) -> Response:
    status = "paused" if action == "pause" else "active"
    console.call("agents.update", {"id": agent, "status": status})
    message = f"Paused agent {agent}: its queued runs wait" if action == "pause" \
        else f"Resumed agent {agent}"
    return set_flash(console, redirect("/agents"), "ok", message)


def index(console: Console, request: Request) -> Response:
    routines = console.call("office.routines.list", {"limit": 500})["items"]
    budgets = console.call("office.budgets.list", {"limit": 500})["items"]
    now = datetime.now(UTC)
    spent = console.reads(lambda store: _spent(store, budgets, now))
    for budget in budgets:
        budget["spent"] = spent.get(budget["id"], 0.0)
        budget["bar"] = spend_bar(budget["spent"], float(budget.get("limit_cents") or 0),
                                  budget.get("alert_threshold_pct"))
    return console.render("office.html", request, title="Office", nav="office",
                          routines=routines, budgets=budgets)


def _spent(store: Any, budgets: list[dict[str, Any]], now: datetime) -> dict[str, float]:
    """What each budget's scope has spent in its current period (as the budget check
    counts it)."""
    with store.connection() as conn:
        return {b["id"]: spent_cents(conn, b["scope_type"], b["scope_id"],
                                     period_of(b["period"], now)[1]) for b in budgets}
