"""``kandevd db``: check and back up the database file (works while the daemon runs),
and copy it into PostgreSQL (``db migrate``: only while no daemon uses the home)."""

from __future__ import annotations

import importlib.util
import sqlite3
import sys
from pathlib import Path

import click

from kandevd import exits
from kandevd.app.homelock import HomeLock, HomeLocked
from kandevd.cli.common import home_option
from kandevd.net.urls import POSTGRES_SCHEMES, redact_url, scrub_secrets
from kandevd.paths import HomeLayout, resolve_home
from kandevd.store.backend import POSTGRES_EXTRA
from kandevd.store.check import DatabaseUnusable, backup, check_file


@click.group()
def db() -> None:
    """Check, back up or migrate the database (<home>/kandevd.db)."""


def _sqlite_path(home: str | None, command: str) -> Path:
    """The home's SQLite file; a home whose config names a PostgreSQL ``store.url`` (and
    has no such file) is told so, exit 1, instead of 'no such file'."""
    root = resolve_home(home)
    path = HomeLayout(root).db
    if not path.exists():
        try:
            from kandevd.config import load_config
            url = load_config(None, home=root).store.url
        except Exception:  # (a config that does not load: the file's absence says enough)
            url = None
        if url is not None:
            click.echo(f"kandevd: this home's store is PostgreSQL ({redact_url(url)}): "
                       f"`kandevd db {command}` works on a SQLite home's file; use "
                       "PostgreSQL's own tools (pg_dump, amcheck)", err=True)
            sys.exit(exits.ERROR)
    return path


@db.command("check")
@home_option
def check(home: str | None) -> None:
    """Run SQLite's quick_check and integrity_check (read-only); exit 1 on problems."""
    path = _sqlite_path(home, "check")
    try:
        results = check_file(path)
    except DatabaseUnusable as exc:
        click.echo(f"kandevd: {exc}", err=True)
        sys.exit(exits.IOERR)
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
        sys.exit(exits.ERROR)


@db.command("backup")
@click.argument("target", type=click.Path(dir_okay=False, path_type=Path))
@home_option
def backup_command(target: Path, home: str | None) -> None:
    """Copy the database to TARGET (a new file), consistent while the daemon writes."""
    path = _sqlite_path(home, "backup")
    try:
        pages = backup(path, target)
    except DatabaseUnusable as exc:
        click.echo(f"kandevd: {exc}", err=True)
        sys.exit(exits.IOERR)
    except OSError as exc:
        if str(exc.filename) == str(target) and exc.strerror:  # (the copy cannot be made)
            click.echo(f"kandevd: backup {target}: {exc.strerror}", err=True)
            sys.exit(exits.CANTCREAT)
        click.echo(f"kandevd: backup {target}: {exc}", err=True)
        sys.exit(exits.IOERR)
    click.echo(f"backed up {path} to {target} ({pages} pages)")


@db.command("migrate")
@click.option("--to", "url", required=True, metavar="URL",
              help="The PostgreSQL database to copy into (postgresql://user:password@host/db);"
                   " it must hold no kandevd data.")
@home_option
def migrate_command(url: str, home: str | None) -> None:
    """Copy the home's SQLite database into an empty PostgreSQL database.

    Every table (runs with their seq, workspaces, agents, workflows, tasks,
    Office config) is copied in one transaction, then counted on both sides:
    one line per table, exit 1 naming any that differ (the copy is then
    rolled back). Refused while a daemon uses the home, which stays locked
    during the copy; refused into a database that already holds data.
    """
    shown = redact_url(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in POSTGRES_SCHEMES:
        click.echo(f"kandevd: --to: {shown} is not a PostgreSQL URL "
                   "(postgresql://user:password@host/database)", err=True)
        sys.exit(exits.USAGE)
    if importlib.util.find_spec("psycopg") is None:
        click.echo(f"kandevd: --to {shown} needs the PostgreSQL driver (psycopg 3), which is "
                   f"not installed: {POSTGRES_EXTRA}", err=True)
        sys.exit(exits.CONFIG)
    layout = HomeLayout(resolve_home(home))
    if not layout.db.is_file():
        what = "is not a file" if layout.db.exists() else "does not exist"
        click.echo(f"kandevd: database {layout.db}: {what}: nothing to migrate "
                   "(is --home right?)", err=True)
        sys.exit(exits.IOERR)
    # The daemon's own lock: refused while one runs, and none can start during the copy.
    lock = HomeLock(layout.lock)
    try:
        lock.acquire()
    except HomeLocked as exc:
        click.echo(f"kandevd: {exc}; stop it before migrating", err=True)
        sys.exit(exits.TEMPFAIL)
    except OSError as exc:
        click.echo(f"kandevd: cannot lock home {layout.root}: {exc}", err=True)
        sys.exit(exits.CANTCREAT)
    try:
        code = _migrate(layout.db, url, shown)
    finally:
        lock.release()
    if code:
        sys.exit(code)


def _migrate(path: Path, url: str, shown: str) -> int:
    """The copy of ``path`` into ``url`` (the home locked); the exit status."""
    from kandevd.store.copy import (
        CopyError,
        SourceUnusable,
        TargetNotEmpty,
        VerificationFailed,
        copy_tables,
        open_source,
        plan,
    )
    from kandevd.store.open import open_store

    try:
        source = open_source(path)
    except SourceUnusable as exc:
        click.echo(f"kandevd: {exc}", err=True)
        return exits.IOERR
    try:
        try:
            store = open_store(url)
        except (sqlite3.Error, RuntimeError) as exc:
            click.echo(f"kandevd: cannot open {shown}: {scrub_secrets(str(exc), url)}", err=True)
            return exits.IOERR
        try:
            plans = plan(source, store)
            total = sum(table.rows for table in plans)
            with click.progressbar(length=total, label=f"copying {total} rows",
                                   file=sys.stderr, hidden=not sys.stderr.isatty()) as bar:
                counts = copy_tables(source, store, plans, progress=bar.update)
        except TargetNotEmpty as exc:
            click.echo(f"kandevd: {shown} is not empty ({exc}): migrate into a new, empty "
                       "database; nothing was written", err=True)
            return exits.ERROR
        except VerificationFailed as exc:
            for count in exc.counts:
                click.echo(f"{count.name}: {count.source} rows" + (
                    "" if count.matches else f" (target: {count.target})"))
            click.echo(f"kandevd: verification failed: the row counts of "
                       f"{', '.join(exc.mismatched)} differ; the copy was rolled back, "
                       f"{shown} holds none of it", err=True)
            return exits.ERROR
        except SourceUnusable as exc:
            click.echo(f"kandevd: database {path}: {exc}; the copy was rolled back, {shown} "
                       "holds none of it", err=True)
            return exits.IOERR
        except CopyError as exc:
            click.echo(f"kandevd: {scrub_secrets(str(exc), url)}; nothing was written", err=True)
            return exits.ERROR
        except sqlite3.Error as exc:
            click.echo(f"kandevd: copying into {shown} failed: {scrub_secrets(str(exc), url)}; the "
                       f"copy was rolled back, {shown} holds none of it", err=True)
            return exits.ERROR
        finally:
            store.close()
    finally:
        source.close()
    for count in counts:
        click.echo(f"{count.name}: {count.target} rows")
    click.echo(f"verified: {len(counts)} tables, {sum(c.target for c in counts)} rows copied "
               f"from {path} to {shown}")
    return 0
