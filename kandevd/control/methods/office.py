"""``office.projects.*``, ``office.routines.*``, ``office.budgets.*``: Office configuration.

These rows are what gates the Office loop: a first project (adoption),
active routine or budget policy created here takes effect on the loop's
next tick, without a restart. Cron expressions (standard 5 fields) and time
zones are checked by :func:`kandevd.cron.parse_cron`;
a bad one, or a reference to an unknown workspace or agent (or an agent of
another workspace), is ``invalid_params`` with a message naming the field.
A taken id is ``conflict``, an unknown id to update ``not_found``.

A routine's ``next_run_at`` is the first fire time after its creation; it is
recomputed from the moment of the change when the schedule (cron expression
or time zone) changes or a paused routine is resumed (a pause does not
catch up on what it skipped).
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Mapping
from typing import Any

from kandevd.control.protocol import Conflict, InvalidParams, NotFound
from kandevd.control.registry import Registry, object_schema, paging_properties
from kandevd.control.services import Services
from kandevd.office.budgets import ACTIONS, PERIODS, SCOPE_TYPES
from kandevd.office.routines import (
    CATCH_UP_POLICIES,
    CONCURRENCY_POLICIES,
    STATUSES,
    first_next_run_at,
)
from kandevd.store.base import BaseStore
from kandevd.store.office import admin as sql
from kandevd.timeutil import rfc3339, utc_now

NEW_ID = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$",
          "x-message": "is not allowed: use letters, digits, '.', '_' and '-', starting "
                       "with a letter or digit (at most 128 characters)"}
ID = {"type": "string", "minLength": 1, "maxLength": 200}
NAME = {"type": "string", "minLength": 1, "maxLength": 500}
CRON = {"type": "string", "minLength": 1, "maxLength": 200}
TIMEZONE = {"type": "string", "minLength": 1, "maxLength": 100}

ROUTINE_FIELDS = {
    "name": NAME, "agent_id": ID, "cron_expression": CRON, "timezone": TIMEZONE,
    "payload": {"type": "object"}, "status": {"enum": list(STATUSES)},
    "concurrency_policy": {"enum": list(CONCURRENCY_POLICIES)},
    "catch_up_policy": {"enum": list(CATCH_UP_POLICIES)},
    "catch_up_max": {"type": "integer", "minimum": 1, "maximum": 1000},
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "office.projects.create": object_schema(
        {"id": NEW_ID, "workspace_id": ID, "name": NAME}, ("workspace_id", "name")),
    "office.projects.list": object_schema({"workspace_id": ID, **paging_properties()}),
    "office.routines.create": object_schema(
        {"id": NEW_ID, "workspace_id": ID, **ROUTINE_FIELDS},
        ("workspace_id", "agent_id", "name", "cron_expression")),
    "office.routines.update": object_schema({"id": ID, **ROUTINE_FIELDS}, ("id",)),
    "office.routines.list": object_schema({
        "workspace_id": ID, "agent_id": ID, "status": {"enum": list(STATUSES)},
        **paging_properties()}),
    "office.budgets.create": object_schema({
        "id": NEW_ID, "workspace_id": ID, "scope_type": {"enum": list(SCOPE_TYPES)},
        "scope_id": ID,
        "limit_cents": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e12},
        "period": {"enum": list(PERIODS)},
        "alert_threshold_pct": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
        "action_on_exceed": {"enum": list(ACTIONS)},
    }, ("workspace_id", "scope_type", "scope_id", "limit_cents", "period")),
    "office.budgets.list": object_schema({
        "workspace_id": ID, "scope_type": {"enum": list(SCOPE_TYPES)}, "scope_id": ID,
        **paging_properties()}),
}


# -- rows -> objects ---------------------------------------------------------------

def project_from_row(row: Mapping[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in ("id", "workspace_id", "name", "created_at")}


ROUTINE_COLUMNS = ("id", "workspace_id", "agent_id", "name", "cron_expression", "timezone",
                   "payload", "status", "concurrency_policy", "catch_up_policy",
                   "catch_up_max", "next_run_at", "last_run_at", "created_at", "updated_at")


def routine_from_row(row: Mapping[str, Any]) -> dict[str, Any]:
    routine = {name: row[name] for name in ROUTINE_COLUMNS}
    routine["payload"] = json.loads(routine["payload"] or "{}")
    return routine


BUDGET_COLUMNS = ("id", "workspace_id", "scope_type", "scope_id", "limit_cents", "period",
                  "alert_threshold_pct", "action_on_exceed", "created_at")


def budget_from_row(row: Mapping[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in BUDGET_COLUMNS}


# -- checks ------------------------------------------------------------------------

def _workspace_ref(conn: sqlite3.Connection, workspace_id: str) -> None:
    if not sql.workspace_exists(conn, workspace_id):
        raise InvalidParams(f"workspace_id: workspace {workspace_id!r} does not exist")


def _agent_ref(conn: sqlite3.Connection, field: str, agent_id: str, workspace_id: str) -> None:
    home = sql.agent_workspace(conn, agent_id)
    if home is None:
        raise InvalidParams(f"{field}: agent {agent_id!r} does not exist")
    if home != workspace_id:
        raise InvalidParams(f"{field}: agent {agent_id!r} belongs to workspace "
                            f"{home!r}, not {workspace_id!r}")


def _free_id(conn: sqlite3.Connection, table: str, what: str, ident: str) -> None:
    if sql.id_taken(conn, table, ident):
        raise Conflict(f"{what} {ident!r} already exists")


def _page(store: BaseStore, table: str, params: Mapping[str, Any], mapper: Any
          ) -> dict[str, Any]:
    limit, offset = params.get("limit", 50), params.get("offset", 0)
    total, rows = sql.page(store, table, params, limit, offset)
    return {"items": [mapper(r) for r in rows], "total": total, "limit": limit,
            "offset": offset}


# -- methods -----------------------------------------------------------------------

def register(registry: Registry, services: Services) -> None:
    store = services.store

    def create_project(p: dict[str, Any]) -> dict[str, Any]:
        project = {"id": p.get("id") or f"prj_{uuid.uuid4().hex}",
                   "workspace_id": p["workspace_id"], "name": p["name"],
                   "created_at": rfc3339(utc_now())}
        with store.transaction() as conn:
            _free_id(conn, "office_projects", "project", project["id"])
            _workspace_ref(conn, project["workspace_id"])
            sql.insert(conn, "office_projects", project,
                       ("id", "workspace_id", "name", "created_at"))
        return project

    def create_routine(p: dict[str, Any]) -> dict[str, Any]:
        now = utc_now()
        now_s = rfc3339(now)
        routine = {
            "id": p.get("id") or f"rtn_{uuid.uuid4().hex}", "workspace_id": p["workspace_id"],
            "agent_id": p["agent_id"], "name": p["name"],
            "cron_expression": p["cron_expression"], "timezone": p.get("timezone") or "UTC",
            "payload": json.dumps(p.get("payload") or {}, separators=(",", ":"),
                                  sort_keys=True),
            "status": p.get("status") or "active",
            "concurrency_policy": p.get("concurrency_policy") or "skip_if_active",
            "catch_up_policy": p.get("catch_up_policy") or "skip_missed",
            "catch_up_max": p.get("catch_up_max", 25), "created_at": now_s, "updated_at": now_s,
        }
        routine["next_run_at"] = first_next_run_at(routine["cron_expression"],
                                                   routine["timezone"], now)
        with store.transaction() as conn:
            _free_id(conn, "office_routines", "routine", routine["id"])
            _workspace_ref(conn, routine["workspace_id"])
            _agent_ref(conn, "agent_id", routine["agent_id"], routine["workspace_id"])
            row = sql.insert(conn, "office_routines", routine,
                             [c for c in ROUTINE_COLUMNS if c in routine])
        return routine_from_row(row)

    def update_routine(p: dict[str, Any]) -> dict[str, Any]:
        now = utc_now()
        now_s = rfc3339(now)
        with store.transaction() as conn:
            before = sql.get(conn, "office_routines", p["id"])
            if before is None:
                raise NotFound(f"routine {p['id']!r} does not exist")
            fields = {name: p[name] for name in ROUTINE_FIELDS if name in p}
            if "payload" in fields:
                fields["payload"] = json.dumps(fields["payload"], separators=(",", ":"),
                                               sort_keys=True)
            if "agent_id" in fields:
                _agent_ref(conn, "agent_id", fields["agent_id"], before["workspace_id"])
            after = {**dict(before), **fields}
            rescheduled = any(after[k] != before[k] for k in ("cron_expression", "timezone"))
            resumed = before["status"] != "active" and after["status"] == "active"
            if rescheduled or resumed:
                fields["next_run_at"] = first_next_run_at(after["cron_expression"],
                                                          after["timezone"], now)
            fields["updated_at"] = now_s
            row = sql.update(conn, "office_routines", p["id"], fields)
        return routine_from_row(row)

    def create_budget(p: dict[str, Any]) -> dict[str, Any]:
        budget = {
            "id": p.get("id") or f"bud_{uuid.uuid4().hex}", "workspace_id": p["workspace_id"],
            "scope_type": p["scope_type"], "scope_id": p["scope_id"],
            "limit_cents": float(p["limit_cents"]), "period": p["period"],
            "alert_threshold_pct": float(p.get("alert_threshold_pct", 80)),
            "action_on_exceed": p.get("action_on_exceed") or "notify_only",
            "created_at": rfc3339(utc_now()),
        }
        with store.transaction() as conn:
            _free_id(conn, "office_budget_policies", "budget policy", budget["id"])
            _workspace_ref(conn, budget["workspace_id"])
            if budget["scope_type"] == "agent":
                _agent_ref(conn, "scope_id", budget["scope_id"], budget["workspace_id"])
            elif budget["scope_id"] != budget["workspace_id"]:
                raise InvalidParams(
                    f"scope_id: a workspace budget's scope_id must be its workspace_id "
                    f"{budget['workspace_id']!r}, not {budget['scope_id']!r}")
            row = sql.insert(conn, "office_budget_policies", budget, BUDGET_COLUMNS)
        return budget_from_row(row)

    registry.add("office.projects.create", create_project, SCHEMAS["office.projects.create"])
    registry.add("office.projects.list",
                 lambda p: _page(store, "office_projects", p, project_from_row),
                 SCHEMAS["office.projects.list"])
    registry.add("office.routines.create", create_routine, SCHEMAS["office.routines.create"])
    registry.add("office.routines.update", update_routine, SCHEMAS["office.routines.update"])
    registry.add("office.routines.list",
                 lambda p: _page(store, "office_routines", p, routine_from_row),
                 SCHEMAS["office.routines.list"])
    registry.add("office.budgets.create", create_budget, SCHEMAS["office.budgets.create"])
    registry.add("office.budgets.list",
                 lambda p: _page(store, "office_budget_policies", p, budget_from_row),
                 SCHEMAS["office.budgets.list"])
