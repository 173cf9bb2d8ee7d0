"""``kandevd jobs ...``, ``kandevd scheduler ...`` and the workflow half of ``validate``.

Real subprocesses against a real daemon on a temp home whose workflow root
holds real workflow folders; one daemon serves many assertions.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kandevd import exits
from tests.support import workflows
from tests.support.daemon import DaemonProcess, cli_json, cli_ok, run_cli

pytestmark = pytest.mark.integration

JOB = "workflow:demo:daily"
TERMINAL = {"success", "error", "stopped"}


def write_workflow(home: Path, name: str, manifest: Any, *, groups: tuple[str, ...] = ("g1",),
                   raw: str | None = None) -> Path:
    folder = home / "workspace" / "Workflow" / name
    (folder / "variables").mkdir(parents=True, exist_ok=True)
    (folder / "variables" / "variables.json").write_text(json.dumps({"groups": [
        {"group_id": g, "display_name": g.upper(), "values": {}, "enabled": True}
        for g in groups]}))
    (folder / "workflow.json").write_text(raw if raw is not None else json.dumps(manifest))
    return folder


def manifest_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "workflow.json").read_text())


def schedules_by_id(folder: Path) -> dict[str, dict[str, Any]]:
    return {s["id"]: s for s in manifest_of(folder)["schedules"]}


def test_jobs_commands_against_a_daemon(daemon_factory: Callable[..., DaemonProcess],
                                        tmp_path: Path) -> None:
    home = tmp_path / "home"
    folder = write_workflow(home, "demo", {
        "label": "Demo", "agent_profile": "default", "custom": {"keep": [1, 2]},
        "schedules": [{"id": "daily", "cron_expression": "0 0 1 1 *", "group_ids": ["g1"]}]})
    daemon = daemon_factory(home=home)

    # list: a table by default, the raw page with --json, filters
    table = cli_ok(home, "jobs", "list")
    header, *rows = table.splitlines()
    for column in ("ID", "USER", "STATE", "CRON", "TZ", "NEXT RUN", "LAST STATUS"):
        assert column in header
    row = next(r for r in rows if r.startswith(JOB))
    assert "0 0 1 1 *" in row and "UTC" in row and re.search(r"\(in \d+[dhms]", row), row
    assert " scheduled " in row, row
    assert rows[-1] == "1 of 1 job(s)"
    page = cli_json(home, "jobs", "list")
    assert page["total"] == 1 and page["items"][0]["id"] == JOB
    assert cli_json(home, "jobs", "list", "--disabled")["total"] == 0
    assert cli_json(home, "jobs", "list", "--enabled", "--limit", "1")["items"][0]["id"] == JOB

    # create: the file gains a schedule and keeps every other key
    created = cli_ok(home, "jobs", "create", "demo", "--id", "hourly", "--cron", "0 * * * *",
                     "--timezone", "Europe/Paris", "--group", "g1", "--message", "hello",
                     "--message", "bye", "--name", "Hourly", "--overlap", "buffer_one",
                     "--payload", '{"k": 1}', "--disabled")
    assert "created workflow:demo:hourly (disabled" in created
    document = manifest_of(folder)
    assert document["label"] == "Demo" and document["custom"] == {"keep": [1, 2]}
    assert document["agent_profile"] == "default"
    hourly = schedules_by_id(folder)["hourly"]
    assert hourly["timezone"] == "Europe/Paris" and hourly["enabled"] is False
    assert hourly["messages"] == ["hello", "bye"] and hourly["trigger_payload"] == {"k": 1}
    assert hourly["overlap_policy"] == "buffer_one" and hourly["name"] == "Hourly"

    job = cli_json(home, "jobs", "get", "workflow:demo:hourly")
    assert job["timezone"] == "Europe/Paris" and job["enabled"] is False
    shown = cli_ok(home, "jobs", "get", "hourly")  # a bare, unique schedule id works
    assert re.search(r"^timezone\s+Europe/Paris$", shown, re.M), shown
    assert re.search(r"^messages\s+hello, bye$", shown, re.M), shown

    # --from-json with an overriding option
    cli_ok(home, "jobs", "create", "demo", "--from-json",
           '{"id": "weekly", "cron_expression": "0 8 * * 1", "group_ids": ["g1"]}',
           "--name", "Weekly")
    assert schedules_by_id(folder)["weekly"]["name"] == "Weekly"

    # update sends only the given options
    updated = cli_json(home, "jobs", "update", "workflow:demo:hourly", "--cron", "30 * * * *",
                       "--pulse")
    assert updated["cron_expression"] == "30 * * * *" and updated["pulse"] is True
    hourly = schedules_by_id(folder)["hourly"]
    assert hourly["cron_expression"] == "30 * * * *" and hourly["timezone"] == "Europe/Paris"
    assert hourly["name"] == "Hourly" and hourly["messages"] == ["hello", "bye"]
    nothing = run_cli(home, "jobs", "update", "workflow:demo:hourly")
    assert nothing.returncode == 2 and "nothing to change" in nothing.stderr

    # enable / disable change the file
    enabled = cli_ok(home, "jobs", "enable", "hourly")
    assert "enabled workflow:demo:hourly (enabled, 30 * * * * Europe/Paris)" in enabled
    assert re.search(r"^next run 20\S+ \S+ CES?T \(in \d+[ms]", enabled, re.M), enabled
    assert schedules_by_id(folder)["hourly"]["enabled"] is True
    cli_ok(home, "jobs", "disable", "workflow:demo:hourly")
    assert schedules_by_id(folder)["hourly"]["enabled"] is False

    # next: a dry run of an unsaved cron, and a saved job
    dry = cli_ok(home, "jobs", "next", "--cron", "0 12 * * *", "--timezone", "Europe/Paris",
                 "--count", "2", "--after", "2026-01-15T00:00:00Z")
    assert "2026-01-15T11:00:00.000000Z" in dry and "2026-01-15T12:00:00+01:00" in dry
    assert "2026-01-16T11:00:00.000000Z" in dry and "LOCAL (Europe/Paris)" in dry
    times = cli_json(home, "jobs", "next", JOB, "--count", "3",
                     "--after", "2026-06-01T00:00:00Z")["times"]
    assert [t["utc"][:10] for t in times] == ["2027-01-01", "2028-01-01", "2029-01-01"]
    assert run_cli(home, "jobs", "next").returncode == 2

    # delete: the schedule leaves the file, the other keys stay
    assert cli_ok(home, "jobs", "delete", "workflow:demo:hourly").strip() == \
        "deleted workflow:demo:hourly"
    assert set(schedules_by_id(folder)) == {"daily", "weekly"}
    assert manifest_of(folder)["custom"] == {"keep": [1, 2]}

    # an error answer: exit 1, one readable line on stderr (the error object with --json)
    missing = run_cli(home, "jobs", "get", "workflow:demo:nope")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == "kandevd: no job 'workflow:demo:nope' (not_found)\n"
    missing = run_cli(home, "jobs", "get", "workflow:demo:nope", "--json")
    assert missing.returncode == 1 and missing.stdout == ""
    assert json.loads(missing.stderr)["data"]["kind"] == "not_found"

    # trigger prints the session id; runs shows the finished entry
    session_id = cli_ok(home, "jobs", "trigger", JOB).strip()
    assert session_id and "\n" not in session_id

    def finished() -> dict[str, Any] | None:
        items = cli_json(home, "jobs", "runs", JOB)["items"]
        return items[0] if items and items[0]["status"] in TERMINAL else None
    entry = daemon.wait_until(finished, what="the triggered session to finish")
    assert entry["session_id"] == session_id and entry["status"] == "success", entry
    history = cli_ok(home, "jobs", "runs", JOB)
    header, first, *_ = history.splitlines()
    for column in ("STARTED", "TRIGGER", "STATUS", "DURATION", "ERROR"):
        assert column in header
    assert "manual" in first and "success" in first and entry["id"] in first
    assert history.splitlines()[-1] == "1 of 1 run(s)"
    stop = run_cli(home, "jobs", "stop", JOB)
    assert stop.returncode == 1 and stop.stderr.startswith("kandevd: ")
    assert stop.stderr.rstrip().endswith("(not_running)") and len(stop.stderr.splitlines()) == 1

    # scheduler pause / status / resume
    assert "scheduler paused by alice" in cli_ok(home, "scheduler", "pause", "--by", "alice")
    assert daemon.call("scheduler.config.get")["paused_by"] == "alice"
    status = cli_ok(home, "scheduler", "status")
    assert re.search(r"^paused\s+yes by alice since ", status, re.M), status
    assert re.search(r"^cron execution\s+enabled$", status, re.M), status
    assert re.search(r"^jobs\s+2$", status, re.M), status
    paused_job = cli_json(home, "jobs", "get", JOB)
    assert paused_job["cron_ineligible_reason"] == "scheduler is globally paused"
    assert cli_ok(home, "scheduler", "resume").startswith("scheduler resumed")
    raw = cli_json(home, "scheduler", "status")
    assert raw["config"]["globally_paused"] is False and raw["status"]["workflows"] == 1

    # reload picks up a folder written behind the daemon's back
    write_workflow(home, "other", {"schedules": [
        {"id": "x", "cron_expression": "5 4 * * *", "group_ids": ["g1"]}]})
    reloaded = cli_ok(home, "scheduler", "reload")
    assert "reloaded: 2 workflow(s), 3 job(s)" in reloaded
    assert "added: workflow:other:x" in reloaded and "0 problems" in reloaded


def test_validate_checks_every_workflow(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_workflow(home, "good", {"schedules": [
        {"id": "a", "cron_expression": "0 9 * * *", "group_ids": ["g1"]},
        {"id": "b", "cron_expression": "0 10 * * 1-5", "timezone": "Europe/Paris",
         "group_ids": ["g1"]}]})
    good = run_cli(home, "validate")
    assert good.returncode == 0, good.stderr
    assert good.stderr == ""
    assert "1 workflow(s), 2 schedule(s), 0 product(s)" in good.stdout

    broken = {
        "notjson": write_workflow(home, "notjson", None, raw="{not json"),
        "badzone": write_workflow(home, "badzone", {"schedules": [
            {"id": "z", "cron_expression": "0 9 * * *", "timezone": "Mars/Olympus",
             "group_ids": ["g1"]}]}),
        "badgroup": write_workflow(home, "badgroup", {"schedules": [
            {"id": "g", "cron_expression": "0 9 * * *", "group_ids": ["nope"]}]}),
    }
    bad = run_cli(home, "validate")
    assert bad.returncode == 1
    lines = bad.stderr.splitlines()
    assert len(lines) == 3, bad.stderr
    by_folder = {name: [line for line in lines
                        if line.startswith(f"{folder / 'workflow.json'}: ")]
                 for name, folder in broken.items()}
    assert all(len(found) == 1 for found in by_folder.values()), by_folder
    assert "JSON" in by_folder["notjson"][0]
    assert "Mars/Olympus" in by_folder["badzone"][0]
    assert "'nope'" in by_folder["badgroup"][0]
    assert "3 problem(s)" in bad.stdout and "schedule(s) ok" not in bad.stdout
    assert (broken["notjson"] / "workflow.json").read_text() == "{not json"  # untouched


def test_commands_without_a_daemon_exit_69(tmp_path: Path) -> None:
    home = tmp_path / "empty"
    home.mkdir()
    for args in (("jobs", "list"), ("jobs", "trigger", JOB), ("scheduler", "status")):
        result = run_cli(home, *args)
        assert result.returncode == exits.UNAVAILABLE, (args, result.stderr)
        assert "no kandevd is listening" in result.stderr


def test_jobs_logs_names_the_job_dates_a_running_turn_and_fails_in_one_line(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    home = tmp_path / "home"
    record = tmp_path / "record.jsonl"
    workflows.write_workflow(home / "workspace", "w", [workflows.schedule(
        "long", "0 0 1 1 *", messages=["HOLD"], workshop_mode="workshop")])
    daemon = daemon_factory(workflows.recorder_config(record), home=home)

    # an error is one line, as for every other command (the error object with --json)
    missing = run_cli(home, "jobs", "logs", "nosuch")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.startswith("kandevd: no job 'nosuch'")
    assert missing.stderr.endswith("(not_found)\n") and missing.stderr.count("\n") == 1

    started = daemon.call("scheduler.jobs.trigger", {"id": "long"})
    daemon.wait_until(Path(str(record) + ".held").exists, what="the turn's agent holding")
    follower = subprocess.Popen([sys.executable, "-m", "kandevd", "jobs", "logs", "long",
                                 "--follow", "--home", str(home)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follower.stdout is not None
        header = follower.stdout.readline()  # (blocks until printed; the turn holds)
        frame = follower.stdout.readline()
        # the job by its id (a bare schedule id was given), the running turn with its start
        assert header.startswith(f"[kandevd] run {started['run_id']} of workflow:w:long: "
                                 f"manual, session {started['session_id']}, started 20")
        assert re.fullmatch(r"\[kandevd\] ==== turn 1/1 message started "
                            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z ====\n", frame), frame
        Path(str(record) + ".release").touch()
        out, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert follower.returncode == 0, err
    assert "[kandevd] ==== turn 1/1 message ended: success" in out
    assert out.rstrip().endswith(f"run {started['run_id']} success")
