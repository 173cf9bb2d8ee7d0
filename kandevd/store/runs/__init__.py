"""The runs repository: the persisted global queue, one room per job.

Every state change of a run happens inside a transaction here, so the rows
are always the truth and memory may be lost at any moment. The parts:
enqueue.py (intake, keys, coalescing), claims.py, outcomes.py, recovery.py
(rescue and restart), admin.py (cancel, retry), reads.py; what differs per
database is in sql_sqlite.py and sql_postgres.py, and nowhere else. Policy is
the caller's: the retry decision is passed in with each failed attempt, the
Office budget gate at construction.
"""

from __future__ import annotations

from kandevd.runs.coalescing import RULES, Coalescing
from kandevd.runs.retry import GiveUp, attempt_limit
from kandevd.store.base import BaseStore
from kandevd.store.runs.admin import Admin
from kandevd.store.runs.base import ClaimGate, RunSql
from kandevd.store.runs.claims import Claims
from kandevd.store.runs.enqueue import Enqueue
from kandevd.store.runs.outcomes import Outcomes
from kandevd.store.runs.reads import Reads
from kandevd.store.runs.recovery import Recovery
from kandevd.store.runs.sql_postgres import PostgresRuns
from kandevd.store.runs.sql_sqlite import SqliteRuns

_DIALECTS: dict[str, type[RunSql]] = {"sqlite": SqliteRuns, "postgresql": PostgresRuns}


class RunRepository(Enqueue, Claims, Outcomes, Recovery, Admin, Reads):
    """The runs table's rules on either store.

    ``claim_gate_probe``: a query of one boolean, false whenever ``claim_gate``
    blocks no agent (the gate's own cheap first look). On PostgreSQL a claim
    sends it inside the statement that locks the agents to claim for, so the
    gate costs no round trip of its own while it has nothing to block.
    """

    def __init__(self, store: BaseStore, boot_id: str, *, give_up: GiveUp | None = None,
                 coalescing: Coalescing = RULES,
                 claim_gate: ClaimGate | None = None, claim_gate_probe: str | None = None,
                 peers_dead_after_s: float | None = None) -> None:
        self.store = store
        self.sql = _DIALECTS[store.dialect]()
        self.boot_id = boot_id
        self.give_up = give_up or attempt_limit(6)  # queue.max_attempts' default
        self.coalescing = coalescing
        self.claim_gate = claim_gate
        self.claim_gate_probe = claim_gate_probe if claim_gate is not None else None
        self.peers_dead_after_s = peers_dead_after_s
        self.held_peers: tuple[str, ...] = ()

    def hold_peers(self, boot_ids: tuple[str, ...]) -> None:
        """Earlier daemons of this home that joined with this one: their claims are this
        daemon's to restore (until :meth:`release_peers`)."""
        self.held_peers = boot_ids

    def release_peers(self) -> None:
        self.held_peers = ()
