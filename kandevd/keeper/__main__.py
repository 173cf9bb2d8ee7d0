"""``python -m kandevd.keeper HOME``: the daemon starts the keeper so."""

import errno
import logging
import os
import sys
from pathlib import Path

from kandevd.keeper.server import AlreadyRunning, Keeper

log = logging.getLogger("kandevd.keeper")


def main(home: str) -> int:
    """Serve until there is no more to keep."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s "
                        "%(name)s[%(process)d]: %(message)s")
    os.chdir("/")
    try:
        keeper = Keeper(Path(home))
    except AlreadyRunning:
        log.info("a keeper already serves %s", home)
        return 0
    except OSError as exc:
        log.error("keeper cannot start in %s: %s", home, exc)
        return 1 if exc.errno != errno.EACCES else 77
    keeper.serve()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m kandevd.keeper HOME\n")
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
