"""Unstarted-task recovery: Office ``TODO`` tasks whose assignment run never happened.

The assignment subscriber queues a task's first ``task_assigned`` run at the
moment of assignment, but events live in memory: a crash between the task's
commit and the enqueue, a task inserted by another process, or a run that
failed for good all leave an Office task nobody works on. Each Office tick
this handler finds such tasks and queues exactly one ``task_assigned`` run
each, at most :data:`MAX_PER_TICK` per tick.

A task qualifies when it is an Office task (the predicate, in SQL), its state
is ``TODO``, it has an effective runner, it was created within
``office.recovery_lookback_hours``, and

* no run *for that task* is ``queued``, ``claimed`` or ``finished``;
* its latest run (highest ``seq`` among the task's runs, any reason) is not a
  *user cancel*. Recovery never undoes ``runs.cancel``: the task stays as it
  is until someone acts on it (reassigns it, retries the run, ...). A
  cancelled run is a user cancel unless its ``cancel_reason`` is one the
  daemon itself writes: ``reassigned`` (the subscriber withdrew the old
  runner's run: void, the task still needs its run) or ``run_too_old`` (the
  retry policy gave up on the run's age: a failure, like ``failed``). Any
  other reason - the default ``cancelled``, free text, or none recorded - is
  a user's. Only the latest run counts: work queued after a cancel (a new
  assignment, say) supersedes it;
* fewer than :data:`MAX_CHAINS_PER_TASK` ``task_assigned`` runs of the task
  (for any agent, whoever queued them) were requested within the lookback
  window, not counting ``reassigned`` withdrawals. A task whose runs always
  fail thus gets at most that many attempt chains (each with its own
  retries) instead of a fresh one every few hours for the whole window; a
  run retried with ``runs.retry`` is the same chain (the same row).

Both run rules are part of the scan's SQL (:data:`RECOVERABLE_SQL`), so
exhausted or user-cancelled tasks never fill the :data:`CANDIDATES` of a
scan and starve the tasks behind them, and they are checked again inside
the enqueue's transaction. An exhausted task is therefore silent: the run
that uses the last chain is logged at INFO when it is queued ("chain 3 of 3"),
nothing is logged per tick afterwards.

Failed, ``run_too_old`` or withdrawn runs do not block: recovery then uses
the next attempt's idempotency key
(:func:`kandevd.office.subscribers.task_assigned_key`), because the key of a
failed run inside the 24 h window would otherwise dedupe forever.

Gate: the handler only scans when Office adoption exists
(:func:`kandevd.store.office.predicate.office_adopted`); otherwise a tick costs one
tiny existence query and touches no ``tasks`` row.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from kandevd.office.subscribers import REASON, task_assigned_key
from kandevd.runqueue.service import RunQueue
from kandevd.runs.model import RunReferenceError
from kandevd.store.base import BaseStore
from kandevd.store.office import tasks as sql
from kandevd.store.office.predicate import office_adopted
from kandevd.timeutil import rfc3339

from . import HandlerResult

log = logging.getLogger("kandevd.office.recovery")

MAX_PER_TICK = 5
#: candidates read per scan; more than MAX_PER_TICK so a task that cannot be
#: queued (its runner was moved to another workspace) does not starve the rest
CANDIDATES = MAX_PER_TICK * 4

#: ``task_assigned`` runs recovery lets a task have within the lookback window
MAX_CHAINS_PER_TASK = 3


class UnstartedTaskRecovery:
    name = "recovery"

    def __init__(self, store: BaseStore, queue: RunQueue, *, lookback_hours: float,
                 max_per_tick: int = MAX_PER_TICK,
                 max_chains: int = MAX_CHAINS_PER_TASK) -> None:
        self.store = store
        self.queue = queue
        self.lookback = timedelta(hours=lookback_hours)
        self.max_per_tick = max_per_tick
        self.max_chains = max_chains

    def active(self) -> bool:
        with self.store.connection() as conn:
            return office_adopted(conn)

    def tick(self, now: datetime) -> HandlerResult:
        if not self.active():
            return HandlerResult(scanned=False)
        cutoff = rfc3339(now - self.lookback)
        candidates = sql.recoverable_tasks(self.store, REASON, cutoff, self.max_chains,
                                           CANDIDATES)
        queued = 0
        for row in candidates:
            if queued >= self.max_per_tick:
                break
            if self._recover(row["id"], row["workspace_id"], row["runner"], cutoff):
                queued += 1
        return HandlerResult(scanned=True, acted=queued)

    def _recover(self, task_id: str, workspace_id: str, agent: str, cutoff: str) -> bool:
        """Queue the task's next ``task_assigned`` run; False when none was inserted.

        The re-check (the scan's run rules, for this task) and the enqueue
        share one transaction, so a subscriber enqueueing for the same task,
        or a user cancelling its run, at the same moment cannot be overruled.
        """
        try:
            with self.store.transaction() as conn:
                chains = sql.chains_if_recoverable(conn, task_id, REASON, cutoff,
                                                   self.max_chains)
                if chains is None:
                    log.debug("recovery: task %s no longer qualifies", task_id)
                    return False
                chain = chains + 1
                attempt = sql.assignment_runs(conn, task_id, agent, REASON)
                result = self.queue.enqueue(
                    workspace_id=workspace_id, agent_id=agent, reason=REASON, task_id=task_id,
                    payload={"task_id": task_id},
                    idempotency_key=task_assigned_key(task_id, agent, attempt))
        except RunReferenceError as exc:
            log.warning("recovery: task %s cannot be queued for %s: %s", task_id, agent, exc)
            return False
        if not result.inserted:
            log.debug("recovery: task %s: run %s already covers attempt %d", task_id,
                      result.run.id, attempt)
            return False
        last = "; no further recovery for it" if chain >= self.max_chains else ""
        log.info("recovered unstarted Office task %s: %s run %s queued for %s (attempt %d,"
                 " chain %d of %d%s)", task_id, REASON, result.run.id, agent, attempt,
                 chain, self.max_chains, last)
        return True
