"""The file-backed scheduler assembled (part of the composition root): its registry
of both kinds of job, the session runner and the cron loop, each given what it uses."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from kandevd.config import Config
from kandevd.lifecycle import FanOut, StopSignal
from kandevd.paths import HomeLayout
from kandevd.runtime import AgentRuntime
from kandevd.schedules.firing import Firing
from kandevd.schedules.history import PendingWrites
from kandevd.schedules.loop import CronLoop
from kandevd.schedules.products.source import ProductSource
from kandevd.schedules.registry import JobRegistry
from kandevd.schedules.sessions.runner import SessionRunner
from kandevd.schedules.settings import Switches, scheduler_root
from kandevd.schedules.source import JobSource
from kandevd.schedules.workflows.source import WorkflowSource
from kandevd.timeutil import utc_now


def build_registry(root: Path, switches: Switches, retention_days: float,
                   backlog: PendingWrites | None = None) -> JobRegistry:
    """The registry of ``root``'s jobs, of both kinds (not loaded yet)."""
    def sources(registry: JobRegistry) -> dict[str, JobSource]:
        return {"workflows": WorkflowSource(registry, retention_days=retention_days,
                                            on_corrupt=registry.report_corrupt),
                "products": ProductSource(registry, retention_days=retention_days,
                                          on_corrupt=registry.report_corrupt)}

    return JobRegistry(root, switches=switches, sources=sources, backlog=backlog)


def build_cron_loop(config: Config, layout: HomeLayout, runtime: AgentRuntime, *,
                    parent: StopSignal | None = None,
                    fire_gate: Callable[[str, datetime], bool] | None = None) -> CronLoop:
    """The cron loop over the home's workflow root, its jobs loaded (histories a dead
    daemon left ``running`` are closed here, before anything can start a session)."""
    # The loop's wake-up: set when a failed history write is kept, or a session's
    # deadline is new.
    wakeup = threading.Event()
    registry = build_registry(scheduler_root(config, layout.root),
                              Switches.from_config(config.scheduler),
                              config.scheduler.history_retention_days,
                              PendingWrites(wake=wakeup.set))
    registry.load_at_start(utc_now())

    fanout = FanOut("cron", logging.getLogger("kandevd.scheduler"))  # its session threads
    firing = Firing(registry)
    runner = SessionRunner(registry, config=config, layout=layout, runtime=runtime,
                           spawn=fanout.spawn, firing=firing, wake=wakeup.set)
    return CronLoop(registry, runner=runner, firing=firing,
                    stop_grace_s=config.runtime.stop_grace_s, parent=parent,
                    fire_gate=fire_gate, wakeup=wakeup, fanout=fanout)
