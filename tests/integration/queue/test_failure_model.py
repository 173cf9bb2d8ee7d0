"""The failure model end to end: a real daemon, real agents, real kills.

An agent run is expensive, so each test proves one way an outcome is kept
instead of re-earned: a database write that fails and is retried, a restart
that adopts a running agent, a kill -9 after an agent finished, attempts that
end in the dead letter, a cancel that races the dispatch, keys that hold,
Office recovery that respects a cancel, step re-entry, and hard budgets.

Executions are counted by the agents themselves: the echo agent's ``touch``
option appends one line per successful execution to a file.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import RpcCallError
from kandevd.keeper.journal import read as read_journal
from tests.support.daemon import DaemonProcess, enqueue, fast_config, run_cli, wait_status

pytestmark = pytest.mark.integration

Factory = Callable[..., DaemonProcess]


def setup_agent(daemon: DaemonProcess, agent: str = "a1", workspace: str = "ws") -> None:
    daemon.call("workspaces.create", {"id": workspace, "name": workspace})
    daemon.call("agents.create", {"id": agent, "workspace_id": workspace, "name": agent})


def executions(touch: Path) -> list[str]:
    """Run ids of the successful executions the agents recorded, in order."""
    if not touch.exists():
        return []
    return [line.split()[0] for line in touch.read_text().splitlines() if line.strip()]


def kept_exit(home: Path, run_id: str) -> dict[str, Any] | None:
    """The exit the keeper's journal holds for ``run_id``'s attempt (not acknowledged)."""
    for entry in read_journal(home / "keeper" / "journal").values():
        if entry.meta.get("run_id") == run_id and entry.exit is not None:
            return entry.exit
    return None


def attempt_dirs(home: Path, run_id: str) -> list[Path]:
    """The run's attempt folders (not the emptied ``<run>.<token>.stdout`` files beside them)."""
    folder = home / "attempts"
    return sorted(p for p in folder.glob(f"{run_id}.*") if p.is_dir()) if folder.exists() else []


# -- 1. an outcome is recorded, not re-earned ---------------------------------------------


def test_a_refused_outcome_write_is_retried_and_the_agent_runs_once(
        daemon_factory: Factory, tmp_path: Path) -> None:
    touch = tmp_path / "executed"
    daemon = daemon_factory(fast_config(queue={"stale_claim_s": 2}),
                            env={"KANDEVD_FAULTS": json.dumps({"fail_outcome_writes": 4})})
    setup_agent(daemon)
    run = enqueue(daemon, touch=str(touch))
    daemon.wait_for_line(f"run {run['id']}: its outcome (succeeded) could not be written")
    finished = wait_status(daemon, run["id"], "finished")
    assert finished["output_summary"] == "echoed run"
    assert executions(touch) == [run["id"]]  # once, although the claim outlived stale_claim_s
    daemon.wait_for_line(f"run {run['id']}: its outcome was written after")
    assert attempt_dirs(daemon.home, run["id"]) == []  # the outcome file is cleaned up
    # Its stdout was merged into the log and removed once the outcome was written.
    assert list((daemon.home / "attempts").glob(f"{run['id']}.*.stdout")) == []
    # The keeper forgets the exit once the acknowledgement sent after that commit reaches it.
    daemon.wait_until(lambda: kept_exit(daemon.home, run["id"]) is None)
    # The agent was busy only until the outcome was written: the next run goes through.
    second = enqueue(daemon, touch=str(touch))
    wait_status(daemon, second["id"], "finished")
    assert executions(touch) == [run["id"], second["id"]]


def test_an_outcome_the_database_never_took_is_recorded_at_the_next_start(
        daemon_factory: Factory, tmp_path: Path) -> None:
    touch = tmp_path / "executed"
    home = tmp_path / "home"
    first = daemon_factory(fast_config(), home=home,
                           env={"KANDEVD_FAULTS": json.dumps({"fail_outcome_writes": 10**6})})
    setup_agent(first)
    run = enqueue(first, touch=str(touch))
    first.wait_for_line(f"run {run['id']}: its outcome (succeeded) could not be written")
    first.kill9()
    second = daemon_factory(fast_config(), home=home)
    second.wait_for_line(f"run {run['id']}: recording the outcome its execution left on disk")
    assert wait_status(second, run["id"], "finished")["output_summary"] == "echoed run"
    assert executions(touch) == [run["id"]]
    # its log closes the attempt as any other (the daemon that started it could not)
    shown = run_cli(home, "runs", "logs", run["id"])
    frames = [line for line in shown.stdout.splitlines() if line.startswith("[kandevd] ====")]
    assert [line.split()[2:5] for line in frames] == [["attempt", "1", "started"],
                                                      ["attempt", "1", "ended"]], shown.stdout
    assert frames[1].endswith(": succeeded ====")


def test_a_cooldown_beyond_any_date_is_refused_at_the_api(daemon_factory: Factory) -> None:
    daemon = daemon_factory(fast_config())
    daemon.call("workspaces.create", {"id": "ws", "name": "ws"})
    with pytest.raises(RpcCallError) as caught:
        daemon.call("agents.create", {"workspace_id": "ws", "name": "a", "cooldown_s": 1e12})
    assert caught.value.code == -32602
    assert "cooldown_s" in str(caught.value)


def test_a_shorter_cooldown_ends_the_one_in_force_sooner(daemon_factory: Factory) -> None:
    """A cooldown mistyped as ten years is not a lock-out: setting it right applies."""
    daemon = daemon_factory(fast_config())
    daemon.call("workspaces.create", {"id": "ws", "name": "ws"})
    daemon.call("agents.create", {"id": "a1", "workspace_id": "ws", "name": "a1",
                                  "cooldown_s": 315360000 / 2})
    wait_status(daemon, enqueue(daemon)["id"], "finished")
    cooling = daemon.call("agents.get", {"id": "a1"})["cooldown_until"]
    assert cooling is not None and cooling > "2031"
    held = enqueue(daemon)
    assert "cooldown_until" in daemon.wait_until(
        lambda: daemon.call("runs.explain", {"id": held["id"]})["blockers"],
        what="the cooldown blocker")
    longer = daemon.call("agents.update", {"id": "a1", "cooldown_s": 315360000})
    assert longer["cooldown_until"] > cooling  # (counted from the same end, longer)
    updated = daemon.call("agents.update", {"id": "a1", "cooldown_s": 0})
    assert updated["cooldown_until"] is None
    wait_status(daemon, held["id"], "finished")


# -- 2. agents survive a daemon restart -----------------------------------------------------


def test_a_restart_adopts_a_running_agent_which_runs_once(
        daemon_factory: Factory, tmp_path: Path) -> None:
    touch = tmp_path / "executed"
    home = tmp_path / "home"
    first = daemon_factory(fast_config(), home=home)
    setup_agent(first)
    # Longer than a daemon takes to start on a busy machine: it is adopted while it runs.
    run = enqueue(first, touch=str(touch), sleep_s=8)
    wait_status(first, run["id"], "claimed")
    first.wait_until(lambda: first.agent_pids(), what="the agent process")
    first.kill_daemon_only()
    assert first.agent_pids(), "the agent must outlive the daemon"
    second = daemon_factory(fast_config(), home=home)
    second.wait_for_line(f"run {run['id']}: adopted its agent")
    assert second.call("daemon.status")["runs"]["adopted"] == 1
    wait_status(second, run["id"], "finished")
    assert executions(touch) == [run["id"]]
    assert second.wait_until(lambda: not second.agent_pids(), what="no agent left")


def test_a_kill_after_the_agent_finished_is_recorded_from_its_exit_file(
        daemon_factory: Factory, tmp_path: Path) -> None:
    touch = tmp_path / "executed"
    home = tmp_path / "home"
    first = daemon_factory(fast_config(), home=home)
    setup_agent(first)
    run = enqueue(first, touch=str(touch), sleep_s=0.5)
    wait_status(first, run["id"], "claimed")
    first.wait_until(lambda: first.agent_pids(), what="the agent process")
    first.kill_daemon_only()
    first.wait_until(lambda: not first.agent_pids(), what="the agent to end on its own")
    # The keeper outlived the daemon: it journals the agent's exit once it reaped it.
    assert first.keeper_pids()
    exit_kept = first.wait_until(lambda: kept_exit(home, run["id"]),
                                 what="the keeper to journal the exit")
    assert exit_kept["code"] == 0
    second = daemon_factory(fast_config(), home=home)
    second.wait_for_line(f"run {run['id']}: recording the outcome its execution left on disk")
    assert wait_status(second, run["id"], "finished")["output_summary"] == "echoed run"
    assert executions(touch) == [run["id"]]
    # its log closes the attempt as any other (the daemon that started it could not)
    shown = run_cli(home, "runs", "logs", run["id"])
    frames = [line for line in shown.stdout.splitlines() if line.startswith("[kandevd] ====")]
    assert [line.split()[2:5] for line in frames] == [["attempt", "1", "started"],
                                                      ["attempt", "1", "ended"]], shown.stdout
    assert frames[1].endswith(": succeeded ====")


def test_keep_agents_on_stop_lets_a_graceful_restart_interrupt_nothing(
        daemon_factory: Factory, tmp_path: Path) -> None:
    touch = tmp_path / "executed"
    home = tmp_path / "home"
    cfg = fast_config(runtime={"keep_agents_on_stop": True})
    first = daemon_factory(cfg, home=home)
    setup_agent(first)
    run = enqueue(first, touch=str(touch), sleep_s=8)
    wait_status(first, run["id"], "claimed")
    # The claim is logged as the execution is handed to a worker; a stop before the
    # spawn starts nothing (the run simply waits for the next start): wait for the agent.
    first.wait_until(first.agent_pids, what="the agent to be running")
    assert first.stop(signal.SIGTERM) == 0
    assert first.agent_pids(), "a graceful stop with keep_agents_on_stop leaves the agent"
    second = daemon_factory(cfg, home=home)
    second.wait_for_line(f"run {run['id']}: adopted its agent")
    wait_status(second, run["id"], "finished")
    assert executions(touch) == [run["id"]]


def test_without_adoption_a_restart_stops_the_agent_and_runs_it_again(
        daemon_factory: Factory, tmp_path: Path) -> None:
    touch = tmp_path / "executed"
    home = tmp_path / "home"
    cfg = fast_config(runtime={"adopt_on_restart": False, "stop_grace_s": 1})
    first = daemon_factory(cfg, home=home)
    setup_agent(first)
    run = enqueue(first, touch=str(touch), sleep_s=3)
    wait_status(first, run["id"], "claimed")
    first.wait_until(lambda: first.agent_pids(), what="the agent process")
    first.kill_daemon_only()
    second = daemon_factory(cfg, home=home)
    second.wait_for_line("left by a previous instance")
    wait_status(second, run["id"], "finished", timeout=60)
    assert executions(touch) == [run["id"]]  # the stopped first execution never touched
    # Each attempt is framed in the log, the one the kill cut short too.
    frames = [line.removeprefix("[kandevd] ==== ") for line in
              run_cli(home, "runs", "logs", run["id"]).stdout.splitlines()
              if line.startswith("[kandevd] ====")]
    assert [f.split()[:3] for f in frames] == [
        ["attempt", "1", "started"], ["attempt", "1", "ended"],
        ["attempt", "2", "started"], ["attempt", "2", "ended"]], frames
    assert ": interrupted (the daemon stopped during the execution" in frames[1]
    assert frames[3].endswith(": succeeded ====")


# -- 3. bounded attempts, the dead letter, runs.retry ---------------------------------------


def test_attempts_end_in_the_dead_letter_and_runs_retry_brings_a_run_back(
        daemon_factory: Factory, tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    daemon = daemon_factory(fast_config(queue={"max_attempts": 2},
                                   retry={"max_retries": 100, "delays_s": [0], "jitter": 0}))
    setup_agent(daemon)
    doomed = enqueue(daemon, fail=True)
    failed = wait_status(daemon, doomed["id"], "failed")
    assert failed["error_message"] == "gave up after 2 attempts; last: exit code 1"
    assert daemon.call("runs.list", {"status": "failed"})["total"] == 1
    assert daemon.call("daemon.status")["runs"]["failed"] == 1

    flaky = enqueue(daemon, fail_once_marker=str(marker))
    wait_status(daemon, flaky["id"], "finished")
    with pytest.raises(RpcCallError) as caught:
        daemon.call("runs.retry", {"id": flaky["id"]})
    assert caught.value.kind == "conflict"

    result = run_cli(daemon.home, "runs", "retry", doomed["id"])
    assert result.returncode == 0, result.stderr
    assert f"{doomed['id']} queued" in result.stdout
    again = wait_status(daemon, doomed["id"], "failed")
    assert again["error_message"].startswith("gave up after 2 attempts")
    # Its log says where the attempts started counting again.
    frames = [line for line in Path(again["log_path"]).read_text().splitlines()
              if line.startswith("[kandevd] ====")]
    started = [i for i, line in enumerate(frames) if " started " in line]
    assert len(started) == 4
    retried = [i for i, line in enumerate(frames) if "re-queued by runs.retry" in line]
    assert len(retried) == 1 and started[1] < retried[0] < started[2]
    assert "attempt 1 started" in frames[started[2]]


def test_a_run_waiting_for_its_back_off_is_retrying_not_waiting_in_the_queue(
        daemon_factory: Factory) -> None:
    """A failed attempt's run is queued again with a ``scheduled_retry_at``: until then it
    is counted in ``runs.retrying`` (and ``kandevd_runs_retrying``), never as a queued run
    waiting to be claimed (``oldest_queued_at``, ``kandevd_oldest_queued_age_seconds``),
    so a queue-stall alert does not fire for a back-off; once due, it waits like any."""
    daemon = daemon_factory(fast_config(retry={"max_retries": 100, "delays_s": [10],
                                          "jitter": 0}))
    setup_agent(daemon)
    run = enqueue(daemon, fail=True)
    daemon.wait_until(lambda: daemon.call("runs.get", {"id": run["id"]})["retry_count"] == 1,
                      what="the first attempt failed and the run waits for its retry")
    daemon.call("agents.update", {"id": "a1", "status": "paused"})  # (its retry: not claimed)
    waiting = daemon.call("runs.get", {"id": run["id"]})
    assert waiting["status"] == "queued" and waiting["scheduled_retry_at"]
    assert "retry_at" in daemon.call("runs.explain", {"id": run["id"]})["blockers"]
    runs = daemon.call("daemon.status")["runs"]
    assert (runs["queued"], runs["retrying"], runs["oldest_queued_at"]) == (1, 1, None)
    metrics = run_cli(daemon.home, "metrics").stdout
    assert "kandevd_runs_retrying 1.0" in metrics
    assert "kandevd_oldest_queued_age_seconds 0.0" in metrics
    assert 'kandevd_runs{status="queued"} 1.0' in metrics
    shown = run_cli(daemon.home, "status").stdout
    assert "queue    1 queued (none ready; 1 retrying after a back-off), 0 claimed" in shown

    # a run ready to claim (its agent merely paused) is still counted as waiting
    daemon.call("agents.create", {"id": "a2", "workspace_id": "ws", "name": "a2",
                                  "status": "paused"})
    ready = enqueue(daemon, "a2")
    runs = daemon.call("daemon.status")["runs"]
    assert (runs["queued"], runs["retrying"]) == (2, 1)
    assert runs["oldest_queued_at"] == ready["requested_at"]
    assert "2 queued (1 ready, oldest waiting" in run_cli(daemon.home, "status").stdout

    # its back-off over, the first run waits in the queue again (no commit needed to say so)
    runs = daemon.wait_until(lambda: (r := daemon.call("daemon.status")["runs"])["retrying"]
                             == 0 and r, what="the back-off over")
    assert runs["oldest_queued_at"] == run["requested_at"]
    assert daemon.call("runs.get", {"id": run["id"]})["status"] == "queued"


# -- 4. cancels stick --------------------------------------------------------------------------


def test_a_cancel_between_claim_and_start_starts_nothing(
        daemon_factory: Factory, tmp_path: Path) -> None:
    touch = tmp_path / "executed"
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    daemon = daemon_factory(fast_config(),
                            env={"KANDEVD_FAULTS": json.dumps({"dispatch_gate": str(gate)})})
    setup_agent(daemon)
    run = enqueue(daemon, touch=str(touch))
    daemon.wait_for_line(f"fault: run {run['id']} waits at the dispatch gate")
    assert daemon.call("runs.get", {"id": run["id"]})["status"] == "claimed"
    cancelled = daemon.call("runs.cancel", {"id": run["id"]})
    assert cancelled["status"] == "cancelled"
    mark = daemon.mark()
    with open(gate, "w") as fifo:  # let the dispatch go on
        fifo.write("go\n")
    daemon.wait_for_line(f"run {run['id']}: cancelled before its agent started; nothing "
                         "started", after=mark)
    assert daemon.call("runs.get", {"id": run["id"]})["status"] == "cancelled"
    assert executions(touch) == []
    assert daemon.call("daemon.status")["runtime"]["active"] == 0
    # Its agent is free again: the next run goes through.
    second = enqueue(daemon, touch=str(touch))
    with open(gate, "w") as fifo:
        fifo.write("go\n")
    wait_status(daemon, second["id"], "finished")
    assert executions(touch) == [second["id"]]


# -- 5. keys mean what the contract says ------------------------------------------------------


def test_a_key_absorbed_by_coalescing_deduplicates_after_the_run_finished(
        daemon_factory: Factory) -> None:
    daemon = daemon_factory(fast_config())
    setup_agent(daemon)
    daemon.call("agents.update", {"id": "a1", "status": "paused"})  # hold the first run
    base = {"workspace_id": "ws", "agent_id": "a1", "reason": "wake"}
    first = daemon.call("runs.enqueue", base)["run"]
    absorbed = daemon.call("runs.enqueue", {**base, "idempotency_key": "k1"})
    assert absorbed["coalesced"] and absorbed["run"]["id"] == first["id"]
    daemon.call("agents.update", {"id": "a1", "status": "active"})
    wait_status(daemon, first["id"], "finished")
    again = daemon.call("runs.enqueue", {**base, "idempotency_key": "k1"})
    assert again["deduplicated"] and again["run"]["id"] == first["id"]
    assert daemon.call("runs.list", {"agent_id": "a1"})["total"] == 1


def test_re_entering_a_step_queues_again_while_a_replayed_move_does_not(
        daemon_factory: Factory) -> None:
    daemon = daemon_factory(fast_config())
    setup_agent(daemon)
    daemon.call("workflows.create", {
        "id": "wf", "workspace_id": "ws", "name": "board", "style": "kanban",
        "steps": [{"id": "todo", "name": "To do"},
                  {"id": "doing", "name": "Doing", "agent_id": "a1",
                   "on_enter": [{"action": "queue_run"}]}]})
    daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws", "workflow_id": "wf",
                                 "title": "t", "step_id": "todo"})
    first = daemon.call("tasks.move", {"id": "t1", "step_id": "doing"})["actions"][0]
    replay = daemon.call("tasks.move", {"id": "t1", "step_id": "doing"})["actions"][0]
    assert replay["deduplicated"] and replay["run_id"] == first["run_id"]
    wait_status(daemon, first["run_id"], "finished")
    daemon.call("tasks.move", {"id": "t1", "step_id": "todo"})
    back = daemon.call("tasks.move", {"id": "t1", "step_id": "doing"})["actions"][0]
    assert not back["deduplicated"] and back["run_id"] != first["run_id"]
    wait_status(daemon, back["run_id"], "finished")


# -- Office recovery respects a cancel -----------------------------------------------------


def test_a_cancelled_office_run_survives_office_ticks(daemon_factory: Factory) -> None:
    daemon = daemon_factory(fast_config(office={"interval_s": 0.2}))
    setup_agent(daemon)
    daemon.call("agents.update", {"id": "a1", "status": "paused"})  # its run stays queued
    daemon.call("workflows.create", {"id": "wf", "workspace_id": "ws", "name": "o",
                                     "style": "office",
                                     "steps": [{"id": "s", "name": "s", "agent_id": "a1"}]})
    daemon.call("workspaces.update", {"id": "ws", "office_workflow_id": "wf"})
    daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws", "workflow_id": "wf",
                                 "title": "t"})
    queued = daemon.wait_until(
        lambda: daemon.call("runs.list", {"task_id": "t1"})["items"], what="the assignment run")
    daemon.call("runs.cancel", {"id": queued[0]["id"]})

    def office_ticks() -> int:
        return daemon.call("daemon.status")["stats"]["office"]["ticks"]

    start = office_ticks()
    daemon.wait_until(lambda: office_ticks() >= start + 5, what="five Office ticks")
    runs = daemon.call("runs.list", {"task_id": "t1"})["items"]
    assert [r["status"] for r in runs] == ["cancelled"]


# -- 7. hard budgets at claim time ------------------------------------------------------------


def test_a_spent_hard_budget_refuses_the_claim(daemon_factory: Factory) -> None:
    daemon = daemon_factory(fast_config())
    setup_agent(daemon)
    spender = enqueue(daemon, cost_cents=150)
    wait_status(daemon, spender["id"], "finished")
    daemon.call("office.budgets.create", {
        "id": "cap", "workspace_id": "ws", "scope_type": "agent", "scope_id": "a1",
        "limit_cents": 100, "period": "lifetime", "action_on_exceed": "pause_agent"})
    held = enqueue(daemon)
    explained = daemon.wait_until(
        lambda: (e := daemon.call("runs.explain", {"id": held["id"]}))["blockers"] and e,
        what="the budget blocker")
    assert "budget_exceeded" in explained["blockers"]
    assert explained["details"]["budget_exceeded"] == "cap"
    # A run of another agent is claimed in the same passes: once it has finished, the
    # held run was passed over at least once.
    daemon.call("agents.create", {"id": "a2", "workspace_id": "ws", "name": "a2"})
    other = enqueue(daemon, "a2")
    wait_status(daemon, other["id"], "finished")
    assert daemon.call("runs.get", {"id": held["id"]})["status"] == "queued"


def test_a_cost_too_large_to_add_up_is_not_recorded_and_the_run_reads_well(
        daemon_factory: Factory, tmp_path: Path) -> None:
    daemon = daemon_factory(fast_config(retry={"delays_s": [0], "jitter": 0}))
    setup_agent(daemon)
    # Two attempts each reporting 1.7e308: their sum would be infinite.
    huge = enqueue(daemon, cost_cents=1.7e308, fail_once_marker=str(tmp_path / "m"))
    fine = enqueue(daemon, cost_cents=1e12)  # (the largest cost taken)
    for run in (huge, fine):
        wait_status(daemon, run["id"], "finished")
    got = daemon.call("runs.get", {"id": huge["id"]})
    assert got["attempt"] == 2 and got["cost_cents"] is None
    assert daemon.call("runs.get", {"id": fine["id"]})["cost_cents"] == 1e12
    listed = daemon.call("runs.list", {"status": "finished"})["items"]
    assert {r["id"] for r in listed} == {huge["id"], fine["id"]}
    daemon.wait_for_line("over 1e+12; not recorded")


def test_a_run_cancelled_as_it_runs_names_its_log_and_a_retry_marks_it(
        daemon_factory: Factory, tmp_path: Path) -> None:
    daemon = daemon_factory(fast_config())
    setup_agent(daemon)
    run = enqueue(daemon, wait_for=str(tmp_path / "never"))
    daemon.wait_until(lambda: daemon.call("runs.get", {"id": run["id"]})["status"]
                      == "claimed" and (daemon.home / "logs" / "runs"
                                        / f"{run['id']}.log").exists(), what="it running")
    cancelled = daemon.call("runs.cancel", {"id": run["id"]})
    log_path = daemon.home / "logs" / "runs" / f"{run['id']}.log"
    assert cancelled["log_path"] == str(log_path)
    assert daemon.call("runs.get", {"id": run["id"]})["log_path"] == str(log_path)

    def frames() -> list[str]:
        return [line for line in log_path.read_text().splitlines()
                if line.startswith("[kandevd] ====")]
    # (The cancel stops the agent; its attempt's end is written once it has ended.)
    daemon.wait_until(lambda: len(frames()) == 2, what="the cancelled attempt's end")
    assert frames()[1].startswith("[kandevd] ==== attempt 1 ended")
    daemon.call("runs.retry", {"id": run["id"]})
    assert "re-queued by runs.retry" in frames()[2]
    daemon.call("runs.cancel", {"id": run["id"]})


def test_runs_logs_of_a_run_that_never_started_says_so(daemon_factory: Factory) -> None:
    daemon = daemon_factory(fast_config())
    setup_agent(daemon)
    daemon.call("agents.update", {"id": "a1", "status": "paused"})
    run = enqueue(daemon)
    shown = run_cli(daemon.home, "runs", "logs", run["id"])
    assert shown.returncode == 0 and shown.stdout == ""
    assert f"run {run['id']} has no log: no attempt of it has started (it is queued)" \
        in shown.stderr


def test_runs_logs_shows_each_attempt_between_separators(
        daemon_factory: Factory, tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    daemon = daemon_factory(fast_config(retry={"delays_s": [0], "jitter": 0}))
    setup_agent(daemon)
    run = enqueue(daemon, fail_once_marker=str(marker), summary="second time lucky")
    wait_status(daemon, run["id"], "finished")
    shown = run_cli(daemon.home, "runs", "logs", run["id"])
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stdout.splitlines() if line.startswith("[kandevd] ====")]
    assert [line.split()[2:4] for line in lines] == [
        ["attempt", "1"], ["attempt", "1"], ["attempt", "2"], ["attempt", "2"]]
    assert lines[1].endswith("failed (exit code 1) ====")
    assert lines[3].endswith("succeeded ====")
    followed = run_cli(daemon.home, "runs", "logs", run["id"], "--follow")
    assert followed.returncode == 0 and followed.stdout == shown.stdout


def test_a_signal_to_the_whole_group_on_stop_uses_no_retry(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """As systemd with KillMode=control-group or a terminal's Ctrl-C would: the stop
    signal reaches the daemon and its agents at once. The agent's death is an
    interruption (the next start runs it again), never a failed attempt."""
    touch = tmp_path / "executed"
    home = tmp_path / "home"
    first = daemon_factory(fast_config(), home=home)
    setup_agent(first)
    run = enqueue(first, touch=str(touch), sleep_s=30)
    wait_status(first, run["id"], "claimed")
    [agent] = first.wait_until(first.agent_pids, what="the agent")
    assert first.proc is not None
    os.kill(first.proc.pid, signal.SIGTERM)
    os.killpg(agent, signal.SIGTERM)
    assert first.wait() == 0
    with first.db() as conn:
        row = conn.execute("SELECT status, retry_count FROM runs WHERE id = ?",
                           (run["id"],)).fetchone()
    assert (row["status"], row["retry_count"]) == ("claimed", 0)  # left for the next start
    # its log closes the attempt as what it was: interrupted, not failed
    frames = [line for line in (home / "logs" / "runs" / f"{run['id']}.log").read_text()
              .splitlines() if line.startswith("[kandevd] ==== attempt 1 ended")]
    assert len(frames) == 1 and ": interrupted" in frames[0], frames
    second = daemon_factory(fast_config(), home=home)
    second.call("runs.get", {"id": run["id"]})
    requeued = wait_status(second, run["id"], "queued", "claimed")
    assert requeued["retry_count"] == 0


def test_ten_graceful_restarts_during_one_run_use_none_of_its_attempts(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """A shutdown never terminally fails a run: each graceful stop interrupts the agent,
    the next start takes the run up again with its attempt given back, and the run
    finishes once, far past ``max_attempts`` restarts."""
    touch, release = tmp_path / "executed", tmp_path / "release"
    home = tmp_path / "home"
    cfg = fast_config(queue={"max_attempts": 2}, runtime={"stop_grace_s": 0.1})
    daemon = daemon_factory(cfg, home=home)
    setup_agent(daemon)
    run = enqueue(daemon, touch=str(touch), wait_for=str(release))
    for _ in range(10):
        daemon.wait_until(daemon.agent_pids, what="the agent to be running")
        assert daemon.stop(signal.SIGTERM) == 0
        daemon = daemon_factory(cfg, home=home)
        assert daemon.call("runs.get", {"id": run["id"]})["status"] in ("queued", "claimed")
    daemon.wait_until(daemon.agent_pids, what="the agent to be running")
    release.touch()
    finished = wait_status(daemon, run["id"], "finished")
    assert (finished["attempt"], finished["retry_count"]) == (1, 0)
    assert executions(touch) == [run["id"]]


def test_a_crash_during_a_run_still_counts_an_attempt(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """What a graceful stop gives back, a crash does not: a run whose daemon died
    (its agent with it) ends in the dead letter once its attempts are used."""
    home = tmp_path / "home"
    cfg = fast_config(queue={"max_attempts": 2}, runtime={"adopt_on_restart": False})
    daemon = daemon_factory(cfg, home=home)
    setup_agent(daemon)
    run = enqueue(daemon, wait_for=str(tmp_path / "never"))
    for _ in range(2):
        daemon.wait_until(daemon.agent_pids, what="the agent to be running")
        daemon.kill9()
        daemon = daemon_factory(cfg, home=home)
    failed = wait_status(daemon, run["id"], "failed")
    assert failed["error_message"].startswith("gave up after 2 attempts")
