"""Folders kandevd creates: every missing one private, an existing one untouched."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kandevd.fsutil import ensure_dir, make_spread_dirs


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


def top_of_hierarchy(folder: Path) -> bool | None:
    """Is ``folder`` marked the top of a hierarchy (``chattr +T``)? None: no such mark here."""
    import fcntl
    import os
    import sys

    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = bytearray(8)
        fcntl.ioctl(fd, 0x80086601, flags, True)
    except OSError:
        return None
    finally:
        os.close(fd)
    return bool(int.from_bytes(flags[:4], sys.byteorder) & 0x00020000)


def test_spread_folders_are_made_private_under_their_names_and_kept_when_there(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "runs").mkdir(mode=0o755)
    (home / "runs" / "r1").mkdir()
    (home / "file").write_text("mine")
    marked = make_spread_dirs(home, ["logs", "runs", "attempts", "file"])
    assert sorted(p.name for p in home.iterdir()) == ["attempts", "file", "logs", "runs"]
    assert mode(home / "logs") == mode(home / "attempts") == 0o700
    assert mode(home / "runs") == 0o755 and (home / "runs" / "r1").is_dir()  # (kept)
    assert (home / "file").read_text() == "mine"  # (a file in the way: left alone)
    # Marked where the file system takes the mark (ext4); tmpfs refuses it.
    assert top_of_hierarchy(home) in ((True,) if marked else (False, None))
    assert make_spread_dirs(home, ["logs"]) == marked  # nothing missing: nothing done
    assert sorted(p.name for p in home.iterdir()) == ["attempts", "file", "logs", "runs"]


def test_a_home_kandevd_creates_gets_its_run_folders_spread_and_an_existing_one_is_kept(
        tmp_path: Path) -> None:
    from kandevd.paths import HomeLayout

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    takes_the_mark = make_spread_dirs(scratch, ["x"])
    new = tmp_path / "new"
    HomeLayout(new).prepare()
    assert sorted(p.name for p in new.iterdir()) == ["attempts", "logs", "runs"]
    assert top_of_hierarchy(new) in ((True,) if takes_the_mark else (False, None))
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o700)
    HomeLayout(existing).prepare()
    assert sorted(p.name for p in existing.iterdir()) == ["logs"]  # (the rest made on use)
    assert top_of_hierarchy(existing) in (False, None)
