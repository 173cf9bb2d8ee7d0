"""``kandevd db``: check and back up the database file (works while the daemon runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kandevd.cli_common import home_option
from kandevd.paths import HomeLayout, resolve_home
from kandevd.store.check import DatabaseUnusable, backup, check_file

EXIT_PROBLEMS = 1
EXIT_IOERR = 74


@click.group()
def db() -> None:
    """Check or back up the database (<home>/kandevd.db)."""


@db.command("check")
@home_option
def check(home: str | None) -> None:
    """Run SQLite's quick_check and integrity_check (read-only); exit 1 on problems."""
    path = HomeLayout(resolve_home(home)).db
    try:
        results = check_file(path)
    except DatabaseUnusable as exc:
        click.echo(f"kandevd: {exc}", err=True)
        sys.exit(EXIT_IOERR)
    failed = False
    for name, problems in results.items():
        if problems:
            failed = True
            click.echo(f"{name}: {len(problems)} problem(s)")
            for problem in problems[:20]:
                click.echo(f"  {problem}")
        else:
            click.echo(f"{name}: ok")
    if failed:
        click.echo(f"{path} is damaged: restore a backup, or recover what is left with "
                   f"`sqlite3 {path} .recover | sqlite3 recovered.db`", err=True)
        sys.exit(EXIT_PROBLEMS)


@db.command("backup")
@click.argument("target", type=click.Path(dir_okay=False, path_type=Path))
@home_option
def backup_command(target: Path, home: str | None) -> None:
    """Copy the database to TARGET (a new file), consistent while the daemon writes."""
    path = HomeLayout(resolve_home(home)).db
    try:
        pages = backup(path, target)
    except DatabaseUnusable as exc:
        click.echo(f"kandevd: {exc}", err=True)
        sys.exit(EXIT_IOERR)
    except OSError as exc:
        click.echo(f"kandevd: backup {target}: {exc}", err=True)
        sys.exit(EXIT_IOERR)
    click.echo(f"backed up {path} to {target} ({pages} pages)")
