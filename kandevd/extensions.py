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
    from kandevd.control.methods import daemon, runs, workspace

    return [daemon, runs, workspace]


def build_loops(daemon: Daemon) -> dict[str, Loop]:
    """Loops started after the queue loop, in start order."""
    return {}
