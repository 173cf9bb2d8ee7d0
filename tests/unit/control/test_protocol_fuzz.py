"""Property-based fuzzing of the control protocol against one real daemon.

Every request line gets a valid JSON-RPC response (standard JSON, strict
UTF-8, no NaN), in order, never -32603; the daemon logs no traceback and
still answers ``daemon.status``. Lines are built from each registered
method's params schema and then mutated (wrong types, huge integers,
NaN/Infinity literals, surrogate escapes, deep nesting, long strings), or are
random JSON values or raw garbage bytes.

600 examples by default (derandomized: the same every run), or
``KANDEVD_FUZZ_EXAMPLES=10000`` for a long, random run.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kandevd.control.methods import MODULES
from kandevd.control.registry import Registry
from kandevd.formats import jsonstrict
from tests.support.daemon import FAST_CONFIG, DaemonProcess

EXAMPLES = int(os.environ.get("KANDEVD_FUZZ_EXAMPLES", "600"))
TIMEOUT = 60.0
#: Methods the fuzzer never calls: the daemon must stay up for the whole run.
SKIPPED = {"daemon.shutdown"}
#: Ids seeded in the daemon, so that some requests reach deep into the handlers.
KNOWN_IDS = ["ws1", "ag1", "wf1", "s1", "t1", "default", "local", "UTC",
             "workflow:wf1:s1", "product:p:s"]
ALLOWED_CODES = {-32700, -32600, -32601, -32602, -32000}


def build_registry() -> Registry:
    """Every method as the daemon registers it (handlers bound to stubs: only the
    names and the schemas are used here)."""
    registry = Registry()
    services = mock.MagicMock()
    for module in MODULES:
        module.register(registry, services)
    return registry


REGISTRY = build_registry()
METHODS = [name for name in REGISTRY.names() if name not in SKIPPED]
SCHEMAS = {name: REGISTRY.get(name).validator.schema for name in REGISTRY.names()}


def numeric_schemas(schema: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(schema, dict):
        kinds = schema.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if "integer" in kinds or "number" in kinds:
            yield path, schema
        for key, value in schema.items():
            yield from numeric_schemas(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            yield from numeric_schemas(value, f"{path}[{index}]")


def test_every_numeric_param_has_a_range_the_code_can_represent() -> None:
    found = 0
    for name, schema in SCHEMAS.items():
        for path, numeric in numeric_schemas(schema, name):
            found += 1
            top = numeric.get("maximum", numeric.get("exclusiveMaximum"))
            bottom = numeric.get("minimum", numeric.get("exclusiveMinimum"))
            assert top is not None and bottom is not None, path
            assert bottom > -(2**63) and top < 2**63, path  # SQLite INTEGER, float-exact
    assert found >= 10


# -- strategies ---------------------------------------------------------------------------

RAW_TOKENS = [
    "NaN", "-NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E400", "-0", "-0.0",
    "1.7976931348623157e308", "5e-324", "1" + "0" * 400, "-" + "9" * 400, "1" * 5000,
    '"\\ud800"', '"\\udfff"', '"a\\udbffb"', '"\\uD83D"', '"\\ud83d\\ude00"', '"\\u0000"',
    '"\\ud800\\ud800"', "[" * 70 + "]" * 70, "{" * 3 + "}" * 3, '{"a":' * 80 + "1" + "}" * 80,
    "tru", "nul", '"unterminated', "01", "1.", ".5", "+1", "0x10", "'single'",
]
RAW_KEYS = ['"\\ud800"', '"\\udc00x"', '"x\\udbff"', '"\\ud83d\\ude00"']

scalars = (st.none() | st.booleans()
           | st.integers(min_value=-(2**70), max_value=2**70)
           | st.integers(min_value=-(10**400), max_value=10**400)
           | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=30) | st.sampled_from(KNOWN_IDS))
json_values = st.recursive(
    scalars, lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4), max_leaves=15)


class Raw:
    """Text spliced into the request line as is (placeholders are swapped at the end)."""

    def __init__(self, text: str) -> None:
        self.text = text


raw_values = st.sampled_from(RAW_TOKENS).map(Raw) | st.builds(
    lambda depth, opener: Raw(("[" if opener else '{"k":') * depth + "0"
                              + ("]" if opener else "}") * depth),
    st.integers(1, 200), st.booleans()) | st.integers(1, 60_000).map(lambda n: "x" * n)


#: Known ids by param name: a request that names them reaches past the lookups.
IDS_BY_NAME = {"workspace_id": "ws1", "agent_id": "ag1", "scope_id": "ag1", "workflow_id": "wf1",
               "step_id": "s1", "task_id": "t1", "runner_agent_id": "ag1", "user_id": "local",
               "timezone": "UTC", "cron_expression": "*/5 * * * *", "profile": "default"}
#: The known object an ``id`` param names, by method area.
ID_BY_AREA = {"workspaces": "ws1", "agents": "ag1", "workflows": "wf1", "tasks": "t1"}


def mutated(draw: st.DrawFn, value: Any, clean: bool) -> Any:
    """Usually the value itself; sometimes something the schema does not expect."""
    roll = draw(st.integers(0, 19))
    if clean or roll < 16:
        return value
    if roll < 18:
        return draw(json_values)
    return draw(raw_values)


@st.composite
def from_schema(draw: st.DrawFn, schema: Any, clean: bool, name: str = "",
                depth: int = 0, ids: dict[str, str] = IDS_BY_NAME) -> Any:
    if not isinstance(schema, dict) or depth > 4:
        return draw(json_values)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    kinds = schema.get("type", "object")
    kind = draw(st.sampled_from(kinds)) if isinstance(kinds, list) else kinds
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        chosen = [prop for prop in properties if prop in required or draw(st.booleans())]
        result: dict[Any, Any] = {}
        for prop in chosen:
            result[prop] = mutated(draw, draw(from_schema(properties[prop], clean, prop,
                                                          depth + 1, ids)), clean)
        if not clean and (not properties or draw(st.integers(0, 9)) == 0):  # odd members
            key = draw(st.text(max_size=8) | st.sampled_from(RAW_KEYS).map(Raw))
            result[key] = draw(json_values)
        if not clean and required and draw(st.integers(0, 9)) == 0:  # a required one missing
            result.pop(draw(st.sampled_from(sorted(required))), None)
        return result
    if kind == "array":
        return draw(st.lists(from_schema(schema.get("items", {}), clean, name, depth + 1,
                                         ids), max_size=3))
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", 300)
        choices = (st.sampled_from(KNOWN_IDS) | st.text(min_size=low, max_size=min(high, 40))
                   | st.just("x" * (high + 1)))
        if "pattern" in schema:
            choices = st.from_regex(schema["pattern"], fullmatch=True) | choices
        if name in ids:
            choices = st.just(ids[name]) | choices
        return draw(choices)
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**63)))
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**63))
        inside = st.integers(int(low), int(high))
        if kind == "number":
            inside = inside | st.floats(low, high, allow_nan=False)
        return draw(inside | st.sampled_from([low - 1, high + 1, 10**400, -(10**400),
                                              2**63, 2**64, 1e308, -1e308, 2.0, 1.5]))
    if kind == "boolean":
        return draw(st.booleans())
    if kind == "null":
        return None
    return draw(json_values)


def render(message: Any) -> bytes:
    """JSON text of ``message`` with every Raw spliced in, as one line."""
    raws: list[Raw] = []

    def swap(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value)
            return f"@@RAW{len(raws) - 1}@@"
        if isinstance(value, dict):
            return {(swap(k) if isinstance(k, Raw) else k): swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(message))
    for index, raw in enumerate(raws):
        text = text.replace(f'"@@RAW{index}@@"', raw.text)
    return text.encode("utf-8") + b"\n"


#: The expected id of a line whose id was mutated: any (the answer is still checked).
ANY_ID = object()


@st.composite
def method_request(draw: st.DrawFn, request_id: int) -> tuple[bytes, Any]:
    name = draw(st.sampled_from(METHODS))
    clean = draw(st.integers(0, 2)) == 0  # a third of the requests are mutation-free
    ids = {**IDS_BY_NAME, "id": ID_BY_AREA.get(name.split(".")[0], "ws1")}
    params = draw(from_schema(SCHEMAS[name], clean, ids=ids))
    message: dict[Any, Any] = {"jsonrpc": "2.0", "id": request_id, "method": name,
                               "params": params}
    roll = 99 if clean else draw(st.integers(0, 19))
    if roll == 0:
        message["method"] = draw(st.text(max_size=20) | st.sampled_from(RAW_KEYS).map(Raw))
    elif roll == 1:
        message["id"] = draw(json_values | raw_values)
        return render(message), ANY_ID
    elif roll == 2:
        message["jsonrpc"] = draw(json_values)
    elif roll == 3:
        message["params"] = draw(json_values | raw_values)
    elif roll == 4:
        message[draw(st.text(max_size=6))] = draw(json_values)
    return render(message), request_id


@st.composite
def any_line(draw: st.DrawFn, request_id: int) -> tuple[bytes, Any]:
    """A line and the id its answer must carry (or None, or ANY_ID)."""
    kind = draw(st.integers(0, 9))
    if kind <= 6:
        return draw(method_request(request_id))
    if kind == 7:  # a random JSON value; an object always carries an id (no notification)
        value = draw(json_values)
        if isinstance(value, dict):
            value.setdefault("id", request_id)
        return render(value), ANY_ID
    if kind == 8:  # raw bytes
        garbage = draw(st.binary(min_size=1, max_size=200)).replace(b"\n", b"")
        # A blank line is no request (no answer is due): keep at least one visible byte.
        return (garbage if garbage.strip() else garbage + b"\x00") + b"\n", ANY_ID
    whole, _ = draw(method_request(request_id))  # a request cut short
    cut = whole[:draw(st.integers(1, max(1, len(whole) - 2)))].replace(b"\n", b"")
    return cut + b"\n", ANY_ID


# -- the daemon ---------------------------------------------------------------------------


class Connection:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT)
        self.sock.connect(str(path))
        self.reader = self.sock.makefile("rb")

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess(tmp_path_factory.mktemp("fuzz") / "home", FAST_CONFIG)
    daemon.start()
    try:
        daemon.call("workspaces.create", {"id": "ws1", "name": "W"})
        daemon.call("agents.create", {"id": "ag1", "workspace_id": "ws1", "name": "A"})
        daemon.call("workflows.create", {"id": "wf1", "workspace_id": "ws1", "name": "F",
                                         "style": "kanban",
                                         "steps": [{"id": "s1", "name": "S"}]})
        daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws1", "workflow_id": "wf1",
                                     "title": "T"})
        yield daemon
        assert daemon.call("daemon.status")["state"] == "running"
        assert daemon.stop() == 0
        assert "Traceback" not in daemon.log_text
    finally:
        daemon.cleanup()


@pytest.fixture(scope="module")
def connection(fuzz_daemon: DaemonProcess) -> Iterator[list[Connection]]:
    holder = [Connection(fuzz_daemon.socket)]
    yield holder
    holder[0].close()


def _reject_constant(name: str) -> Any:
    raise AssertionError(f"the response holds {name}")


def check_response(raw: bytes) -> dict[str, Any]:
    assert raw.endswith(b"\n"), f"connection closed or line cut: {raw[:200]!r}"
    text = raw.decode("utf-8")  # strict: no lone surrogate was encoded
    answer = json.loads(text, parse_constant=_reject_constant)
    assert jsonstrict.loads(text) == answer
    assert isinstance(answer, dict) and answer.get("jsonrpc") == "2.0", answer
    assert ("result" in answer) != ("error" in answer), answer
    assert set(answer) <= {"jsonrpc", "id", "result", "error"}, answer
    if "error" in answer:
        error = answer["error"]
        assert error["code"] in ALLOWED_CODES, answer
        assert isinstance(error["message"], str) and "Traceback" not in error["message"]
        assert isinstance(error["data"]["kind"], str)
    return answer


@pytest.mark.integration
@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 600,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_line_gets_a_valid_answer_in_order(fuzz_daemon: DaemonProcess,
                                                 connection: list[Connection],
                                                 data: st.DataObject) -> None:
    count = data.draw(st.integers(1, 4))
    drawn = [data.draw(any_line(n), label=f"line {n}") for n in range(count)]
    lines = [line for line, _ in drawn]
    sentinel = json.dumps({"jsonrpc": "2.0", "id": "sentinel", "method": "daemon.status"})
    conn = connection[0]
    conn.sock.sendall(b"".join(lines) + sentinel.encode() + b"\n")
    answers = []
    while True:
        answer = check_response(conn.reader.readline())
        if answer["id"] == "sentinel":
            assert answer["result"]["state"] == "running"
            break
        answers.append(answer)
    assert len(answers) == count, (lines, answers)
    for n, answer in enumerate(answers):
        expected = drawn[n][1]
        if expected is not ANY_ID:  # in order: its own id, or null with an error
            assert answer["id"] in (expected, None), (n, lines[n], answer)
            assert answer["id"] == expected or "error" in answer, (lines[n], answer)
    assert "Traceback" not in fuzz_daemon.log_text[-20000:]
