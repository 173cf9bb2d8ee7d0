#!/usr/bin/env python3
"""A complete kandevd agent in Python (see docs/agents.md).

Reads the request from stdin, refuses empty or broken input, stops cleanly on
SIGTERM (a cancel, a timeout or a shutdown), writes progress to stderr (the
log) and reports its summary and cost as the last line of stdout.

Use it from kandevd.yaml:

    agents:
      default:
        command: ["python3", "/path/to/examples/agents/agent.py"]
        timeout_s: 600
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

stopping = False


def on_sigterm(_signum: int, _frame: object) -> None:
    global stopping
    stopping = True


def main() -> int:
    signal.signal(signal.SIGTERM, on_sigterm)
    raw = sys.stdin.read()
    try:
        request = json.loads(raw)
    except ValueError:
        print("agent: stdin is empty or not JSON; refusing to guess", file=sys.stderr)
        return 2
    if not isinstance(request, dict):
        print("agent: stdin is not a JSON object", file=sys.stderr)
        return 2
    kind = request.get("kind")
    what = request.get("run_id") or request.get("session_id")
    print(f"agent: {kind} {what} in {os.getcwd()}", file=sys.stderr)
    payload = request.get("payload") or {}
    steps = int(payload.get("steps", 3)) if isinstance(payload, dict) else 3
    for step in range(steps):  # the real work (model calls, edits) goes here
        if stopping:
            print(f"agent: stopped at step {step}", file=sys.stderr)
            return 143
        print(f"agent: step {step + 1}/{steps}", file=sys.stderr, flush=True)
        time.sleep(0.1)
    print(json.dumps({"summary": f"did {steps} steps for {kind} {what}", "cost_cents": 0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
