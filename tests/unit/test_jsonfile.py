"""JsonFile: atomic replace, corrupt files moved aside (never lost), locked updates."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from kandevd.formats.jsonfile import CorruptFile, JsonFile, JsonFileError
from tests.support.daemon import as_ordinary_user


def test_write_then_read_round_trips_and_leaves_no_temp_file(tmp_path: Path) -> None:
    handle = JsonFile(tmp_path / "sub" / "data.json")
    handle.write({"a": [1, 2, "é"]})
    assert handle.read({}) == {"a": [1, 2, "é"]}
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["data.json",
                                                                    "data.json.lock"]


def test_a_missing_file_reads_as_a_copy_of_the_default(tmp_path: Path) -> None:
    default: list[int] = []
    value = JsonFile(tmp_path / "absent.json").read(default)
    value.append(1)
    assert default == []
    assert not (tmp_path / "absent.json").exists()


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[NaN]", b"[1e999]x"])
def test_a_corrupt_file_is_moved_aside_with_its_bytes_and_reported(tmp_path: Path,
                                                                   content: bytes) -> None:
    path = tmp_path / "history.json"
    path.write_bytes(content)
    reports: list[CorruptFile] = []
    handle = JsonFile(path, on_corrupt=reports.append)
    assert handle.update(lambda v: [*v, "new"], [], expect=list) == ["new"]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("history.json.corrupt-")]
    assert len(aside) == 1
    assert aside[0].read_bytes() == content
    assert json.loads(path.read_text()) == ["new"]
    assert len(reports) == 1 and reports[0].moved_to == str(aside[0])
    assert reports[0].path == str(path) and str(path) not in reports[0].error


def test_a_file_of_the_wrong_json_type_is_moved_aside_too(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    path.write_text('{"an": "object"}')
    assert JsonFile(path).read([], expect=list) == []
    assert [p.name for p in tmp_path.iterdir() if "corrupt" in p.name]
    assert not path.exists()


def test_read_strict_raises_instead_of_moving(tmp_path: Path) -> None:
    path = tmp_path / "workflow.json"
    path.write_text("{broken")
    with pytest.raises(JsonFileError, match=r"workflow\.json: not valid JSON"):
        JsonFile(path).read_strict()
    assert path.read_text() == "{broken"


def test_non_json_values_are_never_written(tmp_path: Path) -> None:
    handle = JsonFile(tmp_path / "x.json")
    handle.write([1])
    with pytest.raises(ValueError):
        handle.write([float("nan")])
    assert handle.read([]) == [1]


def _append_many(path: str, tag: str, count: int, cache: bool) -> None:
    handle = JsonFile(Path(path), cache=cache)
    for i in range(count):
        handle.update(lambda entries, i=i: [f"{tag}-{i}", *entries], [], expect=list)


@pytest.mark.parametrize("cache", [False, True])
def test_two_processes_appending_to_one_file_lose_nothing(tmp_path: Path, cache: bool) -> None:
    path = tmp_path / "schedule-runs.json"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_append_many, args=(str(path), tag, 60, cache))
               for tag in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    entries = json.loads(path.read_text())
    assert sorted(entries) == sorted([f"a-{i}" for i in range(60)] +
                                     [f"b-{i}" for i in range(60)])


def test_a_cached_file_sees_writes_made_by_anyone_else(tmp_path: Path) -> None:
    path = tmp_path / "runs.json"
    cached = JsonFile(path, cache=True)
    cached.update(lambda v: [{"id": 1}, *v], [], expect=list)
    JsonFile(path).write([{"id": "external"}])  # another writer (another process, say)
    cached.update(lambda v: [{"id": 2}, *v], [], expect=list)
    assert json.loads(path.read_text()) == [{"id": 2}, {"id": "external"}]


def test_a_cached_list_is_written_one_item_per_line_and_replaced_items_are_re_encoded(
        tmp_path: Path) -> None:
    path = tmp_path / "runs.json"
    cached = JsonFile(path, cache=True)
    cached.update(lambda v: [{"id": 1, "s": "running"}, {"id": 0}], [], expect=list)

    def finish(items: list) -> list:
        items[0] = {**items[0], "s": "done"}
        return items
    cached.update(finish, [], expect=list)
    assert path.read_text().splitlines() == ["[", '{"id": 1, "s": "done"},', '{"id": 0}', "]"]


def test_a_file_that_cannot_be_read_now_is_left_alone_never_moved_aside(
        tmp_path: Path) -> None:
    """No permission (or no file descriptor left, an I/O error) is not corruption: read
    and update raise JsonFileUnreadable, an OSError, and the file stays where it is.
    (In a child bound by file modes: root reads any mode otherwise.)"""
    target = tmp_path / "state.json"
    target.write_text('{"kept": true}')
    target.chmod(0o000)
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from kandevd.formats.jsonfile import JsonFile, JsonFileUnreadable\n"
        f"f = JsonFile(Path({str(target)!r}))\n"
        "for call in (lambda: f.read({}), lambda: f.update(lambda v: v, {})):\n"
        "    try:\n"
        "        call()\n"
        "    except JsonFileUnreadable as exc:\n"
        "        assert isinstance(exc, OSError)\n"
        "        print('unreadable:', exc)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          preexec_fn=as_ordinary_user(), timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"unreadable: {target}: cannot read: Permission "
                                        "denied"] * 2
    target.chmod(0o600)
    assert target.read_text() == '{"kept": true}'
    assert [p.name for p in tmp_path.iterdir() if "corrupt" in p.name] == []
