"""Loading YAML files a user hands to kandevd (kandevd.yaml, product.yaml, users.yaml).

``yaml.safe_load`` alone is not enough for a daemon: a file of a few hundred
bytes can use aliases to stand for billions of values ("billion laughs"), and
everything that walks the result (JSON Schema, a deep copy) then runs for
minutes. Here the document is composed once, its expanded size is measured
on the node graph (memoized per node, so a bomb is measured without being
expanded) and refused above :data:`MAX_YAML_VALUES`; only then is it built.

Every failure is a :class:`YamlError` whose message is one line: what is
wrong and, for a syntax error, the line and column.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

MAX_YAML_BYTES = 1024 * 1024
MAX_YAML_VALUES = 100_000


class YamlError(ValueError):
    pass


class _Loader(yaml.SafeLoader):
    """The safe loader, reading ``1e3`` and ``1.5e3`` as the numbers YAML 1.2 (and JSON)
    says they are: YAML 1.1's floats need a dot and a signed exponent (``1.5e+3``), so
    ``stop_grace_s: 1e3`` was a string the schema then refused as "not of type
    'number'"."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"))


def read_text(path: Path, what: str = "", *, regular_only: bool = False) -> str:
    """The file's text (UTF-8, at most :data:`MAX_YAML_BYTES`); YamlError says why not.

    ``what`` names the file in "cannot read ..." (``cannot read config: ...``).
    A directory is refused before it is opened; a pipe (``--config <(...)``) is read,
    unless ``regular_only``: a file a loop reads again and again (a product's) must
    not block it on a FIFO nobody writes.
    """
    label = f"cannot read {what}".rstrip()
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise YamlError(f"{label}: is a directory, not a file")
        if regular_only and not stat.S_ISREG(info.st_mode):
            raise YamlError(f"{label}: not a regular file (a FIFO, a socket or a device)")
        if stat.S_ISREG(info.st_mode) and info.st_size > MAX_YAML_BYTES:
            raise YamlError(f"larger than {MAX_YAML_BYTES} bytes")
        with open(path, "rb") as handle:
            data = handle.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise YamlError(f"{label}: {exc.strerror or exc}") from None
    if len(data) > MAX_YAML_BYTES:
        raise YamlError(f"larger than {MAX_YAML_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise YamlError(f"not UTF-8 text: {exc.reason} (byte 0x{data[exc.start]:02x} at "
                        f"offset {exc.start}, line {line})") from None


def loads(text: str) -> Any:
    """Safe-load one YAML document from ``text`` with the alias guard."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if expanded_size(node, {}) > MAX_YAML_VALUES:
            raise YamlError(f"expands to more than {MAX_YAML_VALUES} values (through YAML "
                            "aliases): refused")
        keys_as_written(node, set())
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise YamlError(f"not valid YAML: {where}{one_line(str(problem))}") from None
    except RecursionError:
        raise YamlError("not valid YAML: nested too deeply") from None
    finally:
        loader.dispose()


def load_file(path: Path, what: str = "", *, regular_only: bool = False) -> Any:
    """Safe-load one YAML file; YamlError says where (with the line) and why."""
    return loads(read_text(path, what, regular_only=regular_only))


_BOOL_TAG = "tag:yaml.org,2002:bool"
_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


def keys_as_written(node: yaml.Node, seen: set[int]) -> None:
    """Keep a mapping key such as ``on:`` a string: YAML 1.1 reads the words on, off,
    yes, no as booleans, so ``notify: {on: [failure]}`` would have the key ``True``.
    Only keys written as those words are kept as written (``true``/``false`` and every
    value are read as YAML says). A key written twice in one mapping is refused: YAML
    would keep the second silently and drop what the first said."""
    stack = [node]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, yaml.MappingNode):
            written: dict[tuple[str, str], yaml.Node] = {}
            for key, value in current.value:
                if isinstance(key, yaml.ScalarNode) and key.tag == _BOOL_TAG \
                        and key.style is None and key.value.lower() not in ("true", "false"):
                    key.tag = _STR_TAG
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                    first = written.setdefault((key.tag, key.value), key)
                    if first is not key:  # (YAML keeps the last one: the first is lost)
                        raise YamlError(
                            f"not valid YAML: line {key.start_mark.line + 1}: key "
                            f"{one_line(key.value)!r} given twice (first on line "
                            f"{first.start_mark.line + 1})")
                stack.append(value)
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)


def expanded_size(node: yaml.Node, seen: dict[int, int]) -> int:
    """How many values ``node`` stands for once every alias is expanded (memoized per
    node, so an alias bomb is measured without being expanded)."""
    if id(node) in seen:
        return seen[id(node)]
    seen[id(node)] = 1  # a recursive alias counts once while it is being measured
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(expanded_size(child, seen) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(expanded_size(k, seen) + expanded_size(v, seen) for k, v in node.value)
    seen[id(node)] = size
    return size


def non_finite(document: Any) -> Iterator[tuple[tuple[str, ...], float]]:
    """Every NaN or infinity in a loaded document, with its key path (keys included).

    Iterative and visiting each container once, so a document with shared (aliased)
    parts or deep nesting costs no more than its size.
    """
    stack: list[tuple[tuple[str, ...], Any]] = [((), document)]
    visited: set[int] = set()
    while stack:
        path, node = stack.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                yield path, node
        elif isinstance(node, (dict, list)):
            if id(node) in visited:
                continue
            visited.add(id(node))
            if isinstance(node, dict):
                for key, value in reversed(list(node.items())):
                    if isinstance(key, float) and not math.isfinite(key):
                        yield (*path, str(key)), key
                    stack.append(((*path, str(key)), value))
            else:
                for index in reversed(range(len(node))):
                    stack.append(((*path, str(index)), node[index]))


def describe_non_finite(value: float) -> str:
    if math.isnan(value):
        return "NaN is not allowed"
    return f"{'-' if value < 0 else ''}infinity is not allowed"


def one_line(text: str) -> str:
    return " ".join(text.split())
