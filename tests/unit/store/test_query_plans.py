"""No statement of the store layer reads the whole ``runs`` table.

Every statement the repositories run while a populated store is exercised
(enqueue with and without coalescing, claim with a hard-budget gate, finish,
fail, retry, cancel, requeue and recovery, ``runs.list`` by each filter and
order, explain, the status counts, the queue loop's probes, the Office budgets,
the model's gets and lists) is recorded with its parameters, and its
``EXPLAIN QUERY PLAN`` must not contain ``SCAN`` of ``runs`` (under any alias):
the table holds every run ever made, so a full scan grows without bound. The
plans are checked twice: on a fresh database (the planner's defaults) and after
``ANALYZE`` (what ``PRAGMA optimize`` at close may leave behind).

:data:`ALLOWED` lists the few statements that do walk ``runs`` on purpose,
each with the reason it is bounded or unavoidable.
"""

from __future__ import annotations

import random
import re
import sqlite3
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from kandevd.config import RetryConfig
from kandevd.office.budgets import BudgetGuard, budget_blocker, exceeded_hard_budgets
from kandevd.runs.retry import attempt_limit, retry_decider
from kandevd.store.runs import RunRepository
from kandevd.store.sqlite import Store
from kandevd.timeutil import rfc3339
from tests.support.office import OfficeEnv, seeded_env

#: (pattern of the normalised statement, why its walk of ``runs`` is acceptable)
ALLOWED: list[tuple[str, str]] = [
    (r"^SELECT COUNT\(\*\) FROM runs$",
     "runs.list without a filter: its total is every run. A COUNT(*) with no WHERE is "
     "SQLite's count opcode over the smallest index's pages (no row is decoded; about "
     "1 ms at 110,000 runs)."),
    (r"^SELECT status, CAST\(SUM\(n\) AS BIGINT\) AS n, \(SELECT COUNT\(\*\) FROM runs\)"
     r" AS total FROM run_counts GROUP BY status$",
     "daemon.status's run counts, checked against the number of runs: the same count "
     "opcode as above, once per status call (the counts themselves are kept, not "
     "computed)."),
    (r"^INSERT INTO run_counts \(status, n\) SELECT status, COUNT\(\*\) FROM runs GROUP BY "
     r"status$",
     "rebuilding the run counts after runs were written behind the daemon's back (the "
     "store here is filled with plain INSERTs): a repair, not a step of any request."),
    (r"^SELECT \* FROM runs ORDER BY seq (ASC|DESC) LIMIT \? OFFSET \?$",
     "runs.list without a filter: a walk of the table in rowid order that stops after "
     "offset + limit rows (limit <= 500)."),
]

#: Statements allowed to sort their rows of ``runs`` (``USE TEMP B-TREE``) before a
#: LIMIT: anything else must read its rows in the order asked (a page of one agent's
#: 50,000 runs must not sort all of them first).
ALLOWED_SORTS: list[tuple[str, str]] = [
    (r"^SELECT \* FROM runs WHERE agent_id = \? AND reason = \? AND status = 'queued' AND "
     r"requested_at > \?",
     "coalescing: the rows sorted are the agent's queued runs of that reason requested in "
     "the last COALESCE_WINDOW_S seconds (a range of runs_queued_coalesce)."),
    (r"^UPDATE runs SET status = 'claimed'",
     "claim_batch: the rows sorted are the heads, at most one run per eligible agent "
     "(each found by one probe of runs(agent_id, status))."),
]

RETRY = RetryConfig(max_retries=3, delays_s=(30.0,), jitter=0.0, max_age_s=10**9)
NO_RETRY = RetryConfig(max_retries=0, delays_s=(30.0,), jitter=0.0, max_age_s=10**9)

_WRITES_OR_READS = re.compile(r"^\s*(?:/\*.*?\*/\s*)?(SELECT|WITH|UPDATE|DELETE|INSERT)\b",
                              re.IGNORECASE | re.DOTALL)
#: ``runs r``, ``runs AS r``: the aliases the plan names the table by.
_ALIAS = re.compile(r"\bruns\s+(?:AS\s+)?([A-Za-z_]\w*)", re.IGNORECASE)
_NOT_ALIASES = {"where", "set", "indexed", "order", "group", "limit", "on", "join", "left",
                "inner", "values", "returning", "union", "and", "or", "not", "using"}


class RecordingConnection(sqlite3.Connection):
    """A connection that remembers every statement executed on it, with its parameters."""

    recorded: list[tuple[str, Any]] | None = None

    def execute(  # type: ignore[override]
            self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        if RecordingConnection.recorded is not None:
            RecordingConnection.recorded.append((sql, parameters))
        return super().execute(sql, parameters)


def normalise(sql: str) -> str:
    return " ".join(re.sub(r"/\*.*?\*/", " ", sql, flags=re.DOTALL).split())


def runs_aliases(sql: str) -> set[str]:
    aliases = {"runs"}
    for match in _ALIAS.finditer(sql):
        if match.group(1).lower() not in _NOT_ALIASES:
            aliases.add(match.group(1))
    return aliases


def scans_of_runs(conn: sqlite3.Connection, sql: str, params: Any) -> list[str]:
    """The ``SCAN`` lines of the statement's plan that walk ``runs``."""
    plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
    aliases = runs_aliases(sql)
    return [line for line in plan
            if line.startswith("SCAN ") and line.split()[1] in aliases]


def sorts(conn: sqlite3.Connection, sql: str, params: Any) -> list[str]:
    """The temporary sorts of a statement on ``runs`` that has a LIMIT."""
    if not re.search(r"\bLIMIT\b", sql, re.IGNORECASE):
        return []
    plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
    return [line for line in plan if line.startswith("USE TEMP B-TREE")]


def allowed(sql: str, allow_list: list[tuple[str, str]] | None = None) -> bool:
    text = normalise(sql)
    return any(re.search(pattern, text) for pattern, _why in
               (ALLOWED if allow_list is None else allow_list))


# -- the exercise -------------------------------------------------------------------

def populate(env: OfficeEnv, terminal: int = 3000, queued: int = 300) -> None:
    """Terminal and queued runs of a1, a2 (ws1) written straight to the table."""
    rnd = random.Random(7)
    start = env.clock() - timedelta(days=40)
    rows = []
    for n in range(terminal + queued):
        at = rfc3339(start + timedelta(minutes=n))
        done = n < terminal
        rows.append((f"run_p{n:06d}", "ws1", rnd.choice(["a1", "a2"]), f"task{n % 50}",
                     rnd.choice(["work", "routine", "task_assigned", "manual"]),
                     rnd.choice(["finished", "failed", "cancelled"]) if done else "queued",
                     at, at if done else None,
                     round(rnd.random() * 10, 2) if done and n % 3 else None, at))
    with env.store.transaction() as conn:
        conn.executemany(
            "INSERT INTO runs (id, workspace_id, agent_id, task_id, reason, status,"
            " requested_at, finished_at, cost_cents, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)


def exercise(env: OfficeEnv) -> None:
    store, clock, model = env.store, env.clock, env.model
    repo = RunRepository(store, "boot", give_up=attempt_limit(3), claim_gate=exceeded_hard_budgets)
    other = RunRepository(store, "earlier-boot")
    env.insert_budget("b_agent", scope_type="agent", scope_id="a1", limit_cents=1e9,
                      action="pause_agent")
    env.insert_budget("b_ws", scope_type="workspace", scope_id="ws1", limit_cents=1e9,
                      period="lifetime", action="pause_agent")
    env.insert_budget("b_spent", scope_type="agent", scope_id="a2", limit_cents=0.01,
                      action="notify_only", alert_pct=50)
    model.create_agent({"id": "a3", "workspace_id": "ws1", "name": "a3", "cooldown_s": 60})
    model.create_task({"id": "t1", "workspace_id": "ws1", "workflow_id": "kanban",
                       "title": "t1", "step_id": "free"})
    now = clock()

    # enqueue: plain, keyed (twice: deduplicated), coalesced, task_assigned
    first = repo.enqueue(workspace_id="ws1", agent_id="a3", reason="work", now=now)
    repo.enqueue(workspace_id="ws1", agent_id="a3", reason="work", now=now)  # coalesced
    repo.enqueue(workspace_id="ws1", agent_id="a3", reason="keyed", now=now,
                 idempotency_key="k1")
    repo.enqueue(workspace_id="ws1", agent_id="a3", reason="keyed", now=now,
                 idempotency_key="k1")
    repo.enqueue(workspace_id="ws1", agent_id="a3", reason="task_assigned", task_id="t1",
                 now=now)
    repo.prune_keys(now + timedelta(days=2))

    # claim (with the budget gate), finish, fail with a retry and for good, requeue
    claims = repo.claim_batch(now, 5)
    assert claims
    for claim in claims:
        if claim.run.agent_id == "a1":
            repo.finish(claim.run.id, claim.token, now=now, summary="ok", cost_cents=2.5,
                        log_path=None)
        elif claim.run.agent_id == "a2":
            repo.fail_attempt(claim.run.id, claim.token, now=now, error="boom",
                              decide=retry_decider(RETRY, draw=0.5), cost_cents=1.0)
        else:
            repo.requeue(claim.run.id, claim.token, now)
    claim = repo.claim_next(now + timedelta(hours=2))
    assert claim is not None
    repo.fail_attempt(claim.run.id, claim.token, now=now + timedelta(hours=2),
                      error="boom", decide=retry_decider(NO_RETRY))
    repo.claim_of(claim.run.id, claim.token)
    repo.claimed_tokens()

    # recovery
    stale = repo.claim_next(now + timedelta(hours=3))
    assert stale is not None
    repo.recover_stale(now + timedelta(hours=5), 60.0, ())
    again = repo.claim_next(now + timedelta(hours=6))
    assert again is not None
    other.foreign_claims()
    other.requeue_foreign_claims(now + timedelta(hours=6))
    again = repo.claim_next(now + timedelta(hours=7))
    assert again is not None
    repo.adopt_claim(again.run.id, again.token)
    with store.transaction() as conn:
        repo.rescue(conn, again.run.id, again.token, now, "test")

    # cancel and retry
    repo.cancel(first.run.id, "no longer needed", now)
    repo.retry(first.run.id, now)
    repo.cancel(first.run.id, None, now, only_queued=True)

    # reads
    later = now + timedelta(hours=8)
    for order in ("asc", "desc"):
        repo.list(order=order)
        for name, value in (("status", "queued"), ("status", "finished"), ("agent_id", "a1"),
                            ("workspace_id", "ws1"), ("task_id", "task7"),
                            ("reason", "routine")):
            repo.list(order=order, limit=20, offset=5, **{name: value})
    repo.get(first.run.id)
    queued = repo.list(status="queued", limit=3).items
    for run in queued:
        repo.explain(run.id, later, runtime_full=False)
    repo.explain(first.run.id, later, runtime_full=True)
    repo.count_by_status()
    repo.oldest_queued_at(later)
    repo.retrying(later)
    repo.has_queued()
    repo.next_due(later)

    # Office budgets: the tick (alerts), the claim gate, explain's blocker
    BudgetGuard(store, env.bus).tick(later)
    with store.connection() as conn:
        exceeded_hard_budgets(conn, later)
        budget_blocker(conn, "a1", "ws1", later)

    # the model's gets and lists
    model.get_workspace("ws1")
    model.list_workspaces()
    model.get_agent("a1")
    model.list_agents(workspace_id="ws1")
    model.list_agents(status="active")
    model.get_workflow("kanban")
    model.list_workflows(workspace_id="ws1")
    model.list_workflows(style="office")
    model.get_task("t1")
    for filters in ({}, {"workspace_id": "ws1"}, {"workflow_id": "kanban"}, {"state": "TODO"},
                    {"runner": "a1"}):
        model.list_tasks(**filters)


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
             ) -> Iterator[tuple[Path, list[tuple[str, Any]]]]:
    monkeypatch.setattr(Store, "connection_factory", RecordingConnection)
    with seeded_env(tmp_path) as env:
        populate(env)
        statements: list[tuple[str, Any]] = []
        RecordingConnection.recorded = statements
        try:
            exercise(env)
        finally:
            RecordingConnection.recorded = None
        yield Path(env.store.path), statements


def check_plans(path: Path, statements: list[tuple[str, Any]]) -> list[str]:
    failures: list[str] = []
    seen: set[tuple[str, str]] = set()
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        for sql, params in statements:
            key = (sql, repr(params))
            if not _WRITES_OR_READS.match(sql) or key in seen:
                continue
            seen.add(key)
            found = [] if allowed(sql) else scans_of_runs(conn, sql, params)
            if "runs" in sql and not allowed(sql, ALLOWED_SORTS):
                found += sorts(conn, sql, params)
            failures += [f"{line}: {normalise(sql)}  {params!r}" for line in found]
    return failures


def test_the_exercise_covers_the_store_layer(recorded: tuple[Path, list[Any]]) -> None:
    _path, statements = recorded
    text = "\n".join(" ".join(sql.split()) for sql, _ in statements)
    for needle in ("INSERT INTO runs", "UPDATE runs SET coalesced_count", "UPDATE runs SET "
                   "status = 'claimed'", "status = 'finished'", "office:budget-scan",
                   "office:budget-claim", "FROM run_counts", "FROM agents", "FROM tasks",
                   "FROM workflows", "FROM workspaces", "scheduled_retry_at"):
        assert needle in text, needle
    assert len(statements) > 100


def test_no_statement_scans_runs(recorded: tuple[Path, list[Any]]) -> None:
    path, statements = recorded
    assert check_plans(path, statements) == []


def test_no_statement_scans_runs_after_analyze(recorded: tuple[Path, list[Any]]) -> None:
    path, statements = recorded
    with sqlite3.connect(path) as conn:
        conn.execute("ANALYZE")
    assert check_plans(path, statements) == []


def test_budget_spend_reads_only_its_index(recorded: tuple[Path, list[Any]]) -> None:
    """The spend of a scope is summed from the covering spend index, not the table."""
    path, statements = recorded
    spends = [(sql, params) for sql, params in statements if "SUM(cost_cents)" in sql]
    assert {"agent_id" in sql for sql, _ in spends} == {True, False}
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        for sql, params in spends:
            plan = " | ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql,
                                                             params))
            assert re.fullmatch(r"SEARCH runs USING COVERING INDEX runs_spend_\w+ \(.*\)",
                                plan), plan


def test_the_allow_list_is_used(recorded: tuple[Path, list[Any]]) -> None:
    """Every allowed statement still exists (a stale entry would hide a new scan)."""
    _path, statements = recorded
    texts = [normalise(sql) for sql, _ in statements]
    for pattern, _why in ALLOWED + ALLOWED_SORTS:
        assert any(re.search(pattern, text) for text in texts), pattern


def test_the_detector_sees_a_scan(tmp_path: Path) -> None:
    """The check itself: a full scan of runs, aliased or not, is reported."""
    with sqlite3.connect(tmp_path / "t.db") as conn:
        conn.execute("CREATE TABLE runs (seq INTEGER PRIMARY KEY, cost REAL)")
        assert scans_of_runs(conn, "SELECT SUM(cost) FROM runs", ())
        assert scans_of_runs(conn, "SELECT 1 FROM runs r WHERE r.cost > ?", (1,))
        assert not scans_of_runs(conn, "SELECT cost FROM runs WHERE seq = ?", (1,))
        assert sorts(conn, "SELECT seq FROM runs ORDER BY cost LIMIT 1", ())
        assert not sorts(conn, "SELECT seq FROM runs ORDER BY seq LIMIT 1", ())


def test_coalescing_reads_only_the_window(recorded: tuple[Path, list[Any]]) -> None:
    """The coalescing lookup is a range of the agent's recent queued runs of the reason."""
    path, statements = recorded
    lookups = [(sql, params) for sql, params in statements
               if normalise(sql).startswith("SELECT * FROM runs WHERE agent_id = ? AND reason")]
    assert lookups
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        for sql, params in lookups:
            plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
            assert plan[0] == ("SEARCH runs USING INDEX runs_queued_coalesce"
                               " (agent_id=? AND reason=? AND requested_at>?)"), plan
