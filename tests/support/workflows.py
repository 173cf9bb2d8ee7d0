"""Writing workflow folders for tests: real files under a real workflow root."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.support.daemon import FAST_CONFIG


def write_workflow(root: Path, name: str, schedules: list[dict[str, Any]], *,
                   groups: Iterable[str] | dict[str, bool] = ("g1",),
                   **manifest: Any) -> Path:
    """``<root>/Workflow/<name>/`` with workflow.json and variables/variables.json."""
    folder = root / "Workflow" / name
    (folder / "variables").mkdir(parents=True, exist_ok=True)
    enabled = groups if isinstance(groups, dict) else dict.fromkeys(groups, True)
    (folder / "variables" / "variables.json").write_text(json.dumps({
        "variables": [{"name": "topic"}],
        "groups": [{"group_id": g, "display_name": g.upper(), "values": {"topic": g},
                    "enabled": on} for g, on in enabled.items()]}))
    (folder / "workflow.json").write_text(json.dumps({**manifest, "schedules": schedules},
                                                     indent=2))
    return folder


def schedule(schedule_id: str = "daily", cron: str = "0 9 * * *", **fields: Any
             ) -> dict[str, Any]:
    return {"id": schedule_id, "cron_expression": cron, "group_ids": ["g1"], **fields}


def history(folder: Path) -> list[dict[str, Any]]:
    path = folder / "schedule-runs.json"
    return json.loads(path.read_text()) if path.exists() else []


RECORDER = str(Path(__file__).resolve().parent / "agents" / "recorder.py")


def recorder_config(record: Path, **runtime: Any) -> dict[str, Any]:
    return {**FAST_CONFIG,
            "runtime": {**FAST_CONFIG["runtime"], **runtime},
            "agents": {"default": {"command": [sys.executable, RECORDER],
                                   "env": {"RECORD_FILE": str(record)}}}}


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]
