"""The quick check of ``runs.enqueue_many`` items agrees with the method's JSON Schema.

``_plainly_valid`` lets the common item skip jsonschema; it may refuse a valid
item (the schema then decides) but must never accept an invalid one.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kandevd.control.methods.runs import _ENQUEUE_ITEM, _plainly_valid

_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.text(max_size=3), st.text(min_size=195, max_size=205),
                    st.lists(st.integers(), max_size=2),
                    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
_keys = st.sampled_from(["workspace_id", "agent_id", "reason", "task_id", "payload",
                         "idempotency_key", "coalesce", "other"])
_base = st.fixed_dictionaries({"workspace_id": st.text(min_size=1, max_size=5),
                               "agent_id": st.text(min_size=1, max_size=5),
                               "reason": st.text(min_size=1, max_size=5)})


@st.composite
def items(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly valid items with a few random changes, so both answers are common."""
    value = dict(draw(_base))
    for key, replacement in draw(st.lists(st.tuples(_keys, _values), max_size=3)):
        value[key] = replacement
    for key in draw(st.lists(_keys, max_size=2)):
        value.pop(key, None)
    return value


@settings(max_examples=600, deadline=None)
@given(items())
def test_the_quick_item_check_never_accepts_what_the_schema_refuses(value: dict[str, Any]
                                                                     ) -> None:
    if _plainly_valid(value):
        assert _ENQUEUE_ITEM.is_valid(value), value


def test_the_common_items_take_the_quick_path() -> None:
    assert _plainly_valid({"workspace_id": "w", "agent_id": "a", "reason": "r"})
    assert _plainly_valid({"workspace_id": "w", "agent_id": "a", "reason": "r",
                           "payload": {"n": 1}, "coalesce": False})
    assert not _plainly_valid({"workspace_id": "w", "agent_id": "a", "reason": ""})
