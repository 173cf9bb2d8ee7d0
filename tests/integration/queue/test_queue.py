"""The global run queue end to end: a real daemon, real echo agent processes, real SQLite.

The echo agent's ``touch`` option makes every successful execution append
``<run_id> <start> <end>`` to a file, so the agents themselves record when
they ran: per-agent overlap, execution order and "executed exactly once"
are read from there, and the run rows are read from the database.
"""

from __future__ import annotations

import itertools
import json
import signal
import sqlite3
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import Client, DaemonUnavailable, RpcCallError
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now
from tests.support.daemon import DaemonProcess, add_agents, fast_config, run_cli

pytestmark = pytest.mark.integration

Factory = Callable[..., DaemonProcess]
WAIT_S = 30.0
TERMINAL = {"finished", "failed", "cancelled"}


def enqueue(daemon: DaemonProcess, workspace: str, agent: str, **payload: Any
            ) -> dict[str, Any]:
    result = daemon.call("runs.enqueue", {"workspace_id": workspace, "agent_id": agent,
                                          "reason": "manual", "payload": payload,
                                          "coalesce": False})
    return result["run"]


def statuses(daemon: DaemonProcess, run_ids: Iterable[str]) -> dict[str, sqlite3.Row]:
    ids = list(run_ids)
    with daemon.db() as conn:
        rows = conn.execute(f"SELECT * FROM runs WHERE id IN ({','.join('?' * len(ids))})",
                            ids).fetchall()
    return {row["id"]: row for row in rows}


def wait_terminal(daemon: DaemonProcess, run_ids: list[str], timeout: float = WAIT_S
                  ) -> dict[str, sqlite3.Row]:
    def done() -> dict[str, sqlite3.Row] | None:
        rows = statuses(daemon, run_ids)
        return rows if all(r["status"] in TERMINAL for r in rows.values()) else None

    return daemon.wait_until(done, timeout=timeout, what=f"{len(run_ids)} runs to end")


def windows(path: Path) -> dict[str, list[tuple[datetime, datetime]]]:
    """The ``touch`` lines: run id -> every (start, end) the agent recorded for it."""
    found: dict[str, list[tuple[datetime, datetime]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            run_id, start, end = line.split()
            found.setdefault(run_id, []).append((parse_rfc3339(start), parse_rfc3339(end)))
    return found


def assert_no_overlap_per_agent(touched: dict[str, list[tuple[datetime, datetime]]],
                                agent_of: dict[str, str]) -> None:
    by_agent: dict[str, list[tuple[datetime, datetime, str]]] = {}
    for run_id, spans in touched.items():
        for start, end in spans:
            by_agent.setdefault(agent_of[run_id], []).append((start, end, run_id))
    for agent, spans in by_agent.items():
        spans.sort()
        for (_s1, end1, first), (start2, _e2, second) in itertools.pairwise(spans):
            assert end1 <= start2, f"agent {agent}: {first} and {second} overlapped"


# -- ordering and per-agent serialization ----------------------------------------------


def test_backlog_of_two_workspaces_drains_in_request_order(daemon_factory: Factory,
                                                           tmp_path: Path) -> None:
    """Four agents in two workspaces, two runtime slots: claims follow ``seq`` exactly.

    Two long runs of other agents hold both slots while the backlog is queued,
    round-robin over a1 (ws1), b1 (ws2), a2 (ws1), b2 (ws2). With two slots
    and four agents the oldest queued run's agent is always free, so every
    claim must take the next run in request order.
    """
    daemon = daemon_factory(fast_config(runtime={"max_concurrent": 2}))
    add_agents(daemon, {"ws1": ["a1", "a2", "hold1"], "ws2": ["b1", "b2", "hold2"]})
    touch = tmp_path / "windows.txt"
    holders = [enqueue(daemon, "ws1", "hold1", sleep_s=1.5),
               enqueue(daemon, "ws2", "hold2", sleep_s=1.5)]
    daemon.wait_until(lambda: daemon.call("daemon.status")["runtime"]["active"] == 2,
                      what="both slots held")
    order = [("ws1", "a1"), ("ws2", "b1"), ("ws1", "a2"), ("ws2", "b2")] * 3
    backlog = [enqueue(daemon, ws, agent, sleep_s=0.1, touch=str(touch)) for ws, agent in order]
    assert all(r["status"] == "queued" for r in backlog)
    ids = [r["id"] for r in holders + backlog]
    rows = wait_terminal(daemon, ids)
    assert {rows[i]["status"] for i in ids} == {"finished"}

    claimed = sorted(backlog, key=lambda r: rows[r["id"]]["claimed_at"])
    assert [r["seq"] for r in claimed] == sorted(r["seq"] for r in backlog)
    touched = windows(touch)
    assert sorted(touched) == sorted(r["id"] for r in backlog)
    assert all(len(spans) == 1 for spans in touched.values())
    assert_no_overlap_per_agent(touched, {r["id"]: r["agent_id"] for r in backlog})


def test_at_most_one_claimed_run_per_agent_while_slots_are_free(daemon_factory: Factory,
                                                               tmp_path: Path) -> None:
    """Two agents, four runs each, four slots: each agent still runs one at a time."""
    daemon = daemon_factory(fast_config(runtime={"max_concurrent": 4}))
    add_agents(daemon, {"ws1": ["a1"], "ws2": ["b1"]})
    touch = tmp_path / "windows.txt"
    runs = [enqueue(daemon, ws, agent, sleep_s=0.3, touch=str(touch))
            for ws, agent in [("ws1", "a1"), ("ws1", "a1"), ("ws2", "b1"), ("ws1", "a1"),
                              ("ws2", "b1"), ("ws2", "b1"), ("ws1", "a1"), ("ws2", "b1")]]
    ids = [r["id"] for r in runs]
    most: dict[str, int] = {}

    def sample() -> bool:
        with daemon.db() as conn:
            for agent, count in conn.execute(
                    "SELECT agent_id, COUNT(*) FROM runs WHERE status = 'claimed'"
                    " GROUP BY agent_id"):
                most[agent] = max(most.get(agent, 0), count)
            left = conn.execute("SELECT COUNT(*) FROM runs WHERE status NOT IN"
                                " ('finished', 'failed', 'cancelled')").fetchone()[0]
        return left == 0

    daemon.wait_until(sample, what="every run to end")
    assert most == {"a1": 1, "b1": 1}
    rows = statuses(daemon, ids)
    assert {r["status"] for r in rows.values()} == {"finished"}
    touched = windows(touch)
    agent_of = {r["id"]: r["agent_id"] for r in runs}
    assert_no_overlap_per_agent(touched, agent_of)
    for agent in ("a1", "b1"):  # each agent ran its runs in request order
        mine = [r for r in runs if r["agent_id"] == agent]
        assert sorted(mine, key=lambda r: touched[r["id"]][0][0]) == mine
    # The agents did run side by side: slots were free, only the agent rule held runs back.
    a_spans = [touched[r["id"]][0] for r in runs if r["agent_id"] == "a1"]
    b_spans = [touched[r["id"]][0] for r in runs if r["agent_id"] == "b1"]
    assert any(a0 < b1 and b0 < a1 for a0, a1 in a_spans for b0, b1 in b_spans)


# -- the safety pass ---------------------------------------------------------------------


def test_a_paused_agents_run_wakes_no_queue_pass_and_its_resume_claims_at_once(
        daemon_factory: Factory) -> None:
    """No pass could claim a paused agent's run: queuing it does not wake the queue
    loop (under a backlog each enqueue paid for a pass that found nothing). The
    resume wakes it, so the run is claimed at once, not at the safety pass."""
    daemon = daemon_factory(fast_config(queue={"safety_interval_s": 120}))
    add_agents(daemon, {"ws": ["a1", "a2"]})
    daemon.call("agents.update", {"id": "a1", "status": "paused"})

    def ticks() -> int:
        return daemon.call("daemon.status")["stats"]["queue"]["ticks"]

    daemon.wait_until(lambda: ticks() == ticks(), what="the queue loop idle")
    before = ticks()
    held = [enqueue(daemon, "ws", "a1") for _ in range(10)]
    daemon.call("runs.enqueue_many", {"runs": [
        {"workspace_id": "ws", "agent_id": "a1", "reason": "manual", "coalesce": False}]})
    # (each would wake a pass right after its commit: 12; one pass the setup woke may
    # still land in between on a busy machine)
    assert ticks() - before <= 1
    assert daemon.call("runs.explain", {"id": held[0]["id"]})["blockers"] == ["agent_paused"]

    ready = enqueue(daemon, "ws", "a2")  # an active agent's run still wakes it at once
    daemon.wait_until(lambda: daemon.call("runs.get", {"id": ready["id"]})["claimed_at"],
                      timeout=10, what="the active agent's run claimed")
    daemon.call("agents.update", {"id": "a1", "status": "active"})
    daemon.wait_until(lambda: daemon.call("runs.get", {"id": held[0]["id"]})["claimed_at"],
                      timeout=10, what="the resumed agent's first run claimed")


def test_a_run_inserted_by_another_process_is_claimed_within_one_safety_interval(
        daemon_factory: Factory) -> None:
    safety = 1.0
    daemon = daemon_factory(fast_config(queue={"safety_interval_s": safety}))
    add_agents(daemon, {"ws1": ["a1"]})
    warm = enqueue(daemon, "ws1", "a1")  # the loop is idle (waiting) when the row appears
    wait_terminal(daemon, [warm["id"]])
    with daemon.db() as conn:  # no signal reaches the daemon: only its safety pass sees this
        now = rfc3339(utc_now())
        conn.execute("INSERT INTO runs (id, workspace_id, agent_id, reason, payload, status,"
                     " requested_at, updated_at) VALUES ('run_outside', 'ws1', 'a1', 'external',"
                     " '{}', 'queued', ?, ?)", (now, now))
    inserted = time.monotonic()

    def claimed() -> bool:
        row = statuses(daemon, ["run_outside"])["run_outside"]
        return row["status"] != "queued"

    daemon.wait_until(claimed, timeout=10, what="the external run to be claimed")
    elapsed = time.monotonic() - inserted
    assert elapsed <= safety + 0.5, f"claimed {elapsed:.2f}s after the insert"
    assert wait_terminal(daemon, ["run_outside"])["run_outside"]["status"] == "finished"


# -- crashes and stops -------------------------------------------------------------------


def test_kill_9_with_queued_claimed_and_retrying_runs_loses_nothing(daemon_factory: Factory,
                                                                    tmp_path: Path) -> None:
    cfg = fast_config(queue={"safety_interval_s": 1},
                 retry={"max_retries": 2, "delays_s": [3], "jitter": 0},
                 runtime={"max_concurrent": 3})
    daemon = daemon_factory(cfg)
    add_agents(daemon, {"ws1": ["a1", "a3"], "ws2": ["a2"]})
    touch = tmp_path / "windows.txt"
    marker = tmp_path / "failed-once"
    retrying = enqueue(daemon, "ws1", "a3", fail_once_marker=str(marker), touch=str(touch))
    busy = [enqueue(daemon, "ws1", "a1", sleep_s=4, touch=str(touch)),
            enqueue(daemon, "ws2", "a2", sleep_s=4, touch=str(touch))]
    queued = [enqueue(daemon, ws, agent, touch=str(touch))
              for ws, agent in [("ws1", "a1"), ("ws2", "a2"), ("ws1", "a1"), ("ws2", "a2")]]
    everything = [retrying, *busy, *queued]
    ids = [r["id"] for r in everything]

    def crash_point() -> bool:
        rows = statuses(daemon, ids)
        return (rows[retrying["id"]]["status"] == "queued"
                and rows[retrying["id"]]["retry_count"] == 1
                and all(rows[r["id"]]["status"] == "claimed" for r in busy)
                and len(daemon.agent_pids()) == 2)

    daemon.wait_until(crash_point, what="a retry scheduled and two agents mid-execution")
    daemon.kill9()
    assert daemon.agent_pids() == []  # the agents died with it
    before = statuses(daemon, ids)
    assert [before[r["id"]]["status"] for r in busy] == ["claimed", "claimed"]
    assert [before[r["id"]]["status"] for r in queued] == ["queued"] * 4
    assert before[retrying["id"]]["scheduled_retry_at"] is not None
    assert not touch.exists()  # nothing had finished yet

    daemon.start()
    daemon.wait_for_line("re-queued 2 run(s) claimed by a previous daemon instance")
    rows = wait_terminal(daemon, ids)
    assert {rows[i]["status"] for i in ids} == {"finished"}
    assert {i: rows[i]["seq"] for i in ids} == {r["id"]: r["seq"] for r in everything}
    assert rows[retrying["id"]]["retry_count"] == 1
    touched = windows(touch)
    assert {run_id: len(spans) for run_id, spans in touched.items()} == {i: 1 for i in ids}
    agent_of = {r["id"]: r["agent_id"] for r in everything}
    assert_no_overlap_per_agent(touched, agent_of)
    for agent in ("a1", "a2"):  # the re-queued run went first, then the queue in order
        mine = [r for r in everything if r["agent_id"] == agent]
        assert sorted(mine, key=lambda r: touched[r["id"]][0][0]) == mine
    assert "superseded" not in daemon.log_text


def test_sigint_while_agents_run_leaves_them_claimed_for_the_next_start(
        daemon_factory: Factory, tmp_path: Path) -> None:
    cfg = fast_config(runtime={"max_concurrent": 4, "stop_grace_s": 0.5})
    daemon = daemon_factory(cfg, args=["--log-level", "DEBUG"])
    add_agents(daemon, {"ws1": ["a1", "a2"]})
    touch = tmp_path / "windows.txt"
    running = [enqueue(daemon, "ws1", agent, sleep_s=3, touch=str(touch))
               for agent in ("a1", "a2")]
    waiting = enqueue(daemon, "ws1", "a1", touch=str(touch))
    ids = [r["id"] for r in [*running, waiting]]
    daemon.wait_until(lambda: len(daemon.agent_pids()) == 2, what="two agents running")
    client = Client(daemon.socket)  # opened before the stop: intake must refuse on it
    try:
        mark = daemon.mark()
        daemon.send_signal(signal.SIGINT)
        daemon.wait_for_line("Graceful shutdown started", after=mark)
        with pytest.raises((RpcCallError, DaemonUnavailable)) as refused:
            client.call("runs.enqueue", {"workspace_id": "ws1", "agent_id": "a2",
                                         "reason": "late"})
        if isinstance(refused.value, RpcCallError):
            assert refused.value.kind == "shutting_down"
    finally:
        client.close()
    assert daemon.wait() == 0
    assert daemon.agent_pids() == []  # the runtime stopped its agents
    lines = [line for line in daemon.lines[mark:] if line.strip()]
    assert "Graceful shutdown complete" in lines[-1]

    def first(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    # intake off -> queue loop joined -> agents interrupted -> runtime stopped -> store closed
    assert first("Graceful shutdown started") < first("queue loop stopped") \
        < first("interrupting 2 execution(s)") < first("runtime stopped") \
        < first("store closed") < len(lines) - 1
    assert "database is closed" not in daemon.log_text
    rows = statuses(daemon, ids)
    assert [rows[r["id"]]["status"] for r in running] == ["claimed", "claimed"]
    assert rows[waiting["id"]]["status"] == "queued"
    with daemon.db() as conn:
        assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 3  # nothing late

    daemon.start()
    daemon.wait_for_line("re-queued 2 run(s) claimed by a previous daemon instance")
    rows = wait_terminal(daemon, ids)
    assert {rows[i]["status"] for i in ids} == {"finished"}
    assert {run_id: len(spans) for run_id, spans in windows(touch).items()} == \
        {i: 1 for i in ids}


# -- cancel ------------------------------------------------------------------------------


def test_cancel_of_a_claimed_run_stops_its_agent_process(daemon_factory: Factory,
                                                        tmp_path: Path) -> None:
    daemon = daemon_factory()
    add_agents(daemon, {"ws1": ["a1"]})
    touch = tmp_path / "windows.txt"
    run = enqueue(daemon, "ws1", "a1", sleep_s=30, touch=str(touch))
    after = enqueue(daemon, "ws1", "a1", touch=str(touch))
    daemon.wait_until(lambda: len(daemon.agent_pids()) == 1, what="the agent running")
    (pid,) = daemon.agent_pids()
    cancelled = daemon.call("runs.cancel", {"id": run["id"], "reason": "operator"})
    assert (cancelled["status"], cancelled["cancel_reason"]) == ("cancelled", "operator")
    daemon.wait_until(lambda: pid not in daemon.agent_pids(), timeout=10,
                      what="the cancelled run's agent to be stopped")
    rows = wait_terminal(daemon, [run["id"], after["id"]])
    assert rows[run["id"]]["status"] == "cancelled"  # its end did not overwrite the cancel
    assert rows[after["id"]]["status"] == "finished"
    assert list(windows(touch)) == [after["id"]]  # the cancelled one never completed
    log_text = (daemon.home / "logs" / "runs" / f"{run['id']}.log").read_text()
    assert "SIGTERM" in log_text

    with pytest.raises(RpcCallError) as conflict:
        daemon.call("runs.cancel", {"id": run["id"]})
    assert conflict.value.kind == "conflict"
    with pytest.raises(RpcCallError) as missing:
        daemon.call("runs.cancel", {"id": "run_missing"})
    assert missing.value.kind == "not_found"


# -- the CLI ------------------------------------------------------------------------------


def test_runs_cli_list_get_explain_cancel(daemon_factory: Factory) -> None:
    daemon = daemon_factory()
    add_agents(daemon, {"ws1": ["a1"]}, status="paused")
    home = daemon.home
    made = run_cli(home, "runs", "enqueue", "--workspace", "ws1", "--agent", "a1",
                   "--reason", "manual", "--payload", '{"x": 1}', "--key", "k-1")
    assert made.returncode == 0, made.stderr
    run_id, status = made.stdout.split()
    assert status == "queued"
    again = run_cli(home, "runs", "enqueue", "--workspace", "ws1", "--agent", "a1",
                    "--reason", "manual", "--key", "k-1")
    assert again.stdout.strip() == f"{run_id} queued (deduplicated)"

    table = run_cli(home, "runs", "list")
    assert table.returncode == 0
    header, row, footer = table.stdout.strip().splitlines()
    assert header.split() == ["SEQ", "ID", "STATUS", "AGENT_ID", "REASON", "RETRY_COUNT",
                              "REQUESTED_AT"]
    assert row.split()[1:5] == [run_id, "queued", "a1", "manual"]
    assert footer == "1 of 1 run(s)"
    listed = json.loads(run_cli(home, "runs", "list", "--json", "--status", "queued").stdout)
    assert [r["id"] for r in listed["items"]] == [run_id] and listed["total"] == 1
    assert json.loads(run_cli(home, "runs", "list", "--json", "--agent", "zz").stdout)[
        "total"] == 0
    assert json.loads(run_cli(home, "runs", "list", "--json", "--reason", "manual").stdout)[
        "total"] == 1
    bad = run_cli(home, "runs", "list", "--status", "bogus")
    assert bad.returncode == 2 and "bogus" in bad.stderr

    shown = run_cli(home, "runs", "get", run_id)
    fields = {line[:20].strip(): line[21:] for line in shown.stdout.splitlines()}
    assert fields["task_id"] == ""  # None is shown as nothing
    assert fields["id"] == run_id and fields["status"] == "queued"
    assert fields["payload"] == '{"x": 1}'
    assert json.loads(run_cli(home, "runs", "get", run_id, "--json").stdout)["payload"] == \
        {"x": 1}

    explained = run_cli(home, "runs", "explain", run_id)
    assert explained.stdout.strip() == "blocked: agent_paused"
    assert json.loads(run_cli(home, "runs", "explain", run_id, "--json").stdout) == {
        "eligible": False, "blockers": ["agent_paused"], "details": {}}

    cancelled = run_cli(home, "runs", "cancel", run_id, "--reason", "not needed")
    assert cancelled.stdout.strip() == f"{run_id} cancelled"
    again = run_cli(home, "runs", "cancel", run_id, "--json")
    assert again.returncode == 1
    assert json.loads(again.stderr)["data"]["kind"] == "conflict"
    missing = run_cli(home, "runs", "get", "run_missing")
    assert missing.returncode == 1 and "not_found" in missing.stderr
    assert json.loads(run_cli(home, "runs", "get", run_id, "--json").stdout)[
        "cancel_reason"] == "not needed"

    daemon.call("agents.update", {"id": "a1", "status": "active"})
    ready = daemon.call("runs.enqueue", {"workspace_id": "ws1", "agent_id": "a1",
                                         "reason": "manual", "payload": {"sleep_s": 30}})
    daemon.wait_until(lambda: daemon.call("runs.get", {"id": ready["run"]["id"]})["status"]
                      == "claimed", what="the run claimed")
    status = run_cli(home, "runs", "explain", ready["run"]["id"])
    assert status.stdout.strip() == "blocked: status_claimed"
    stopped = run_cli(home, "runs", "cancel", ready["run"]["id"], "--json")
    assert json.loads(stopped.stdout)["status"] == "cancelled"

    daemon.stop()
    offline = run_cli(home, "runs", "list")
    assert offline.returncode == 69


def test_runs_enqueue_from_a_jsonl_file(daemon_factory: Factory, tmp_path: Path) -> None:
    daemon = daemon_factory(fast_config())
    add_agents(daemon, {"ws1": ["a1"]}, status="paused")
    lines = [{"workspace_id": "ws1", "agent_id": "a1", "reason": f"r{i}", "coalesce": False}
             for i in range(3)]
    source = tmp_path / "runs.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines)
                      + '\n\n{"workspace_id": "ws1", "agent_id": "nope", "reason": "x"}\n')
    done = run_cli(daemon.home, "runs", "enqueue", "--from-file", str(source))
    assert done.returncode == 1  # the fourth line names an unknown agent
    assert [line.split()[0:2] for line in done.stdout.splitlines()] == [
        ["line", "1:"], ["line", "2:"], ["line", "3:"]]
    assert "line 5:" in done.stderr and "3 of 4 queued" in done.stderr
    assert daemon.call("runs.list", {"agent_id": "a1"})["total"] == 3
    missing = run_cli(daemon.home, "runs", "enqueue", "--workspace", "ws1")
    assert missing.returncode == 2 and "--agent" in missing.stderr
