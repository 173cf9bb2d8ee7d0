"""Batched intake through the real daemon: ``runs.enqueue_many`` and ``runs enqueue --from-file``.

A batch is one transaction: every item is stored, in order, or none is, and
the error names the failing item's index in ``data.index``. Requests
pipelined on one connection are answered in order.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import RpcCallError
from kandevd.control.methods.runs import MAX_BATCH
from tests.support.daemon import DaemonProcess, add_agents, run_cli


def item(agent: str, reason: str, **extra: Any) -> dict[str, Any]:
    return {"workspace_id": "ws1", "agent_id": agent, "reason": reason, **extra}


@pytest.fixture
def daemon(daemon_factory: Any) -> DaemonProcess:
    made = daemon_factory()
    add_agents(made, {"ws1": ["a1", "a2"], "ws2": ["b1"]}, status="paused")
    return made


def test_a_batch_is_stored_in_order_with_keys_and_coalescing(daemon: DaemonProcess) -> None:
    daemon.call("workflows.create", {"id": "wf", "workspace_id": "ws1", "name": "w",
                                     "style": "office", "steps": [{"id": "s", "name": "s"}]})
    daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws1", "workflow_id": "wf",
                                 "title": "t"})
    answer = daemon.call("runs.enqueue_many", {"runs": [
        item("a1", "r1", idempotency_key="k1"),
        item("a1", "r1", idempotency_key="k1"),
        item("a2", "r2"), item("a2", "r2"),
        item("a1", "r3", coalesce=False, payload={"n": 1}, task_id="t1"),
    ]})
    results = answer["results"]
    assert [(r["deduplicated"], r["coalesced"]) for r in results] == [
        (False, False), (True, False), (False, False), (False, True), (False, False)]
    assert results[0]["run"]["id"] == results[1]["run"]["id"]
    assert results[2]["run"]["id"] == results[3]["run"]["id"]
    assert results[3]["run"]["coalesced_count"] == 1  # the run that absorbed the fourth
    listed = daemon.call("runs.list", {"workspace_id": "ws1"})["items"]
    assert [run["id"] for run in listed] == [results[i]["run"]["id"] for i in (0, 2, 4)]
    assert [r["run"]["seq"] for r in results if not (r["deduplicated"] or r["coalesced"])] == \
        [run["seq"] for run in listed]
    assert listed[2] == results[4]["run"]  # the run as stored, not a summary of it
    assert listed[2]["payload"] == {"n": 1} and listed[2]["task_id"] == "t1"


@pytest.mark.parametrize(("bad", "words"), [
    (item("ghost", "x"), "params.runs.2.agent_id: agent 'ghost' does not exist"),
    ({"workspace_id": "ws2", "agent_id": "a1", "reason": "x"}, "belongs to workspace"),
    ({"workspace_id": "ws1", "reason": ""},  # every problem of the item at once
     "params.runs.2: 'agent_id' is a required property; params.runs.2.reason: ''"),
    ({"workspace_id": "ws1", "agent_id": "a1", "reason": "x", "bogus": 1},
     "params.runs.2.bogus: unknown parameter"),
    ("not an object", "params.runs.2: str is not an object"),
])
def test_an_invalid_item_fails_the_whole_batch_naming_its_index(
        daemon: DaemonProcess, bad: Any, words: str) -> None:
    batch = [item("a1", "ok-1", idempotency_key="kept-free"), item("a2", "ok-2"), bad,
             item("a1", "ok-3")]
    with pytest.raises(RpcCallError) as info:
        daemon.client().call("runs.enqueue_many", {"runs": batch})
    error = info.value.error
    assert error["code"] == -32602
    assert (error["data"]["kind"], error["data"]["index"]) == ("invalid_params", 2)
    assert words in error["message"]
    assert daemon.call("runs.list", {})["total"] == 0  # nothing of the batch was stored
    # The key of the rolled-back first item is still free.
    fresh = daemon.call("runs.enqueue_many", {"runs": batch[:1]})["results"][0]
    assert not fresh["deduplicated"]


def test_a_batch_is_at_most_a_thousand_and_never_empty(daemon: DaemonProcess) -> None:
    client = daemon.client()
    for runs in ([], [item("a1", f"r{i}") for i in range(MAX_BATCH + 1)]):
        with pytest.raises(RpcCallError) as info:
            client.call("runs.enqueue_many", {"runs": runs})
        assert info.value.kind == "invalid_params" and "params.runs" in str(info.value)
        if runs:  # says what is wrong instead of quoting the thousand items
            assert str(info.value) == "params.runs: 1001 items; at most 1000 allowed"
    full = client.call("runs.enqueue_many",
                       {"runs": [item("a1", f"r{i}") for i in range(MAX_BATCH)]})
    assert len(full["results"]) == MAX_BATCH
    assert daemon.call("runs.list", {"limit": 1})["total"] == MAX_BATCH


def test_pipelined_requests_are_answered_in_order(daemon: DaemonProcess) -> None:
    """Many requests written at once on one connection: one answer each, in request order."""
    requests = []
    for number in range(1, 201):
        method = "runs.enqueue" if number % 3 else "daemon.status"
        params = item("a1", f"p{number}") if number % 3 else {}
        requests.append({"jsonrpc": "2.0", "id": number, "method": method, "params": params})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(daemon.socket))
        sock.sendall(b"".join(json.dumps(r).encode() + b"\n" for r in requests))
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    answers = [json.loads(line) for line in data.splitlines()]
    assert [a["id"] for a in answers] == list(range(1, 201))
    assert all("result" in a for a in answers)


def test_runs_enqueue_from_file_sends_batches_and_skips_only_bad_lines(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    lines = [json.dumps(item("a1" if n % 2 else "a2", f"f{n}")) for n in range(1, 1201)]
    lines[699] = json.dumps(item("ghost", "bad"))  # line 700, in the second batch
    lines[1099] = json.dumps(item("a1", "f1"))  # line 1100: coalesces into line 1
    source = tmp_path / "runs.jsonl"
    source.write_text("\n".join(lines) + "\n")
    done = run_cli(daemon.home, "runs", "enqueue", "--from-file", str(source))
    assert done.returncode == 1
    assert "line 700: agent_id: agent 'ghost' does not exist (invalid_params)" in done.stderr
    assert "1199 of 1200 queued (0 deduplicated, 1 coalesced, 1 failed)" in done.stderr
    printed = done.stdout.splitlines()
    assert len(printed) == 1199 and printed[0].startswith("line 1: run_")
    assert printed[1098].startswith("line 1100: ") and printed[1098].endswith("(coalesced)")
    assert daemon.call("runs.list", {"limit": 1})["total"] == 1198


def test_daemon_status_sees_every_commit_at_once(daemon: DaemonProcess) -> None:
    """status reads the database again after each commit (and only then)."""
    client = daemon.client()
    before = client.call("daemon.status")
    client.call("runs.enqueue_many", {"runs": [item("a1", "s1"), item("a2", "s2")]})
    after = client.call("daemon.status")
    assert after["runs"]["queued"] == before["runs"]["queued"] + 2
    assert after["runs"]["oldest_queued_at"] is not None
    assert after["store"]["db"]["size_bytes"] >= before["store"]["db"]["size_bytes"]
    run = client.call("runs.list", {"limit": 1})["items"][0]
    client.call("runs.cancel", {"id": run["id"]})
    final = client.call("daemon.status")
    assert (final["runs"]["queued"], final["runs"]["cancelled"]) == (
        after["runs"]["queued"] - 1, after["runs"]["cancelled"] + 1)



def test_daemon_status_sees_runs_written_by_another_process(daemon: DaemonProcess) -> None:
    """Another process's commit (here: plain sqlite3 on the home's database) shows at once."""
    before = daemon.call("daemon.status")["runs"]["failed"]
    with daemon.db() as conn:
        conn.execute("INSERT INTO runs (id, workspace_id, agent_id, reason, status,"
                     " requested_at, updated_at) VALUES ('run_outside', 'ws1', 'a1', 'm',"
                     " 'failed', 'x', 'x')")
    conn.close()
    assert daemon.call("daemon.status")["runs"]["failed"] == before + 1


def test_every_malformed_item_is_listed_and_the_first_is_the_index(
        daemon: DaemonProcess) -> None:
    batch = [item("a1", "ok"), item("ghost", "x"), item("a1", "ok2"),
             {"workspace_id": "ws1", "agent_id": "a1"}, item("a2", "")]
    with pytest.raises(RpcCallError) as info:
        daemon.client().call("runs.enqueue_many", {"runs": batch})
    error = info.value.error
    assert (error["data"]["index"], error["data"]["indexes"]) == (3, [3, 4])
    assert error["message"].startswith("params.runs.3: 'reason' is a required property; "
                                       "params.runs.4.reason: ")
    # Well-formed, the batch fails at its first item naming nothing: index 1.
    batch[3:] = [item("a1", "ok3")]
    with pytest.raises(RpcCallError) as info:
        daemon.client().call("runs.enqueue_many", {"runs": batch})
    assert info.value.error["data"]["index"] == 1
