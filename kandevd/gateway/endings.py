"""What a runner sends back, checked: an execution's end and its output's offsets.

Shared by the queued runs (:mod:`kandevd.gateway.remote`) and the scheduled turns
(:mod:`kandevd.gateway.turns`) that runners execute.
"""

from __future__ import annotations

import math
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from kandevd.gateway.protocol import Ending
from kandevd.runtime import DETACHED, ERROR, OUTCOMES, ExecutionResult
from kandevd.timeutil import parse_rfc3339, utc_now


class UnknownExecution(LookupError):
    """No execution of that id is this runner's (never, or no longer)."""


class LogGap(ValueError):
    """A log chunk that starts past what was received: resend from ``received``."""

    def __init__(self, received: int) -> None:
        super().__init__(f"the chunk starts past the {received} bytes received")
        self.received = received


class Receiving(Protocol):
    """What :func:`append_from` keeps per execution."""

    received: int
    lock: threading.Lock


def ending_result(key: str, log_path: Path, ending: Ending) -> ExecutionResult:
    """An execution's end as its runner reported it, every field checked (an unknown
    outcome is an error, a bad number or time is left out)."""
    now = utc_now()
    outcome = ending.get("outcome")
    outcome = outcome if isinstance(outcome, str) and outcome in OUTCOMES \
        and outcome != DETACHED else ERROR
    code, evaluation = ending.get("exit_code"), ending.get("evaluation")
    started = _time(ending.get("started_at"), now)
    return ExecutionResult(
        key=key, outcome=outcome,
        exit_code=code if isinstance(code, int) and not isinstance(code, bool)
        and -(2 ** 31) <= code < 2 ** 31 else None,
        summary=_text(ending.get("summary")), cost_cents=_cost(ending.get("cost_cents")),
        error=_text(ending.get("error")), started_at=started,
        ended_at=max(started, _time(ending.get("ended_at"), now)),
        log_path=log_path, evaluation=evaluation if isinstance(evaluation, dict) else None)


def append_from(path: Path, holder: Receiving, offset: int, data: bytes) -> int:
    """Append ``data`` (the runner's bytes from ``offset``) to ``path``, skipping what
    ``holder.received`` says arrived already (-1: unknown, take the offset); how much
    has arrived. LogGap when ``offset`` is past it."""
    with holder.lock:
        if holder.received < 0:
            holder.received = offset
        if offset > holder.received:
            raise LogGap(holder.received)
        fresh = data[holder.received - offset:]
        if fresh:
            with path.open("ab") as handle:
                handle.write(fresh)
            holder.received += len(fresh)
        return int(holder.received)


def _cost(value: Any) -> float | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        cost = float(value)
    except OverflowError:
        return None
    return cost if math.isfinite(cost) and cost >= 0 else None


def _text(value: Any) -> str | None:
    return value[:4000] if isinstance(value, str) else None


def _time(value: Any, default: datetime) -> datetime:
    try:
        return parse_rfc3339(value) if isinstance(value, str) else default
    except (ValueError, OverflowError):
        return default
