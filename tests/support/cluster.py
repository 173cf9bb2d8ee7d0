"""Several real daemons on one PostgreSQL database: a member's config, the log its probe
agent keeps (tests/support/agents/serial_probe.py, partition_probe.py), and waiting."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

AGENTS = Path(__file__).resolve().parent / "agents"


def cluster_config(url: str, probe_file: Path, *, probe: str = "serial_probe.py",
                   heartbeat_s: float = 0.5, dead_after_s: float = 3,
                   safety_interval_s: float = 5, stop_grace_s: float = 5,
                   timeout_s: float = 60, **overrides: dict[str, Any]) -> dict[str, Any]:
    """A member's config on ``url``: its default agent is ``probe`` (a script in
    tests/support/agents) logging to ``probe_file``; each of ``overrides`` is merged into
    its section."""
    config: dict[str, Any] = {
        "store": {"url": url},
        "cluster": {"heartbeat_s": heartbeat_s, "dead_after_s": dead_after_s},
        "queue": {"safety_interval_s": safety_interval_s},
        "runtime": {"max_concurrent": 2, "stop_grace_s": stop_grace_s},
        "office": {"interval_s": 1},
        "agents": {"default": {"command": [sys.executable, str(AGENTS / probe)],
                               "timeout_s": timeout_s,
                               "env": {"PROBE_FILE": str(probe_file)}}},
    }
    for key, value in overrides.items():
        config[key] = {**config.get(key, {}), **value}
    return config


def probe_log(path: Path) -> list[dict[str, Any]]:
    """The lines a probe agent wrote, in order ([] before the first)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """``predicate()``'s first truthy value, polled every 50 ms for ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
