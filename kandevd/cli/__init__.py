"""The ``kandevd`` command line (click): one module per command group."""

from kandevd.cli.main import cli, main

__all__ = ["cli", "main"]
