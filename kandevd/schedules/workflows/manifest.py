"""Workflow manifests: ``Workflow/<name>/workflow.json`` and its ``variables.json``.

Reading turns a workflow folder into a :class:`Workflow` (its schedules validated
and normalized) or into :class:`Problem` s, one per thing wrong, each naming the
file, the schedule and the field. A workflow with any problem loads no schedule:
a half-understood manifest must not run unattended.

Writing (:func:`edit_schedules`) changes only the ``schedules`` list; every other
key of the file (capabilities, ownership, execution defaults, ``pending_upgrades``)
is kept exactly as it was. It happens atomically under the file's lock, and never
over a file that does not parse.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from kandevd.cron import CronError, CronSchedule, parse_cron, parse_timezone
from kandevd.formats.jsonfile import JsonFile, JsonFileError
from kandevd.formats.schemacheck import validation_problems
from kandevd.schedules.rules.options import (
    NO_OPTIONS,
    OPTION_FIELDS,
    ScheduleOptions,
    option_problems,
    parse_options,
    with_options,
)
from kandevd.suggest import did_you_mean

WORKFLOW_DIR = "Workflow"
MANIFEST = "workflow.json"
VARIABLES = Path("variables") / "variables.json"
DEFAULT_PROFILE = "default"

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

SCHEDULE_FIELDS = ("id", "name", "description", "cron_expression", "timezone", "enabled",
                   "trigger_payload", "group_ids", "mode", "messages", "workshop_mode", "pulse",
                   "overlap_policy", *OPTION_FIELDS)
MODE_ALIASES = {"workflow": "workshop"}
WORKSHOP_MODE_ALIASES = {"runner": "run"}


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a file, as ``validate`` prints it: ``path: message``."""

    path: str
    message: str
    #: Whose file: ``workflow``, ``product``, ``users`` (users.yaml) or ``state``.
    kind: str = "workflow"

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message, "kind": self.kind}


class ManifestError(ValueError):
    """A schedule or manifest that cannot be used; the message says where and why."""


class ManifestUnusable(ManifestError):
    """The manifest itself is missing or does not parse: kandevd will not rewrite it."""


@dataclass(frozen=True)
class Schedule:
    """One validated, normalized schedule of a workflow."""

    id: str
    cron_expression: str
    timezone: str
    group_ids: tuple[str, ...]
    name: str = ""
    description: str = ""
    enabled: bool = True
    trigger_payload: Mapping[str, Any] = field(default_factory=dict)
    mode: str = "workshop"
    messages: tuple[str, ...] = ()
    workshop_mode: str = "run"
    pulse: bool = False
    overlap_policy: str = "skip"
    options: ScheduleOptions = NO_OPTIONS

    @property
    def trigger(self) -> CronSchedule:
        return _trigger(self.cron_expression, self.timezone)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "description": self.description,
                "cron_expression": self.cron_expression, "timezone": self.timezone,
                "enabled": self.enabled, "group_ids": list(self.group_ids), "mode": self.mode,
                "messages": list(self.messages), "workshop_mode": self.workshop_mode,
                "trigger_payload": self.trigger_payload,  # read-only here: it is encoded
                "overlap_policy": self.overlap_policy, "pulse": self.pulse,
                **self.options.as_dict()}


@dataclass(frozen=True)
class Workflow:
    """A workflow folder whose manifest loaded without a problem."""

    name: str
    folder: Path
    manifest_id: str
    label: str
    agent_profile: str
    pending_upgrades: bool
    schedules: tuple[Schedule, ...]
    enabled_groups: frozenset[str]

    @cached_property
    def aliases(self) -> frozenset[str]:
        """Names an allow/block list entry may use: folder, manifest id, label (lowercase)."""
        return frozenset(n.lower() for n in (self.name, self.manifest_id, self.label) if n)


# -- schemas --------------------------------------------------------------------------

@cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    text = resources.files("kandevd.schemas").joinpath(f"{name}.json").read_text("utf-8")
    schema = json.loads(text)
    return jsonschema.Draft202012Validator(with_options(schema) if name == "schedule"
                                           else schema)


@cache
def _trigger(cron_expression: str, timezone: str) -> CronSchedule:
    return parse_cron(cron_expression, timezone)


def _schema_problems(name: str, document: Any, prefix: str = "") -> list[str]:
    return validation_problems(_validator(name), document, prefix, noun="field")


# -- names ----------------------------------------------------------------------------

def check_workflow_name(name: str) -> str:
    """A workflow name is a folder name: letters, digits, '.', '_', '-'; never '..'."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or set(name) == {"."}:
        raise ManifestError(
            f"workflow name {name!r} is not allowed: use letters, digits, '.', '_' and '-' "
            "(at most 128 characters, not '.' or '..', no path separators)")
    return name


def workflow_root(root: Path) -> Path:
    return root / WORKFLOW_DIR


def workflow_folder(root: Path, name: str) -> Path:
    return workflow_root(root) / check_workflow_name(name)


def manifest_file(folder: Path) -> JsonFile:
    return JsonFile(folder / MANIFEST)


# -- schedules ------------------------------------------------------------------------

def parse_schedule(raw: Any, groups: Mapping[str, bool] | None, *, index: int | None = None
                   ) -> Schedule:
    """Validate and normalize one schedule; ManifestError lists every problem at once.

    ``groups`` None: the workflow's groups are unknown (variables.json has a
    problem of its own), so ``group_ids`` is not checked against them.
    """
    where = f"schedules[{index}]" if index is not None else "schedule"
    if isinstance(raw, Mapping) and isinstance(raw.get("id"), str) and raw.get("id"):
        where = f"schedule {raw['id']!r}"
    problems = _schema_problems("schedule", raw)
    if isinstance(raw, Mapping):
        problems += _timing_problems(raw) + option_problems(raw)
        if groups is not None:
            problems += _group_problems(raw.get("group_ids"), groups)
    if problems:
        raise ManifestError("; ".join(f"{where}: {p}" for p in problems))
    return Schedule(
        id=raw["id"], cron_expression=" ".join(raw["cron_expression"].split()),
        timezone=raw.get("timezone", "UTC"), group_ids=tuple(raw["group_ids"]),
        name=raw.get("name", ""),
        description=raw.get("description", ""), enabled=raw.get("enabled", True),
        trigger_payload=raw.get("trigger_payload", {}),
        mode=MODE_ALIASES.get(raw.get("mode", "workshop"), raw.get("mode", "workshop")),
        messages=tuple(raw.get("messages", ())),
        workshop_mode=WORKSHOP_MODE_ALIASES.get(raw.get("workshop_mode", "run"),
                                                raw.get("workshop_mode", "run")),
        pulse=raw.get("pulse", False), overlap_policy=raw.get("overlap_policy", "skip"),
        options=parse_options(raw),
    )


def _timing_problems(raw: Mapping[str, Any]) -> list[str]:
    """The time zone and the cron expression, each checked when it is a string."""
    timezone = raw.get("timezone", "UTC")
    if not isinstance(timezone, str):
        return []
    try:
        parse_timezone(timezone)
    except CronError as exc:
        return [str(exc)]
    expression = raw.get("cron_expression")
    if not isinstance(expression, str) or not expression:
        return []
    try:
        _trigger(expression, timezone)
    except CronError as exc:
        return [str(exc)]
    return []


def _group_problems(group_ids: Any, groups: Mapping[str, bool]) -> list[str]:
    if group_ids is not None and not (isinstance(group_ids, list)
                                      and all(isinstance(g, str) for g in group_ids)):
        return []  # the schema said what is wrong
    group_ids = group_ids or []
    available = ", ".join(sorted(groups)) or "none: variables/variables.json defines no group"
    if not group_ids:
        return [f"group_ids: at least one group is required (available: {available})"]
    problems = []
    unknown = [g for g in group_ids if g not in groups]
    if unknown:
        hints = "".join(did_you_mean(g, groups) for g in unknown[:1])
        problems.append(f"group_ids: unknown group(s) {', '.join(map(repr, unknown))} "
                        f"(available: {available}){hints}")
    if len(set(group_ids)) != len(group_ids):
        problems.append("group_ids: a group is listed twice")
    return problems


# -- variables ------------------------------------------------------------------------

def read_groups(folder: Path) -> tuple[dict[str, bool], list[Problem]]:
    """``{group_id: enabled}`` from variables.json (absent file: no groups)."""
    path = folder / VARIABLES
    try:
        document = JsonFile(path).read_strict(unique_keys=True)
    except FileNotFoundError:
        return {}, []
    except JsonFileError as exc:
        return {}, [Problem(str(path), str(exc).removeprefix(f"{path}: "))]
    problems = [Problem(str(path), p) for p in _schema_problems("variables", document)]
    raw = document.get("groups") if isinstance(document, Mapping) else None
    seen: set[str] = set()
    for group in raw if isinstance(raw, list) else []:
        # (said whatever else is wrong, so that every problem of the file is said at once)
        given = group.get("group_id") if isinstance(group, Mapping) else None
        if isinstance(given, str) and given in seen:
            problems.append(Problem(str(path), f"groups: group_id {given!r} is defined twice"))
        if isinstance(given, str):
            seen.add(given)
    if problems:
        return {}, problems
    return {group["group_id"]: group.get("enabled", True)
            for group in document.get("groups", [])}, []


# -- workflows ------------------------------------------------------------------------

def load_workflow(folder: Path) -> tuple[Workflow | None, list[Problem]]:
    """The workflow in ``folder`` and its problems; None when it cannot be used."""
    path = folder / MANIFEST
    try:
        check_workflow_name(folder.name)
    except ManifestError as exc:
        return None, [Problem(str(folder), str(exc))]
    try:
        document = JsonFile(path).read_strict(unique_keys=True)
    except FileNotFoundError:
        return None, [Problem(str(path), "missing: a workflow folder needs a workflow.json")]
    except JsonFileError as exc:
        return None, [Problem(str(path), str(exc).removeprefix(f"{path}: "))]
    problems = _manifest_problems(document)
    if problems:
        return None, [Problem(str(path), p) for p in problems]
    return _workflow_from(folder, document)


def _manifest_problems(document: Any) -> list[str]:
    """What is wrong with the manifest itself (the keys kandevd reads), schedules aside."""
    return _schema_problems("workflow", document)


def _workflow_from(folder: Path, document: dict[str, Any]
                   ) -> tuple[Workflow | None, list[Problem]]:
    """Validate the schedules of a well-formed manifest against the workflow's groups."""
    path = folder / MANIFEST
    groups, problems = read_groups(folder)
    known_groups = None if problems else groups  # broken variables.json: its cause only
    schedules: list[Schedule] = []
    seen: set[str] = set()
    for index, raw in enumerate(document.get("schedules", [])):
        # (a repeated id is said even when the schedule has other problems too)
        given = raw.get("id") if isinstance(raw, Mapping) else None
        if isinstance(given, str) and given in seen:
            problems.append(Problem(str(path), f"schedule {given!r}: id: used twice "
                                               "in this workflow"))
        if isinstance(given, str):
            seen.add(given)
        try:
            schedule = parse_schedule(raw, known_groups, index=index)
        except ManifestError as exc:
            problems.append(Problem(str(path), str(exc)))
            continue
        schedules.append(schedule)
    if problems:
        return None, problems
    return Workflow(
        name=folder.name, folder=folder, manifest_id=str(document.get("id", "")),
        label=str(document.get("label", "")),
        agent_profile=document.get("agent_profile", DEFAULT_PROFILE),
        pending_upgrades=bool(document.get("pending_upgrades")),
        schedules=tuple(schedules),
        enabled_groups=frozenset(g for g, enabled in groups.items() if enabled),
    ), []


def workflow_folders(root: Path) -> list[Path]:
    """Every folder under ``<root>/Workflow``, sorted by name (none when it is missing).

    Symbolic links to folders count as folders (a workflow may live elsewhere);
    plain files and dangling links are not workflows and are skipped. OSError when
    ``<root>/Workflow`` exists but cannot be listed (e.g. it is a file).
    """
    base = workflow_root(root)
    try:
        return sorted((p for p in base.iterdir() if p.is_dir()), key=lambda p: p.name)
    except FileNotFoundError:
        return []


def scan(root: Path) -> tuple[list[Workflow], list[Problem]]:
    """Load every workflow under the root; problems of one never stop the others."""
    workflows: list[Workflow] = []
    problems: list[Problem] = []
    try:
        folders = workflow_folders(root)
    except OSError as exc:
        return [], [Problem(str(workflow_root(root)),
                            f"cannot read: {exc.strerror or exc}")]
    seen: dict[str, Path] = {}  # real folder -> the name it was loaded under
    for folder in folders:
        real = str(folder.resolve())
        if real in seen:  # a second name (a link) for one folder: its sessions would share it
            problems.append(Problem(str(folder), f"the same folder as {seen[real]} (a link "
                                    "to it): not loaded twice, so that no two sessions "
                                    "ever work in one run folder"))
            continue
        seen[real] = folder
        workflow, found = load_workflow(folder)
        problems.extend(found)
        if workflow is not None:
            workflows.append(workflow)
    return workflows, problems


def edit_schedules(folder: Path, edit: Callable[[list[Any]], list[Any]]) -> Workflow:
    """Rewrite the manifest's ``schedules`` with ``edit(schedules)``; keep every other key.

    A manifest that is missing, does not parse, or is wrong apart from its schedules
    is never rewritten (ManifestUnusable: fix it first). The edited manifest is
    validated as a whole before anything is written: ManifestError leaves the file
    exactly as it was.
    """
    handle = manifest_file(folder)
    with handle.lock():
        try:
            document = handle.read_strict(unique_keys=True)
        except FileNotFoundError:
            raise ManifestUnusable(f"{handle.path}: missing") from None
        except JsonFileError as exc:
            raise ManifestUnusable(f"{exc}; fix the file first (kandevd never rewrites it)"
                                   ) from None
        problems = _manifest_problems(document)
        if problems:
            raise ManifestUnusable(f"{handle.path}: {'; '.join(problems)}; fix the file "
                                   "first (kandevd never rewrites it)")
        document["schedules"] = edit(list(document.get("schedules", [])))
        workflow, found = _workflow_from(folder, document)
        if workflow is None:
            if any(Path(p.path).name != MANIFEST for p in found):  # variables.json is bad
                raise ManifestUnusable("; ".join(str(p) for p in found))
            raise ManifestError("; ".join(p.message for p in found))
        handle.write_locked(document)
    return workflow


def find_schedule(schedules: Iterable[Any], schedule_id: str) -> int:
    """Index of the raw schedule with ``schedule_id``; -1 when absent."""
    for index, raw in enumerate(schedules):
        if isinstance(raw, Mapping) and raw.get("id") == schedule_id:
            return index
    return -1


#: Files kandevd keeps under the root, and the JSON type each must hold.
STATE_FILES = (("schedule-runs.json", list), ("decisions.json", list))
PAUSE_FILE = Path("config") / "scheduler.json"


def state_file_problems(root: Path) -> list[Problem]:
    """What is wrong with the files kandevd keeps (history, decisions, the pause).

    The daemon moves such a file aside when it meets it (one that does not parse; one
    that cannot be read now it leaves alone); ``validate`` reports it first, without
    touching anything.
    """
    checks = [(root / PAUSE_FILE, dict)]
    try:
        folders = workflow_folders(root)
    except OSError:
        folders = []  # scan() reports the unreadable root
    for folder in folders:
        checks += [(folder / name, kind) for name, kind in STATE_FILES]
    problems = []
    for path, kind in checks:
        try:
            value = JsonFile(path).read_strict()
        except FileNotFoundError:
            continue
        except JsonFileError as exc:
            problems.append(Problem(str(path), str(exc).removeprefix(f"{path}: ")))
            continue
        if not isinstance(value, kind):
            expected = "an array" if kind is list else "an object"
            problems.append(Problem(str(path), f"must be {expected}"))
    return [dataclasses.replace(p, kind="state") for p in problems]
