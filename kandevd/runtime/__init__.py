"""The agent runtime: the bounded pool that runs agent executions.

``AgentRuntime`` (runtime.py) owns the slots and the worker threads;
``ProcessRunner`` (process.py) runs one execution under a shim (shim.py) that
owns the agent's process group and records its exit status; records.py reads
what an execution left on disk, for adopting it after a daemon restart.
"""

from kandevd.runtime.process import (
    DETACHED,
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
from kandevd.runtime.records import ExecutionRecord, read_record, record_alive
from kandevd.runtime.runtime import (
    AgentRuntime,
    Reservation,
    RuntimeFull,
    RuntimeStopped,
)

__all__ = [
    "DETACHED",
    "ERROR",
    "FAILED",
    "INTERRUPTED",
    "OUTCOMES",
    "STOPPED",
    "SUCCEEDED",
    "TIMED_OUT",
    "AgentRuntime",
    "ExecutionControl",
    "ExecutionRecord",
    "ExecutionResult",
    "ExecutionSpec",
    "InProcessRunner",
    "ProcessRunner",
    "Reservation",
    "Runner",
    "RuntimeFull",
    "RuntimeStopped",
    "read_record",
    "record_alive",
]
