"""Group commit: attempt outcomes recorded at the same moment share one transaction.

With ``synchronous=FULL`` every commit waits for an fsync, and with several
agents finishing at once their outcome writes would queue up behind each
other's fsync. :class:`GroupCommit` lets them ride one commit instead, with
no timer and no extra thread (the leader/follower habit of database logs)::

    worker A  submit(op_a) -> takes the commit lock -> BEGIN; op_a; COMMIT (fsync) ...
    worker B  submit(op_b) -> waits for the lock          |
    worker C  submit(op_c) -> waits for the lock          v
    worker B  gets the lock -> BEGIN; op_b; op_c; COMMIT (one fsync for both)
    worker C  gets the lock -> its op is done already: returns its result

Every caller returns only after its own write is committed (durable), with
its own result or exception. A lone caller pays nothing extra. If a batch
fails as a whole, each of its operations is retried in its own transaction,
so one bad operation never takes the others down with it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kandevd.store.base import BaseStore

log = logging.getLogger("kandevd.queue.commit")

T = TypeVar("T")


class _Op:
    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None


class GroupCommit:
    """Runs write operations on ``store``, batching those submitted concurrently."""

    def __init__(self, store: BaseStore) -> None:
        self.store = store
        self._pending_lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self._pending: list[_Op] = []
        self.commits = 0
        self.operations = 0

    @property
    def pending(self) -> int:
        """Operations waiting for the commit in progress (they will share the next one)."""
        with self._pending_lock:
            return len(self._pending)

    def submit(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (which uses ``store.transaction()``) inside a shared commit.

        Returns ``fn``'s result once the transaction holding it has committed;
        raises what ``fn`` raised (or what the commit raised).
        """
        op = _Op(fn)
        with self._pending_lock:
            self._pending.append(op)
        with self._commit_lock:
            if not op.done:  # nobody took it into their batch: lead one now
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                self._commit(batch)
        if op.error is not None:
            raise op.error
        return op.result  # type: ignore[no-any-return]

    def _commit(self, batch: list[_Op]) -> None:
        try:
            with self.store.transaction():
                for op in batch:
                    op.result = op.fn()
            self.commits += 1
        except Exception as exc:
            if len(batch) == 1:
                batch[0].error = exc
            else:
                log.warning("a commit of %d outcomes failed (%s); applying them one by one",
                            len(batch), exc)
                for op in batch:
                    op.result = None
                    try:
                        with self.store.transaction():
                            op.result = op.fn()
                        self.commits += 1
                    except Exception as one:
                        op.error = one
        except BaseException as exc:  # KeyboardInterrupt and friends: nothing was committed
            for op in batch:
                op.error = exc
            raise
        finally:
            self.operations += len(batch)
            for op in batch:
                op.done = True
