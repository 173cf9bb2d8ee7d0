"""Built-in agents. ``echo`` is the demo agent used when a profile has no command."""

from __future__ import annotations

import sys

ECHO_MODULE = "kandevd.agents.echo"


def echo_argv() -> tuple[str, ...]:
    """The argv of the built-in echo agent, run with the daemon's own interpreter.

    The child must be able to import ``kandevd`` (installed, or on PYTHONPATH),
    because its cwd is the run folder, not the source tree.
    """
    return (sys.executable, "-m", ECHO_MODULE)


__all__ = ["ECHO_MODULE", "echo_argv"]
