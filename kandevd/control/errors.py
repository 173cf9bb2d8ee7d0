"""The domain's errors in the protocol's words, in one table.

A method lets the domain's exceptions through and the registry (every handler
it holds) maps them here, so a ``JobNotFound`` is ``not_found`` from every method that
can raise it. A method still catches an error itself where it adds what only
it knows (the parameter's path, the job's id).
"""

from __future__ import annotations

from collections.abc import Callable

from kandevd.control.protocol import (
    AlreadyRunning,
    Conflict,
    InvalidParams,
    NotFound,
    NotRunning,
    Refused,
    RpcError,
    ShuttingDown,
)
from kandevd.cron import CronError
from kandevd.gateway.directory import RunnerNotFound
from kandevd.model.errors import ConflictError, InvalidReference, LaunchRefused, NotFoundError
from kandevd.runs.model import BatchItemError, RunConflict, RunNotFound, RunReferenceError
from kandevd.runtime.pool import RuntimeStopped
from kandevd.schedules.catchup.backfill import BackfillRunning, RangeTooLarge
from kandevd.schedules.jobs import AmbiguousJob, JobNotFound, UserNeeded
from kandevd.schedules.sessions import runner as sessions
from kandevd.schedules.workflows.manifest import ManifestError, ManifestUnusable
from kandevd.schedules.workflows.source import DuplicateSchedule, ScheduleGone, WorkflowMissing
from kandevd.store.runners import RunnerExists

Translate = Callable[[Exception], RpcError]


def _batch_item(exc: Exception) -> RpcError:
    assert isinstance(exc, BatchItemError)
    return InvalidParams(f"params.{exc}", data={"index": exc.index})


#: The first row whose class the exception is an instance of decides (subclasses first).
DOMAIN_ERRORS: tuple[tuple[type[Exception], Translate], ...] = (
    # The queue's runs.
    (RunNotFound, lambda exc: NotFound(str(exc))),
    (RunConflict, lambda exc: Conflict(str(exc))),
    (BatchItemError, _batch_item),
    (RunReferenceError, lambda exc: InvalidParams(f"params.{exc}")),  # (its field first)
    # The runners on other machines.
    (RunnerNotFound, lambda exc: NotFound(str(exc))),
    (RunnerExists, lambda exc: Conflict(str(exc))),
    # The workspace model.
    (NotFoundError, lambda exc: NotFound(str(exc))),
    (ConflictError, lambda exc: Conflict(str(exc))),
    (InvalidReference, lambda exc: InvalidParams(str(exc))),
    (LaunchRefused, lambda exc: Refused(str(exc))),
    (RuntimeStopped, lambda exc: ShuttingDown(str(exc))),
    # The scheduler's jobs, manifests and sessions.
    (UserNeeded, lambda exc: InvalidParams(f"params.user_id: {exc}")),
    (JobNotFound, lambda exc: NotFound(str(exc))),
    (AmbiguousJob, lambda exc: InvalidParams(str(exc))),
    (WorkflowMissing, lambda exc: NotFound(str(exc))),
    (ScheduleGone, lambda exc: NotFound(str(exc))),
    (DuplicateSchedule, lambda exc: Conflict(str(exc))),
    (ManifestUnusable, lambda exc: Conflict(str(exc))),
    (ManifestError, lambda exc: InvalidParams(str(exc))),
    (sessions.AlreadyRunning, lambda exc: AlreadyRunning(str(exc))),
    (sessions.NotRunning, lambda exc: NotRunning(str(exc))),
    (sessions.RunnerClosed, lambda exc: ShuttingDown(str(exc))),
    (RangeTooLarge, lambda exc: InvalidParams(
        f"params.to: the range from params.from {str(exc).removeprefix('the range ')}")),
    (BackfillRunning, lambda exc: Conflict(str(exc))),
    (CronError, lambda exc: InvalidParams(str(exc))),
)


def domain_error(exc: Exception) -> RpcError | None:
    """``exc`` as the protocol's error, or None if it is not one of the domain's."""
    for kind, translate in DOMAIN_ERRORS:
        if isinstance(exc, kind):
            return translate(exc)
    return None
