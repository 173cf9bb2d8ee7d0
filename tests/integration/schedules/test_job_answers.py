"""Every question about a job answered through the real daemon: when next (per user),
why not (one ``state``), what happened (kept across reloads, a turn's output), and the
specification's rules for product jobs (members without ``products``, resuming at the
failed message, a hold that survives a restart, ``@daily`` at the zone's midnight)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from kandevd.control.client import RpcCallError
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now
from tests.integration.schedules.test_products import brief, finished, write_product
from tests.support.daemon import DaemonProcess, run_cli
from tests.support.workflows import recorder_config, records, schedule, write_workflow

pytestmark = pytest.mark.integration

JOB = "product:helper:brief"
TWO_USERS = [{"id": "ann", "enabled": True, "products": ["helper"]},
             {"id": "bob", "enabled": True}]  # bob: no `products`, so every product


def start(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess], *,
          products: list[dict[str, Any]] | None = None,
          users: list[dict[str, Any]] | None = None,
          workflows: dict[str, list[dict[str, Any]]] | None = None,
          env: dict[str, str] | None = None) -> tuple[DaemonProcess, Path]:
    home = tmp_path / "home"
    if products is not None:
        write_product(home / "workspace", products)
    if users is not None:
        (home / "workspace" / "users.yaml").write_text(yaml.safe_dump(users))
    for name, schedules in (workflows or {}).items():
        write_workflow(home / "workspace", name, schedules, groups=("g1",))
    record = tmp_path / "record.jsonl"
    return daemon_factory(recorder_config(record), home=home, env=env), record


def error_of(daemon: DaemonProcess, method: str, params: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(RpcCallError) as info:
        daemon.call(method, params)
    return info.value.error


def test_next_fire_times_per_user_and_members_without_products(tmp_path, daemon_factory
                                                              ) -> None:
    daemon, _ = start(tmp_path, daemon_factory, products=[brief()], users=TWO_USERS)
    listed = daemon.call("scheduler.jobs.list", {"entity_type": "product"})["items"]
    assert sorted(j["user_id"] for j in listed) == ["ann", "bob"]
    assert {j["state"] for j in listed} == {"scheduled"}

    missing = error_of(daemon, "scheduler.jobs.next", {"id": JOB, "count": 2})
    assert missing["code"] == -32602 and "ann, bob" in missing["message"]
    answer = daemon.call("scheduler.jobs.next", {"id": JOB, "user_id": "bob", "count": 3,
                                                 "after": "2026-12-05T00:00:00Z"})
    assert [t["local"][11:16] for t in answer["times"]] == ["08:00"] * 3  # Europe/Paris
    assert answer["times"][0]["utc"] == "2026-12-05T07:00:00.000000Z"

    shown = run_cli(daemon.home, "jobs", "next", JOB, "--user", "ann", "--count", "2",
                    "--after", "2026-12-05T00:00:00Z")
    assert shown.returncode == 0, shown.stderr
    assert "2026-12-05T07:00:00.000000Z" in shown.stdout
    assert "2026-12-06T07:00:00.000000Z" in shown.stdout
    no_user = run_cli(daemon.home, "jobs", "next", JOB)
    assert no_user.returncode == 1 and "--user" in no_user.stderr, no_user.stderr
    for command in (["get"], ["runs"], ["disable"], ["enable"]):
        done = run_cli(daemon.home, "jobs", *command, JOB, "--user", "bob")
        assert done.returncode == 0, (command, done.stderr)
    state = run_cli(daemon.home, "jobs", "get", JOB, "--user", "bob", "--json")
    assert json.loads(state.stdout)["user_id"] == "bob"


def test_states_follow_the_switches_and_an_invalid_file_keeps_the_job(
        tmp_path, daemon_factory) -> None:
    daemon, _ = start(tmp_path, daemon_factory,
                      workflows={"w": [schedule("daily", "0 9 * * *", messages=["m"])]})
    job_id = "workflow:w:daily"
    daemon.call("scheduler.jobs.trigger", {"id": job_id})
    finished(daemon, job_id)
    assert daemon.call("scheduler.jobs.get", {"id": job_id})["run_count"] == 1

    daemon.call("scheduler.config.put", {"globally_paused": True, "paused_by": "ann"})
    paused = daemon.call("scheduler.jobs.get", {"id": job_id})
    assert paused["state"] == "paused" and paused["next_run_at"] is None
    assert "paused by ann" in paused["state_reason"]
    assert daemon.call("scheduler.jobs.list", {"state": "paused"})["total"] == 1
    daemon.wait_for_line("scheduler paused by ann: no schedule fires until it is resumed")
    daemon.call("scheduler.config.put", {"globally_paused": False})
    daemon.wait_for_line("scheduler resumed by an operator: schedules fire again")
    daemon.call("scheduler.jobs.disable", {"id": job_id})
    disabled = daemon.call("scheduler.jobs.get", {"id": job_id})
    assert (disabled["state"], disabled["next_run_at"]) == ("disabled", None)
    daemon.call("scheduler.jobs.enable", {"id": job_id})

    manifest = daemon.home / "workspace" / "Workflow" / "w" / "workflow.json"
    good = manifest.read_text()
    manifest.write_text("{broken")
    broken = daemon.call("scheduler.reload")
    assert broken["invalid"] == [job_id] and broken["removed"] == []
    job = daemon.call("scheduler.jobs.get", {"id": job_id})
    assert job["state"] == "invalid" and "workflow.json" in job["state_reason"]
    assert job["next_run_at"] is None and job["run_count"] == 1
    listed = run_cli(daemon.home, "jobs", "list")
    assert " invalid " in listed.stdout, listed.stdout
    refused = error_of(daemon, "scheduler.jobs.trigger", {"id": job_id})
    assert refused["data"]["kind"] == "conflict"

    manifest.write_text(good)
    fixed = daemon.call("scheduler.reload")
    assert fixed["invalid"] == [] and fixed["errors"] == []
    job = daemon.call("scheduler.jobs.get", {"id": job_id})
    assert (job["state"], job["run_count"], job["last_status"]) == ("scheduled", 1, "success")
    assert job["next_run_at"] is not None


def test_a_typo_in_a_workflow_schedule_is_refused_with_a_suggestion(
        tmp_path, daemon_factory) -> None:
    daemon, _ = start(tmp_path, daemon_factory,
                      workflows={"ok": [schedule("a", "@hourly")]})
    write_workflow(daemon.home / "workspace", "typo", [
        {"id": "t", "cron_expression": "0 9 * * *", "timzone": "Europe/Paris",
         "group_ids": ["g1"]}], groups=("g1",))
    validated = run_cli(daemon.home, "validate")
    assert validated.returncode == 1
    assert "schedule 't': timzone: unknown field; did you mean timezone?" in \
        validated.stderr
    reloaded = daemon.call("scheduler.reload")
    [problem] = reloaded["errors"]
    assert problem["kind"] == "workflow" and "did you mean timezone?" in problem["message"]
    assert "<root>" not in problem["message"]
    assert [j["id"] for j in daemon.call("scheduler.jobs.list")["items"]] == ["workflow:ok:a"]
    zone = run_cli(daemon.home, "jobs", "next", "--cron", "0 9 * * *", "--tz", "Europe/Pari")
    assert zone.returncode == 1 and "did you mean Europe/Paris?" in zone.stderr, zone.stderr
    reboot = run_cli(daemon.home, "jobs", "next", "--cron", "@reboot")
    assert reboot.returncode == 1 and "@reboot" in reboot.stderr


def test_product_problems_are_product_problems_and_unknown_activity_is_not_found(
        tmp_path, daemon_factory) -> None:
    daemon, _ = start(tmp_path, daemon_factory, products=[brief(), brief(id="b2")])
    product_file = daemon.home / "workspace" / "products" / "helper" / "product.yaml"
    product_file.write_text("profile: [")
    reloaded = run_cli(daemon.home, "scheduler", "reload")
    assert reloaded.returncode == 0, reloaded.stderr
    assert "1 product problem" in reloaded.stdout, reloaded.stdout
    assert "invalid: product:helper:b2@local, product:helper:brief@local" in reloaded.stdout
    for profile in ("nothere", "../../x"):
        error = error_of(daemon, "products.activity", {"user_id": "local", "profile": profile})
        assert error["data"]["kind"] == "not_found"
    assert not (daemon.home / "workspace" / "_users" / "local" / "chat_history" /
                "product-schedules.json").read_text().count("nothere")


def test_a_retry_starts_at_the_failed_message_and_turns_keep_their_output(
        tmp_path, daemon_factory) -> None:
    daemon, record = start(tmp_path, daemon_factory, products=[
        brief(messages=["one", "FAILONCE two", "EVAL three"])])
    daemon.call("scheduler.jobs.trigger", {"id": JOB})
    [failed] = finished(daemon, JOB)
    assert failed["status"] == "error" and len(failed["turns"]) == 2
    daemon.call("scheduler.jobs.trigger", {"id": JOB})
    retried, _ = finished(daemon, JOB, count=2)
    assert retried["status"] == "success" and retried["first_message"] == 1
    sent = [r["stdin"]["message"] for r in records(record)]
    assert sent == ["one", "FAILONCE two", "FAILONCE two", "EVAL three"]
    last = retried["turns"][-1]
    assert last["output"] == "did EVAL three"
    assert last["evaluation"] == {"score": 0.9, "verdict": "good"}

    # jobs logs: the newest entry's turns, each framed; runs logs points there
    logs = run_cli(daemon.home, "jobs", "logs", JOB)
    assert logs.returncode == 0, logs.stderr
    assert "[kandevd] ==== turn 1/2 message started" in logs.stdout
    assert "[kandevd] ==== turn 2/2 message ended: success" in logs.stdout
    assert "[kandevd] output: did EVAL three" in logs.stdout
    older = run_cli(daemon.home, "jobs", "logs", JOB, failed["id"])
    assert "ended: error" in older.stdout and older.stdout.rstrip().endswith(
        f"run {failed['id']} error: {failed['error']}")
    by_session = run_cli(daemon.home, "runs", "logs", retried["session_id"])
    assert by_session.returncode == 1 and "kandevd jobs logs" in by_session.stderr


def in_state(daemon: DaemonProcess, job_id: str, state: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        job = daemon.call("scheduler.jobs.get", {"id": job_id})
        return job if job["state"] == state else None
    result: dict[str, Any] = daemon.wait_until(check, what=f"{job_id} {state}")
    return result


def _hold_state(home: Path, occurrence: datetime, active: datetime) -> None:
    """A cron occurrence the last daemon saw come due, and the user active just before."""
    state = home / "workspace" / "_users" / "local" / "chat_history" / \
        "product-schedules.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"schedules": {"helper:brief": {
        "next_run_at": rfc3339(occurrence)}}, "activity": {"helper": rfc3339(active)}}))
    alive = home / "workspace" / "config" / "scheduler.alive"
    alive.parent.mkdir(parents=True, exist_ok=True)
    alive.touch()
    seen = (occurrence + timedelta(seconds=1)).timestamp()
    os.utime(alive, (seen, seen))


def test_a_quiet_rule_hold_is_shown_and_survives_a_restart(tmp_path, daemon_factory) -> None:
    now = utc_now().replace(microsecond=0)
    occurrence = now - timedelta(minutes=2)
    home = tmp_path / "home"
    write_product(home / "workspace", [brief(cron_expression="* * * * *", timezone="UTC",
                                             quiet_minutes=60)])
    _hold_state(home, occurrence, active=now - timedelta(minutes=1))
    daemon, _ = start(tmp_path, daemon_factory)
    expected = rfc3339(now + timedelta(minutes=59))
    held = in_state(daemon, JOB, "held")
    assert held["held_until"] == expected and held["next_run_at"] == expected
    assert held["last_activity_at"] == rfc3339(now - timedelta(minutes=1))
    assert held["missed_while_down"] == 0 and held["run_count"] == 0
    daemon.wait_for_line("held by the quiet rule")
    assert daemon.call("scheduler.jobs.list", {"state": "held"})["total"] == 1
    assert " held " in run_cli(daemon.home, "jobs", "list").stdout

    assert daemon.stop() == 0
    daemon.start()
    again = in_state(daemon, JOB, "held")
    assert again["held_until"] == expected and again["missed_while_down"] == 0


def _fixed_zone(folder: Path, name: str, offset_s: int) -> None:
    """A TZif file for a zone at a fixed UTC offset (a made-up zone, so a test can choose
    when its midnight falls)."""
    sign = "-" if offset_s >= 0 else "+"  # POSIX TZ strings count west of UTC
    magnitude = abs(offset_s)
    posix = f"KDT{sign}{magnitude // 3600}:{magnitude % 3600 // 60:02d}"
    header = b"TZif2" + b"\0" * 15 + struct.pack(">6l", 0, 0, 0, 0, 1, 4)
    block = struct.pack(">lBB", offset_s, 0, 0) + b"KDT\0"
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + block + header + block + f"\n{posix}\n".encode())


def test_at_daily_fires_at_midnight_in_the_schedules_zone(tmp_path, daemon_factory) -> None:
    # A zone whose midnight is the next whole minute at least 20 s away.
    now = utc_now()
    midnight = (now + timedelta(seconds=80)).replace(second=0, microsecond=0)
    offset = -(midnight.hour * 3600 + midnight.minute * 60)
    if offset <= -12 * 3600:
        offset += 24 * 3600
    zones = tmp_path / "zones"
    _fixed_zone(zones, "Test/Midnight", offset)
    env = {"PYTHONTZPATH": str(zones)}
    daemon, record = start(tmp_path, daemon_factory, env=env, workflows={"w": [
        schedule("nightly", "@daily", timezone="Test/Midnight", messages=["m"])]})
    job = daemon.call("scheduler.jobs.get", {"id": "workflow:w:nightly"})
    assert job["next_run_at"] == rfc3339(midnight), (job, offset)
    times = daemon.call("scheduler.jobs.next", {"id": "workflow:w:nightly", "count": 2})
    assert [t["local"][11:19] for t in times["times"]] == ["00:00:00", "00:00:00"]

    def fired() -> dict[str, Any] | None:
        items = daemon.call("scheduler.jobs.runs", {"id": "workflow:w:nightly"})["items"]
        return items[0] if items and items[0]["status"] != "running" else None
    entry = daemon.wait_until(fired, what="the midnight fire", timeout=150)
    assert entry["trigger_source"] == "cron" and entry["status"] == "success"
    started = parse_rfc3339(entry["started_at"])
    assert midnight <= started < midnight + timedelta(seconds=30)
    assert records(record)[0]["stdin"]["triggered_by"] == "cron"
