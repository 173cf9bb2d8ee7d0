"""A history entry as answers show it: every field the format names holds its type.

``schedule-runs.json`` is the operator's file too: a hand edit may put a number where a
time belongs or a string where a duration does. kandevd's own reading is defensive, and
so is what it answers: a field of the wrong type is shown as ``null`` (the file itself is
never changed here), so a client, the CLI or the console never meets a value that its
documented type does not allow. Fields the format does not name are shown as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _texts(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _object(value: Any) -> bool:
    return isinstance(value, dict)


#: What each named field of a turn may hold (``null`` is always allowed).
TURN_FIELDS: dict[str, Callable[[Any], bool]] = {
    "index": _whole, "kind": _text, "message": _text, "workshop_mode": _text,
    "status": _text, "started_at": _text, "completed_at": _text, "duration_ms": _number,
    "log_path": _text, "cost_cents": _number, "error": _text, "exit_code": _whole,
    "output": _text, "adopted_at": _text}

#: What each named field of an entry may hold (``turns``: a list of turn objects).
ENTRY_FIELDS: dict[str, Callable[[Any], bool]] = {
    "id": _text, "schedule_id": _text, "product": _text, "user_id": _text,
    "run_folder": _text, "session_id": _text, "status": _text, "error": _text,
    "duration_ms": _number, "group_ids": _texts, "started_at": _text,
    "completed_at": _text, "trigger_source": _text, "intended_at": _text,
    "late_s": _number, "fire_times": _texts, "notified": _object, "cost_cents": _number,
    "first_message": _text}


def _fields(item: dict[str, Any], kinds: dict[str, Callable[[Any], bool]]) -> dict[str, Any]:
    return {key: value if value is None or key not in kinds or kinds[key](value) else None
            for key, value in item.items()}


def shaped(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with each named field of the wrong type as ``None``; its turns likewise
    (a turn that is not an object is left out; ``turns`` that is not a list is ``None``)."""
    shown = _fields(entry, ENTRY_FIELDS)
    if "turns" in entry:
        turns = entry["turns"]
        shown["turns"] = [_fields(turn, TURN_FIELDS) for turn in turns
                          if isinstance(turn, dict)] if isinstance(turns, list) else None
    return shown
