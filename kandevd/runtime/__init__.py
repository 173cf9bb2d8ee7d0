"""The agent runtime: the bounded pool that runs agent executions.

``AgentRuntime`` (runtime.py) owns the slots and the worker threads;
``ProcessRunner`` (process.py) runs one execution as a process-group child.
"""

from kandevd.runtime.process import (
    ERROR,
    FAILED,
    INTERRUPTED,
    OUTCOMES,
    STOPPED,
    SUCCEEDED,
    TIMED_OUT,
    ExecutionControl,
    ExecutionResult,
    ExecutionSpec,
    InProcessRunner,
    ProcessRunner,
    Runner,
)
from kandevd.runtime.runtime import (
    AgentRuntime,
    Reservation,
    RuntimeFull,
    RuntimeStopped,
)

__all__ = [
    "ERROR",
    "FAILED",
    "INTERRUPTED",
    "OUTCOMES",
    "STOPPED",
    "SUCCEEDED",
    "TIMED_OUT",
    "AgentRuntime",
    "ExecutionControl",
    "ExecutionResult",
    "ExecutionSpec",
    "InProcessRunner",
    "ProcessRunner",
    "Reservation",
    "Runner",
    "RuntimeFull",
    "RuntimeStopped",
]
