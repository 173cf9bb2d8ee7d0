"""Strict JSON reading: only what every JSON reader can take back.

Python's ``json`` accepts ``NaN``, ``Infinity``, numbers that overflow to
infinity (``1e999``) and ``\\ud800``-style escapes of lone surrogates (text that
is not Unicode and cannot be written as UTF-8). Accepted, they surface later
as a response that is not JSON, a file that cannot be written, or an internal
error far from the input. Both the control socket and the files under the
workflow root read through :func:`loads`, which rejects them at the door with
a message that says what is wrong.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class StrictJsonError(ValueError):
    """Valid JSON syntax that kandevd still cannot accept."""


class UnpairedSurrogate(StrictJsonError):
    """A ``\\ud800``-style escape of a lone surrogate, in a key or a value."""


def _constant(name: str) -> Any:
    raise StrictJsonError(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise StrictJsonError(f"number {text[:40]} is out of range (it overflows to infinity)")
    return value


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise StrictJsonError(f"key {key[:60]!r} appears twice in one object (a JSON "
                                  "reader keeps the last one and drops the first)")
        found[key] = value
    return found


#: One decoder for every call (``json.loads`` with options builds a new one each time).
_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_float)
_UNIQUE_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_float,
                                   object_pairs_hook=_unique)


def loads(text: str, *, unique_keys: bool = False) -> Any:
    """Parse ``text``; ValueError (a StrictJsonError for the cases above) when it is bad.

    ``unique_keys``: a key given twice in one object is refused too (a file people
    edit by hand, where the second would silently win and a rewrite would drop the
    first; the machine's own files and requests skip the cost)."""
    if text.startswith("\ufeff"):  # what json.loads says of it
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    value = (_UNIQUE_DECODER if unique_keys else _DECODER).decode(text)
    if _SURROGATE_ESCAPE.search(text):  # paired escapes are fine: only then walk the value
        _check_unicode(value)
    return value


def _check_unicode(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, dict):
            for key, member in item.items():
                _check_text(key)
                stack.append(member)
        elif isinstance(item, list):
            stack.extend(item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise UnpairedSurrogate(f"string {text[:40]!r} holds the lone surrogate "
                                f"\\u{ord(bad):04x}, which is not valid Unicode") from None
