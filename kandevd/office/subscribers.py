"""Office assignment subscribers: an Office task that gets a runner is queued.

On ``task.created`` and ``task.updated`` the subscriber looks at the task the
event carries. When it is an Office task (:mod:`kandevd.store.office.predicate`)
in state ``TODO`` with an effective runner, one ``task_assigned`` run is
enqueued for the runner with payload ``{"task_id"}`` and the idempotency key
``task_assigned:<task>:<agent>``. A reassignment to another agent names a
new key, so the new agent is queued; a replayed event dedupes on the key.

A Kanban or custom task with a runner gets nothing: assigning a runner never
makes ordinary work autonomous (an explicit ``queue_run`` action does).

``task.updated`` only counts when the update made the task eligible for its
runner (it was not an Office ``TODO`` task of that runner before): editing
the title of an already assigned task must not queue it again once the 24 h
idempotency window of the first run has passed.

The subscriber runs synchronously in the publisher's thread, after the
model's commit; it only reads the workspace row and enqueues.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kandevd.bus import EventBus
from kandevd.runqueue.service import RunQueue
from kandevd.runs.model import EnqueueResult, RunConflict, RunNotFound, RunReferenceError
from kandevd.store.base import BaseStore
from kandevd.store.office import tasks as sql
from kandevd.store.office.predicate import is_office_task

#: Statuses of an earlier assignment run that do not stand for the work being done.
VOID = frozenset({"cancelled", "failed"})

log = logging.getLogger("kandevd.office.assign")

REASON = "task_assigned"
TOPICS = ("task.created", "task.updated")


def task_assigned_key(task_id: str, agent_id: str, attempt: int = 0) -> str:
    """The idempotency key of a ``task_assigned`` run.

    Attempt 0 is the contract's ``task_assigned:<task>:<agent>``, shared by the
    subscriber and recovery so the two can never both queue the first run.
    Recovery uses attempt ``n`` (the number of earlier ``task_assigned`` runs
    of this task and agent, all failed or cancelled by then) after a failure:
    ``task_assigned:<task>:<agent>:attempt:<n>``. The attempt number is derived
    from persisted rows, so it is the same across ticks and restarts, and it
    never collides with a key still inside the 24 h idempotency window.
    """
    base = f"{REASON}:{task_id}:{agent_id}"
    return base if attempt == 0 else f"{base}:attempt:{attempt}"


def assignment_target(task: Mapping[str, Any], office_workflow_id: str | None) -> str | None:
    """The agent an Office ``TODO`` task should be queued for, or None."""
    runner = task.get("runner")
    if not runner or task.get("state") != "TODO":
        return None
    return runner if is_office_task(task, office_workflow_id) else None


class AssignmentSubscriber:
    """Queues ``task_assigned`` runs for Office tasks; subscribe with :meth:`attach`."""

    def __init__(self, store: BaseStore, queue: RunQueue) -> None:
        self.store = store
        self.queue = queue

    def attach(self, bus: EventBus) -> None:
        for topic in TOPICS:
            bus.subscribe(topic, self.on_task_event)

    def _office_workflow_id(self, workspace_id: str) -> str | None:
        return sql.office_workflow_id(self.store, workspace_id)

    def on_task_event(self, topic: str, event: Mapping[str, Any]) -> None:
        task = event.get("task")
        if not isinstance(task, Mapping) or not task.get("runner") \
                or task.get("state") != "TODO":
            return  # cheap exits first: no query for tasks that cannot qualify
        office_workflow_id = self._office_workflow_id(task["workspace_id"])
        agent = assignment_target(task, office_workflow_id)
        if agent is None:
            return
        previous = event.get("previous")
        before = (assignment_target(previous, office_workflow_id)
                  if topic == "task.updated" and isinstance(previous, Mapping) else None)
        if before == agent:
            return  # it was already assigned to this agent; nothing new happened
        self.enqueue(task, agent)
        if before is not None:
            self.withdraw(task["id"], before)

    def _enqueue(self, task: Mapping[str, Any], agent: str, *, attempt: int) -> EnqueueResult:
        return self.queue.enqueue(
            workspace_id=task["workspace_id"], agent_id=agent, reason=REASON,
            task_id=task["id"], payload={"task_id": task["id"]},
            idempotency_key=task_assigned_key(task["id"], agent, attempt))

    def withdraw(self, task_id: str, agent: str) -> None:
        """A reassigned task: the old runner's assignment run that has not started is void.

        Only ``queued`` runs are cancelled (reason ``reassigned``); one already
        claimed is work in progress and is left to finish.
        """
        for run_id in sql.queued_assignment_runs(self.store, task_id, agent, REASON):
            try:
                self.queue.cancel(run_id, "reassigned", only_queued=True)
            except (RunConflict, RunNotFound):
                continue  # claimed or finished meanwhile: nothing to withdraw
            log.info("task %s reassigned: %s run %s of %s cancelled", task_id, REASON,
                     run_id, agent)

    def enqueue(self, task: Mapping[str, Any], agent: str) -> None:
        try:
            result = self._enqueue(task, agent, attempt=0)
            if result.deduplicated and result.run.status in VOID:
                # Assigned to this agent before, and that run was withdrawn or failed: a new
                # assignment is new work (the same attempt-numbered key recovery uses).
                attempt = sql.assignment_runs(self.store, task["id"], agent, REASON)
                result = self._enqueue(task, agent, attempt=attempt)
        except RunReferenceError as exc:
            log.warning("task %s: cannot queue %s for %s: %s", task["id"], REASON, agent, exc)
            return
        if result.inserted:
            log.info("task %s assigned to %s: %s run %s queued", task["id"], agent, REASON,
                     result.run.id)
        else:
            log.debug("task %s assigned to %s: run %s already exists", task["id"], agent,
                      result.run.id)
