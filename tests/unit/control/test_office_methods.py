"""``office.*`` control methods through the real registry (schema check + handler)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.methods import office
from kandevd.control.protocol import Conflict, InvalidParams, NotFound, RpcError
from kandevd.control.registry import Registry
from kandevd.control.services import Services
from kandevd.events.hub import EventHub
from kandevd.timeutil import parse_rfc3339, utc_now
from tests.support.office import OfficeEnv, seeded_env


class Methods:
    def __init__(self, env: OfficeEnv) -> None:
        self.registry = Registry()
        office.register(self.registry, Services(
            config=env.config, layout=env.layout, store=env.store, bus=env.bus,
            runtime=env.runtime, queue=env.queue, model=env.model, cron=None, status=dict,
            request_shutdown=lambda: None, metrics_text=str, events=EventHub()))

    def __call__(self, name: str, params: dict[str, Any] | None = None) -> Any:
        method = self.registry.get(name)
        self.registry.check_params(method, params or {})
        return method.handler(params or {})


@pytest.fixture
def env(tmp_path: Path, store_location: str) -> Iterator[OfficeEnv]:
    with seeded_env(tmp_path, location=store_location) as made:
        made.model.create_workspace({"id": "ws2", "name": "Two"})
        made.model.create_agent({"id": "b1", "workspace_id": "ws2", "name": "b1"})
        yield made


@pytest.fixture
def call(env: OfficeEnv) -> Methods:
    return Methods(env)


def expect(error: type[RpcError], message: str, call: Methods, name: str,
           params: dict[str, Any]) -> None:
    with pytest.raises(error) as caught:
        call(name, params)
    assert caught.value.message == message or caught.value.message.startswith(message), \
        caught.value.message


def test_projects(call: Methods) -> None:
    project = call("office.projects.create", {"id": "p1", "workspace_id": "ws1", "name": "P"})
    assert project["id"] == "p1" and project["workspace_id"] == "ws1"
    generated = call("office.projects.create", {"workspace_id": "ws2", "name": "Q"})
    assert generated["id"].startswith("prj_")
    listed = call("office.projects.list", {"workspace_id": "ws1"})
    assert listed == {"items": [project], "total": 1, "limit": 50, "offset": 0}
    assert call("office.projects.list", {"limit": 1, "offset": 1})["items"] == [generated]
    expect(Conflict, "project 'p1' already exists", call, "office.projects.create",
           {"id": "p1", "workspace_id": "ws1", "name": "again"})
    expect(InvalidParams, "workspace_id: workspace 'nope' does not exist", call,
           "office.projects.create", {"workspace_id": "nope", "name": "P"})


def test_routine_create_defaults_and_next_run_at(call: Methods) -> None:
    before = utc_now()
    routine = call("office.routines.create", {
        "id": "r1", "workspace_id": "ws1", "agent_id": "a1", "name": "hourly",
        "cron_expression": "0 * * * *", "payload": {"k": 1}})
    assert {k: routine[k] for k in ("timezone", "status", "concurrency_policy",
                                    "catch_up_policy", "catch_up_max", "payload")} == {
        "timezone": "UTC", "status": "active", "concurrency_policy": "skip_if_active",
        "catch_up_policy": "skip_missed", "catch_up_max": 25, "payload": {"k": 1}}
    upcoming = parse_rfc3339(routine["next_run_at"])
    assert upcoming > before and upcoming.minute == 0 and upcoming.second == 0
    assert (upcoming - before).total_seconds() <= 3600
    assert routine["last_run_at"] is None
    assert call("office.routines.list", {"agent_id": "a1"})["items"] == [routine]
    assert call("office.routines.list", {"status": "paused"})["total"] == 0


@pytest.mark.parametrize(("params", "message"), [
    ({"cron_expression": "* * * *"},
     "cron_expression: '* * * *' is not a valid 5-field cron expression: Wrong number of "
     "fields; got 4, expected 5"),
    ({"cron_expression": "0 0 31 2 *"}, "cron_expression: '0 0 31 2 *' never fires"),
    ({"timezone": "Nowhere/City"}, "timezone: unknown time zone 'Nowhere/City'"),
    ({"agent_id": "ghost"}, "agent_id: agent 'ghost' does not exist"),
    ({"agent_id": "b1"}, "agent_id: agent 'b1' belongs to workspace 'ws2', not 'ws1'"),
    ({"workspace_id": "nope"}, "workspace_id: workspace 'nope' does not exist"),
    ({"concurrency_policy": "sometimes"}, "params.concurrency_policy: 'sometimes' is not one"),
    ({"catch_up_max": 0}, "params.catch_up_max: 0 is less than the minimum of 1"),
    ({"extra": 1}, "params.extra: unknown parameter"),
])
def test_routine_create_rejects(call: Methods, params: dict[str, Any], message: str) -> None:
    base = {"workspace_id": "ws1", "agent_id": "a1", "name": "r",
            "cron_expression": "* * * * *"}
    expect(InvalidParams, message, call, "office.routines.create", {**base, **params})


def test_routine_update_reschedules_and_resumes(call: Methods, env: OfficeEnv) -> None:
    call("office.routines.create", {"id": "r1", "workspace_id": "ws1", "agent_id": "a1",
                                    "name": "r", "cron_expression": "0 0 1 1 *"})
    renamed = call("office.routines.update", {"id": "r1", "name": "renamed",
                                              "payload": {"x": 2}})
    assert renamed["name"] == "renamed" and renamed["payload"] == {"x": 2}
    moved = call("office.routines.update", {"id": "r1", "cron_expression": "* * * * *"})
    assert (parse_rfc3339(moved["next_run_at"]) - utc_now()).total_seconds() <= 60
    env.store.execute("UPDATE office_routines SET next_run_at = '2000-01-01T00:00:00.000000Z'")
    paused = call("office.routines.update", {"id": "r1", "status": "paused"})
    assert paused["next_run_at"] == "2000-01-01T00:00:00.000000Z"
    resumed = call("office.routines.update", {"id": "r1", "status": "active"})
    assert parse_rfc3339(resumed["next_run_at"]) > utc_now()   # no catch-up of the pause
    expect(InvalidParams, "timezone: unknown time zone 'X/Y'", call, "office.routines.update",
           {"id": "r1", "timezone": "X/Y"})
    expect(InvalidParams, "agent_id: agent 'b1' belongs to workspace 'ws2'", call,
           "office.routines.update", {"id": "r1", "agent_id": "b1"})
    expect(NotFound, "routine 'nope' does not exist", call, "office.routines.update",
           {"id": "nope", "name": "x"})


def test_budgets(call: Methods) -> None:
    budget = call("office.budgets.create", {
        "id": "b1", "workspace_id": "ws1", "scope_type": "agent", "scope_id": "a1",
        "limit_cents": 500, "period": "monthly"})
    assert budget["alert_threshold_pct"] == 80 and budget["action_on_exceed"] == "notify_only"
    assert budget["limit_cents"] == 500
    whole = call("office.budgets.create", {
        "workspace_id": "ws1", "scope_type": "workspace", "scope_id": "ws1",
        "limit_cents": 1000, "period": "lifetime", "alert_threshold_pct": 50,
        "action_on_exceed": "pause_agent"})
    assert whole["id"].startswith("bud_")
    assert call("office.budgets.list", {"scope_type": "agent"})["items"] == [budget]
    assert call("office.budgets.list", {"workspace_id": "ws1"})["total"] == 2
    expect(Conflict, "budget policy 'b1' already exists", call, "office.budgets.create", {
        "id": "b1", "workspace_id": "ws1", "scope_type": "agent", "scope_id": "a1",
        "limit_cents": 5, "period": "monthly"})


@pytest.mark.parametrize(("params", "message"), [
    ({"scope_id": "ghost"}, "scope_id: agent 'ghost' does not exist"),
    ({"scope_id": "b1"}, "scope_id: agent 'b1' belongs to workspace 'ws2', not 'ws1'"),
    ({"scope_type": "workspace", "scope_id": "ws2"},
     "scope_id: a workspace budget's scope_id must be its workspace_id 'ws1', not 'ws2'"),
    ({"limit_cents": 0}, "params.limit_cents: 0 is less than or equal to the minimum of 0"),
    ({"alert_threshold_pct": 120}, "params.alert_threshold_pct: 120 is greater than"),
    ({"period": "weekly"}, "params.period: 'weekly' is not one of"),
    ({"action_on_exceed": "fail_runs"}, "params.action_on_exceed: 'fail_runs' is not one of"),
])
def test_budget_create_rejects(call: Methods, params: dict[str, Any], message: str) -> None:
    base = {"workspace_id": "ws1", "scope_type": "agent", "scope_id": "a1",
            "limit_cents": 100, "period": "monthly"}
    expect(InvalidParams, message, call, "office.budgets.create", {**base, **params})
