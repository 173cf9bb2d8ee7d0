"""The domain's errors in the protocol's words: one table, applied to every handler."""

from __future__ import annotations

from typing import Any

import pytest

from kandevd.control.errors import DOMAIN_ERRORS, domain_error
from kandevd.control.protocol import Conflict, InvalidParams, NotFound, RpcError
from kandevd.control.registry import Registry
from kandevd.runs.model import BatchItemError, RunNotFound, RunReferenceError
from kandevd.schedules.workflows.manifest import ManifestError, ManifestUnusable


def test_a_subclass_is_translated_by_its_own_row_not_its_parents() -> None:
    unusable = domain_error(ManifestUnusable("the manifest cannot be read"))
    assert isinstance(unusable, Conflict)
    assert isinstance(domain_error(ManifestError("bad")), InvalidParams)
    item = domain_error(BatchItemError(3, "runs[3].agent_id: agent 'x' does not exist"))
    assert isinstance(item, InvalidParams)
    assert item.extra == {"index": 3}


def test_a_run_naming_nothing_is_refused_naming_its_parameter() -> None:
    refused = domain_error(RunReferenceError("task_id: task 't9' does not exist"))
    assert isinstance(refused, InvalidParams)
    assert refused.message == "params.task_id: task 't9' does not exist"


def test_no_row_is_hidden_behind_an_earlier_parent() -> None:
    for index, (kind, _translate) in enumerate(DOMAIN_ERRORS):
        for earlier, _ in DOMAIN_ERRORS[:index]:
            assert not issubclass(kind, earlier), f"{kind.__name__} after {earlier.__name__}"


def test_what_is_not_the_domains_is_left_alone() -> None:
    assert domain_error(KeyError("x")) is None
    assert domain_error(ValueError("x")) is None


def test_every_registered_handler_answers_in_the_protocols_words() -> None:
    registry = Registry()

    def get(_params: dict[str, Any]) -> Any:
        raise RunNotFound("run 'r1' does not exist")

    def broken(_params: dict[str, Any]) -> Any:
        raise KeyError("a bug")

    registry.add("things.get", get)
    registry.add("things.broken", broken)
    with pytest.raises(NotFound, match="run 'r1' does not exist"):
        registry.get("things.get").handler({})
    with pytest.raises(KeyError):  # a bug stays a bug: -32603 from the server, logged
        registry.get("things.broken").handler({})
    assert not issubclass(KeyError, RpcError)
