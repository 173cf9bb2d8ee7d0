"""The benchmark scripts still speak to the code they measure (they run outside the suite,
so an API change would otherwise first show when someone runs them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
        del sys.modules[spec.name]
    return module


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py")))
def test_every_bench_script_imports(name: str) -> None:
    assert load(name).__doc__


def test_the_scheduler_bench_records_into_a_large_history(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    load("scheduler_bench").history_cost(tmp_path)
    assert "record_start: empty" in capsys.readouterr().out
