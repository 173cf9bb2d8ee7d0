"""scripts/check_structure on a small package tree written here."""

from __future__ import annotations

import importlib.util
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_structure"


@pytest.fixture(scope="module")
def cs() -> ModuleType:
    loader = SourceFileLoader("check_structure", str(SCRIPT))
    spec = importlib.util.spec_from_loader("check_structure", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_structure"] = module  # dataclasses look the module up
    try:
        loader.exec_module(module)
    finally:
        del sys.modules["check_structure"]
    return module


FILES = {
    "kandevd/__init__.py": '"""root"""\n',
    "kandevd/leaf.py": "import kandevd.room.a\n",  # upward: floor 0 -> floor 3
    "kandevd/room/__init__.py": "",
    # a circle: a imports b at module level, b imports a inside a function
    "kandevd/room/a.py": "from kandevd.room import b\n",
    "kandevd/room/b.py": "def late():\n    from . import a\n    return a\n",
    # under TYPE_CHECKING only: neither an upward import nor a circle
    "kandevd/room/c.py": (
        "from typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n    from kandevd.top import Top\n"
        "else:\n    from kandevd import leaf\n"
    ),
    "kandevd/top.py": "from kandevd.room.c import x\n",
    "kandevd/big.py": "x = 1\n" * 12,
    "kandevd/stray.py": "",
}
LAYERS = {"kandevd": 0, "kandevd.leaf": 0, "kandevd.big": 0, "kandevd.room": 3, "kandevd.top": 5}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name, text in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_each_rule_is_found(cs: ModuleType, tree: Path) -> None:
    modules = cs.find_modules(tree)
    assert set(modules) == {
        "kandevd", "kandevd.leaf", "kandevd.room", "kandevd.room.a", "kandevd.room.b",
        "kandevd.room.c", "kandevd.top", "kandevd.big", "kandevd.stray",
    }  # fmt: skip
    edges = cs.import_edges(tree, modules)
    pairs = {(e.src, e.dst) for e in edges}
    late = [e for e in edges if e.src == "kandevd.room.b"]
    assert [(e.dst, e.line, e.deferred) for e in late] == [("kandevd.room.a", 2, True)]
    assert ("kandevd.room.c", "kandevd.top") not in pairs  # TYPE_CHECKING is ignored
    assert ("kandevd.room.c", "kandevd.leaf") in pairs  # ...its else branch is not

    assert cs.strongly_connected(modules, edges) == [["kandevd.room.a", "kandevd.room.b"]]

    up = cs.upward(edges, LAYERS)
    assert [(e.src, e.dst, e.where(), low, high) for e, low, high in up] == [
        ("kandevd.leaf", "kandevd.room.a", "kandevd/leaf.py:1", 0, 3)
    ]
    assert cs.unplaced(modules, LAYERS) == ["kandevd.stray"]

    banned = cs.forbidden(edges, [("kandevd", "kandevd.room", ("kandevd.top",))])
    assert [(e.src, e.dst) for e, _, _ in banned] == [
        ("kandevd.leaf", "kandevd.room.a")
    ]  # not room's own modules, not the exempt top

    sizes = {"kandevd/big.py": cs.count_lines(modules["kandevd.big"])}
    assert cs.oversized(sizes, 10) == [("kandevd/big.py", 12)]


def test_report(cs: ModuleType, tree: Path) -> None:
    lines, problems = cs.check(tree, 10, show_sizes=True, layers=LAYERS, pairs=[],
                               sql_waiting=())
    text = "\n".join(lines)
    assert "kandevd/big.py:1: 12 lines (> 10)" in text
    assert "circle 1 (2 modules): kandevd.room.a, kandevd.room.b" in text
    assert "kandevd/room/b.py:2: kandevd.room.b -> kandevd.room.a: from . import a" in text
    assert "kandevd/leaf.py:1: kandevd.leaf -> kandevd.room.a" in text
    assert "warning: kandevd.stray is unplaced" in text
    assert problems == 3
    assert lines[-1] == "structure: 3 problem(s)"

    strict, problems = cs.check(tree, 100, strict=True, layers=LAYERS, pairs=[],
                                sql_waiting=())
    assert problems == 3  # no size problem; the unplaced module counts
    assert strict[-1] == "structure: 3 problem(s)"

    (tree / "kandevd/leaf.py").write_text("")
    (tree / "kandevd/room/b.py").write_text("")
    lines, problems = cs.check(tree, 100, layers=LAYERS, pairs=[], sql_waiting=())
    assert (problems, lines[-1]) == (0, "structure: ok")


def test_rooms_sql_and_json_shaped_signatures(cs: ModuleType, tmp_path: Path) -> None:
    files = {
        "kandevd/__init__.py": "",
        "kandevd/store/__init__.py": "",
        "kandevd/store/runs.py": 'Q = "SELECT 1 FROM runs"\n',  # the store may
        "kandevd/room/__init__.py": "",
        "kandevd/room/a.py": (
            '"""SELECT nothing: a docstring is no statement."""\n'
            "from typing import Any\n"
            'def go(conn, x: dict[str, Any]) -> dict[str, Any]:\n'
            '    return conn.execute(f"UPDATE runs SET x = {x}")\n'
            "def _private(x: dict[str, Any]) -> None: ...\n"
        ),
        "kandevd/room/b.py": 'WHERE = " AND status = 1"  # a fragment, not a statement\n',
        "kandevd/room/c.py": 'OLD = "DELETE FROM runs"\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = cs.find_modules(tmp_path)
    assert cs.sql_outside_store(modules, tmp_path) == [
        ("kandevd.room.a", "kandevd/room/a.py", 4), ("kandevd.room.c", "kandevd/room/c.py", 1)]
    assert cs.dict_any_in_signatures(modules) == 2
    assert cs.dict_any_in_signatures(modules, ("kandevd.room",)) == 0
    assert cs.crowded(modules, {"kandevd.room": 3}) == [("kandevd.room", 4, 3)]

    layers = {"kandevd": 0, "kandevd.store": 2, "kandevd.room": 3}
    lines, problems = cs.check(tmp_path, layers=layers, pairs=[], crowding={"kandevd.room": 3},
                               sql_waiting=("kandevd.room.c", "kandevd.gone"), dict_ceiling=1)
    text = "\n".join(lines)
    assert "kandevd/room/a.py:4: SQL outside kandevd/store/" in text
    assert "== SQL outside the store: 1 new, 1 not yet moved (in 1 module(s))" in text
    assert "kandevd.gone: holds no SQL any more" in text
    assert "kandevd.room: 4 modules directly in it (> 3)" in text
    assert "2 > 1: pass a typed value instead" in text
    assert problems == 4


def test_every_package_is_in_the_picture(cs: ModuleType, tmp_path: Path) -> None:
    for name in ("kandevd/__init__.py", "kandevd/room/__init__.py",
                 "kandevd/room/inner/__init__.py", "kandevd/hidden/__init__.py", "kandevd/leaf.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    modules = cs.find_modules(tmp_path)
    assert cs.unpictured(modules, tmp_path) == []  # a tree without the document
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/architecture.md").write_text(
        "# The house\n\n```\nfloor 1  room/   the room, and inner/ in it\n```\n\n"
        "Later text naming hidden/ does not count.\n")
    assert cs.unpictured(modules, tmp_path) == ["kandevd.hidden"]
    layers = {"kandevd": 0, "kandevd.room": 1, "kandevd.hidden": 1, "kandevd.leaf": 0}
    lines, problems = cs.check(tmp_path, layers=layers, pairs=[], sql_waiting=())
    assert "kandevd.hidden: not in the picture of docs/architecture.md" in lines
    assert problems == 1
