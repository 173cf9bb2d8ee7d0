"""A runtime's executions watched by a test: their results, and the environment children need."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kandevd
from kandevd.runtime import (
    AgentRuntime,
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


@contextmanager
def runtimes(*, verify_clean: bool = False) -> Iterator[Callable[..., AgentRuntime]]:
    """``make(max_concurrent=4, stop_grace_s=5.0, **kwargs)`` -> an AgentRuntime, every one
    stopped (and checked idle) at the end; ``verify_clean`` also checks that none kept a
    live key and that no execution thread is left."""
    made: list[AgentRuntime] = []

    def make(max_concurrent: int = 4, stop_grace_s: float = 5.0, **kwargs: Any) -> AgentRuntime:
        runtime = AgentRuntime(max_concurrent, stop_grace_s, **kwargs)
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.stop()
        assert runtime.active == 0
        if verify_clean:
            assert runtime.live_keys() == frozenset()
    if verify_clean:
        assert not [t for t in threading.enumerate() if t.name.startswith("kandevd-exec-")]
