"""A run of the global queue as a typed value, its statuses, and the errors about runs.

Store, queue, control and CLI all speak of runs in these words; a run crosses
rooms as a :class:`Run`, and becomes the contract's RUN object only at the edge
(:meth:`Run.to_dict`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict

STATUSES = ("queued", "claimed", "finished", "failed", "cancelled")
TERMINAL = frozenset({"finished", "failed", "cancelled"})
#: A key given again within this window answers with the run it was given to.
IDEMPOTENCY_WINDOW_S = 24 * 3600
#: A queued run of the same agent and reason requested this recently absorbs a new request.
COALESCE_WINDOW_S = 5.0

#: The contract's RUN fields, in order, plus ``attempt`` (executions so far).
RUN_FIELDS = (
    "id", "seq", "workspace_id", "agent_id", "task_id", "reason", "payload", "status",
    "idempotency_key", "coalesced_count", "retry_count", "scheduled_retry_at", "requested_at",
    "claimed_at", "finished_at", "error_message", "cancel_reason", "output_summary",
    "cost_cents", "log_path", "attempt",
)


@dataclass(frozen=True, slots=True)
class Run:
    """One row of ``runs`` (timestamps as the RFC 3339 text they are stored as)."""

    id: str
    seq: int
    workspace_id: str
    agent_id: str
    task_id: str | None
    reason: str
    payload: dict[str, Any]
    status: str
    idempotency_key: str | None
    coalesced_count: int
    retry_count: int
    scheduled_retry_at: str | None
    requested_at: str
    claimed_at: str | None
    finished_at: str | None
    error_message: str | None
    cancel_reason: str | None
    output_summary: str | None
    cost_cents: float | None
    log_path: str | None
    attempt: int

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Run:
        """The run a ``runs`` row holds (its payload parsed)."""
        return cls(row["id"], row["seq"], row["workspace_id"], row["agent_id"], row["task_id"],
                   row["reason"], json.loads(row["payload"] or "{}"), row["status"],
                   row["idempotency_key"], row["coalesced_count"], row["retry_count"],
                   row["scheduled_retry_at"], row["requested_at"], row["claimed_at"],
                   row["finished_at"], row["error_message"], row["cancel_reason"],
                   row["output_summary"], _finite(row["cost_cents"]), row["log_path"],
                   row["attempt"])

    def to_dict(self) -> dict[str, Any]:
        """The contract's RUN object (with ``attempt``)."""
        return {name: getattr(self, name) for name in RUN_FIELDS}


@dataclass(frozen=True, slots=True)
class RunPage:
    """One page of ``runs.list``: its runs, how many match in all, where it starts."""

    items: list[Run]
    total: int
    limit: int
    offset: int

    def to_dict(self) -> dict[str, Any]:
        """The contract's page: ``{items: [RUN], total, limit, offset}``."""
        return {"items": [run.to_dict() for run in self.items], "total": self.total,
                "limit": self.limit, "offset": self.offset}


class Explanation(TypedDict):
    """``runs.explain``: whether a run can be claimed now and, if not, what holds it
    (blocker names; ``details`` names the run, agent or time behind each)."""

    eligible: bool
    blockers: list[str]
    details: dict[str, Any]


class EnqueueRequest(TypedDict):
    """One run request of ``runs.enqueue_many``: the keyword arguments of ``enqueue``."""

    workspace_id: str
    agent_id: str
    reason: str
    task_id: str | None
    payload: dict[str, Any]
    idempotency_key: str | None
    coalesce: bool


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    run: Run
    deduplicated: bool = False
    coalesced: bool = False
    #: False when the run's agent was paused as it was queued: no pass could claim it,
    #: so the queue loop is not woken for it (the agent's resume wakes it).
    claimable: bool = True

    @property
    def inserted(self) -> bool:
        return not (self.deduplicated or self.coalesced)

    def to_dict(self) -> dict[str, Any]:
        """``{run, deduplicated, coalesced}``, the answer of ``runs.enqueue``."""
        return {"run": self.run.to_dict(), "deduplicated": self.deduplicated,
                "coalesced": self.coalesced}


@dataclass(frozen=True, slots=True)
class Claim:
    """A claimed run, the token that fences its attempt, and its agent's profile."""

    run: Run
    token: str
    profile: str


@dataclass(frozen=True, slots=True)
class FailedAttempt:
    """What the retry policy is asked about a run whose attempt failed."""

    attempt: int
    retry_count: int
    requested_at: datetime
    now: datetime


@dataclass(frozen=True, slots=True)
class RetryDecision:
    """``action`` is ``retry`` (with ``retry_at``), ``fail`` or ``too_old``."""

    action: str
    retry_at: datetime | None = None
    delay_s: float | None = None


class RunNotFound(LookupError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} does not exist")


class RunReferenceError(ValueError):
    """The run names a workspace or agent that does not exist (or do not match)."""


class RunConflict(RuntimeError):
    """The run is not in a status the request applies to."""


class BatchItemError(RunReferenceError):
    """An item of ``enqueue_many`` that cannot be stored; ``index`` names it."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"runs.{index}.{message}")  # message: "<field>: <why>"
        self.index = index


def gave_up(attempts: int, last: str | None) -> str:
    """The dead letter's ``error_message``."""
    return f"gave up after {attempts} attempts; last: {last or 'unknown'}"


def _finite(cost: float | None) -> float | None:
    """A stored cost as a number JSON can carry: an infinite one (the sum of costs
    an earlier version let through) reads as unknown."""
    return cost if cost is None or math.isfinite(cost) else None
