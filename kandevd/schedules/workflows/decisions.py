"""``Workflow/<name>/decisions.json``: questions a user answered for the workflow.

``[{id, question, answer, status: open|answered|applied, applied_at?, applied_session_id?}]``

A scheduled session first runs a *preflight* turn with the ``answered``
decisions; when it succeeds they become ``applied`` (with the time and the
session), so the next session does not apply them again.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, TypedDict

from kandevd.formats.jsonfile import CorruptReporter, JsonFile
from kandevd.timeutil import rfc3339

DECISIONS = "decisions.json"
ANSWERED, APPLIED = "answered", "applied"


class Decision(TypedDict, total=False):
    """One question a user answered (or has yet to) for the workflow."""

    id: Any
    question: str
    answer: Any
    status: str
    applied_at: str
    applied_session_id: str


class Decisions:
    def __init__(self, folder: Path, *, on_corrupt: CorruptReporter | None = None) -> None:
        self.file = JsonFile(folder / DECISIONS, on_corrupt=on_corrupt)

    def answered(self) -> list[Decision]:
        """The decisions waiting to be applied (status ``answered``)."""
        if not self.file.path.exists():
            return []
        return [d for d in self.file.read([], expect=list)
                if isinstance(d, dict) and d.get("status") == ANSWERED]

    def mark_applied(self, ids: list[Any], session_id: str, now: datetime) -> None:
        """The preflight that carried ``ids`` succeeded: they are ``applied`` now."""
        wanted = set(map(repr, ids))

        def apply(decisions: list[Any]) -> list[Any]:
            for decision in decisions:
                if isinstance(decision, dict) and decision.get("status") == ANSWERED \
                        and repr(decision.get("id")) in wanted:
                    decision["status"] = APPLIED
                    decision["applied_at"] = rfc3339(now)
                    decision["applied_session_id"] = session_id
            return decisions
        self.file.update(apply, [], expect=list)
