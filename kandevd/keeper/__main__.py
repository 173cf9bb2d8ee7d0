"""``python -m kandevd.keeper HOME``: the daemon starts the keeper so."""

import sys

from kandevd.keeper.server import main

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m kandevd.keeper HOME\n")
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
