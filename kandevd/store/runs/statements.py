"""The run statements both databases understand (SQLite's placeholders; PostgreSQL's
connection translates them). What differs per database is in sql_sqlite.py and
sql_postgres.py."""

from __future__ import annotations

#: An attempt's reported cost is added to what earlier attempts of the run cost,
#: so budgets see every attempt; an attempt that reports nothing adds nothing.
ADD_COST = ("CASE WHEN CAST(:cost AS DOUBLE PRECISION) IS NULL THEN cost_cents"
            " ELSE COALESCE(cost_cents, 0) + CAST(:cost AS DOUBLE PRECISION) END")

#: A successful attempt's row, less its WHERE clause (fenced by the claim token).
FINISH = ("UPDATE runs SET status = 'finished', finished_at = :now, output_summary = :summary,"
          " cost_cents = " + ADD_COST + ", log_path = :log, claim_token = NULL,"
          " error_message = NULL, scheduled_retry_at = NULL, updated_at = :now")

#: Each eligible agent's oldest due queued run, oldest first. Eligible: active,
#: cooled down, no claimed run. Driven by the agents (one index probe each on
#: runs(agent_id, status), whose rowid order is the request order), so a busy
#: agent's backlog is never walked, however deep it is.
HEADS = """
    SELECT s FROM (
      SELECT (SELECT q.seq FROM runs q
              WHERE q.agent_id = a.id AND q.status = 'queued'
                AND (q.scheduled_retry_at IS NULL OR q.scheduled_retry_at <= :now)
              ORDER BY q.seq LIMIT 1) AS s
      FROM agents a
      WHERE a.status = 'active'
        AND (a.cooldown_until IS NULL OR a.cooldown_until <= :now)
        AND NOT EXISTS (SELECT 1 FROM runs c WHERE c.agent_id = a.id
                        AND c.status = 'claimed')
        {exclusion}
    ) AS heads WHERE s IS NOT NULL ORDER BY s LIMIT :limit
"""

#: The head of the queue: its first queued runs in request order, due or not (the
#: walk stops after ``:window`` rows, however many retries wait there).
QUEUE_HEAD = ("SELECT seq, agent_id, scheduled_retry_at FROM runs INDEXED BY"
              " idx_runs_status_seq WHERE status = 'queued' ORDER BY seq LIMIT :window")

#: Which of some agents may take a run now: active, cooled down, no claimed run.
ELIGIBLE = """
    SELECT a.id FROM agents a WHERE a.id IN ({agents}) AND a.status = 'active'
      AND (a.cooldown_until IS NULL OR a.cooldown_until <= ?)
      AND NOT EXISTS (SELECT 1 FROM runs c WHERE c.agent_id = a.id AND c.status = 'claimed')
"""

#: A claim's row, less what it claims.
CLAIM = ("UPDATE runs SET status = 'claimed', claimed_at = :now,"
         " claim_token = :token || '.' || seq, claimed_by = :boot,"
         " attempt = attempt + 1, finished_at = NULL, updated_at = :now")

#: A claim given back to the queue, less its WHERE clause.
REQUEUE = ("UPDATE runs SET status = 'queued', claimed_at = NULL, claim_token = NULL,"
           " claimed_by = NULL, updated_at = :now")


def exclusion(excluded: set[str], params: dict[str, object]) -> str:
    """The HEADS clause leaving out ``excluded`` agents; their names go into ``params``."""
    if not excluded:
        return ""
    names = []
    for i, agent in enumerate(sorted(excluded)):
        params[f"x{i}"] = agent
        names.append(f":x{i}")
    return f"AND a.id NOT IN ({', '.join(names)})"
