"""The README's example block works when pasted: run verbatim (bash) on a temp home."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[3] / "README.md"


def example_block() -> str:
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if b.startswith("kandevd serve --home /tmp/h &")]
    return block


def test_the_readme_example_block_runs_verbatim(tmp_path: Path) -> None:
    home = tmp_path / "h"
    script = "set -e\n" + example_block().replace("/tmp/h", str(home))
    bin_dir = str(Path(sys.executable).parent)
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.rstrip().endswith("Graceful shutdown complete"), done.stderr[-2000:]
    assert "hello" in done.stdout  # `runs list` shows the run
