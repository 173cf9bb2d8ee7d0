"""``kandevd init``: lay out a home, from an example, with a systemd unit."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import click

from kandevd import exits
from kandevd.cli.common import home_option
from kandevd.paths import HomeError, HomeLayout, resolve_home

#: What the package ships beside its code: examples/ and conf/ (package data).
DATA_DIR = Path(__file__).resolve().parent.parent
UNIT_NAME = "kandevd.service"


def copy_example(source: Path, root: Path, *, force: bool) -> tuple[list[Path], list[Path]]:
    """Copy the example ``source`` into ``root``; ``(written, kept)`` relative paths.

    A file that already exists in the home is kept as it is (the user may have
    edited it) unless ``force``. What is written is private: new folders 0700,
    files 0600 (0700 when executable); the home itself and everything else in
    it keep their modes.
    """
    written: list[Path] = []
    kept: list[Path] = []
    for folder, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = Path(folder).relative_to(source)
        target_dir = root / rel
        if not target_dir.exists():
            target_dir.mkdir(mode=0o700, parents=True)
        for name in sorted(files):
            origin = Path(folder) / name
            target = target_dir / name
            if target.exists() and not force:
                kept.append(rel / name)
                continue
            shutil.copyfile(origin, target)
            os.chmod(target, 0o700 if os.access(origin, os.X_OK) else 0o600)
            written.append(rel / name)
    return written, kept


@click.command()
@home_option
@click.option("--example", default=None, help="Copy examples/NAME into the home (e.g. demo).")
@click.option("--force", is_flag=True, help="Overwrite files of the example that exist already.")
@click.option("--systemd", is_flag=True,
              help="Also write <home>/kandevd.service, a systemd unit for this home.")
def init(home: str | None, example: str | None, force: bool, systemd: bool) -> None:
    """Lay out a home directory (new folders 0700), optionally from an example.

    Nothing that exists is overwritten (it says what it kept; --force
    overwrites the example's files). Bad arguments fail before anything is
    created. An existing home keeps its mode (a warning says so when it is not
    0700); a home that cannot be created or written exits 73.
    """
    root = resolve_home(home)
    layout = HomeLayout(root)
    source: Path | None = None
    if example:
        from kandevd.paths import check_safe_name

        try:
            check_safe_name(example, "example")
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        source = DATA_DIR / "examples" / example
        if not source.is_dir():
            examples = DATA_DIR / "examples"
            known = sorted(p.name for p in examples.iterdir()) if examples.is_dir() else []
            raise click.ClickException(f"no example named {example!r} (known: {known})")
    try:
        layout.prepare(warn=lambda message: click.echo(f"kandevd: warning: {message}", err=True))
        layout.workspace.mkdir(mode=0o700, exist_ok=True)
        written, kept = copy_example(source, root, force=force) if source else ([], [])
    except HomeError as exc:
        click.echo(f"kandevd: cannot use home {root}: {exc}", err=True)
        sys.exit(exits.CANTCREAT)
    except OSError as exc:
        click.echo(f"kandevd: cannot use home {root}: {exc.strerror or exc}", err=True)
        sys.exit(exits.CANTCREAT)
    for path in kept:
        click.echo(f"kept {root / path} (it exists; --force overwrites it)")
    if written:
        click.echo(f"wrote {len(written)} file(s) of example {example!r}")
    if systemd:
        write_unit(root, force=force)
    click.echo(f"home ready: {root}")
    click.echo(f"next: kandevd serve --home {root}")


def write_unit(root: Path, *, force: bool) -> None:
    """``<home>/kandevd.service``: the shipped unit, run by this kandevd on this home."""
    target = root / UNIT_NAME
    if target.exists() and not force:
        click.echo(f"kept {target} (it exists; --force overwrites it)")
        return
    text = (DATA_DIR / "conf" / UNIT_NAME).read_text(encoding="utf-8")
    # The kandevd of this interpreter (its virtualenv's), else the one on PATH.
    command = (shutil.which("kandevd", path=os.path.dirname(sys.executable))
               or shutil.which("kandevd") or f"{sys.executable} -m kandevd")
    text = text.replace("ExecStart=%h/.local/bin/kandevd serve",
                        f"ExecStart={command} serve --home {root}")
    try:
        target.write_text(text, encoding="utf-8")
        os.chmod(target, 0o600)
    except OSError as exc:
        click.echo(f"kandevd: cannot write {target}: {exc.strerror or exc}", err=True)
        sys.exit(exits.CANTCREAT)
    click.echo(f"wrote {target}; install it with: systemctl --user link {target} && "
               "systemctl --user enable --now kandevd")
