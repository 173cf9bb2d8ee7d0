"""job_status: one state per job, and a next_run_at only when the job will really fire."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kandevd.schedules.jobs import Job, JobFacts
from kandevd.schedules.rules.options import NO_OPTIONS, ScheduleOptions
from kandevd.schedules.rules.states import (
    BLOCKED,
    BUFFERED,
    DISABLED,
    HELD,
    INVALID,
    PAUSED,
    RUNNING,
    SCHEDULED,
    STATES,
    Surroundings,
    job_status,
)
from kandevd.schedules.settings import Switches

T0 = datetime(2026, 12, 3, 10, tzinfo=UTC)


@dataclass
class Schedule:
    enabled: bool
    options: ScheduleOptions = NO_OPTIONS


@dataclass
class Spec:
    """The least a job's spec needs for its state: enabled, its key, an allow/block verdict."""

    schedule: Schedule
    user_id: str | None = None

    @property
    def key(self) -> str:
        return "workflow:w:s"

    def verdict(self, switches: Switches) -> str | None:
        return switches.workflow_verdict(["w"])


def make_job(*, enabled: bool = True, override: bool | None = None,
             invalid: str | None = None, held: bool = False,
             next_fire: datetime | None = T0) -> Job:
    state = JobFacts(enabled=override, invalid=invalid, next_fire=next_fire,
                     held_until=T0 + timedelta(minutes=30) if held else None)
    return Job("workflow:w:s", Spec(Schedule(enabled)), source=None,  # type: ignore[arg-type]
               state=state)


def around(*, execution: bool = True, blocked: bool = False, paused: bool = False,
           running: bool = False, buffered: bool = False) -> Surroundings:
    pause: dict[str, Any] = {"globally_paused": paused, "paused_by": "ann" if paused else None}
    return Surroundings(
        Switches(configured_enabled=execution, blocked_workflows=("w",) if blocked else ()),
        pause, running=frozenset({"workflow:w:s"} if running else ()),
        buffered=frozenset({"workflow:w:s"} if buffered else ()))


@given(enabled=st.booleans(), override=st.sampled_from([None, True, False]),
       invalid=st.sampled_from([None, "workflow.json: not JSON"]), held=st.booleans(),
       execution=st.booleans(), blocked=st.booleans(), paused=st.booleans(),
       running=st.booleans(), buffered=st.booleans())
def test_one_state_and_a_next_run_only_when_it_will_fire(
        enabled: bool, override: bool | None, invalid: str | None, held: bool,
        execution: bool, blocked: bool, paused: bool, running: bool, buffered: bool) -> None:
    job = make_job(enabled=enabled, override=override, invalid=invalid, held=held)
    status = job_status(job, around(execution=execution, blocked=blocked, paused=paused,
                                    running=running, buffered=buffered))
    assert status.state in STATES and status.reason
    effective = enabled if override is None else override
    stopped = invalid is not None or not effective or not execution or blocked or paused
    # next_run_at: absent exactly when something keeps the job from firing
    assert (status.next_run_at is None) == stopped
    if held and not stopped:
        assert status.next_run_at == job.state.held_until
    # the most decisive reason wins, in the documented order
    expected = (BUFFERED if buffered else RUNNING if running
                else INVALID if invalid is not None else DISABLED if not effective
                else BLOCKED if not execution or blocked else PAUSED if paused
                else HELD if held else SCHEDULED)
    assert status.state == expected


def test_reasons_name_the_cause() -> None:
    assert job_status(make_job(), around(paused=True)).reason.startswith(
        "the scheduler is globally paused by ann")
    assert job_status(make_job(), around(blocked=True)).reason == \
        "workflow blocked by the block list (w)"
    assert job_status(make_job(), around(execution=False)).reason == \
        "scheduler.enabled is false in the config"
    assert job_status(make_job(override=False), around()).reason == "disabled for user None"
    assert job_status(make_job(invalid="bad"), around()).reason == "bad"
    held = job_status(make_job(held=True), around())
    assert held.state == HELD and "2026-12-03T10:30:00" in held.reason
    assert job_status(make_job(), around()).reason == "fires at 2026-12-03T10:00:00.000000Z"


LABELS = st.sets(st.sampled_from(["gpu", "big", "mac", "linux"]), max_size=3)


@given(needed=LABELS, online=st.one_of(st.none(), st.lists(LABELS, max_size=3)))
def test_a_job_whose_turns_need_a_runner_is_blocked_until_one_online_carries_its_labels(
        needed: set[str], online: list[set[str]] | None) -> None:
    job = make_job()
    job.spec.schedule.options = ScheduleOptions(  # type: ignore[attr-defined]
        runs_on=tuple(sorted(needed)) or None)
    runners = None if online is None else tuple(frozenset(r) for r in online)
    status = job_status(job, Surroundings(Switches(), {}, runners=runners))
    covered = not needed or (runners is not None and any(needed <= r for r in runners))
    assert status.state == (SCHEDULED if covered else BLOCKED)
    assert status.next_run_at == T0  # it still fires: its turns wait for a runner
    if not covered:
        assert all(label in status.reason for label in needed)
        assert ("gateway.listen" in status.reason) == (runners is None)
