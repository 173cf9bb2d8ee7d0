"""The exit codes of every ``kandevd`` command, in one table (sysexits where they apply)."""

from __future__ import annotations

OK = 0
#: An error answer from the daemon, a failed check, or a forced stop (second signal).
ERROR = 1
FORCED = ERROR
#: Bad usage: click's own code for an unknown option or a missing argument.
USAGE = 2
#: A file named on the command line has bad contents (EX_DATAERR): an empty token file.
DATAERR = 65
#: A file named on the command line cannot be read (EX_NOINPUT): a runner's token file.
NOINPUT = 66
#: No daemon listens on the socket (EX_UNAVAILABLE).
UNAVAILABLE = 69
#: The home cannot be created or written (EX_CANTCREAT).
CANTCREAT = 73
#: The database cannot be opened or fails its check (EX_IOERR).
IOERR = 74
#: The home is held by another live daemon (EX_TEMPFAIL).
TEMPFAIL = 75
#: The server refused a runner's token (EX_NOPERM): revoked, or never registered.
NOPERM = 77
#: A bad config (EX_CONFIG) for ``serve`` and ``db``; ``validate`` answers it with ERROR (its
#: contract is exit 0/1), with the same one-line reason.
CONFIG = 78
