"""The run model read from its row."""

from __future__ import annotations

import json
import math

from kandevd.runs.model import Run


def row(cost: float | None) -> dict[str, object]:
    return {"id": "run_1", "seq": 1, "workspace_id": "ws", "agent_id": "a", "task_id": None,
            "reason": "r", "payload": "{}", "status": "finished", "idempotency_key": None,
            "coalesced_count": 0, "retry_count": 0, "scheduled_retry_at": None,
            "requested_at": "2026-01-01T00:00:00Z", "claimed_at": None, "finished_at": None,
            "error_message": None, "cancel_reason": None, "output_summary": None,
            "cost_cents": cost, "log_path": None, "attempt": 1}


def test_an_infinite_stored_cost_reads_as_unknown_and_the_run_as_json() -> None:
    """(An earlier version let two huge costs add up to infinity.)"""
    for stored in (math.inf, -math.inf):
        run = Run.from_row(row(stored))
        assert run.cost_cents is None
        json.dumps(run.to_dict(), allow_nan=False)
    assert Run.from_row(row(12.5)).cost_cents == 12.5
    assert Run.from_row(row(None)).cost_cents is None
