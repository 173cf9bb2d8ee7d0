"""The PostgreSQL store itself: SQL translation, rows, and claims from several daemons at once."""

from __future__ import annotations

import threading
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import pytest

from kandevd.office.budgets import HARD_BUDGET_PROBE_SQL, exceeded_hard_budgets
from kandevd.store.open import open_store
from kandevd.store.postgres import Row, translate
from kandevd.store.runs import RunRepository
from kandevd.timeutil import rfc3339

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(("sqlite", "postgres"), [
    ("SELECT * FROM runs WHERE id = ?", "SELECT * FROM runs WHERE id = %s"),
    ("UPDATE runs SET a = :a WHERE b = :b", "UPDATE runs SET a = %(a)s WHERE b = %(b)s"),
    ("SELECT 1 WHERE task_id IS ? AND x IS :y",
     "SELECT 1 WHERE task_id IS NOT DISTINCT FROM %s AND x IS NOT DISTINCT FROM %(y)s"),
    ("SELECT 1 WHERE x IS NULL AND y IS NOT NULL", "SELECT 1 WHERE x IS NULL AND y IS NOT NULL"),
    ("SELECT '%', 'it''s ?', \"col?\" FROM t", "SELECT '%%', 'it''s ?', \"col?\" FROM t"),
    ("/* office:probe */ SELECT 1 -- a:b ?\nWHERE x LIKE 'a%'",
     "/* office:probe */ SELECT 1 -- a:b ?\nWHERE x LIKE 'a%%'"),
    ("SELECT x::jsonb FROM t", "SELECT x::jsonb FROM t"),
    ("SELECT 1 FROM r WHERE json_extract(payload, '$.routine_id') = ?",
     "SELECT 1 FROM r WHERE (payload::jsonb ->> 'routine_id') = %s"),
    ("SELECT MIN(t) FROM runs INDEXED BY runs_queued_retry_at WHERE a = 1",
     "SELECT MIN(t) FROM runs WHERE a = 1"),
])
def test_sqlite_sql_is_translated_for_postgresql(sqlite: str, postgres: str) -> None:
    assert translate(sqlite) == postgres


def test_a_row_reads_like_sqlite3_row() -> None:
    row = Row({"id": 0, "n": 1}, ("a", 2))
    assert (row["id"], row[1], row.keys(), list(row), len(row)) == ("a", 2, ["id", "n"],
                                                                     ["a", 2], 2)
    assert dict(zip(row.keys(), row, strict=True)) == {"id": "a", "n": 2}


def seed(store: Any, agents: int, runs_each: int) -> list[str]:
    now = rfc3339(T0)
    names = [f"a{i:02d}" for i in range(agents)]
    with store.transaction() as conn:
        conn.execute("INSERT INTO workspaces (id, name, office_workflow_id, created_at,"
                     " updated_at) VALUES ('ws', 'ws', '', ?, ?)", (now, now))
        for name in names:
            conn.execute("INSERT INTO agents (id, workspace_id, name, profile, cooldown_s,"
                         " status, created_at, updated_at) VALUES (?, 'ws', ?, 'default', 0,"
                         " 'active', ?, ?)", (name, name, now, now))
    repo = RunRepository(store, "seed")
    repo.enqueue_many([{"workspace_id": "ws", "agent_id": name, "reason": f"r{n}",
                        "coalesce": False}
                       for n in range(runs_each) for name in names], now=T0)
    return names


@pytest.mark.parametrize("as_the_queue_does", [False, True])
def test_daemons_claiming_at_once_never_claim_an_agent_twice(pg_url: str,
                                                             as_the_queue_does: bool) -> None:
    """Three stores (three daemons) claim and finish as fast as they can: each run is
    claimed once, each agent's runs in request order, and no claim ever fails.

    ``as_the_queue_does``: with the daemon's hard-budget gate and its probe, and
    each outcome written in one transaction with the next claims, as the queue
    loop writes them."""
    stores = [open_store(pg_url) for _ in range(3)]
    try:
        seed(stores[0], agents=12, runs_each=8)
        total = 12 * 8
        # (agent, seq, daemon) in claim order: noted while the claim holds its agent, so
        # the next claim of that agent (only possible after this one's finish) comes later.
        done: list[tuple[str, int, str]] = []
        lock = threading.Lock()
        errors: list[BaseException] = []

        def work(store: Any, boot: str) -> None:
            repo = (RunRepository(store, boot, claim_gate=exceeded_hard_budgets,
                                  claim_gate_probe=HARD_BUDGET_PROBE_SQL)
                    if as_the_queue_does else RunRepository(store, boot))
            claims: list[Any] = []
            try:
                while True:
                    with lock:
                        finished_all = len(done) >= total
                    if finished_all:
                        for claim in claims if as_the_queue_does else ():
                            assert repo.finish(claim.run.id, claim.token, now=T0,
                                               summary=None, cost_cents=None, log_path=None)
                        return
                    if as_the_queue_does:
                        with store.transaction(exclusive=False):
                            for claim in claims:
                                assert repo.finish(claim.run.id, claim.token, now=T0,
                                                   summary=None, cost_cents=None,
                                                   log_path=None)
                            claims = repo.claim_batch(T0, 3)
                    else:
                        claims = repo.claim_batch(T0, 3)
                    with lock:
                        done.extend((c.run.agent_id, c.run.seq, boot) for c in claims)
                    if not as_the_queue_does:
                        for claim in claims:
                            assert repo.finish(claim.run.id, claim.token, now=T0,
                                               summary=None, cost_cents=None, log_path=None)
            except BaseException as exc:  # reported by the test below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(store, f"boot-{n}"))
                   for n, store in enumerate(stores)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert len(done) == total == len({seq for _, seq, _ in done})
        by_agent: dict[str, list[int]] = defaultdict(list)
        for agent, seq, _ in done:
            by_agent[agent].append(seq)
        assert all(seqs == sorted(seqs) for seqs in by_agent.values())
        rows = stores[0].query("SELECT attempt, status FROM runs")
        assert {(r["attempt"], r["status"]) for r in rows} == {(1, "finished")}
        assert len({boot for _, _, boot in done}) >= 2  # the daemons did share the work
        counts = RunRepository(stores[0], "x").count_by_status()
        assert counts["finished"] == total and counts["queued"] == counts["claimed"] == 0
    finally:
        for store in stores:
            store.close()


def test_a_writer_lock_timeout_leaves_the_writer_usable(pg_url: str) -> None:
    """A write that times out waiting for the writer lock fails as 'locked'; the
    daemon's next write works (its connection is not left inside the failed one)."""
    import sqlite3

    holder, waiter = open_store(pg_url), open_store(pg_url)
    try:
        seed(holder, agents=1, runs_each=0)
        waiter._writer().execute("SET lock_timeout = 200")  # instead of 10 s
        with holder.transaction(), pytest.raises(sqlite3.OperationalError,
                                                 match="database is locked"):
            waiter.execute("UPDATE agents SET status = 'paused'")
        assert waiter.execute("UPDATE agents SET status = 'paused'") == 1
        assert holder.query_one("SELECT status FROM agents")[0] == "paused"
    finally:
        holder.close()
        waiter.close()


def test_a_claim_never_takes_a_run_a_concurrent_cancel_committed(pg_url: str) -> None:
    """The cancel holds the row while a claim of another daemon waits for it: once the
    cancel commits, the claim must see 'cancelled', not take the run anyway."""
    canceller, claimer = open_store(pg_url), open_store(pg_url)
    try:
        seed(canceller, agents=1, runs_each=1)
        run_id = canceller.query_one("SELECT id FROM runs")[0]
        claimed: list[Any] = []
        with canceller.transaction():
            RunRepository(canceller, "a").cancel(run_id, "stop", T0)
            waiting = threading.Thread(target=lambda: claimed.extend(
                RunRepository(claimer, "b").claim_batch(T0, 1)))
            waiting.start()
            waiting.join(1.0)  # it reads the run queued, then waits for the row
        waiting.join(30)
        assert claimed == []
        row = canceller.query_one("SELECT status, attempt, claimed_by FROM runs")
        assert tuple(row) == ("cancelled", 0, None)
    finally:
        canceller.close()
        claimer.close()


def test_a_daemon_alone_tells_no_one_that_its_slots_filled(pg_url: str) -> None:
    """The NOTIFY after a saturated queue pass is for other daemons: a daemon alone on
    the database sends none, and sends them again once another daemon heartbeats."""
    from kandevd.cluster.hooks import ClusterHooks
    from kandevd.cluster.membership import Cluster
    from kandevd.config import ClusterConfig

    config = ClusterConfig(heartbeat_s=0.1, dead_after_s=1.0)
    stores = [open_store(pg_url) for _ in range(2)]
    beat = threading.Condition()

    def on_beat(_rescue: bool) -> None:
        with beat:
            beat.notify_all()

    clusters = [Cluster(store, config, f"boot-{n}", f"/home-{n}")
                for n, store in enumerate(stores)]
    alone = clusters[0]
    try:
        alone.join()
        alone.settled()
        alone.start(ClusterHooks(wake=lambda: None, on_beat=on_beat))
        with beat:
            assert beat.wait_for(lambda: alone.beats >= 2, 10)
        assert alone.peers_alive is False
        alone.notify()
        assert not alone._notify_wanted.is_set()  # no NOTIFY for nobody
        other = clusters[1]
        other.join()
        other.start(ClusterHooks(wake=lambda: None, on_beat=on_beat))
        with beat:
            target = alone.beats + 2
            assert beat.wait_for(lambda: alone.beats >= target, 10)
        assert alone.peers_alive is True
        import psycopg

        with psycopg.connect(pg_url, autocommit=True) as listener:
            listener.execute("LISTEN kandevd_queue")
            alone.notify()
            notes = list(listener.notifies(timeout=10, stop_after=1))
        assert [note.payload for note in notes] == [""]
    finally:
        for cluster in clusters:
            cluster.stop()
        for store in stores:
            store.close()


def test_begin_travels_with_the_first_statement_and_an_empty_transaction_sends_nothing(
        pg_url: str) -> None:
    store = open_store(pg_url)
    try:
        seed(store, agents=1, runs_each=0)
        sent: list[str] = []
        store._writer()._trace = sent.append  # what the connection sends, in order
        with store.transaction(exclusive=False):
            pass
        assert sent == []  # nothing begun, nothing to commit or roll back
        with store.transaction(exclusive=False) as conn:
            assert store._in_transaction(conn)  # a transaction, though nothing was sent
            with store.transaction(exclusive=False):  # nested: joins, begins nothing
                conn.execute("UPDATE agents SET status = 'paused'")
            conn.execute("UPDATE agents SET name = 'renamed'")
        assert sent == ["BEGIN", "UPDATE agents SET status = 'paused'",
                        "UPDATE agents SET name = 'renamed'", "COMMIT"]
        assert tuple(store.query_one("SELECT status, name FROM agents")) == ("paused",
                                                                             "renamed")
    finally:
        store.close()


def test_a_first_statement_that_fails_rolls_its_transaction_back(pg_url: str) -> None:
    import sqlite3

    store = open_store(pg_url)
    try:
        seed(store, agents=1, runs_each=0)
        with pytest.raises(sqlite3.IntegrityError), store.transaction(exclusive=False) as conn:
            conn.execute("INSERT INTO workspaces (id, name, office_workflow_id, created_at,"
                         " updated_at) VALUES ('ws', 'twice', '', 'x', 'x')")
        assert not store._in_transaction(store._writer())
        with store.transaction(exclusive=False) as conn:  # the writer works on
            conn.execute("UPDATE agents SET status = 'paused'")
        assert store.query_one("SELECT status FROM agents")[0] == "paused"
        with pytest.raises(RuntimeError), store.transaction() as conn:
            conn.execute("UPDATE agents SET status = 'active'")
            raise RuntimeError("the caller failed after a write")
        assert store.query_one("SELECT status FROM agents")[0] == "paused"
    finally:
        store.close()


@pytest.mark.parametrize("analyzed", [False, True])
def test_a_claim_and_an_outcome_look_runs_up_by_index_in_a_long_queue(pg_url: str,
                                                                      analyzed: bool) -> None:
    """With 5,000 queued runs, no statement of a claim or an outcome reads the whole
    runs table: each touches only the heads of the agents and the rows it writes,
    also before the table has statistics (a new database, a burst of enqueues)."""
    store = open_store(pg_url)
    try:
        seed(store, agents=50, runs_each=100)
        if analyzed:
            store.execute("ANALYZE runs")
            store.execute("ANALYZE agents")
        repo = RunRepository(store, "boot", claim_gate=exceeded_hard_budgets,
                             claim_gate_probe=HARD_BUDGET_PROBE_SQL)
        conn = store._writer()
        sent: list[tuple[str, Any]] = []
        execute, pipelined = conn.execute, conn.pipelined

        def recording(sql: str, params: Any = ()) -> Any:
            sent.append((sql, params))
            return execute(sql, params)

        def recording_all(statements: Any) -> Any:
            sent.extend(statements)
            return pipelined(statements)

        conn.execute, conn.pipelined = recording, recording_all  # type: ignore[method-assign]
        with store.transaction(exclusive=False):
            claims = repo.claim_batch(T0, 4)
            assert repo.finish(claims[0].run.id, claims[0].token, now=T0, summary=None,
                               cost_cents=None, log_path=None)
            repo.claim_batch(T0, 1, exclude_agents={claims[0].run.agent_id})
        conn.execute, conn.pipelined = execute, pipelined  # type: ignore[method-assign]
        statements = [(sql, params) for sql, params in sent
                      if sql.lstrip().upper().startswith(("SELECT", "UPDATE", "WITH"))]
        assert len(statements) == 5  # lock, claim, finish, lock, claim
        for sql, params in statements:
            with store.transaction(exclusive=False) as tx:
                plan = "\n".join(row[0] for row in tx.execute("EXPLAIN " + sql, params))
            assert "Seq Scan on runs" not in plan, plan
    finally:
        store.close()


def test_every_connection_reads_committed_whatever_the_database_default(pg_url: str) -> None:
    """A claim relies on each statement's fresh snapshot: a database (or role) whose
    default isolation is stricter must not change that for kandevd's connections."""
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as admin:
        database = admin.execute("SELECT current_database()").fetchone()[0]
        admin.execute(f'ALTER DATABASE "{database}" SET default_transaction_isolation'
                      " = 'repeatable read'")
    store = open_store(pg_url)
    try:
        with store.transaction(exclusive=False) as conn:
            level = conn.execute("SHOW transaction_isolation").fetchone()[0]
        assert level == "read committed"
    finally:
        store.close()
