"""Recycled attempt folders: emptied before they are parked, reused under a new name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kandevd.runtime import attempts as recycle
from kandevd.runtime.records import read_exit_status, read_record


def attempt(parent: Path, name: str, **files: str) -> Path:
    directory = parent / name
    directory.mkdir(parents=True)
    for file, text in files.items():
        (directory / file).write_text(text)
    return directory


def test_a_parked_folder_is_empty_and_comes_back_under_the_new_name(tmp_path: Path) -> None:
    pool = recycle.FolderPool(tmp_path)
    done = attempt(tmp_path, "run_a.t1", **{"record.json": '{"pid": 1}', "exit": "0\n",
                                            "stdout": "out\n", "summary.json": "{}",
                                            "outcome.json": "{}"})
    inodes = {name: os.stat(done / name).st_ino for name in recycle.KEPT_FILES}
    assert pool.put(done)
    assert not done.exists()
    (parked,) = [p for p in tmp_path.iterdir() if recycle.is_free(p.name)]
    # The stdout file is not kept: a process the agent left may still be writing to it.
    assert sorted(p.name for p in parked.iterdir()) == sorted(recycle.KEPT_FILES)
    assert all(p.stat().st_size == 0 for p in parked.iterdir())
    target = tmp_path / "run_b.t7"
    assert pool.take(target)
    # The same files (no inode allocated): empty, so neither a record nor an exit status.
    assert {name: os.stat(target / name).st_ino for name in recycle.KEPT_FILES} == inodes
    assert read_record(target) is None and read_exit_status(target) is None
    assert not pool.take(tmp_path / "run_c.t1")  # nothing left to take


def test_a_new_pool_finds_the_folders_an_earlier_daemon_parked(tmp_path: Path) -> None:
    assert recycle.FolderPool(tmp_path).put(attempt(tmp_path, "run_a.t1", exit="3\n"))
    again = recycle.FolderPool(tmp_path)  # a restarted daemon
    assert again.take(tmp_path / "run_b.t1")
    assert (tmp_path / "run_b.t1" / "exit").read_text() == ""


def test_a_taken_name_that_holds_files_is_left_alone(tmp_path: Path) -> None:
    pool = recycle.FolderPool(tmp_path)
    assert pool.put(attempt(tmp_path, "run_a.t1"))
    occupied = attempt(tmp_path, "run_b.t1", exit="0\n")
    assert not pool.take(occupied)  # never replaced: the caller clears it itself
    assert (occupied / "exit").read_text() == "0\n"
    assert pool.take(tmp_path / "run_c.t1")  # the free folder is still there


def test_the_pool_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recycle, "LIMIT", 2)
    pool = recycle.FolderPool(tmp_path)
    folders = [attempt(tmp_path, f"run_{n}.t") for n in range(3)]
    assert [pool.put(folder) for folder in folders] == [True, True, False]
    assert folders[2].is_dir()  # the caller removes it


def test_a_late_writer_of_the_last_stdout_never_reaches_the_next_attempt(tmp_path: Path) -> None:
    """A process the agent left behind keeps its stdout open: its writes must land in a
    file nobody reads, not in the stdout of the attempt that takes the folder next."""
    pool = recycle.FolderPool(tmp_path)
    done = attempt(tmp_path, "run_a.t1", stdout="")
    with open(done / "stdout", "a") as late:  # opened by path, as the shim's >> does
        assert pool.put(done)
        target = tmp_path / "run_b.t1"
        assert pool.take(target)
        late.write("a secret of run_a\n")
    assert not (target / "stdout").exists()


def test_emptying_a_taken_folder_again_drops_what_a_lost_emptying_left(tmp_path: Path) -> None:
    """A power cut can keep a parked folder's rename and lose its emptying: the runner
    empties the folder it took once more, creating nothing."""
    pool = recycle.FolderPool(tmp_path)
    assert pool.put(attempt(tmp_path, "run_a.t1"))
    (parked,) = [p for p in tmp_path.iterdir() if recycle.is_free(p.name)]
    for name, text in (("record.json", '{"run_id": "run_a"}'), ("exit", "0\n"),
                       ("summary.json", "{}"), ("outcome.json", "{}"), ("stdout", "x")):
        (parked / name).write_text(text)  # as if the emptying never reached the disk
    target = tmp_path / "run_b.t1"
    assert pool.take(target)
    recycle.empty(target)
    assert sorted(p.name for p in target.iterdir()) == sorted(recycle.KEPT_FILES)
    assert all(p.stat().st_size == 0 for p in target.iterdir())
    assert read_record(target) is None and read_exit_status(target) is None
