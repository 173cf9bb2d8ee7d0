"""How an agent profile becomes an execution: one place for every source.

Queued runs, Kanban launches (and later scheduled turns) all execute an agent
the same way (docs/agents.md): the profile's argv (the built-in echo
agent when it has none), its timeout and extra environment, a working folder
``<home>/runs/<key>/`` and a log ``<home>/logs/runs/<key>.log``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kandevd.agents import echo_argv
from kandevd.config import AgentProfile
from kandevd.paths import HomeLayout
from kandevd.runtime.execution import ExecutionSpec

ECHO_AGENT = echo_argv()


def agent_execution(profile: AgentProfile, layout: HomeLayout, *, kind: str, key: str,
                    stdin: Mapping[str, Any], session_id: str, run_id: str = "",
                    cwd: Path | None = None, log_path: Path | None = None,
                    record_dir: Path | None = None, attempt: int = 0) -> ExecutionSpec:
    """The ExecutionSpec that runs ``profile`` for one run, launch or turn.

    Runs and launches work in ``<home>/runs/<key>/``; a workflow turn passes its
    run folder as ``cwd`` and its session's log as ``log_path``. A queued run
    passes its attempt's folder as ``record_dir`` (where the shim records the
    agent's process and exit status, see :mod:`kandevd.runtime.attempts`).
    """
    return ExecutionSpec(
        key=key, kind=kind,
        argv=tuple(profile.command) if profile.command else ECHO_AGENT,
        stdin=stdin, cwd=cwd if cwd is not None else layout.runs / key,
        log_path=log_path if log_path is not None else layout.run_logs / f"{key}.log",
        timeout_s=profile.timeout_s, env=dict(profile.env), session_id=session_id,
        run_id=run_id, home=str(layout.root), record_dir=record_dir, attempt=attempt,
    )
