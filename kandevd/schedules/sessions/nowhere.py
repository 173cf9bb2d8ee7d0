"""NoGateway: where the turns of a schedule with ``runs_on`` go when this daemon serves no
runners (``gateway.listen`` unset): each turn ends at once with an error that says so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kandevd.runtime import ERROR, ExecutionResult
from kandevd.timeutil import utc_now


class NoGateway:
    """A TurnRuntime that runs nothing (see the module docstring)."""

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels

    def launch_when_free(self, spec: Any, on_done: Callable[[ExecutionResult], None],
                         cancelled: Callable[[], bool]) -> bool:
        now = utc_now()
        on_done(ExecutionResult(
            key=spec.key, outcome=ERROR, exit_code=None, summary=None, cost_cents=None,
            error=f"runs_on {', '.join(self.labels)}: this daemon serves no runners "
                  "(set gateway.listen)", started_at=now, ended_at=now,
            log_path=spec.log_path))
        return True

    def stop_execution(self, key: str, reason: str) -> bool:
        return False

    def detach_execution(self, key: str) -> bool:
        return False

    def settle_ids(self, ids: list[str]) -> None:
        return None
