"""Which queued run a new request merges into: the queue's coalescing rules.

Pure, and handed to the store (``RunRepository(coalescing=...)``), which only
finds the candidate and writes the merge. The contract's rules: a run of the
same agent and reason, still queued and requested less than
``COALESCE_WINDOW_S`` ago, absorbs the new request; for ``task_assigned`` only
a run of the same task; a comment event (a key starting ``task_comment:``) must
each be seen, so it never merges, in either direction.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coalescing:
    #: Keys of requests that are never merged, nor absorb another.
    unmerged_key_prefix: str = "task_comment:"
    #: Reasons whose runs merge only with a run of the same task.
    per_task_reasons: frozenset[str] = frozenset({"task_assigned"})

    def may_merge(self, key: str | None) -> bool:
        """A request (or a queued run) with ``key`` may take part in a merge."""
        return not (key or "").startswith(self.unmerged_key_prefix)

    def per_task(self, reason: str) -> bool:
        """Runs of ``reason`` merge only within one task."""
        return reason in self.per_task_reasons


RULES = Coalescing()
"""The contract's rules (CONTRACT, ``runs.enqueue``)."""
