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

from kandevd.cli import runs as cli_runs
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


def run_lines(monkeypatch: pytest.MonkeyPatch, reasons: list[str] | list[bytes],
              daemon: ScriptedDaemon, *, as_json: bool = False) -> int:
    """Feed lines (reasons, or raw lines as bytes) to the command; its exit status."""
    @contextmanager
    def connect(_home: Any, _socket: Any) -> Iterator[ScriptedDaemon]:
        yield daemon

    monkeypatch.setattr(cli_runs, "connect", connect)
    monkeypatch.setattr(cli_runs, "FROM_FILE_BATCH", 3)
    raw = b"".join(r if isinstance(r, bytes) else json.dumps(
        {"workspace_id": "w", "agent_id": "a", "reason": r}).encode() + b"\n" for r in reasons)
    with pytest.raises(SystemExit) as info:
        cli_runs._enqueue_lines(io.BytesIO(raw), as_json, None, None)
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
    assert ("kandevd: the daemon is shutting down (shutting_down); lines 4 to 7 were not "
            "queued") in err
    assert "2 of 7 queued (0 deduplicated, 0 coalesced, 5 failed)" in err
    assert "Traceback" not in err


def test_lines_the_daemon_could_not_take_are_refused_here_one_by_one(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Not UTF-8, not strict JSON, not an object: that line only; the others go."""
    daemon = ScriptedDaemon()
    lines: list[bytes] = [
        b'{"workspace_id": "w", "agent_id": "a", "reason": "r1"}\n',
        b'{"workspace_id": "w", "agent_id": "a", "reason": "caf\xe9"}\n',
        b'{"workspace_id": "w", "agent_id": "a", "reason": "n", "payload": {"x": NaN}}\n',
        b"[1, 2]\n", b"{not json\n", b"\n",
        b'{"workspace_id": "w", "agent_id": "a", "reason": "r7"}\n']
    code = run_lines(monkeypatch, lines, daemon)
    out, err = capsys.readouterr()
    assert code == 1
    assert [[r["reason"] for r in call] for call in daemon.calls] == [["r1", "r7"]]
    assert "line 2: not UTF-8 text (byte 0xe9 at column 54) (invalid_line)" in err
    assert "line 3: not valid JSON: NaN is not a JSON number (invalid_line)" in err
    assert "line 4: not a JSON object but an array (invalid_line)" in err
    assert "line 5: not valid JSON: Expecting property name enclosed in double quotes " \
           "(column 2) (invalid_line)" in err
    assert out.splitlines() == ["line 1: run_r1 queued", "line 7: run_r7 queued"]
    assert "2 of 6 queued (0 deduplicated, 0 coalesced, 4 failed)" in err


def test_batches_stay_under_the_socket_line_limit_and_errors_are_json_with_json(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli_runs, "FROM_FILE_BATCH_BYTES", 1000)
    daemon = ScriptedDaemon()
    big = "x" * 400
    lines = [json.dumps({"workspace_id": "w", "agent_id": "a", "reason": f"r{n}",
                         "payload": {"text": big}}).encode() + b"\n" for n in range(5)]
    lines.append(json.dumps({"workspace_id": "w", "agent_id": "a", "reason": "huge",
                             "payload": {"text": "y" * 2000}}).encode() + b"\n")
    code = run_lines(monkeypatch, lines, daemon, as_json=True)
    out, _err = capsys.readouterr()
    assert code == 1
    assert [len(call) for call in daemon.calls] == [2, 2, 1]  # two of ~450 bytes fit 1000
    answers = [json.loads(line) for line in out.splitlines()]
    assert answers[0]["line"] == 6 and answers[0]["error"]["kind"] == "invalid_line"
    assert "more than the 1000 one request can carry" in answers[0]["error"]["message"]
    assert [a["line"] for a in answers[1:]] == [1, 2, 3, 4, 5]


def test_from_file_takes_no_single_run_options(tmp_path: Any) -> None:
    from click.testing import CliRunner

    from kandevd.cli import cli

    source = tmp_path / "runs.jsonl"
    source.write_text("{}\n")
    result = CliRunner().invoke(cli, ["runs", "enqueue", "--from-file", str(source),
                                      "--agent", "a1", "--no-coalesce"])
    assert result.exit_code == 2
    assert "--agent, --no-coalesce cannot be given with it" in result.output
