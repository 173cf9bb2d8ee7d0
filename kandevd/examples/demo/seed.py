"""Seed the demo home: a workspace, two agents, a custom workflow with a queue_run step,
an Office workflow, tasks, and a few runs. Safe to run twice (existing objects are kept).
(The file-backed workflow `daily-digest` needs no seeding: `kandevd init --example demo`
copies kandevd/examples/demo/workspace/ into the home, and the daemon loads it at start.)

    python kandevd/examples/demo/seed.py --home demo-home
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kandevd.control.client import Client, DaemonUnavailable, RpcCallError
from kandevd.paths import HomeLayout, resolve_home


def connect(socket: Path, timeout: float = 30.0) -> Client:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(socket)
        except DaemonUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # the daemon is still starting


def ensure(client: Client, method: str, params: dict) -> dict | None:
    try:
        return client.call(method, params)
    except RpcCallError as exc:
        if exc.kind == "conflict":
            return None  # already seeded
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", default=None)
    args = parser.parse_args()
    socket = HomeLayout(resolve_home(args.home)).socket
    with connect(socket) as c:
        ensure(c, "workspaces.create", {"id": "demo", "name": "Demo workspace"})
        ensure(c, "agents.create", {"id": "writer", "workspace_id": "demo", "name": "Writer"})
        ensure(c, "agents.create", {"id": "reviewer", "workspace_id": "demo", "name": "Reviewer",
                                    "cooldown_s": 2})
        ensure(c, "workflows.create", {
            "id": "pipeline", "workspace_id": "demo", "name": "Write and review",
            "style": "custom",
            "steps": [
                {"id": "draft", "name": "Draft", "agent_id": "writer",
                 "on_enter": [{"action": "queue_run", "reason": "draft",
                               "payload": {"sleep_s": 1, "summary": "drafted"}}]},
                {"id": "review", "name": "Review", "agent_id": "reviewer",
                 "on_enter": [{"action": "queue_run", "reason": "review"}]},
            ]})
        ensure(c, "workflows.create", {
            "id": "office", "workspace_id": "demo", "name": "Office", "style": "office",
            "steps": [{"id": "todo", "name": "To do", "agent_id": "writer"}]})
        ensure(c, "workspaces.update", {"id": "demo", "office_workflow_id": "office"})
        if ensure(c, "tasks.create", {"id": "t-essay", "workspace_id": "demo",
                                      "workflow_id": "pipeline", "title": "Write an essay"}):
            c.call("tasks.move", {"id": "t-essay", "step_id": "draft"})
        ensure(c, "tasks.create", {"id": "t-inbox", "workspace_id": "demo",
                                   "workflow_id": "office", "title": "Triage the inbox"})
        for n in range(3):
            c.call("runs.enqueue", {"workspace_id": "demo", "agent_id": "reviewer",
                                    "reason": "demo", "payload": {"n": n}, "coalesce": False,
                                    "idempotency_key": f"demo-seed-{n}"})
        runs = c.call("runs.list", {})
    print(f"seeded the demo workspace; {runs['total']} run(s) in the queue history")
    return 0


if __name__ == "__main__":
    sys.exit(main())
