"""Labels: what a runner on another machine carries, and what an agent's runs need.

An agent with ``runs_on: [label, ...]`` has its runs taken only by a runner
whose labels include every one of them; an agent without runs only on the
daemon's own machine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

#: A label: a letter or digit, then letters, digits, ``.``, ``_`` or ``-`` (63 at most).
#: (``(?!\n)``: Python's ``$`` also matches before a final newline, JSON Schema's does not.)
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}(?!\n)$"
LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
#: The most labels a runner or an agent may name.
MAX_LABELS = 16

#: A label's schema: the pattern, and its words for a label that is not one.
LABEL_SCHEMA: dict[str, Any] = {
    "type": "string", "pattern": LABEL_PATTERN,
    "x-message": "is not a label: letters, digits, '.', '_' and '-', starting with a letter "
                 "or digit (at most 63 characters)"}

#: The JSON Schema of ``runs_on`` (null: on the daemon's machine).
RUNS_ON_SCHEMA: dict[str, Any] = {
    "type": ["array", "null"], "minItems": 1, "maxItems": MAX_LABELS, "uniqueItems": True,
    "items": LABEL_SCHEMA}
#: The JSON Schema of a runner's labels (none: it takes only agents that need none).
LABELS_SCHEMA: dict[str, Any] = {
    "type": "array", "maxItems": MAX_LABELS, "uniqueItems": True,
    "items": LABEL_SCHEMA}


def covers(carried: Iterable[str], needed: Iterable[str]) -> bool:
    """Does a runner carrying ``carried`` take runs that need ``needed``?"""
    return set(needed) <= set(carried)


def bad_label(labels: Iterable[str]) -> str | None:
    """The first label that is not one (None: all are)."""
    return next((label for label in labels if not LABEL_RE.fullmatch(label)), None)
