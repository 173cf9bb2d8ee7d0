"""Shared fixtures: real daemons on temp homes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from tests.support.daemon import FAST_CONFIG, DaemonProcess
from tests.support.stores import (  # noqa: F401 (fixtures)
    backend,
    empty_pg_url,
    pg_base,
    pg_url,
    store_location,
)

# ``scripts/test`` (and so CI) runs the property tests on a fixed set of examples
# (KANDEVD_HYPOTHESIS=ci): a suite is green or red for the code, not for the draw.
# Plain ``pytest`` explores new examples at every run.
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("KANDEVD_HYPOTHESIS", "default"))



@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """``make(config=None, home=None, env=None, start=True)`` -> a DaemonProcess.

    Every daemon made is killed at teardown if a test left it running.
    """
    made: list[DaemonProcess] = []

    def make(config: dict[str, Any] | None = None, *, home: Path | None = None,
             env: dict[str, str] | None = None, start: bool = True,
             args: list[str] | None = None) -> DaemonProcess:
        daemon = DaemonProcess(home or tmp_path / "home", config if config is not None
                               else FAST_CONFIG, env=env, args=args)
        made.append(daemon)
        if start:
            daemon.start()
        return daemon

    yield make
    for daemon in made:
        daemon.cleanup()
