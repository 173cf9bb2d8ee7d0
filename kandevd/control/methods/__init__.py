"""Control methods, one module per area; each exposes ``register(registry, services)``."""

from __future__ import annotations

from types import ModuleType

from kandevd.control.methods import (
    daemon,
    events,
    office,
    runners,
    runs,
    scheduler,
    workspace,
)

#: Every method module, in registration order.
MODULES: tuple[ModuleType, ...] = (daemon, runs, workspace, office, scheduler, runners,
                                   events)
