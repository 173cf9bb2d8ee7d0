"""The agent runtime: the bounded pool every agent execution goes through.

execution.py (the spec, the result, the control, the runner interface),
pool.py (``AgentRuntime``: slots, workers, stop), process.py (``ProcessRunner``:
one execution under a shim), output.py (the log, the stdout merge),
inprocess.py (the test double), attempts.py (the attempt folder's one owner),
records.py (what an execution left on disk), shim.py, orphans.py, specs.py.
"""

from kandevd.runtime.execution import (
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
    Runner,
)
from kandevd.runtime.inprocess import InProcessRunner
from kandevd.runtime.pool import AgentRuntime, Reservation, RuntimeFull, RuntimeStopped
from kandevd.runtime.process import ProcessRunner
from kandevd.runtime.records import ExecutionRecord, read_record, record_alive

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
