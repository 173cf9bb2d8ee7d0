"""Restart repair of scheduled turns, in one place.

What a dead daemon's sessions left is repaired in three steps whose order
matters, all here: while the root loads, its runs left ``running`` are marked
interrupted and noted (:meth:`StrandedTurns.mark
<kandevd.schedules.restart.stranded.StrandedTurns.mark>`, called by each source
as it reads a history); then :meth:`TurnRestart.adopt` (called by the daemon's
start) takes the turns whose agents still run, before the daemon stops the agents
it does not keep; then, on the cron loop's first tick (the keeper has told those
others' exits by then), :meth:`TurnRestart.settle` records every other turn's real
end. With several daemons on one store, the
entries may be another daemon's: only the runs whose turns left a record in this
home are settled (the others' next write puts them right).
"""

from __future__ import annotations

import logging

from kandevd.runtime import AgentRuntime
from kandevd.schedules.registry import JobRegistry
from kandevd.schedules.restart.adopted import adopt_turns
from kandevd.schedules.restart.stranded import StrandedTurns
from kandevd.schedules.sessions.runner import SessionRunner

log = logging.getLogger("kandevd.scheduler")


class TurnRestart:
    """The adoption and settling of what the runs a dead daemon left (noted in
    ``stranded`` while loading) still hold; built by the composition root."""

    def __init__(self, stranded: StrandedTurns, registry: JobRegistry,
                 runner: SessionRunner, runtime: AgentRuntime, home: str, *,
                 shared: bool) -> None:
        """``shared``: several daemons on one store (the entries may be another's)."""
        self._stranded = stranded
        self._registry = registry
        self._runner = runner
        self._runtime = runtime
        self._home = home
        self._shared = shared

    def adopt(self) -> frozenset[int]:
        """Adopt every live turn of the runs marked at start; the adopted agents' pids
        (which the daemon's sweep of orphan agents must leave alone)."""
        return adopt_turns(self._stranded, self._registry, self._runner, self._runtime,
                           self._home)

    def settle(self) -> int:
        """Record the real end of every turn not adopted (after the orphan agents were
        stopped, so their exits are written); how many turns had files left."""
        runner = self._runner
        if self._shared:  # several daemons: the runs marked may be others'; its records
            self._stranded.keep_this_homes(runner.turns_folder)  # are this home's runs
        return self._stranded.settle(
            runner.turns_folder, live=runner.is_live_turn,
            ended=lambda item, entry: runner.settled(str(item.job_key), entry, item.history),
            release=runner.settle_turns)
