"""A test agent that records what it was given: one JSON line per execution.

Appends ``{"stdin": ..., "cwd": ..., "env": {...}, "start": t, "end": t}`` to the
file named by ``$RECORD_FILE`` when it exits. The message decides the rest:
``FAILONCE`` in it exits 1 the first time only, any other ``FAIL`` exits 1,
``SLEEP`` sleeps until SIGTERM (at most 60 s), ``HOLD`` says so on stdout and
stderr, creates ``$RECORD_FILE.held`` and waits for ``$RECORD_FILE.release``
(or SIGTERM, at most 60 s), ``EVAL`` adds an ``evaluation`` to the summary line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main() -> int:
    start = time.time()
    request = json.loads(sys.stdin.read())
    message = request.get("message", "")
    code = 1 if "FAIL" in message else 0
    if "FAILONCE" in message:
        marker = os.environ["RECORD_FILE"] + ".failed-once"
        code = 0 if os.path.exists(marker) else 1
        open(marker, "a").close()
    terminated = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal terminated
        terminated = True

    signal.signal(signal.SIGTERM, on_term)
    if "SLEEP" in message:
        deadline = time.time() + 60
        while not terminated and time.time() < deadline:
            time.sleep(0.02)
    if "HOLD" in message:
        print("holding until released", flush=True)
        print("waiting for the release file", file=sys.stderr, flush=True)
        record_file = os.environ["RECORD_FILE"]
        open(record_file + ".held", "a").close()
        deadline = time.time() + 60
        while not terminated and time.time() < deadline \
                and not os.path.exists(record_file + ".release"):
            time.sleep(0.02)
    record = {"stdin": request, "cwd": os.getcwd(), "start": start, "end": time.time(),
              "terminated": terminated,
              "env": {k: v for k, v in os.environ.items() if k.startswith("KANDEVD_")}}
    with open(os.environ["RECORD_FILE"], "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
    report = {"summary": f"did {message[:20]}", "cost_cents": 3}
    if "EVAL" in message:
        report["evaluation"] = {"score": 0.9, "verdict": "good"}
    print(json.dumps(report))
    return 143 if terminated else code


if __name__ == "__main__":
    sys.exit(main())
