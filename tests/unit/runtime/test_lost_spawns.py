"""Spawns a dead keeper never answered: found in /proc and followed, or refused, so no
execution waits for an answer for ever (also when no keeper could replace it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kandevd.runtime.keeperclient import Handle, KeeperClient

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")


def asked(client: KeeperClient, name: str, connection: int, session: str) -> Handle:
    handle = Handle(name, {"session_id": session})
    handle.owned, handle.asked_on, handle.asked_at = True, connection, time.time()
    client._handles[name] = handle
    return handle


def test_a_spawn_no_keeper_answered_is_refused_even_when_none_replaced_it(
        tmp_path: Path) -> None:
    client = KeeperClient(tmp_path / "home")
    client._connection = 1  # the dead keeper's connection: no other came after it
    lost = asked(client, "x", 1, "ses_never_started")
    client.lost = True
    client._answer_lost_spawns(no_keeper=True)
    assert lost.refused == "the keeper ended before it started the agent"


def test_only_spawns_sent_to_the_dead_keeper_are_answered_here(tmp_path: Path) -> None:
    client = KeeperClient(tmp_path / "home")
    client._connection = 2  # a new keeper took over
    old = asked(client, "old", 1, "ses_a")
    new = asked(client, "new", 2, "ses_b")  # (its keeper is alive: it answers itself)
    client._answer_lost_spawns()
    assert old.refused is not None and new.refused is None and not new.spawned


def test_an_agent_started_before_its_keeper_died_is_found_and_followed(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    client = KeeperClient(home)
    client._connection = 2
    handle = asked(client, "run", 1, "ses_spawned")
    agent = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
        start_new_session=True, env={"KANDEVD_HOME": str(home), "KANDEVD_RUN_ID": "run_1",
                                     "KANDEVD_SESSION_ID": "ses_spawned"})
    try:  # (Popen returns once the child has exec'd: its environment is its own)
        client._answer_lost_spawns()
        assert handle.refused is None and handle.pid == agent.pid
        assert handle.pidfd is not None
    finally:
        handle.close()
        agent.communicate(b"")
