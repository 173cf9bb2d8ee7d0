"""``/runs``: the queue's runs filtered and paged, one run (its attempts, why it waits,
its log followed live), cancel and retry, and the dead letter."""

from __future__ import annotations

import re
from typing import Any

from kandevd.control.protocol import RpcError
from kandevd.web.context import Console, set_flash
from kandevd.web.http import Request, Response, redirect
from kandevd.web.logs import readable_log
from kandevd.web.views.schedules import _int

PAGE = 50
STATUSES = ("queued", "claimed", "finished", "failed", "cancelled")
FILTERS = ("status", "agent_id", "workspace_id", "reason")
_ATTEMPT = re.compile(r"^\[kandevd\] ==== attempt (?P<n>\d+) (?P<what>started|ended) "
                      r"(?P<at>\S+?)(?:: (?P<outcome>.*?))? ====$", re.M)


def index(console: Console, request: Request) -> Response:
    params: dict[str, Any] = {"order": "desc", "limit": PAGE,
                              "offset": _int(request.query.get("offset"))}
    for key in FILTERS:
        value = request.query.get(key, "").strip()
        if value and (key != "status" or value in STATUSES):
            params[key] = value
    page = console.call("runs.list", params)
    return console.render("runs.html", request, title="Runs", nav="runs", page=page,
                          filters={k: request.query.get(k, "") for k in FILTERS},
                          statuses=STATUSES, limit=PAGE)


def dead(console: Console, request: Request) -> Response:
    offset = _int(request.query.get("offset"))
    page = console.call("runs.list", {"status": "failed", "order": "desc", "limit": PAGE,
                                      "offset": offset})
    return console.render("dead.html", request, title="Dead letter", nav="dead", page=page,
                          limit=PAGE)


def retry_selected(console: Console, request: Request) -> Response:
    chosen = [r for r in request.form_lists().get("run", []) if r][:500]
    retried, problems = [], []
    for run_id in chosen:
        try:
            console.call("runs.retry", {"id": run_id})
            retried.append(run_id)
        except RpcError as exc:
            problems.append(f"{run_id}: {exc.message}")
    if not chosen:
        return set_flash(console, redirect("/runs/dead"), "error", "No run selected")
    message = f"Retried {len(retried)} run(s)"
    if problems:
        message += "; not retried: " + "; ".join(problems[:5])
    return set_flash(console, redirect("/runs/dead"), "error" if problems else "ok", message)


def run(console: Console, request: Request, run: str) -> Response:
    found = console.call("runs.get", {"id": run})
    explanation = console.call("runs.explain", {"id": run})
    log = readable_log(console, found.get("log_path"))
    return console.render("run.html", request, title=f"Run {run}", nav="runs", run=found,
                          reasons=explain_in_words(explanation),
                          attempts=attempts_of(log["text"]), log=log)


def act(console: Console, request: Request, run: str, action: str) -> Response:
    result = console.call(f"runs.{action}", {"id": run})
    message = f"Cancelled run {run}" if action == "cancel" else \
        f"Queued run {run} again (status {result.get('status')})"
    return set_flash(console, redirect(f"/runs/{run}"), "ok", message)


def attempts_of(log_text: str) -> list[dict[str, Any]]:
    """The attempts the log frames (``==== attempt N started/ended ... ====``)."""
    attempts: dict[int, dict[str, Any]] = {}
    order: list[int] = []
    for match in _ATTEMPT.finditer(log_text):
        number = int(match["n"])
        if match["what"] == "started":
            attempts[number] = {"number": number, "started_at": match["at"],
                                "ended_at": None, "outcome": None}
            if number not in order:
                order.append(number)
        elif number in attempts:
            attempts[number].update(ended_at=match["at"], outcome=match["outcome"])
    return [attempts[n] for n in order]


def explain_in_words(explanation: dict[str, Any]) -> list[str]:
    """``runs.explain`` as sentences."""
    if explanation.get("eligible"):
        return ["eligible: it is claimed on the next pass of the queue"]
    details = explanation.get("details") or {}
    words = []
    for blocker in explanation.get("blockers") or []:
        detail = details.get(blocker)
        if blocker.startswith("status_"):
            words.append(f"{blocker[len('status_'):]}: not waiting in the queue")
        elif blocker == "agent_paused":
            words.append("waiting: its agent is paused")
        elif blocker == "agent_busy":
            words.append(f"waiting: agent busy with run {detail}" if detail
                         else "waiting: agent busy with another run")
        elif blocker == "cooldown_until":
            words.append(f"cooling down until {detail}")
        elif blocker == "retry_at":
            words.append(f"retry scheduled at {detail}")
        elif blocker == "queued_behind":
            words.append(f"waiting: queued behind run {detail} of the same agent")
        elif blocker == "runtime_full":
            words.append("waiting: every agent slot is in use")
        elif blocker == "budget_exceeded":
            words.append(f"waiting: budget exceeded ({detail})")
        else:
            words.append(f"{blocker}" + (f" ({detail})" if detail else ""))
    return words
