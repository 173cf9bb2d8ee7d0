"""A full workflow root never swallows a fire: a real, small tmpfs filled to the last byte
under the real daemon. A start that cannot be written does not start (a trigger answers
``unavailable``, a cron fire is counted as skipped), and a history write that fails is
kept in memory and lands once space returns."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from kandevd.control.client import RpcCallError
from kandevd.timeutil import utc_now
from tests.support.daemon import DaemonProcess, run_cli
from tests.support.workflows import recorder_config, records, schedule, write_workflow

pytestmark = pytest.mark.integration

JOB = "workflow:w:s"


@pytest.fixture
def small_root(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (mounting needs root, as the CI runs it)."""
    mount = tmp_path / "root"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs",
                           str(mount)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(root: Path) -> Path:
    """Fill the file system to its last byte; the filler file (delete it to free space)."""
    filler = root / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (65536, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                continue
    finally:
        os.close(fd)
    return filler


def entries(daemon: DaemonProcess) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = daemon.call("scheduler.jobs.runs", {"id": JOB})["items"]
    return items


def turn_records(daemon: DaemonProcess) -> list[str]:
    """The execution records of turns in the home (kept until their outcome is written)."""
    folder = daemon.home / "turns"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_full_root_refuses_starts_and_loses_no_record(
        small_root: Path, tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
        ) -> None:
    # daily at midnight, the last daemon gone for two days: a fire to catch up at start
    # (and no other fire of the test's minutes, so a trigger never meets one)
    write_workflow(small_root, "w", [schedule("s", "0 0 * * *", messages=["SLEEP", "b"],
                                              catchup_window_s=259200)])
    alive = small_root / "config" / "scheduler.alive"
    alive.parent.mkdir(parents=True, exist_ok=True)
    alive.touch()
    seen = (utc_now() - timedelta(days=2)).timestamp()
    os.utime(alive, (seen, seen))
    filler = fill(small_root)
    config = {**recorder_config(tmp_path / "record.jsonl"), "scheduler": {
        "root": str(small_root)}}
    daemon = daemon_factory(config, home=tmp_path / "home")

    # the catch-up fire at start could not be recorded: skipped, said, no traceback
    daemon.wait_for_line("cron fire skipped: its start could not be recorded")
    job = daemon.call("scheduler.jobs.get", {"id": JOB})
    assert job["skipped_unrecorded"] == 1 and job["running"] is False
    assert "No space left on device" in job["last_error"]
    with pytest.raises(RpcCallError) as refused:
        daemon.call("scheduler.jobs.trigger", {"id": JOB})
    history = small_root / "Workflow" / "w" / "schedule-runs.json"
    assert refused.value.error["data"] == {"kind": "unavailable", "path": str(history)}
    assert refused.value.error["message"] == (
        f"{JOB} not started: its start could not be recorded: No space left on device "
        f"({history})")
    assert f"cron fire skipped: its start could not be recorded: No space left on device " \
        f"({history})" in daemon.log_text  # the skipped fire names the file too
    assert "Traceback" not in daemon.log_text

    # space returns: a session starts; its later writes fail and are kept in memory
    filler.unlink()
    started = daemon.call("scheduler.jobs.trigger", {"id": JOB})
    daemon.wait_until(lambda: entries(daemon) and entries(daemon)[0]["turns"],
                      what="the first turn recorded")
    # Its agent has started (the turn's record is written once it is spawned): a stop
    # that came first would start nothing, and leave no record to keep.
    daemon.wait_until(lambda: turn_records(daemon), what="the turn's record")
    filler = fill(small_root)
    daemon.call("scheduler.jobs.stop", {"id": JOB})
    daemon.wait_for_line("history write failed")

    def ours() -> dict[str, Any]:  # (a minute's cron fire may add a newer entry)
        return next(e for e in entries(daemon) if e["session_id"] == started["session_id"])
    daemon.wait_for_line(f"session {started['session_id']} of {JOB} ended")
    assert ours()["status"] == "running"  # the file could not take its end
    # The turn's record is kept until its outcome is on the entry (a write that still
    # found a few bytes free, freed by the daemon's own temporary file as the disk
    # filled, may have put it there already).
    assert turn_records(daemon) or ours()["turns"][0]["status"] != "running"
    filler.unlink()
    recorded = daemon.wait_until(lambda: ours()["status"] == "stopped" and ours(),
                                 what="the kept entry written once space returned",
                                 timeout=30)
    assert recorded["error"] == "stopped: scheduler.jobs.stop"
    daemon.wait_until(lambda: turn_records(daemon) == [], what="the turn's record removed")
    assert "Traceback" not in daemon.log_text
    assert daemon.stop() == 0


def test_a_change_asked_on_a_full_root_answers_unavailable_with_the_path(
        small_root: Path, tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
        ) -> None:
    write_workflow(small_root, "w", [schedule("s", "0 0 1 1 *")])
    product = small_root / "products" / "helper"
    product.mkdir(parents=True)
    (product / "product.yaml").write_text(yaml.safe_dump({"profile": {
        "id": "helper", "runtime": {"conversation": {"mode": "singleton"}},
        "schedules": [{"id": "brief", "cron_expression": "0 8 * * *", "messages": ["one"]}]}}))
    config = {**recorder_config(tmp_path / "record.jsonl"), "scheduler": {
        "root": str(small_root)}}
    daemon = daemon_factory(config, home=tmp_path / "home")
    manifest = small_root / "Workflow" / "w" / "workflow.json"
    before = manifest.read_text()
    filler = fill(small_root)

    def refused(method: str, params: dict[str, Any], path: Path) -> str:
        with pytest.raises(RpcCallError) as caught:
            daemon.call(method, params)
        error = caught.value.error
        assert (error["code"], error["data"]["kind"]) == (-32000, "unavailable"), error
        assert error["data"]["path"] == str(path)
        assert f"cannot write {path}: No space left on device" in error["message"]
        return str(error["message"])

    # a manifest edit: the file and the job as they were
    refused("scheduler.jobs.disable", {"id": JOB}, manifest)
    refused("scheduler.jobs.update", {"id": JOB, "schedule": {"cron_expression": "5 4 * * *"}},
            manifest)
    refused("scheduler.jobs.create", {"workflow": "w", "schedule": schedule("t")}, manifest)
    assert manifest.read_text() == before
    job = daemon.call("scheduler.jobs.get", {"id": JOB})
    assert job["enabled"] is True and job["cron_expression"] == "0 0 1 1 *"
    shown = run_cli(daemon.home, "jobs", "disable", JOB)
    assert shown.returncode == 1 and shown.stderr == (
        f"kandevd: cannot write {manifest}: No space left on device; nothing was changed "
        "(unavailable)\n")

    # the global pause, a user's override and activity (their state files)
    refused("scheduler.config.put", {"globally_paused": True},
            small_root / "config" / "scheduler.json")
    assert daemon.call("scheduler.config.get")["globally_paused"] is False
    state = small_root / "_users" / "local" / "chat_history" / "product-schedules.json"
    refused("scheduler.jobs.disable", {"id": "product:helper:brief"}, state)
    assert daemon.call("scheduler.jobs.get", {"id": "product:helper:brief"})["enabled"] is True
    refused("products.activity", {"user_id": "local", "profile": "helper"}, state)
    assert daemon.call("scheduler.jobs.get", {"id": "product:helper:brief"}
                       )["last_activity_at"] is None
    assert "Traceback" not in daemon.log_text and "internal error" not in daemon.log_text

    # space returns: the same requests go through
    filler.unlink()
    assert daemon.call("scheduler.jobs.disable", {"id": JOB})["enabled"] is False
    assert json.loads(manifest.read_text())["schedules"][0]["enabled"] is False
    assert daemon.call("scheduler.jobs.disable", {"id": "product:helper:brief"}
                       )["enabled"] is False
    assert daemon.stop() == 0


def test_a_stop_on_a_full_root_keeps_the_turns_record_for_the_next_start(
        small_root: Path, tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
        ) -> None:
    """The session succeeds while its writes fail; the daemon stops before space returns,
    so they are lost with it, but the turn's record stays (on the home's own file system)
    and the next start records the run's real end from it: a success, not an error."""
    write_workflow(small_root, "w", [schedule("s", "0 0 1 1 *", messages=["HOLD"],
                                              workshop_mode="workshop")])
    record = tmp_path / "record.jsonl"
    config = {**recorder_config(record), "scheduler": {"root": str(small_root)}}
    daemon = daemon_factory(config, home=tmp_path / "home")
    started = daemon.call("scheduler.jobs.trigger", {"id": JOB})
    daemon.wait_until(Path(str(record) + ".held").exists, what="the turn's agent holding")
    filler = fill(small_root)
    Path(str(record) + ".release").touch()
    daemon.wait_for_line(f"session {started['session_id']} of {JOB} ended: success")
    assert entries(daemon)[0]["status"] == "running"  # what the file could take
    assert daemon.stop() == 0
    daemon.wait_for_line("history write(s) could not be written before the stop")
    assert (daemon.home / "turns" / f"turn-{started['run_id']}-0" / "record.json").exists()

    filler.unlink()
    daemon.start()
    daemon.wait_for_line("settled 1 scheduled turn(s)")
    [entry] = entries(daemon)
    assert (entry["status"], entry["error"]) == ("success", None), entry
    [turn] = entry["turns"]
    assert (turn["status"], turn["exit_code"], turn["output"]) == ("success", 0, "did HOLD")
    job = daemon.call("scheduler.jobs.get", {"id": JOB})
    assert (job["last_status"], job["consecutive_failures"]) == ("success", 0)
    assert turn_records(daemon) == []
    assert [r["stdin"]["message"] for r in records(record)] == ["HOLD"]  # run once
    assert "Traceback" not in daemon.log_text
