"""``rpc.discover``, ``kandevd methods`` and the generated method reference."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner

from kandevd import __version__
from kandevd.cli import cli
from kandevd.control import openrpc, reference
from kandevd.control.protocol import InvalidParams
from kandevd.control.registry import Registry, object_schema, paging_properties


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    registry = reference.build_registry()
    return registry.get("rpc.discover").handler({})


def test_discover_is_an_openrpc_document_of_every_method(document: dict[str, Any]) -> None:
    assert document["openrpc"] == "1.2.6"
    assert document["info"] == {"title": "kandevd", "version": __version__}
    names = [m["name"] for m in document["methods"]]
    assert names == sorted(names)
    assert {"daemon.status", "daemon.shutdown", "rpc.discover", "runs.enqueue",
            "scheduler.jobs.next", "tasks.launch"} <= set(names)
    for method in document["methods"]:
        assert method["paramStructure"] == "by-name"
        assert method["result"]["name"] == "result" and "schema" in method["result"]
        for param in method["params"]:
            assert set(param) == {"name", "required", "schema"}
            jsonschema.Draft202012Validator.check_schema(param["schema"])
    json.dumps(document)  # JSON all the way down


def test_discover_params_come_from_the_schemas(document: dict[str, Any]) -> None:
    by_name = {m["name"]: m for m in document["methods"]}
    enqueue = {p["name"]: p for p in by_name["runs.enqueue"]["params"]}
    assert enqueue["workspace_id"]["required"] is True
    assert enqueue["coalesce"] == {"name": "coalesce", "required": False,
                                   "schema": {"type": "boolean"}}
    limit = {p["name"]: p for p in by_name["runs.list"]["params"]}["limit"]["schema"]
    assert (limit["minimum"], limit["maximum"], limit["default"]) == (1, 500, 50)
    assert by_name["rpc.discover"]["params"] == []


def test_every_method_has_a_summary(document: dict[str, Any]) -> None:
    missing = [m["name"] for m in document["methods"] if not m.get("summary")]
    assert not missing, ("give these a summary (registry.add(summary=...) or "
                         f"kandevd/control/openrpc.py SUMMARIES): {missing}")


def test_docs_method_reference_is_generated() -> None:
    current = reference.DOCS_PATH.read_text(encoding="utf-8")
    wanted = reference.render_docs(current, reference.markdown_reference())
    assert current == wanted, ("docs/protocol.md's method reference is stale: "
                               "run python -m kandevd.control.reference --write")


def test_validation_lists_every_problem_at_once() -> None:
    reg = Registry()
    reg.add("m", lambda p: p, object_schema(
        {"id": {"type": "string"}, "kind": {"enum": ["a", "b"]}, **paging_properties()},
        ("id",)))
    with pytest.raises(InvalidParams) as info:
        reg.check_params(reg.get("m"), {"kind": "c", "limit": 0, "offset": -1, "x": 1, "y": 2})
    message = info.value.message
    expected = ["params: 'id' is a required property",
                "params.x: unknown parameter; allowed here: id, kind, limit, offset "
                "(also unknown: y)",
                "params.kind: 'c' is not one of ['a', 'b']",
                "params.limit: 0 is less than the minimum of 1",
                "params.offset: -1 is less than the minimum of 0"]
    assert message == "; ".join(expected)


def test_cli_methods_lists_and_shows_without_a_daemon(tmp_path: Any) -> None:
    runner = CliRunner()
    env = {"KANDEVD_HOME": str(tmp_path / "nohome")}
    listed = runner.invoke(cli, ["methods"], env=env)
    assert listed.exit_code == 0, listed.output
    line = next(ln for ln in listed.output.splitlines() if ln.startswith("runs.get "))
    assert "{id}" in line
    shown = runner.invoke(cli, ["methods", "runs.list"], env=env)
    assert shown.exit_code == 0, shown.output
    assert "limit: integer 1..500, optional, default 50" in shown.output
    entry = runner.invoke(cli, ["methods", "runs.get", "--json"], env=env)
    assert json.loads(entry.output)["name"] == "runs.get"
    whole = runner.invoke(cli, ["methods", "--json"], env=env)
    assert json.loads(whole.output)["openrpc"] == "1.2.6"
    unknown = runner.invoke(cli, ["methods", "nope"], env=env)
    assert unknown.exit_code == 1 and "unknown method: nope" in unknown.output


@pytest.mark.integration
def test_a_real_daemon_discovers_what_the_cli_shows(tmp_path: Any) -> None:
    from tests.support.daemon import FAST_CONFIG, DaemonProcess

    process = DaemonProcess(tmp_path / "home", FAST_CONFIG)
    process.start()
    try:
        served = process.call("rpc.discover")
        assert served == openrpc.discover(reference.build_registry())
        assert process.stop() == 0
    finally:
        process.cleanup()
