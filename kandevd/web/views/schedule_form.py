"""Create and edit a workflow schedule: presets for the timing, a live preview, errors
shown beside their field.

Saving is ``scheduler.jobs.create`` / ``scheduler.jobs.update`` (the manifest's
validation, the file rewritten as the CLI does); the preview is the
``scheduler.jobs.next`` dry run. The variable groups offered are those of the
workflow's ``variables/variables.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kandevd.control.protocol import RpcError
from kandevd.web.context import Console, set_flash
from kandevd.web.http import Request, Response, redirect
from kandevd.web.views.schedules import job_url

#: Form fields, in the order of the page; the errors of the method are placed by them.
FIELDS = ("workflow", "id", "name", "description", "cron_expression", "timezone",
          "group_ids", "messages", "enabled", "overlap_policy", "timeout_s", "jitter_s",
          "pause_after_failures", "catchup_window_s")
NUMBERS = {"timeout_s": float, "jitter_s": float, "pause_after_failures": int,
           "catchup_window_s": float}
OVERLAP = ("skip", "buffer_one", "replace")


def workflows(root: Path) -> list[str]:
    folder = root / "Workflow"
    try:
        return sorted(p.name for p in folder.iterdir() if (p / "workflow.json").is_file())
    except OSError:
        return []


def groups_of(root: Path, workflow: str) -> list[dict[str, Any]]:
    """The workflow's variable groups (id, name, enabled); [] when unreadable."""
    if not workflow or "/" in workflow or workflow.startswith("."):
        return []
    path = root / "Workflow" / workflow / "variables" / "variables.json"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    found = []
    for group in document.get("groups") or [] if isinstance(document, dict) else []:
        if isinstance(group, dict) and isinstance(group.get("group_id"), str):
            found.append({"id": group["group_id"],
                          "name": str(group.get("display_name") or group["group_id"]),
                          "enabled": group.get("enabled", True) is not False})
    return found


def new(console: Console, request: Request) -> Response:
    names = workflows(console.workflow_root)
    chosen = request.query.get("workflow") or (names[0] if names else "")
    values = {"workflow": chosen, "timezone": "UTC", "cron_expression": "0 9 * * *",
              "enabled": True, "overlap_policy": "skip", "group_ids": [], "messages": ""}
    return _form(console, request, values, {}, editing=None)


def edit(console: Console, request: Request, job: str) -> Response:
    params: dict[str, Any] = {"id": job}
    found = console.call("scheduler.jobs.get", params)
    if found.get("entity_type") != "workflow":
        return console.render("error.html", request, http_status=400, title="Not editable",
                              message="Product schedules are edited in product.yaml.")
    values = {key: found.get(key) for key in FIELDS}
    values["id"] = found["schedule_id"]
    values["messages"] = "\n".join(found.get("messages") or [])
    return _form(console, request, values, {}, editing=found)


def _form(console: Console, request: Request, values: dict[str, Any],
          errors: dict[str, list[str]], *, editing: dict[str, Any] | None,
          status: int = 200) -> Response:
    workflow = str(values.get("workflow") or "")
    return console.render(
        "schedule_form.html", request, http_status=status,
        title=f"Edit {editing['id']}" if editing else "New schedule", nav="schedules",
        values=values, errors=errors, editing=editing, overlap=OVERLAP,
        workflows=workflows(console.workflow_root),
        groups=groups_of(console.workflow_root, workflow), job_url=job_url)


def schedule_from(form: dict[str, list[str]], *, editing: bool) -> dict[str, Any]:
    """The schedule object the form describes (only what it sets)."""
    first = {k: v[0] for k, v in form.items() if v}
    schedule: dict[str, Any] = {}
    if not editing:
        schedule["id"] = first.get("id", "").strip()
    for key in ("name", "description"):
        if first.get(key, "").strip() or editing:  # (editing: a cleared field is cleared)
            schedule[key] = first.get(key, "").strip()
    schedule["cron_expression"] = first.get("cron_expression", "").strip()
    schedule["timezone"] = first.get("timezone", "").strip() or "UTC"
    schedule["group_ids"] = [g for g in form.get("group_ids", []) if g]
    messages = [m.strip() for m in first.get("messages", "").splitlines() if m.strip()]
    if messages:
        schedule["messages"] = messages
    schedule["enabled"] = first.get("enabled") == "on"
    if first.get("overlap_policy") in OVERLAP:
        schedule["overlap_policy"] = first["overlap_policy"]
    for key, kind in NUMBERS.items():
        raw = first.get(key, "").strip()
        if raw:
            try:
                number = kind(raw)
            except ValueError:
                schedule[key] = raw  # the method's validation names it
                continue
            # (a whole number typed is sent whole: a problem quotes it as typed, 0 not 0.0)
            schedule[key] = int(number) if isinstance(number, float) and number.is_integer() \
                and "." not in raw and "e" not in raw.lower() else number
    return schedule


def create(console: Console, request: Request) -> Response:
    form = request.form_lists()
    workflow = (form.get("workflow") or [""])[0]
    schedule = schedule_from(form, editing=False)
    try:
        job = console.call("scheduler.jobs.create", {"workflow": workflow,
                                                     "schedule": schedule})
    except RpcError as exc:
        return _form(console, request, _values(form, workflow), place_errors(exc.message),
                     editing=None, status=400)
    return set_flash(console, redirect(job_url(job)), "ok",
                     f"Created {job['id']} in {workflow}/workflow.json")


def update(console: Console, request: Request, job: str) -> Response:
    found = console.call("scheduler.jobs.get", {"id": job})
    form = request.form_lists()
    # Only what the form changes: a field it showed as it was (a default included, which
    # the file may not hold) is left as the file has it.
    schedule = {key: value for key, value in schedule_from(form, editing=True).items()
                if not _same(value, found.get(key))}
    if not schedule:
        return set_flash(console, redirect(job_url(found)), "ok",
                         f"No change to {found['id']}")
    try:
        changed = console.call("scheduler.jobs.update", {"id": job, "schedule": schedule})
    except RpcError as exc:
        values = _values(form, found.get("workflow") or "")
        values["id"] = found["schedule_id"]
        return _form(console, request, values, place_errors(exc.message), editing=found,
                     status=400)
    return set_flash(console, redirect(job_url(changed)), "ok", f"Saved {changed['id']}")


def _same(value: Any, current: Any) -> bool:
    """Does the form's ``value`` say what the job already has (``0`` and ``0.0`` alike)?"""
    numbers = (int, float)
    if isinstance(value, numbers) and isinstance(current, numbers) \
            and not isinstance(value, bool) and not isinstance(current, bool):
        return float(value) == float(current)
    return bool(value == current)


def _values(form: dict[str, list[str]], workflow: str) -> dict[str, Any]:
    first = {k: v[0] for k, v in form.items() if v}
    values: dict[str, Any] = {key: first.get(key, "") for key in FIELDS}
    values["workflow"] = workflow
    values["group_ids"] = form.get("group_ids", [])
    values["enabled"] = first.get("enabled") == "on"
    return values


_FIELD_AT = re.compile(r"(?:params\.schedule\.|schedule '[^']*': |^)(?P<field>[a-z_]+)"
                       r"(?:\[\d+\])?: ")
#: What names where a problem is, before the problem itself (said beside the field).
_PREFIX = re.compile(r"^(?:workflow '[^']*': )?(?:schedule '[^']*': )?(?:params\.schedule\.|"
                     r"params\.)?")
#: Where one problem ends and the next begins (a problem may contain "; " itself).
_PROBLEMS = re.compile(r"; (?=workflow '|schedule '|params\.|[a-z_]+(?:\[\d+\])?: )")
_CRON = re.compile(r"^'(?P<expr>.*)' is not a valid 5-field cron expression: (?P<why>.*)$",
                   re.S)
_FIELDS_COUNT = re.compile(r"Wrong number of fields; got (?P<n>\d+), expected 5")
_CRON_FIELD = re.compile(r"^(?P<name>[a-z-]+) field (?P<value>'[^']*'): (?P<detail>.*)$", re.S)


#: A number's problem as JSON Schema says it, and as the form says it.
_NUMBER_WORDS = (
    (re.compile(r"^(?P<v>\S+) is less than or equal to the minimum of (?P<n>\S+)$"),
     "{v} is too small: it must be more than {n}"),
    (re.compile(r"^(?P<v>\S+) is less than the minimum of (?P<n>\S+)$"),
     "{v} is too small: it must be at least {n}"),
    (re.compile(r"^(?P<v>\S+) is greater than or equal to the maximum of (?P<n>\S+)$"),
     "{v} is too large: it must be less than {n}"),
    (re.compile(r"^(?P<v>\S+) is greater than the maximum of (?P<n>\S+)$"),
     "{v} is too large: it must be at most {n}"),
    (re.compile(r"^(?P<v>.+) is not of type 'integer'$"), "{v} is not a whole number"),
    (re.compile(r"^(?P<v>.+) is not of type 'number'$"), "{v} is not a number"),
)


def _number_in_words(text: str) -> str:
    for pattern, words in _NUMBER_WORDS:
        found = pattern.match(text)
        if found is not None:
            return words.format(**found.groupdict())
    return text


def plain_problem(problem: str, field: str | None) -> str:
    """A method's problem as a sentence for a person: without the names of where it is
    (the workflow, the schedule, ``params.``), and without the field's name when it is
    shown beside that field; a cron expression's problem in words."""
    text = _PREFIX.sub("", problem, count=1)
    if field and field != "_":
        text = re.sub(rf"^{re.escape(field)}(?:\[\d+\])?: ", "", text, count=1)
    cron = _CRON.match(text)
    if cron is None:
        text = _number_in_words(text)
        return text[:1].upper() + text[1:]
    why = cron["why"]
    counted = _FIELDS_COUNT.search(why)
    part = _CRON_FIELD.match(why)
    if counted:
        why = (f"it has {counted['n']} field(s); a cron expression has 5 (minute, hour, "
               "day of month, month, day of week), or is one of @hourly, @daily, "
               "@weekly, @monthly, @yearly")
    elif part:
        why = f"in its {part['name'].replace('-', ' ')} field ({part['value']}), " \
              f"{part['detail']}"
    return f"'{cron['expr']}' is not a valid cron expression: {why}"


def place_errors(message: str) -> dict[str, list[str]]:
    """The method's problems by the form field they concern (``_`` for the rest), each
    said once, in words."""
    placed: dict[str, list[str]] = {}
    for problem in _PROBLEMS.split(message):
        text = problem.split(": ", 1)[-1] if problem.startswith("workflow '") else problem
        match = _FIELD_AT.search(text)
        field = match.group("field") if match else "_"
        if " already has a schedule " in problem:  # (the id is taken: said by the id)
            field = "id"
        if field == "params":
            field = "_"
        if field not in FIELDS:
            field = "_"
        said = plain_problem(problem, field)
        if said not in placed.get(field, []):
            placed.setdefault(field, []).append(said)
    return placed


def preview(console: Console, request: Request) -> Response:
    """The next fires of an expression as it is typed (the ``jobs.next`` dry run)."""
    cron = request.query.get("cron_expression", "").strip()
    zone = request.query.get("timezone", "").strip() or "UTC"
    times: list[dict[str, str]] = []
    error = None
    if cron:
        try:
            times = console.call("scheduler.jobs.next", {
                "schedule": {"cron_expression": cron, "timezone": zone},
                "count": 5})["times"]
        except RpcError as exc:
            error = "; ".join(p for said in place_errors(exc.message).values() for p in said)
    return console.fragment("preview.html", times=times, error=error, cron=cron)
