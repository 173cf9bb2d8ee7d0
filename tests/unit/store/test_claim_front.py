"""The claim's shortcut through the front of the queue picks exactly what asking every
agent (HEADS) picks: the oldest due run of each eligible agent, oldest first.

Random queues (agents paused, cooling down, holding a claim or excluded; runs
due, waiting for a retry or already ended) on a real SQLite file: whenever the
front answers, its answer is HEADS's; when it cannot tell, it says so.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kandevd.store.open import open_store
from kandevd.store.runs.sql_sqlite import HEAD_WINDOW, heads_at_the_front
from kandevd.store.runs.statements import HEADS, exclusion

NOW = "2026-06-01T12:00:00.000000Z"
PAST = "2026-06-01T11:00:00.000000Z"
LATER = "2026-06-01T13:00:00.000000Z"

agents_st = st.lists(st.tuples(st.sampled_from(["active", "active", "active", "paused"]),
                               st.sampled_from([None, None, PAST, LATER]),
                               st.booleans(),  # excluded (still running here)
                               st.sampled_from([None, None, None, '["gpu"]'])),  # runs_on
                     min_size=1, max_size=8)
# (a0 has most runs: a front full of one ineligible agent's backlog must happen; agent
# number 8 is no agent at all: its runs stay queued, never claimed)
runs_st = st.lists(st.tuples(st.one_of(st.just(0), st.just(0), st.integers(0, 8)),
                             st.sampled_from(["queued"] * 6 + ["claimed", "finished"]),
                             st.sampled_from([None, None, None, PAST, LATER])),
                   min_size=HEAD_WINDOW, max_size=4 * HEAD_WINDOW)


@settings(max_examples=200, deadline=None)
@given(agents=agents_st, runs=runs_st, limit=st.integers(1, 6))
def test_the_front_of_the_queue_claims_what_every_agent_would(agents, runs, limit) -> None:
    with tempfile.TemporaryDirectory() as folder:
        store = open_store(Path(folder) / "k.db")
        try:
            with store.connection() as conn:  # (runs of an agent that is gone)
                conn.execute("PRAGMA foreign_keys=OFF")
            with store.transaction() as conn:
                conn.execute("INSERT INTO workspaces (id, name, office_workflow_id,"
                             " created_at, updated_at) VALUES ('ws', 'ws', '', ?, ?)",
                             (NOW, NOW))
                for n, (status, cooldown, _excluded, runs_on) in enumerate(agents):
                    conn.execute("INSERT INTO agents (id, workspace_id, name, profile,"
                                 " cooldown_s, status, cooldown_until, runs_on, created_at,"
                                 " updated_at) VALUES (?, 'ws', ?, ?, 0, ?, ?, ?, ?, ?)",
                                 (f"a{n}", f"a{n}", f"p{n}", status, cooldown, runs_on,
                                  NOW, NOW))
                claimed: set[str] = set()
                for n, (agent_no, status, retry_at) in enumerate(runs):
                    agent = "gone" if agent_no == 8 else f"a{agent_no % len(agents)}"
                    if status == "claimed":  # at most one claimed run per agent
                        if agent in claimed:
                            status = "finished"
                        claimed.add(agent)
                    conn.execute("INSERT INTO runs (id, workspace_id, agent_id, reason,"
                                 " status, scheduled_retry_at, requested_at, updated_at)"
                                 " VALUES (?, 'ws', ?, 'work', ?, ?, ?, ?)",
                                 (f"r{n}", agent, status, retry_at, NOW, NOW))
                excluded = {f"a{n}" for n, (_s, _c, out, _r) in enumerate(agents) if out}
                params: dict[str, object] = {"now": NOW, "limit": limit}
                expected = [row[0] for row in conn.execute(
                    HEADS.format(exclusion=exclusion(set(excluded), params)), params)]
                found = heads_at_the_front(conn, set(excluded), NOW, limit)
                queued = sum(1 for _a, status, _r in runs if status == "queued")
                agent_of = dict(conn.execute("SELECT seq, agent_id FROM runs").fetchall())
        finally:
            store.close()
    if found is None:
        assert queued >= HEAD_WINDOW  # it may only pass when more waits behind the front
    else:
        seqs, profiles = found
        assert seqs == expected
        # Each claimed run's agent with its own profile (the claim reads no other).
        assert profiles == {agent_of[seq]: "p" + agent_of[seq][1:] for seq in seqs}
