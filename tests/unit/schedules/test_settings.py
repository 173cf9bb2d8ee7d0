"""Execution switches, the allow/block lists and the persisted global pause."""

from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kandevd.config import build_config
from kandevd.formats.jsonfile import CorruptFile
from kandevd.schedules.settings import PauseState, Switches, list_verdict, parse_list

NAMES = st.sampled_from(["reports", "Reports", "REP", "rep", "other", "x"])


def test_parse_list_trims_and_drops_empty_entries() -> None:
    assert parse_list(" a, ,b ,,c ") == ("a", "b", "c")
    assert parse_list("") == () and parse_list(None) == ()


@given(st.lists(NAMES, max_size=3), st.lists(NAMES, max_size=3), st.lists(NAMES, max_size=3))
def test_block_wins_and_an_empty_allow_list_allows(aliases: list[str], allowed: list[str],
                                                   blocked: list[str]) -> None:
    verdict = list_verdict(aliases, allowed, blocked)
    lowered = {a.lower() for a in aliases}
    if any(b.lower() in lowered for b in blocked):
        assert verdict is not None and verdict.startswith("blocked")
    elif allowed and not any(a.lower() in lowered for a in allowed):
        assert verdict == "not in the allow list"
    else:
        assert verdict is None


def test_switches_from_the_environment_and_config() -> None:
    env = {"SCHEDULER_ENABLED": "false", "SCHEDULER_ALLOWED_WORKFLOWS": "Reports, daily ",
           "SCHEDULER_BLOCKED_USERS": "bob"}
    switches = Switches.from_config(build_config(None, environ=env).scheduler, env)
    assert not switches.execution_enabled and switches.disabled_via_env
    assert switches.disabled_reason == "SCHEDULER_ENABLED=false in the environment"
    assert switches.allowed_workflows == ("Reports", "daily")
    assert switches.workflow_verdict({"reports"}) is None
    assert switches.workflow_verdict({"other"}) == "workflow not in the allow list"
    assert switches.user_verdict("bob") == "user blocked by the block list (bob)"
    by_config = Switches.from_config(
        build_config({"scheduler": {"enabled": False}}, environ={}).scheduler, {})
    assert by_config.disabled_reason == "scheduler.enabled is false in the config"
    assert by_config.as_dict()["disabled_via_env"] is False


def test_pause_state_persists_only_its_fields(tmp_path: Path) -> None:
    pause = PauseState(tmp_path)
    assert pause.get() == {"globally_paused": False, "paused_at": None, "paused_by": None,
                           "updated_at": None}
    now = datetime(2026, 12, 3, 10, tzinfo=UTC)
    pause.put(True, "ops", now)
    stored = json.loads((tmp_path / "config" / "scheduler.json").read_text())
    assert stored == {"globally_paused": True, "paused_at": "2026-12-03T10:00:00.000000Z",
                      "paused_by": "ops", "updated_at": "2026-12-03T10:00:00.000000Z"}
    pause.put(False, None, now)
    assert pause.get()["globally_paused"] is False and pause.get()["paused_by"] is None


def test_a_pause_file_that_does_not_parse_leaves_the_scheduler_paused(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "scheduler.json").write_text('{"globally_paused": tru')
    reports: list[CorruptFile] = []
    pause = PauseState(tmp_path, on_corrupt=reports.append)
    state = pause.get()
    assert state["globally_paused"] is True
    assert state["paused_by"] is not None
    assert state["paused_by"].startswith("kandevd: config/scheduler.json could not be read "
                                         "(moved aside to scheduler.json.corrupt-")
    assert len(reports) == 1  # (listed with the root's other state problems)
    # The pause is written down: a restart (a new reader) finds it paused too.
    assert PauseState(tmp_path).get()["globally_paused"] is True
    assert [p.name for p in (tmp_path / "config").iterdir()
            if p.name.startswith("scheduler.json.corrupt-")]


def test_readers_at_once_of_an_unreadable_pause_file_all_find_it_paused(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "scheduler.json").write_text("garbage")
    pause = PauseState(tmp_path)
    start = threading.Barrier(8)
    seen: list[bool] = []

    def read() -> None:
        start.wait()
        seen.append(pause.get()["globally_paused"])

    readers = [threading.Thread(target=read) for _ in range(8)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert seen == [True] * 8


@pytest.mark.parametrize("flag", ['"true"', "1", "0", "null", "[]", '"no"'])
def test_a_pause_flag_that_is_neither_true_nor_false_leaves_the_scheduler_paused(
        tmp_path: Path, flag: str, caplog: pytest.LogCaptureFixture) -> None:
    """A hand edit that is not a boolean: whether it is meant to be paused is unknown, so
    it is paused (a fire made by mistake cannot be taken back), and the file is kept."""
    (tmp_path / "config").mkdir()
    path = tmp_path / "config" / "scheduler.json"
    text = f'{{"globally_paused": {flag}, "paused_by": "ann"}}'
    path.write_text(text)
    with caplog.at_level(logging.ERROR, logger="kandevd.scheduler"):
        state = PauseState(tmp_path).get()
    assert state["globally_paused"] is True
    assert state["paused_by"] == (f'kandevd: config/scheduler.json holds "globally_paused": '
                                  f"{json.dumps(json.loads(flag))}, neither true nor false")
    assert "neither true nor false" in caplog.text
    assert path.read_text() == text
    assert not [p.name for p in path.parent.iterdir() if ".corrupt-" in p.name]


def test_a_pause_or_resume_made_by_editing_the_file_is_said_in_the_log(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pause = PauseState(tmp_path)
    pause.put(False, None, datetime(2026, 12, 3, 10, tzinfo=UTC))
    path = tmp_path / "config" / "scheduler.json"
    with caplog.at_level(logging.WARNING, logger="kandevd.scheduler"):
        path.write_text('{"globally_paused": true, "paused_by": "by hand"}')
        assert pause.get()["globally_paused"] is True
        assert pause.get()["globally_paused"] is True  # (said once, not at each read)
        path.write_text('{"globally_paused": false}')
        assert pause.get()["globally_paused"] is False
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"scheduler paused by a change to {path}: no schedule fires until it is "
                    "resumed", f"scheduler resumed by a change to {path}: schedules fire again"]
