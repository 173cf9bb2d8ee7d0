"""Unix socket addresses for paths of any depth.

A unix socket's path must fit in ``sun_path`` (108 bytes, its NUL included), yet a
home may lie deeper than that. Both the control socket and the keeper's reach such
a path through its folder: Linux resolves ``/proc/self/fd/<fd>/<name>`` to that
folder's entry for ``bind`` and ``connect``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

#: The longest path ``sun_path`` holds (108 bytes, its NUL included).
MAX_ADDRESS = 107


@contextlib.contextmanager
def address(path: Path) -> Iterator[str]:
    """``path`` as a unix socket address, usable only inside the ``with`` block."""
    text = str(path)
    if len(os.fsencode(text)) <= MAX_ADDRESS:
        yield text
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)
