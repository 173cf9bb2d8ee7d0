"""Whether automatic (cron) execution happens on this server.

Three layers, all of which stop cron fires only (a manual ``trigger`` always runs):

* the persisted global pause, ``<root>/config/scheduler.json``
  (``globally_paused, paused_at, paused_by, updated_at``; nothing else is stored);
* the execution switches: ``scheduler.enabled: false`` in kandevd.yaml or
  ``SCHEDULER_ENABLED=false`` in the environment;
* the allow/block lists, comma lists from ``SCHEDULER_ALLOWED_WORKFLOWS``,
  ``SCHEDULER_BLOCKED_WORKFLOWS``, ``SCHEDULER_ALLOWED_USERS``,
  ``SCHEDULER_BLOCKED_USERS`` (entries trimmed, empty ones ignored, matched
  case-insensitively). A workflow matches an entry by folder name, manifest
  ``id`` or ``label``. Allowed = the allow list is empty or matches, and the
  block list does not match (block wins).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypedDict

from kandevd.config import SWITCH_OFF, SWITCH_ON, Config, SchedulerConfig
from kandevd.formats.jsonfile import (
    CorruptFile,
    CorruptReporter,
    JsonFile,
    JsonFileUnreadable,
    stat_key,
)
from kandevd.paths import HomeLayout
from kandevd.timeutil import rfc3339, utc_now

log = logging.getLogger("kandevd.scheduler")

PAUSE_FILE = Path("config") / "scheduler.json"
PERSISTED = ("globally_paused", "paused_at", "paused_by", "updated_at")
ENV_LISTS = {
    "allowed_workflows": "SCHEDULER_ALLOWED_WORKFLOWS",
    "blocked_workflows": "SCHEDULER_BLOCKED_WORKFLOWS",
    "allowed_users": "SCHEDULER_ALLOWED_USERS",
    "blocked_users": "SCHEDULER_BLOCKED_USERS",
}


class SwitchesObject(TypedDict):
    """The execution switches as ``scheduler.config.get`` shows them."""

    execution_enabled: bool
    disabled_via_env: bool
    disabled_reason: str | None
    allowed_workflows: list[str]
    blocked_workflows: list[str]
    allowed_users: list[str]
    blocked_users: list[str]


def parse_list(value: str | None) -> tuple[str, ...]:
    """A comma list: entries trimmed, empty ones dropped."""
    if not value:
        return ()
    return tuple(item.strip() for item in value.split(",") if item.strip())


def list_verdict(names: Iterable[str], allowed: Iterable[str], blocked: Iterable[str]
                 ) -> str | None:
    """None when allowed; else the reason. ``names`` are the candidate's aliases."""
    lowered = {n.lower() for n in names if n}
    blocked_hits = [b for b in blocked if b.lower() in lowered]
    if blocked_hits:
        return f"blocked by the block list ({blocked_hits[0]})"
    allowed = list(allowed)
    if allowed and not any(a.lower() in lowered for a in allowed):
        return "not in the allow list"
    return None


@dataclass(frozen=True)
class Switches:
    """The execution switches and allow/block lists, read once at start."""

    configured_enabled: bool = True
    disabled_via_env: bool = False
    #: ``SCHEDULER_ENABLED`` when it is neither on nor off (and so turned cron off).
    unknown_env_switch: str | None = None
    allowed_workflows: tuple[str, ...] = ()
    blocked_workflows: tuple[str, ...] = ()
    allowed_users: tuple[str, ...] = ()
    blocked_users: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: SchedulerConfig,
                    environ: Mapping[str, str] | None = None) -> Switches:
        environ = os.environ if environ is None else environ
        return cls(configured_enabled=config.configured_enabled,
                   disabled_via_env=config.disabled_via_env,
                   unknown_env_switch=config.unknown_env_switch,
                   **{field: parse_list(environ.get(var)) for field, var in ENV_LISTS.items()})

    @property
    def execution_enabled(self) -> bool:
        return self.configured_enabled and not self.disabled_via_env

    @property
    def disabled_reason(self) -> str | None:
        if self.unknown_env_switch is not None:
            return (f"SCHEDULER_ENABLED={self.unknown_env_switch!r} in the environment, "
                    f"neither on ({', '.join(SWITCH_ON)}) nor off ({', '.join(SWITCH_OFF)})")
        if self.disabled_via_env:
            return "SCHEDULER_ENABLED=false in the environment"
        if not self.configured_enabled:
            return "scheduler.enabled is false in the config"
        return None

    def workflow_verdict(self, aliases: Iterable[str]) -> str | None:
        verdict = list_verdict(aliases, self.allowed_workflows, self.blocked_workflows)
        return None if verdict is None else f"workflow {verdict}"

    def user_verdict(self, user_id: str) -> str | None:
        verdict = list_verdict([user_id], self.allowed_users, self.blocked_users)
        return None if verdict is None else f"user {verdict}"

    def as_dict(self) -> SwitchesObject:
        return {"execution_enabled": self.execution_enabled,
                "disabled_via_env": self.disabled_via_env,
                "disabled_reason": self.disabled_reason,
                **{field: list(getattr(self, field)) for field in ENV_LISTS}}


class Pause(TypedDict):
    """The global pause as ``config/scheduler.json`` holds it (and scheduler.config.get)."""

    globally_paused: bool
    paused_at: str | None
    paused_by: str | None
    updated_at: str | None


def _default_pause() -> Pause:
    return {"globally_paused": False, "paused_at": None, "paused_by": None, "updated_at": None}


class PauseState:
    """The persisted global pause (``config/scheduler.json``).

    A file that does not parse is moved aside (as every state file is) and the
    scheduler is then paused, not resumed: whether an operator had paused it is
    unknown, and a schedule fired by mistake cannot be taken back. ``paused_by``
    says why, and ``kandevd scheduler resume`` lifts it."""

    def __init__(self, root: Path, *, on_corrupt: CorruptReporter | None = None) -> None:
        self._report = on_corrupt
        self.file = JsonFile(root / PAUSE_FILE, on_corrupt=self._moved_aside)
        self._seen: tuple[Any, Pause] | None = None
        self._unreadable: CorruptFile | None = None
        #: The file is there but could not be read at the last look (said once).
        self._cannot_read = False
        self._reading = threading.Lock()
        #: Paused or not as last read or written here (None: not yet): a change made
        #: by editing the file is said in the log as the methods' changes are.
        self._known: bool | None = None

    def _moved_aside(self, report: CorruptFile) -> None:
        self._unreadable = report
        if self._report is not None:
            self._report(report)

    def get(self) -> Pause:
        """The pause state; the file is read again only when ``stat`` says it changed
        (every write replaces it), so ``daemon.status`` and each fire stay cheap."""
        key = stat_key(self.file.path)
        seen = self._seen
        if seen is not None and seen[0] == key:
            return Pause(**seen[1])
        state = self._read()
        # (a file that could not be read is read again next time: a chmod changes no key)
        self._seen = None if self._cannot_read else (stat_key(self.file.path), state)
        return Pause(**state)

    def _read(self) -> Pause:
        with self._reading:  # (one reader at a time: it alone may meet a corrupt file)
            state = self._read_locked()
            paused = state["globally_paused"]
            if self._cannot_read:  # (said so; what the file says stays unknown till read)
                return state
            if self._known is not None and paused != self._known:
                log.warning("scheduler %s by a change to %s: %s",
                            "paused" if paused else "resumed", self.file.path,
                            "no schedule fires until it is resumed" if paused
                            else "schedules fire again")
            self._known = paused
            return state

    def _read_locked(self) -> Pause:
        self._unreadable = None
        try:
            stored = self.file.read({}, expect=dict)
        except OSError as exc:  # there, but unreadable now: left as it is, and paused
            if not self._cannot_read:  # (read again at every look, said once)
                log.error("scheduler paused: %s; whether it was paused is unknown, no "
                          "schedule fires until it can be read", exc)
            self._cannot_read = True
            state = _default_pause()
            state["globally_paused"] = True
            why = exc.why if isinstance(exc, JsonFileUnreadable) else exc.strerror or exc
            state["paused_by"] = f"kandevd: {PAUSE_FILE} cannot be read now ({why})"
            return state
        if self._cannot_read:
            self._cannot_read = False
            log.info("%s can be read again", self.file.path)
        if self._unreadable is not None:
            aside = Path(self._unreadable.moved_to).name
            by = f"kandevd: {PAUSE_FILE} could not be read (moved aside to {aside})"
            log.error("scheduler paused: %s could not be read, so whether it was paused "
                      "is unknown; no schedule fires until `kandevd scheduler resume`",
                      self.file.path)
            return self.put(True, by, utc_now())
        state = _default_pause()
        # Only well-typed values are believed: a hand-edited file cannot make a
        # response carry an object where a timestamp belongs.
        state.update({k: stored[k] for k in PERSISTED[1:] if isinstance(stored.get(k), str)})
        flag = stored.get("globally_paused", False)
        if isinstance(flag, bool):
            state["globally_paused"] = flag
            return state
        # Neither true nor false (a hand edit: "true", 1, null): whether it is meant to
        # be paused is unknown, so it is paused, as for a file that does not parse. The
        # file is left as it is (the operator's to fix); resuming rewrites it.
        shown = json.dumps(flag)[:40]
        log.error("scheduler paused: %s holds \"globally_paused\": %s, neither true nor "
                  "false; no schedule fires until it is fixed or `kandevd scheduler resume`",
                  self.file.path, shown)
        state["globally_paused"] = True
        state["paused_by"] = (f"kandevd: {PAUSE_FILE} holds \"globally_paused\": {shown}, "
                              "neither true nor false")
        return state

    def put(self, paused: bool, paused_by: str | None, now: datetime) -> Pause:
        def change(_stored: object) -> Pause:
            state = _default_pause()
            state["globally_paused"] = paused
            state["paused_at"] = rfc3339(now) if paused else None
            state["paused_by"] = paused_by if paused else None
            state["updated_at"] = rfc3339(now)
            return state
        written = self.file.update(change, {}, expect=dict)
        self._seen = None
        self._known = paused  # (its caller says so in the log)
        return written


def scheduler_root(config: Config, home: Path) -> Path:
    """``scheduler.root`` (relative to the home when relative), else ``<home>/workspace``."""
    if config.scheduler.root:
        root = Path(config.scheduler.root).expanduser()
        return root if root.is_absolute() else home / root
    return HomeLayout(home).workspace
