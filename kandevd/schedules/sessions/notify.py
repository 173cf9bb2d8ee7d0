"""Telling someone that a scheduled run failed (or recovered): a command, a webhook.

A notification never delays a schedule and never storms: the runner hands it
over and goes on; one worker thread (in the cron loop's fan-out, so a stop
joins it) sends them one at a time, each attempt bounded by
:data:`NOTIFY_TIMEOUT_S`. A failed attempt is retried once, a minute later;
then it is given up and logged at WARNING. Each attempt's outcome is written
onto the history entry as ``notified: {ok, at, error}`` (by the ``record``
callback the runner gives), so an operator sees on the run itself whether
anyone was told.

What is sent: the history entry as JSON, plus ``event`` (``failure``,
``recovery``, ``success`` or ``paused``) and ``job_id``; on the command's
stdin (an argv list, never a shell), or as the body of an HTTP POST.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kandevd.schedules.history import HistoryEntry
from kandevd.schedules.rules.options import NotifySpec
from kandevd.timeutil import rfc3339, utc_now

log = logging.getLogger("kandevd.scheduler.notify")

NOTIFY_TIMEOUT_S = 10.0
RETRY_AFTER_S = 60.0
#: Notifications waiting beyond this are dropped (logged): a storm must not grow memory.
MAX_PENDING = 1000
#: How much of a failed command's output is kept in the error.
OUTPUT_TAIL = 500

FAILURE, RECOVERY, SUCCESS, PAUSED = "failure", "recovery", "success", "paused"

Spawn = Callable[[str, Callable[[], Any]], Any]
Record = Callable[[dict[str, Any]], None]


def notify_event(status: str, failures_before: int, on: tuple[str, ...], *,
                 paused: bool = False) -> str | None:
    """Which event a finished run is, if it is one to tell (``on``). Pure.

    ``error`` is a ``failure`` (``paused`` when it paused the job: always told);
    a ``success`` after failures is a ``recovery``, else a ``success``; a run that
    was ``stopped`` is none.
    """
    if status == "error":
        return PAUSED if paused else (FAILURE if FAILURE in on else None)
    if status != "success":
        return None
    if failures_before > 0 and RECOVERY in on:
        return RECOVERY
    return SUCCESS if SUCCESS in on else None


@dataclass
class _Pending:
    due: float
    attempt: int
    job_id: str
    spec: NotifySpec
    body: dict[str, Any]
    record: Record


class Notifier:
    def __init__(self, spawn: Spawn, *, timeout_s: float = NOTIFY_TIMEOUT_S,
                 retry_after_s: float = RETRY_AFTER_S) -> None:
        self._spawn = spawn
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._working = False
        self._closed = False
        self.sent = 0
        self.failed = 0

    def tell_ended(self, job_id: str, spec: NotifySpec, entry: HistoryEntry,
                   failures_before: int, update_entry: Callable[[str, HistoryEntry], Any],
                   paused: str | None) -> None:
        """Hand over the notification a run of ``job_id`` that ended with ``entry`` calls
        for (none when ``spec`` tells no one of it); its outcome is recorded on the entry
        (``update_entry``)."""
        event = notify_event(str(entry.get("status")), failures_before, spec.on,
                             paused=paused is not None)
        if event is None or not spec.has_target:
            return
        body = dict(entry)
        if paused is not None:
            body["paused_reason"] = paused
        entry_id = str(entry.get("id"))

        def record(outcome: dict[str, Any]) -> None:
            try:
                update_entry(entry_id, {**entry, "notified": outcome})
                entry["notified"] = outcome
            except Exception as exc:  # the notification went out; only its record failed
                log.warning("%s: notification outcome not recorded: %s", job_id, exc)

        self.submit(job_id, spec, event, body, record)

    def submit(self, job_id: str, spec: NotifySpec, event: str, entry: HistoryEntry,
               record: Record) -> None:
        """Send ``entry`` as ``event`` to ``spec``'s targets, soon, from another thread."""
        if not spec.has_target:
            return
        body = {**entry, "event": event, "job_id": job_id}
        with self._cond:
            if self._closed:
                return
            if len(self._pending) >= MAX_PENDING:
                log.warning("%s: %s notification dropped: %d are already waiting", job_id,
                            event, MAX_PENDING)
                return
            self._pending.append(_Pending(time.monotonic(), 1, job_id, spec, body, record))
            self._cond.notify_all()
            if self._working:
                return
            self._working = True
        self._spawn("notify", self._work)

    def close(self) -> None:
        """Send nothing more (a retry still waiting is dropped); the attempt in flight
        ends within its timeout."""
        with self._cond:
            self._closed = True
            dropped = len(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        if dropped:
            log.info("%d notification(s) not sent: the scheduler is stopping", dropped)

    def _next(self) -> _Pending | None:
        with self._cond:
            while True:
                if self._closed or not self._pending:
                    self._working = False
                    return None
                now = time.monotonic()
                ready = min(self._pending, key=lambda p: p.due)
                if ready.due <= now:
                    self._pending.remove(ready)
                    return ready
                self._cond.wait(ready.due - now)

    def _work(self) -> None:
        try:
            self._work_through()
        finally:  # whatever happened, a later notification starts a worker again
            with self._cond:
                self._working = False

    def _work_through(self) -> None:
        while (item := self._next()) is not None:
            error = self._send(item.spec, item.body)
            item.record({"ok": error is None, "at": rfc3339(utc_now()), "error": error})
            if error is None:
                self.sent += 1
                log.info("%s: %s notification sent", item.job_id, item.body["event"])
                continue
            if item.attempt == 1:
                log.warning("%s: %s notification failed (%s); retried in %ds", item.job_id,
                            item.body["event"], error, int(self._retry_after_s))
                item.attempt, item.due = 2, time.monotonic() + self._retry_after_s
                with self._cond:
                    if not self._closed:
                        self._pending.append(item)
                continue
            self.failed += 1
            log.warning("%s: %s notification failed again (%s); given up", item.job_id,
                        item.body["event"], error)

    def _send(self, spec: NotifySpec, body: dict[str, Any]) -> str | None:
        """One attempt to every target; the first error, or None."""
        errors: list[str | None] = []
        try:
            data = json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
            if spec.command:
                errors.append(self._run(spec.command, data))
            if spec.webhook:
                errors.append(self._post(spec.webhook, data))
        except Exception as exc:  # a malformed reply, an odd entry: one attempt failed
            errors.append(f"{type(exc).__name__}: {exc}")
        return "; ".join(e for e in errors if e) or None

    def _run(self, command: tuple[str, ...], data: bytes) -> str | None:
        try:
            done = subprocess.run(list(command), input=data, capture_output=True,
                                  timeout=self._timeout_s, check=False,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return f"command timed out after {self._timeout_s:g}s"
        except OSError as exc:
            return f"command could not run: {exc}"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).decode(errors="replace").strip()
            return f"command exited {done.returncode}" + (
                f": {tail[-OUTPUT_TAIL:]}" if tail else "")
        return None

    def _post(self, url: str, data: bytes) -> str | None:
        request = urllib.request.Request(url, data=data, method="POST", headers={
            "Content-Type": "application/json", "User-Agent": "kandevd"})
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            return f"webhook answered {exc.code}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            return f"webhook unreachable: {reason}"
        return None if 200 <= status < 300 else f"webhook answered {status}"
