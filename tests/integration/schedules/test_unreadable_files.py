"""A history or pause file that is there but cannot be read now (its mode, here) is no
corrupt file: the real daemon, bound by file modes, starts, moves nothing aside, starts no
session it cannot record, and goes on once the file can be read again."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kandevd.control.client import RpcCallError
from tests.integration.schedules.test_products import brief, write_product
from tests.support.daemon import DaemonProcess, as_ordinary_user
from tests.support.workflows import recorder_config, schedule, write_workflow

pytestmark = pytest.mark.integration

JOB = "workflow:w:s"


def bound_by_modes(make: Callable[..., DaemonProcess], config: dict[str, object]
                   ) -> DaemonProcess:
    daemon = make(config, start=False)
    daemon.preexec_fn = as_ordinary_user()
    return daemon.start()


def ended(daemon: DaemonProcess, session: str) -> None:
    daemon.wait_until(lambda: any(e["session_id"] == session and e["status"] != "running"
                                  for e in daemon.call("scheduler.jobs.runs",
                                                       {"id": JOB})["items"]),
                      what=f"session {session} recorded")


def test_an_unreadable_history_is_left_alone_and_nothing_runs_unrecorded(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    daemon = bound_by_modes(daemon_factory, recorder_config(tmp_path / "record.jsonl"))
    folder = write_workflow(daemon.home / "workspace", "w", [schedule("s", "0 3 * * *")])
    daemon.call("scheduler.reload")
    first = daemon.call("scheduler.jobs.trigger", {"id": JOB})["session_id"]
    ended(daemon, first)
    history = folder / "schedule-runs.json"
    kept = history.read_bytes()
    history.chmod(0o000)
    assert daemon.stop() == 0
    daemon.start()  # (it read the file at start: it did not stop on it)
    with pytest.raises(RpcCallError) as refused:
        daemon.call("scheduler.jobs.trigger", {"id": JOB})
    assert "cannot read: Permission denied" in str(refused.value)
    with pytest.raises(RpcCallError, match="cannot read: Permission denied"):
        daemon.call("scheduler.jobs.runs", {"id": JOB})
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("schedule-runs")) \
        == ["schedule-runs.json", "schedule-runs.json.lock"]  # nothing moved aside
    assert "cannot read: Permission denied; the jobs it records start their counts" \
        in daemon.log_text
    history.chmod(0o600)
    assert history.read_bytes() == kept
    second = daemon.call("scheduler.jobs.trigger", {"id": JOB})["session_id"]
    ended(daemon, second)
    sessions = [e["session_id"] for e in daemon.call("scheduler.jobs.runs",
                                                     {"id": JOB})["items"]]
    assert sessions == [second, first]


def test_an_unreadable_pause_file_pauses_without_a_rewrite_until_it_can_be_read(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    daemon = bound_by_modes(daemon_factory, recorder_config(tmp_path / "record.jsonl"))
    daemon.call("scheduler.config.put", {"globally_paused": True})
    daemon.call("scheduler.config.put", {"globally_paused": False})
    [pause] = list((daemon.home / "workspace").rglob("scheduler.json"))
    kept = pause.read_bytes()
    pause.chmod(0o000)
    assert daemon.stop() == 0
    daemon.start()
    scheduler = daemon.call("daemon.status")["scheduler"]
    assert scheduler["globally_paused"] is True, scheduler
    assert "cannot be read now (Permission denied)" in scheduler["paused_by"], scheduler
    # (said once; the line may reach this side's reader just after the answer)
    daemon.wait_for_line("whether it was paused is unknown")
    assert daemon.log_text.count("whether it was paused is unknown") == 1
    assert "by a change to" not in daemon.log_text  # (the file did not change)
    pause.chmod(0o600)
    scheduler = daemon.call("daemon.status")["scheduler"]
    assert scheduler["globally_paused"] is False, scheduler
    assert "by a change to" not in daemon.log_text
    assert pause.read_bytes() == kept and json.loads(kept)["globally_paused"] is False
    assert not list(pause.parent.glob("scheduler.json.corrupt-*"))


def test_a_product_conversation_that_cannot_be_read_starts_nothing_and_stalls_nothing(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """(It once made every cron tick raise, so due jobs behind it never fired.) The
    product's fire is skipped as unrecorded, naming the file; a workflow job on the same
    minute fires on."""
    home = tmp_path / "home"
    write_product(home / "workspace", [brief(cron_expression="* * * * *")])
    write_workflow(home / "workspace", "w", [schedule("s", "* * * * *")])
    conversation = home / "workspace" / "_users" / "local" / "Chats" / "helper" / \
        "conversation.json"
    conversation.parent.mkdir(parents=True)
    conversation.write_text('{"session_id": "kept"}')
    conversation.chmod(0o000)
    daemon = daemon_factory(recorder_config(tmp_path / "record.jsonl"), home=home,
                            start=False)
    daemon.preexec_fn = as_ordinary_user()
    daemon.start()
    product = "product:helper:brief"
    with pytest.raises(RpcCallError, match="Permission denied"):
        daemon.call("scheduler.jobs.trigger", {"id": product})
    daemon.wait_until(lambda: daemon.call("scheduler.jobs.runs", {"id": JOB})["items"],
                      timeout=90, what="the workflow job's cron fire")
    daemon.wait_until(lambda: daemon.call("scheduler.jobs.get", {"id": product})[
        "skipped_unrecorded"] >= 1, timeout=30, what="the product's fire skipped")
    assert "Traceback" not in daemon.log_text
    conversation.chmod(0o600)
    assert conversation.read_text() == '{"session_id": "kept"}'
