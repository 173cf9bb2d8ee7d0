"""What the keeper keeps of an execution, as the daemon reads it back: its record, an
execution an earlier daemon started (adopted at the start), and the exits given up once
their outcomes are recorded (the adopting half of :class:`KeeperRunner`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.runtime.execution import (
    DETACHED,
    ERROR,
    ExecutionControl,
    ExecutionResult,
    ExecutionSpec,
    termination_text,
)
from kandevd.runtime.keeperclient import Handle, KeeperClient, KeeperUnavailable
from kandevd.runtime.output import LogSink, unlink_stdout
from kandevd.runtime.process import DETACHED_ERROR, ProcessRunner
from kandevd.runtime.records import ExecutionRecord, kept_outcome
from kandevd.timeutil import after, parse_rfc3339, rfc3339

log = logging.getLogger("kandevd.runtime.process")


class KeeperAdoption:
    """Adoption and settling; the rest is :class:`~kandevd.runtime.keeperrunner.KeeperRunner`'s."""

    client: KeeperClient
    kill_grace_s: float
    legacy: ProcessRunner
    _wait: Callable[..., str]
    _result: Callable[..., ExecutionResult]

    # -- an execution an earlier daemon started --------------------------------------------

    def adopt(self, spec: ExecutionSpec, control: ExecutionControl,
              record: ExecutionRecord) -> ExecutionResult:
        if record.keeper_id is None:  # started by an older version, under its shim
            return self.legacy.adopt(spec, control, record)
        handle = self.client.handle(record.keeper_id)
        if handle is None or handle.exit is not None:
            ended = kept_outcome(record)
            return ended if ended is not None else self._result(
                spec, record.started_at, ERROR, error="the agent's exit status is unknown")
        handle.wake, handle.owned = control.notify, True
        handle.wake()
        log.info("execution %s adopted: agent pid %d (started by the keeper)", spec.key,
                 record.pid)
        waited = self._wait(spec, control, handle)
        control.detach()
        if waited == DETACHED:
            self.client.forget(handle.id)
            return self._result(spec, record.started_at, DETACHED, error=DETACHED_ERROR)
        sink = LogSink.open_or_disabled(record.log_path)
        try:
            note_termination(sink, handle, self.kill_grace_s, record.timeout_s)
        finally:
            sink.close()
        result = kept_outcome(with_exit(record, handle))
        if result is None:
            return self._result(spec, record.started_at, ERROR,
                                error="the agent's exit status is unknown",
                                execution=handle.id)
        return result

    # -- after the outcome is recorded --------------------------------------------------------

    def settle_ids(self, ids: list[str]) -> None:
        """These outcomes are recorded: the keeper forgets their exits, their stdout goes."""
        for execution in ids:
            handle = self.client.handle(execution)
            if handle is not None and handle.meta.get("stdout_path"):
                unlink_stdout(str(handle.meta["stdout_path"]))  # (no Path parsed per run)
        if ids:
            try:
                self.client.acknowledge(ids)
            except KeeperUnavailable as exc:
                log.warning("could not tell the keeper %d exit(s) are recorded (%s); it "
                            "reports them again, and they are recorded once", len(ids), exc)

    def release_unclaimed(self) -> None:
        released = self.client.release_unowned()
        if released:
            log.info("the keeper's record of %d execution(s) of an earlier instance that "
                     "nothing took up is released", len(released))

    def record_for(self, record_dir: Path) -> ExecutionRecord | None:
        """The keeper's record of the execution whose record folder is ``record_dir``."""
        handle = self.client.handle(record_dir.name)
        if handle is None or handle.meta.get("record_dir") != str(record_dir):
            return None
        return with_exit(record_of(handle), handle)


def record_of(handle: Handle) -> ExecutionRecord:
    """An :class:`ExecutionRecord` from what the keeper keeps of an execution."""
    meta = handle.meta
    started = parse_rfc3339(meta["started_at"])
    return ExecutionRecord(
        record_dir=Path(meta.get("record_dir") or "."), pid=handle.pid, pid_start=handle.start,
        key=str(meta["key"]), run_id=str(meta.get("run_id", "")),
        session_id=str(meta.get("session_id", "")), started_at=started,
        deadline=after(started, float(meta["timeout_s"])), timeout_s=float(meta["timeout_s"]),
        log_path=Path(meta["log_path"]), input_path=Path(meta["input_path"]),
        argv=tuple(meta["argv"]), log_offset=int(meta.get("log_offset", 0)),
        stdout_path=Path(meta["stdout_path"]), keeper_id=handle.id, ended=handle.exit)


def with_exit(record: ExecutionRecord, handle: Handle) -> ExecutionRecord:
    return dataclasses.replace(record, ended=handle.exit)


def meta_of(spec: ExecutionSpec, started_at: datetime, out_path: Path, log_offset: int
          ) -> dict[str, Any]:
    return {"key": spec.key, "kind": spec.kind, "run_id": spec.run_id,
            "session_id": spec.session_id, "started_at": rfc3339(started_at),
            "timeout_s": float(spec.timeout_s), "log_path": str(spec.log_path),
            "input_path": str(spec.input_path), "stdout_path": str(out_path),
            "argv": list(spec.argv), "log_offset": log_offset,
            "record_dir": str(spec.record_dir) if spec.record_dir is not None else None}


def note_termination(sink: LogSink, handle: Handle, grace: float, timeout_s: float) -> None:
    """In the log: how the keeper ended the agent (its stderr came before)."""
    ended = handle.exit or {}
    by = ended.get("by")
    if not by:
        return
    text = termination_text(str(by), str(ended.get("reason") or ""), timeout_s)
    sink.note(f"{text}: SIGTERM sent to process group {handle.pid}")
    if ended.get("killed"):
        sink.note(f"still running {grace:g}s after SIGTERM: SIGKILL sent")


