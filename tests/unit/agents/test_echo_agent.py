"""The built-in echo agent, run as a real ``python -m kandevd.agents.echo`` child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

import kandevd
from kandevd.agents import echo_argv
from kandevd.timeutil import parse_rfc3339

REPO_ROOT = str(Path(kandevd.__file__).resolve().parent.parent)
WAIT_S = 15.0


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT
    env.update(extra)
    return env


def echo(cwd: Path, stdin: str | dict[str, Any], **env: str) -> subprocess.CompletedProcess[str]:
    text = stdin if isinstance(stdin, str) else json.dumps(stdin)
    return subprocess.run(list(echo_argv()), input=text, capture_output=True, text=True,
                          cwd=cwd, env=child_env(**env), timeout=WAIT_S, check=False)


def last_json(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def test_run_prints_identity_env_and_default_summary(tmp_path: Path):
    done = echo(tmp_path, {"kind": "run", "run_id": "r-1", "session_id": "s-1"},
                KANDEVD_RUN_ID="r-1", KANDEVD_SESSION_ID="s-1", KANDEVD_HOME="/h")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "echo: run r-1"
    assert lines[1] == "echo: env KANDEVD_RUN_ID=r-1 KANDEVD_SESSION_ID=s-1 KANDEVD_HOME=/h"
    assert last_json(done.stdout) == {"summary": "echoed run", "cost_cents": 0}


def test_turn_reads_execution_options_over_payload(tmp_path: Path):
    done = echo(tmp_path, {"kind": "turn", "session_id": "sess-9", "message": "hello\nthere",
                           "payload": {"summary": "from payload", "cost_cents": 1},
                           "execution_options": {"summary": "from options"}})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "echo: turn sess-9"
    assert 'echo: message "hello\\nthere"' in done.stdout
    assert last_json(done.stdout) == {"summary": "from options", "cost_cents": 1}


@pytest.mark.parametrize(("stdin", "message"), [
    ("not json at all", "not valid JSON"),
    ("", "not valid JSON"),  # empty input: cut short, never a request
    ('{"kind": "run", "pay', "not valid JSON"),  # cut in the middle
    ("[1, 2, 3]", "must be a JSON object"),
    ('{"kind": "run", "payload": [1]}', "payload must be a JSON object"),
    ('{"kind": "run", "payload": {"sleep_s": "long"}}', "option sleep_s"),
    ('{"kind": "run", "payload": {"fail": "yes"}}', "option fail"),
])
def test_bad_stdin_exits_2_with_a_message(tmp_path: Path, stdin: str, message: str):
    done = echo(tmp_path, stdin)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_fail_and_exit_code(tmp_path: Path):
    failed = echo(tmp_path, {"kind": "run", "run_id": "r", "payload": {"fail": True}})
    assert failed.returncode == 1
    assert "failing as asked" in failed.stderr
    assert "summary" not in failed.stdout
    coded = echo(tmp_path, {"kind": "run", "run_id": "r", "payload": {"exit_code": 7}})
    assert coded.returncode == 7


def test_fail_once_marker_fails_then_succeeds(tmp_path: Path):
    marker = tmp_path / "state" / "failed-once"
    request = {"kind": "run", "run_id": "r", "payload": {"fail_once_marker": str(marker)}}
    first = echo(tmp_path, request)
    assert first.returncode == 1 and marker.exists()
    assert "failing once" in first.stderr
    second = echo(tmp_path, request)
    assert second.returncode == 0, second.stderr
    assert last_json(second.stdout)["summary"] == "echoed run"


def test_touch_records_one_window_per_successful_run(tmp_path: Path):
    touch = tmp_path / "windows" / "agent-a.txt"
    for run_id in ("run-1", "run-2"):
        done = echo(tmp_path, {"kind": "run", "run_id": run_id,
                               "payload": {"touch": str(touch), "sleep_s": 0.05}})
        assert done.returncode == 0, done.stderr
    failing = echo(tmp_path, {"kind": "run", "run_id": "run-3",
                              "payload": {"touch": str(touch), "fail": True}})
    assert failing.returncode == 1

    lines = touch.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["run-1", "run-2"]
    windows = [(parse_rfc3339(a), parse_rfc3339(b)) for _, a, b in map(str.split, lines)]
    for start, end in windows:
        assert (end - start).total_seconds() >= 0.05
    assert windows[0][1] <= windows[1][0]


def _started_sleeper(tmp_path: Path, **payload: Any) -> subprocess.Popen[str]:
    proc = subprocess.Popen(list(echo_argv()), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=child_env())
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"kind": "run", "run_id": "r",
                                 "payload": {"sleep_s": 30, **payload}}))
    proc.stdin.close()
    # The first line is printed after the SIGTERM disposition is in place.
    assert proc.stdout.readline() == "echo: run r\n"
    return proc


def test_sigterm_interrupts_the_sleep_with_143(tmp_path: Path):
    proc = _started_sleeper(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(WAIT_S) == 143
    assert proc.stderr is not None and "terminated by SIGTERM" in proc.stderr.read()
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()


def test_ignore_sigterm_keeps_sleeping(tmp_path: Path):
    proc = _started_sleeper(tmp_path, ignore_sigterm=True)
    try:
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.3)  # still alive well after SIGTERM
    finally:
        proc.kill()
        assert proc.wait(WAIT_S) == -signal.SIGKILL
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
