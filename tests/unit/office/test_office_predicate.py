"""The Office predicate: both rules, and the SQL and Python forms agree on random data."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kandevd.store.office.predicate import (
    OFFICE_TASK_SQL,
    PROBE_TAG,
    is_office_task,
    office_adopted,
)
from kandevd.store.open import open_store
from kandevd.store.sqlite import Store

STAMP = "2026-01-01T00:00:00.000000Z"
WORKFLOWS = ("wf_a", "wf_b", "wf_c")


@pytest.mark.parametrize(("task", "office_workflow_id", "expected"), [
    ({"project_id": "p1", "workflow_id": "wf_a"}, "", True),         # project rule
    ({"project_id": "p1", "workflow_id": "wf_a"}, "wf_b", True),
    ({"project_id": "", "workflow_id": "wf_a"}, "wf_a", True),       # office workflow rule
    ({"project_id": None, "workflow_id": "wf_a"}, "wf_a", True),
    ({"project_id": "", "workflow_id": "wf_a"}, "wf_b", False),
    ({"project_id": "", "workflow_id": "wf_a"}, "", False),          # no office workflow set
    ({"project_id": "", "workflow_id": ""}, "", False),              # empty never matches empty
    ({"project_id": "", "workflow_id": "wf_a"}, None, False),
])
def test_python_rules(task: dict[str, str | None], office_workflow_id: str | None,
                      expected: bool) -> None:
    assert is_office_task(task, office_workflow_id) is expected


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = open_store(tmp_path / "kandevd.db")
    yield opened
    opened.close()


def _reset(store: Store, workspaces: dict[str, str]) -> None:
    with store.transaction() as conn:
        for table in ("tasks", "workflows", "office_projects", "workspaces"):
            conn.execute(f"DELETE FROM {table}")
        for ws, office in workspaces.items():
            conn.execute("INSERT INTO workspaces (id, name, office_workflow_id, created_at,"
                         " updated_at) VALUES (?, ?, ?, ?, ?)", (ws, ws, office, STAMP, STAMP))
            for wf in WORKFLOWS:
                conn.execute("INSERT INTO workflows (id, workspace_id, name, style, created_at)"
                             " VALUES (?, ?, ?, 'custom', ?)", (f"{ws}.{wf}", ws, wf, STAMP))


workspace_ids = st.sampled_from(["ws1", "ws2", "ws3"])
office_choice = st.sampled_from(["", *WORKFLOWS])
tasks = st.lists(st.tuples(workspace_ids, st.sampled_from(WORKFLOWS),
                           st.sampled_from(["", "p1", " ", "p2"])), max_size=12)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offices=st.fixed_dictionaries({w: office_choice for w in ("ws1", "ws2", "ws3")}),
       rows=tasks)
def test_sql_and_python_agree(store: Store, offices: dict[str, str],
                              rows: list[tuple[str, str, str]]) -> None:
    # workflow ids are qualified by workspace, so "the same name in another workspace" is
    # never the office workflow: the rule compares the task's own workspace only
    _reset(store, {ws: (f"{ws}.{wf}" if wf else "") for ws, wf in offices.items()})
    with store.transaction() as conn:
        for n, (ws, wf, project) in enumerate(rows):
            conn.execute("INSERT INTO tasks (id, workspace_id, workflow_id, title, project_id,"
                         " state, created_at, updated_at) VALUES (?, ?, ?, 't', ?, 'TODO', ?, ?)",
                         (f"t{n}", ws, f"{ws}.{wf}", project, STAMP, STAMP))
    by_sql = {r["id"] for r in store.query(
        f"SELECT t.id FROM tasks t JOIN workspaces w ON w.id = t.workspace_id"
        f" WHERE {OFFICE_TASK_SQL}")}
    rows_with_ws = store.query("SELECT t.*, w.office_workflow_id FROM tasks t"
                               " JOIN workspaces w ON w.id = t.workspace_id")
    by_python = {r["id"] for r in rows_with_ws if is_office_task(dict(r), r["office_workflow_id"])}
    assert by_sql == by_python
    expected = {f"t{n}" for n, (ws, wf, project) in enumerate(rows)
                if project or (offices[ws] and offices[ws] == wf)}
    assert by_python == expected


def test_office_adopted_follows_workflows_and_projects(store: Store) -> None:
    _reset(store, {"ws1": "", "ws2": ""})
    with store.connection() as conn:
        assert office_adopted(conn) is False
    store.execute("UPDATE workspaces SET office_workflow_id = 'ws2.wf_a' WHERE id = 'ws2'")
    with store.connection() as conn:
        assert office_adopted(conn) is True
    store.execute("UPDATE workspaces SET office_workflow_id = ''")
    with store.connection() as conn:
        assert office_adopted(conn) is False
    store.execute("INSERT INTO office_projects (id, workspace_id, name, created_at)"
                  " VALUES ('p1', 'ws1', 'P', ?)", (STAMP,))
    with store.connection() as conn:
        assert office_adopted(conn) is True


def test_office_adopted_is_one_tagged_statement(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.sql"
    monkeypatch.setenv("KANDEVD_TRACE_SQL", str(trace))
    traced = open_store(tmp_path / "traced.db")
    try:
        before, lines = traced.statements, len(trace.read_text().splitlines())
        with traced.connection() as conn:
            assert office_adopted(conn) is False
        assert traced.statements - before == 1
        (statement,) = trace.read_text().splitlines()[lines:]
    finally:
        traced.close()
    assert statement.startswith(PROBE_TAG)
    assert "tasks" not in statement and "office_projects" in statement
