"""Which control-method modules and loops the daemon assembles.

A capability plugs in here with one line: its method module in
:func:`method_modules`, its loop in :func:`build_loops`.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from kandevd.lifecycle import Loop

if TYPE_CHECKING:
    from kandevd.daemon import Daemon


def method_modules() -> list[ModuleType]:
    from kandevd.control.methods import daemon, office, runs, scheduler, workspace

    return [daemon, runs, workspace, office, scheduler]


def build_loops(daemon: Daemon) -> dict[str, Loop]:
    """Loops started after the queue loop, in start order."""
    loops: dict[str, Loop] = {}
    if daemon.config.office.enabled:
        # office.enabled false: no assignment subscribers and no Office loop at all.
        from kandevd.office.loop import OfficeLoop
        from kandevd.office.subscribers import AssignmentSubscriber

        AssignmentSubscriber(daemon.store, daemon.queue).attach(daemon.bus)
        cluster = daemon.cluster
        loops["office"] = OfficeLoop(daemon.store, daemon.queue, daemon.bus, daemon.config.office,
                                     leader=cluster.is_leader if cluster else None,
                                     parent=daemon.stop_signal)
    from kandevd.scheduler.build import build_cron_loop

    loops["cron"] = build_cron_loop(daemon.config, daemon.layout, daemon.runtime,
                                    parent=daemon.stop_signal,
                                    fire_gate=daemon.cluster.fire_gate if daemon.cluster else None)
    return loops
