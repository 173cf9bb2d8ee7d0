"""Writing workflow folders for tests: real files under a real workflow root."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


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
