"""The method reference: every method as docs/protocol.md and ``kandevd methods`` show it.

The registry is built here without a daemon (stand-in services: ``register``
only captures services in closures, it never calls them), so the reference is
exactly what the daemon checks. ``python -m kandevd.control.reference
--write`` refreshes docs/protocol.md (between the ``methods:begin`` and
``methods:end`` markers, and the event topics between ``topics:begin`` and
``topics:end``) and ``--check`` exits 1 when it is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kandevd.control.methods import MODULES
from kandevd.control.openrpc import discover
from kandevd.control.registry import Registry
from kandevd.events.topics import markdown as topic_markdown

DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
BEGIN = "<!-- methods:begin -->"
END = "<!-- methods:end -->"
TOPICS_BEGIN = "<!-- topics:begin -->"
TOPICS_END = "<!-- topics:end -->"


class _Stub:
    """Stands in for every service when the registry is built without a daemon:
    ``register`` only captures services in closures, it never calls them."""

    def __getattr__(self, _name: str) -> _Stub:
        return _Stub()

    def __getitem__(self, _key: Any) -> _Stub:
        return _Stub()

    def __call__(self, *_args: Any, **_kwargs: Any) -> _Stub:
        return _Stub()


def build_registry() -> Registry:
    """The daemon's registry, built in-process (handlers unusable, schemas real)."""
    registry = Registry()
    stub: Any = _Stub()
    for module in MODULES:
        module.register(registry, stub)
    return registry


# -- human rendering -----------------------------------------------------------------

def type_text(schema: dict[str, Any]) -> str:
    """``string``, ``integer 1..500``, ``"asc" | "desc"``, ``object``..."""
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    kind = schema.get("type")
    if isinstance(kind, list):
        text = " | ".join(str(k) for k in kind)
    elif kind:
        text = str(kind)
    elif "anyOf" in schema or "oneOf" in schema:
        text = " | ".join(type_text(s) for s in schema.get("anyOf", schema.get("oneOf", [])))
    else:
        text = "any"
    if kind == "array" and isinstance(schema.get("items"), dict):
        text = f"array of {type_text(schema['items'])}"
        few, many = schema.get("minItems"), schema.get("maxItems")
        if few is not None or many is not None:  # (the array's own length, not an item's)
            text += f"; {'' if few is None else few}..{'' if many is None else many} items"
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None or high is not None:
        text += f" {'' if low is None else low}..{'' if high is None else high}"
    low, high = schema.get("minLength"), schema.get("maxLength")
    if low is not None or high is not None:
        text += f" (length {'' if low is None else low}..{'' if high is None else high})"
    if "pattern" in schema:
        text += f" matching `{schema['pattern']}`"
    return text


def param_summary(entry: dict[str, Any]) -> str:
    """``{id, limit?, offset?}``: the param names, optional ones with ``?``."""
    names = [p["name"] + ("" if p["required"] else "?") for p in entry["params"]]
    return "{" + ", ".join(names) + "}"


def param_lines(entry: dict[str, Any]) -> list[str]:
    lines = []
    for param in entry["params"]:
        schema = param["schema"]
        text = f"{param['name']}: {type_text(schema)}"
        text += ", required" if param["required"] else ", optional"
        if "default" in schema:
            text += f", default {json.dumps(schema['default'])}"
        if schema.get("description"):
            text += f": {schema['description']}"
        lines.append(text)
    return lines


def markdown_reference(registry: Registry | None = None) -> str:
    """The method reference of docs/protocol.md (without the markers)."""
    document = discover(registry or build_registry())
    out = ["Generated from the registry's JSON Schemas by",
           "`python -m kandevd.control.reference --write`; do not edit by hand.",
           "`rpc.discover` returns the same data as an OpenRPC document.", ""]
    for entry in document["methods"]:
        out.append(f"### `{entry['name']}`")
        out.append("")
        if entry.get("summary"):
            out.append(entry["summary"])
            out.append("")
        if entry["result"].get("description"):
            out.append(f"Result: {entry['result']['description']}")
            out.append("")
        lines = param_lines(entry)
        if lines:
            out.extend(f"- `{line.split(':', 1)[0]}`:{line.split(':', 1)[1]}" for line in lines)
        else:
            out.append("No params.")
        out.append("")
    return "\n".join(out)


def render_docs(text: str, reference: str, topics: str | None = None) -> str:
    """``text`` with the method reference between its markers replaced by
    ``reference``, and the topic reference by ``topics`` (default: the topics')."""
    text = _between(text, BEGIN, END, reference)
    return _between(text, TOPICS_BEGIN, TOPICS_END, topics if topics is not None
                    else topic_markdown())


def _between(text: str, begin: str, end_marker: str, body: str) -> str:
    start, end = text.find(begin), text.find(end_marker)
    if start < 0 or end < start:
        raise ValueError(f"{DOCS_PATH.name}: missing {begin} ... {end_marker} markers")
    return text[:start + len(begin)] + "\n\n" + body.rstrip("\n") + "\n\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kandevd.control.reference",
                                     description="Print the OpenRPC document or the method "
                                                 "reference of docs/protocol.md.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--markdown", action="store_true", help="print the markdown reference")
    group.add_argument("--write", action="store_true", help="refresh docs/protocol.md")
    group.add_argument("--check", action="store_true", help="exit 1 when docs/protocol.md is stale")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_reference())
        return 0
    if args.write or args.check:
        current = DOCS_PATH.read_text(encoding="utf-8")
        wanted = render_docs(current, markdown_reference())
        if args.check:
            if wanted != current:
                print(f"{DOCS_PATH} is stale: run python -m kandevd.control.reference --write",
                      file=sys.stderr)
                return 1
            return 0
        if wanted != current:
            DOCS_PATH.write_text(wanted, encoding="utf-8")
        return 0
    print(json.dumps(discover(build_registry()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
