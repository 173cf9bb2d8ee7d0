"""``runs enqueue --from-file`` against a scripted daemon: batching, dropped lines, a stop.

The client is a stand-in that answers ``runs.enqueue_many`` by rules, so the
command's own logic (which line is reported, what is sent again, the summary
and the exit status) is checked without a daemon.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kandevd import cli_runs
from kandevd.control.client import RpcCallError


class ScriptedDaemon:
    """Refuses items whose reason is ``bad`` (naming their index); stops after ``limit`` calls."""

    def __init__(self, limit: int | None = None) -> None:
        self.calls: list[list[dict[str, Any]]] = []
        self.limit = limit

    def call(self, method: str, params: dict[str, Any]) -> Any:
        assert method == "runs.enqueue_many"
        runs = params["runs"]
        self.calls.append(runs)
        if self.limit is not None and len(self.calls) > self.limit:
            raise RpcCallError({"code": -32000, "message": "the daemon is shutting down",
                                "data": {"kind": "shutting_down"}})
        for index, run in enumerate(runs):
            if run["reason"] == "bad":
                raise RpcCallError({"code": -32602, "message":
                                    f"params.runs.{index}.agent_id: agent 'x' does not exist",
                                    "data": {"kind": "invalid_params", "index": index}})
        return {"results": [{"run": {"id": f"run_{r['reason']}", "status": "queued"},
                             "deduplicated": False, "coalesced": False} for r in runs]}


def run_lines(monkeypatch: pytest.MonkeyPatch, reasons: list[str],
              daemon: ScriptedDaemon) -> int:
    @contextmanager
    def connect(_home: Any, _socket: Any) -> Iterator[ScriptedDaemon]:
        yield daemon

    monkeypatch.setattr(cli_runs, "connect", connect)
    monkeypatch.setattr(cli_runs, "FROM_FILE_BATCH", 3)
    lines = io.StringIO("".join(json.dumps({"workspace_id": "w", "agent_id": "a",
                                            "reason": r}) + "\n" for r in reasons))
    with pytest.raises(SystemExit) as info:
        cli_runs._enqueue_lines(lines, False, None, None)
        raise SystemExit(0)
    return int(info.value.code or 0)


def test_a_refused_line_is_reported_and_its_batch_sent_again_without_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = ScriptedDaemon()
    code = run_lines(monkeypatch, ["r1", "bad", "r3", "r4", "r5"], daemon)
    out, err = capsys.readouterr()
    assert code == 1
    assert [[r["reason"] for r in call] for call in daemon.calls] == [
        ["r1", "bad", "r3"], ["r1", "r3"], ["r4", "r5"]]
    assert "line 2: agent_id: agent 'x' does not exist (invalid_params)" in err
    assert out.splitlines() == ["line 1: run_r1 queued", "line 3: run_r3 queued",
                                "line 4: run_r4 queued", "line 5: run_r5 queued"]
    assert "4 of 5 queued (0 deduplicated, 0 coalesced, 1 failed)" in err


def test_an_error_about_no_line_stops_with_one_line_and_a_summary(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = ScriptedDaemon(limit=2)  # the first batch goes in (after a retry); then it stops
    code = run_lines(monkeypatch, ["r1", "bad", "r3", "r4", "bad", "r6", "r7"], daemon)
    out, err = capsys.readouterr()
    assert code == 1
    assert out.splitlines() == ["line 1: run_r1 queued", "line 3: run_r3 queued"]
    assert "kandevd: stopped at line 4: the daemon is shutting down (shutting_down)" in err
    assert "2 of 7 queued (0 deduplicated, 0 coalesced, 5 failed)" in err
    assert "Traceback" not in err
