"""Messages for what JSON Schema finds wrong: each names its key path, never a traceback.

Config, manifests, product files and the control socket's params share these,
so every problem reads the same: ``a.b.c: message``, an unknown key at its own
path with a "did you mean", a missing key named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonschema

from kandevd.formats import yamlsafe
from kandevd.suggest import did_you_mean

MAX_MESSAGE = 300


def format_validation_error(error: jsonschema.ValidationError, prefix: str = "",
                            noun: str = "key") -> str:
    """``a.b.c: message`` for a jsonschema error; the root is named ``<root>``.

    An unknown key is reported at its own path (``queue.bogus: unknown key``),
    not at its parent's, so the message always names the offending key.
    """
    parts = [prefix] if prefix else []
    parts.extend(str(p) for p in error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict) \
            and error.validator_value is False:
        known = set(error.schema.get("properties", {}))
        unknown = sorted(str(k) for k in error.instance if k not in known)
        if unknown:
            more = f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""
            return _unknown_message(unknown[0], known, parts, noun) + more
    where = ".".join(parts) or "<root>"
    if error.validator == "maxItems" and isinstance(error.instance, list):
        # jsonschema would quote the whole (long) list and never say what is wrong.
        return f"{where}: {len(error.instance)} items; at most {error.validator_value} allowed"
    if error.validator == "pattern" and isinstance(error.schema.get("x-message"), str):
        # (A schema's own words for a pattern: a regular expression tells a user little.)
        return f"{where}: {yamlsafe.one_line(repr(error.instance))[:MAX_MESSAGE]} " \
            f"{error.schema['x-message']}"
    message = yamlsafe.one_line(error.message)
    quoted = repr(error.instance)
    if message.startswith(quoted):
        # jsonschema quotes the value first, in Python's spelling and whole: JSON's words
        # for null, true and false, a long value cut short, so the reason still shows.
        message = shown(error.instance) + message[len(quoted):]
        if error.validator == "maxLength" or (error.validator == "minLength"
                                              and error.validator_value > 1):
            bound = "at most" if error.validator == "maxLength" else "at least"
            message += f" ({bound} {error.validator_value} characters)"
    if len(message) > MAX_MESSAGE:  # (a message that quotes a value elsewhere)
        message = message[:MAX_MESSAGE] + "..."
    return f"{where}: {message}"


#: How much of a long value a message shows.
SHOWN_CHARS = 40


def shown(value: Any) -> str:
    """``value`` as a message shows it: JSON's null, true and false, a long string or
    list cut short (with its length), anything else as Python quotes it."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return yamlsafe.one_line(repr(value[:SHOWN_CHARS])) + f"... ({len(value)} characters)"
    if isinstance(value, list | dict) and len(repr(value)) > SHOWN_CHARS * 2:
        kind = "a list of" if isinstance(value, list) else "an object of"
        return f"{kind} {len(value)} {'items' if isinstance(value, list) else 'keys'}"
    return yamlsafe.one_line(repr(value))


def _unknown_message(key: str, known: set[str], parts: list[str], noun: str) -> str:
    where = ".".join([*parts, key])
    hint = did_you_mean(key, known)
    if hint:
        return f"{where}: unknown {noun}{hint}"
    return f"{where}: unknown {noun}; allowed here: {', '.join(sorted(known)) or 'none'}"


def _missing_required(error: jsonschema.ValidationError) -> str | None:
    """The name a ``required`` error is about (reported at its own path, not the parent's)."""
    if error.validator != "required" or not isinstance(error.instance, Mapping):
        return None
    for name in error.validator_value:
        if name not in error.instance and error.message.startswith(repr(name)):
            return str(name)
    return None


def validation_problems(validator: Any, document: Any, prefix: str = "",
                        noun: str = "key") -> list[str]:
    """Every problem ``validator`` finds in ``document``, one message each, by path.

    Unlike one :func:`format_validation_error` per error, each unknown key is a
    problem of its own (with its "did you mean") and a missing key is named at
    its own path, so a file's problems are all reported at once, by name.
    """
    messages: list[str] = []
    errors = sorted(validator.iter_errors(document),
                    key=lambda e: [str(p) for p in e.absolute_path])
    for error in errors:
        parts = [prefix] if prefix else []
        parts.extend(str(p) for p in error.absolute_path)
        missing = _missing_required(error)
        if missing is not None:  # at its own path, never at the parent's "<root>"
            messages.append(f"{'.'.join([*parts, missing])}: required {noun} missing")
        elif error.validator == "additionalProperties" and isinstance(error.instance, dict) \
                and error.validator_value is False:
            known = set(error.schema.get("properties", {}))
            messages += [_unknown_message(str(key), known, parts, noun)
                         for key in sorted(map(str, error.instance)) if key not in known]
        else:
            messages.append(format_validation_error(error, prefix, noun))
    return messages
