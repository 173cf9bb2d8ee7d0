"""The options every schedule takes besides its timing: whom to tell about a failure, when
to give up, how far to catch up, how long a session may run, how to spread fires, and
the window the schedule is active in.

Workflow schedules (``workflow.json``) and product schedules (``product.yaml``) take
the same options, so they are checked by one schema (``schemas/options.json``,
merged into both schedule schemas) and parsed into one :class:`ScheduleOptions`.
The rules they stand for are in docs/scheduling.md ("Failures, catch-up and time
limits").
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from importlib import resources
from typing import Any, TypedDict

from kandevd.timeutil import parse_rfc3339, rfc3339

NOTIFY_EVENTS = ("failure", "recovery", "success")
DEFAULT_NOTIFY_ON = ("failure", "recovery")
OPTION_FIELDS = ("notify", "pause_after_failures", "catchup_window_s", "timeout_s",
                 "jitter_s", "start_at", "end_at", "runs_on")


class NotifyObject(TypedDict):
    """A job's ``notify`` as the JOB object shows it."""

    command: list[str] | None
    webhook: str | None
    on: list[str]


class OptionsObject(TypedDict):
    """The JOB's option fields."""

    notify: NotifyObject | None
    pause_after_failures: int | None
    catchup_window_s: float
    timeout_s: float | None
    jitter_s: float
    start_at: str | None
    end_at: str | None
    #: The labels a runner on another machine must carry to run the turns (None: here).
    runs_on: list[str] | None


@dataclass(frozen=True)
class NotifySpec:
    """Where a job's notifications go: a command (argv), a webhook, or both."""

    command: tuple[str, ...] | None = None
    webhook: str | None = None
    on: tuple[str, ...] = DEFAULT_NOTIFY_ON

    @property
    def has_target(self) -> bool:
        return bool(self.command) or bool(self.webhook)

    def as_dict(self) -> NotifyObject:
        return {"command": list(self.command) if self.command else None,
                "webhook": self.webhook, "on": list(self.on)}

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> NotifySpec:
        command = raw.get("command")
        return cls(command=tuple(command) if command else None, webhook=raw.get("webhook"),
                   on=tuple(raw.get("on", DEFAULT_NOTIFY_ON)))


@dataclass(frozen=True)
class ScheduleOptions:
    #: None: the config's ``scheduler.notify``.
    notify: NotifySpec | None = None
    pause_after_failures: int | None = None
    catchup_window_s: float = 0
    timeout_s: float | None = None
    jitter_s: float = 0
    start_at: datetime | None = None
    end_at: datetime | None = None
    runs_on: tuple[str, ...] | None = None

    def as_dict(self) -> OptionsObject:
        """The JOB's option fields (every one, so a reader sees what is in force)."""
        return {"notify": self.notify.as_dict() if self.notify else None,
                "pause_after_failures": self.pause_after_failures,
                "catchup_window_s": self.catchup_window_s, "timeout_s": self.timeout_s,
                "jitter_s": self.jitter_s,
                "start_at": rfc3339(self.start_at) if self.start_at else None,
                "end_at": rfc3339(self.end_at) if self.end_at else None,
                "runs_on": list(self.runs_on) if self.runs_on else None}

    def window_timing(self) -> tuple[datetime | None, datetime | None]:
        return self.start_at, self.end_at

    def ended(self, now: datetime) -> bool:
        return self.end_at is not None and now > self.end_at


NO_OPTIONS = ScheduleOptions()


@cache
def option_properties() -> dict[str, Any]:
    """The options' JSON-schema properties, to merge into a schedule schema."""
    text = resources.files("kandevd.schemas").joinpath("options.json").read_text("utf-8")
    properties: dict[str, Any] = json.loads(text)["properties"]
    return properties


def with_options(schedule_schema: dict[str, Any]) -> dict[str, Any]:
    """``schedule_schema`` with the option fields allowed."""
    return {**schedule_schema,
            "properties": {**schedule_schema.get("properties", {}), **option_properties()}}


def option_problems(raw: Mapping[str, Any]) -> list[str]:
    """What the schema cannot say: the window's times and order, finite numbers."""
    problems = []
    for name in ("catchup_window_s", "timeout_s", "jitter_s"):
        value = raw.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{name}: must be a finite number")
    moments = {}
    for name in ("start_at", "end_at"):
        value = raw.get(name)
        if not isinstance(value, str):
            continue
        try:
            moments[name] = parse_rfc3339(value)
        except (ValueError, OverflowError):
            problems.append(f"{name}: {value!r} is not an RFC 3339 time with an offset "
                            "(e.g. 2027-01-01T00:00:00Z)")
    if "start_at" in moments and "end_at" in moments \
            and moments["end_at"] <= moments["start_at"]:
        problems.append("end_at: must be later than start_at")
    return problems


def parse_options(raw: Mapping[str, Any]) -> ScheduleOptions:
    """The options of a schedule that passed the schema and :func:`option_problems`."""
    if not any(name in raw for name in OPTION_FIELDS):
        return NO_OPTIONS
    notify = raw.get("notify")
    start, end = raw.get("start_at"), raw.get("end_at")
    return ScheduleOptions(  # numbers as written (10, not 10.0, in the JOB)
        notify=NotifySpec.from_raw(notify) if isinstance(notify, Mapping) else None,
        pause_after_failures=raw.get("pause_after_failures"),
        catchup_window_s=raw.get("catchup_window_s", 0),
        timeout_s=raw.get("timeout_s"),
        jitter_s=raw.get("jitter_s", 0),
        start_at=parse_rfc3339(start) if isinstance(start, str) else None,
        end_at=parse_rfc3339(end) if isinstance(end, str) else None,
        runs_on=tuple(raw["runs_on"]) if raw.get("runs_on") else None)


def jitter_delay(key: str, intended: datetime, jitter_s: float) -> timedelta:
    """How long the fire of ``key`` due at ``intended`` waits: in ``[0, jitter_s]``.

    Pseudo-random but fixed for one fire (a hash of the job and the time), so the
    same fire gets the same delay after a restart or on another daemon, and a
    thousand jobs due at one minute are spread over the whole window. Pure.
    """
    if jitter_s <= 0:
        return timedelta(0)
    digest = hashlib.sha256(f"{key}@{rfc3339(intended)}".encode()).digest()
    fraction = int.from_bytes(digest[:8], "big") / float(2 ** 64)
    return timedelta(seconds=round(fraction * jitter_s, 3))


def within_window(options: ScheduleOptions, moment: datetime) -> bool:
    start, end = options.window_timing()
    return (start is None or moment >= start) and (end is None or moment <= end)
