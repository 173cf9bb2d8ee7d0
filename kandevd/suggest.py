""""Did you mean": the closest known word to a misspelt one, for error messages.

A hand-edited file with ``timzone`` or a zone spelt ``europe/paris`` should be
told what was meant, not only that it is wrong.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: How alike (difflib's ratio) a known word must be to be suggested.
CUTOFF = 0.75


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice ``word`` most likely meant (the same word in another case first)."""
    lowered = {choice.lower(): choice for choice in choices}
    if word.lower() in lowered:
        return lowered[word.lower()]
    found = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=CUTOFF)
    return lowered[found[0]] if found else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean X?"`` when a choice is close to ``word``, else ``""``."""
    found = closest(word, choices)
    return f"; did you mean {found}?" if found is not None else ""
