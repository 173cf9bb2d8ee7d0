"""A runtime's executions watched by a test: their results, and the environment children need."""

from __future__ import annotations

import threading
from pathlib import Path

import kandevd
from kandevd.runtime import (
    ExecutionResult,
)

REPO_ROOT = str(Path(kandevd.__file__).resolve().parent.parent)


CHILD_ENV = {"PYTHONPATH": REPO_ROOT}


WAIT_S = 15.0  # generous upper bound for any single event; tests end far sooner


class Recorder:
    """Collects on_done results and lets a test wait for one key."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.results: dict[str, ExecutionResult] = {}
        self.order: list[str] = []
        self.threads: dict[str, str] = {}

    def __call__(self, result: ExecutionResult) -> None:
        with self._cond:
            self.results[result.key] = result
            self.order.append(f"done:{result.key}")
            self.threads[result.key] = threading.current_thread().name
            self._cond.notify_all()

    def wait(self, key: str) -> ExecutionResult:
        with self._cond:
            assert self._cond.wait_for(lambda: key in self.results, WAIT_S), f"{key} never ended"
            return self.results[key]
