"""Folders kandevd creates: every missing one private, an existing one untouched."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kandevd.fsutil import ensure_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_missing_folder_is_made_private_and_an_existing_one_is_kept(
        tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    deep = shared / "a" / "b" / "c"
    assert ensure_dir(deep) == deep
    assert [mode(p) for p in (shared / "a", shared / "a" / "b", deep)] == [0o700] * 3
    assert mode(shared) == 0o755  # (existing: left as it was)
    leaf = deep / "d"  # only the leaf missing: made at once
    assert ensure_dir(leaf) == leaf and mode(leaf) == 0o700
    assert ensure_dir(leaf) == leaf  # existing: nothing to do


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        ensure_dir(tmp_path / "file")
    with pytest.raises(NotADirectoryError):
        ensure_dir(tmp_path / "file" / "below")
