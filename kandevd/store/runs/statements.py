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
#: walk stops after ``:window`` rows, however many retries wait there), each with
#: whether its agent may take a run here now (active, cooled down, no claimed run,
#: not one that runs on a runner on another machine) and the agent's profile. (In no
#: promised order: sorting the few rows in Python costs less than SQLite's sort.)
QUEUE_FRONT = """
    SELECT r.seq, r.agent_id, r.scheduled_retry_at, a.profile,
           a.status = 'active' AND a.runs_on IS NULL
             AND (a.cooldown_until IS NULL OR a.cooldown_until <= :now)
             AND NOT EXISTS (SELECT 1 FROM runs c WHERE c.agent_id = a.id
                             AND c.status = 'claimed') AS eligible
    FROM (SELECT seq, agent_id, scheduled_retry_at FROM runs INDEXED BY idx_runs_status_seq
          WHERE status = 'queued' ORDER BY seq LIMIT :window) AS r
    LEFT JOIN agents a ON a.id = r.agent_id
"""

#: A claim's row, less what it claims.
CLAIM = ("UPDATE runs SET status = 'claimed', claimed_at = :now,"
         " claim_token = :token || '.' || seq, claimed_by = :boot,"
         " attempt = attempt + 1, finished_at = NULL, updated_at = :now")

#: A claim given back to the queue, less its WHERE clause.
REQUEUE = ("UPDATE runs SET status = 'queued', claimed_at = NULL, claim_token = NULL,"
           " claimed_by = NULL, updated_at = :now")


#: The claims of this daemon's queue: agents that run here (not on a runner).
HERE = " AND a.runs_on IS NULL"
#: A runner's claims: not an agent whose cancelled run a runner is still stopping (in
#: the claim itself, so that a cancel committed just before it is seen).
NOT_STOPPING = " AND NOT EXISTS (SELECT 1 FROM runner_stops s WHERE s.agent_id = a.id)"


def exclusion(excluded: set[str], params: dict[str, object],
              only: frozenset[str] | None = None) -> str:
    """The HEADS clause leaving out ``excluded`` agents, and keeping only the agents that
    run here (``only`` None) or only the agents ``only`` (a runner's claim); their names
    go into ``params``."""
    clause = HERE if only is None else _among(sorted(only), "o", params, "IN") + NOT_STOPPING
    if not excluded:
        return clause
    return clause + _among(sorted(excluded), "x", params, "NOT IN")


def _among(agents: list[str], prefix: str, params: dict[str, object], test: str) -> str:
    if not agents:
        return " AND FALSE" if test == "IN" else ""
    names = []
    for i, agent in enumerate(agents):
        params[f"{prefix}{i}"] = agent
        names.append(f":{prefix}{i}")
    return f" AND a.id {test} ({', '.join(names)})"


#: A runner's claims are never rescued by a daemon's own recovery (start-up, stale
#: claims, dead peers): the gateway ends them when their runner goes silent.
NOT_A_RUNNERS = " AND (claimed_by IS NULL OR claimed_by NOT LIKE 'runner:%')"
