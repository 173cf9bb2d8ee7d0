"""The file-backed scheduler assembled (part of the composition root): its registry
of both kinds of job, the session runner, the cron loop and the restart repair of
scheduled turns, each given what it uses."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.config import Config
from kandevd.formats.jsonfile import CorruptFiles
from kandevd.lifecycle import FanOut, StopSignal
from kandevd.paths import HomeLayout
from kandevd.runtime import AgentRuntime
from kandevd.schedules.firing import Firing
from kandevd.schedules.history import PendingWrites
from kandevd.schedules.jobs import JobTable
from kandevd.schedules.loop import CronLoop
from kandevd.schedules.products.source import ProductSource
from kandevd.schedules.registry import JobRegistry
from kandevd.schedules.restart.repair import TurnRestart
from kandevd.schedules.restart.stranded import StrandedTurns
from kandevd.schedules.sessions.runner import SessionRunner
from kandevd.schedules.sessions.session import TurnRuntime
from kandevd.schedules.settings import Switches, scheduler_root
from kandevd.schedules.source import SourceParts
from kandevd.schedules.workflows.source import WorkflowSource
from kandevd.timeutil import utc_now


def build_registry(root: Path, switches: Switches, retention_days: float,
                   backlog: PendingWrites | None = None,
                   stranded: StrandedTurns | None = None) -> JobRegistry:
    """The registry of ``root``'s jobs, of both kinds (not loaded yet); ``stranded``:
    where the load at start notes the runs a dead daemon left running."""
    table, corrupt = JobTable(("workflows", "products")), CorruptFiles()
    parts = SourceParts(root=root, retention_days=retention_days,
                        backlog=backlog if backlog is not None else PendingWrites(),
                        table=table,
                        stranded=stranded if stranded is not None else StrandedTurns(),
                        on_corrupt=corrupt)
    return JobRegistry(root, switches=switches, table=table, backlog=parts.backlog,
                       corrupt=corrupt,
                       sources={"workflows": WorkflowSource(parts),
                                "products": ProductSource(parts)})


@dataclass(frozen=True)
class Scheduler:
    """The file-backed scheduler's parts the daemon drives: the cron loop, and what a
    dead daemon's sessions left, repaired at start."""

    loop: CronLoop
    restart: TurnRestart


def build_scheduler(config: Config, layout: HomeLayout, runtime: AgentRuntime, *,
                    parent: StopSignal | None = None,
                    fire_gate: Callable[[str, datetime], bool] | None = None,
                    remote_turns: Callable[[tuple[str, ...], str], TurnRuntime] | None = None,
                    runners_online: Callable[[], tuple[frozenset[str], ...]] | None = None,
                    publish: Callable[[str, Mapping[str, Any]], None] | None = None
                    ) -> Scheduler:
    """The cron loop over the home's workflow root, its jobs loaded (histories a dead
    daemon left ``running`` are closed here, before anything can start a session);
    ``remote_turns``: where the turns of schedules with ``runs_on`` go (the gateway's);
    ``runners_online()``: the label sets of the runners online (a job's state);
    ``publish``: the daemon's bus (fires, sessions, pauses)."""
    # The loop's wake-up: set when a failed history write is kept, or a session's
    # deadline is new.
    wakeup = threading.Event()
    stranded = StrandedTurns()
    switches = Switches.from_config(config.scheduler)
    if switches.unknown_env_switch is not None:
        logging.getLogger("kandevd.scheduler").warning(
            "cron execution is off: %s; set it to one of them", switches.disabled_reason)
    registry = build_registry(scheduler_root(config, layout.root), switches,
                              config.scheduler.history_retention_days,
                              PendingWrites(wake=wakeup.set), stranded)
    registry.load_at_start(utc_now())

    fanout = FanOut("cron", logging.getLogger("kandevd.scheduler"))  # its session threads
    firing = Firing(registry)
    runner = SessionRunner(registry, config=config, layout=layout, runtime=runtime,
                           spawn=fanout.spawn, firing=firing, wake=wakeup.set,
                           remote_turns=remote_turns, publish=publish)
    restart = TurnRestart(stranded, registry, runner, runtime, str(layout.root),
                          shared=fire_gate is not None)
    # The turns not adopted are settled on the loop's first tick: after the start stopped
    # their agents, once the keeper has had the moment to tell their exits.
    loop = CronLoop(registry, runner=runner, firing=firing,
                    stop_grace_s=config.runtime.stop_grace_s, parent=parent,
                    fire_gate=fire_gate, wakeup=wakeup, fanout=fanout,
                    runners_online=runners_online, first_tick=restart.settle)
    return Scheduler(loop=loop, restart=restart)
