"""scripts/gpu_tests/run.sh names only tests that exist, and the quick tier's pairwise cut keeps
every parameter value and every pair of values of each parametrized test."""

from __future__ import annotations

import subprocess
import sys
from itertools import combinations
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests_pairwise import case_values, pairwise_subset  # noqa: E402


def tier_paths(*flags: str) -> list[str]:
    out = subprocess.run(["bash", "scripts/gpu_tests/run.sh", "-", "--paths", *flags], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.mark.parametrize("flags", [(), ("--multi",)], ids=["one_gpu", "multi_gpu"])
def test_every_path_of_a_tier_exists_and_holds_tests(flags):
    paths = tier_paths(*flags)
    assert paths
    for p in paths:
        assert (REPO / p).exists(), p
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
                         cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    collected = {line.split("::")[0] for line in run.stdout.splitlines() if "::" in line}
    for p in paths:
        assert any(c == p or c.startswith(p.rstrip("/") + "/") for c in collected), f"{p}: no test collected"


def _case(name: str, **params):
    return SimpleNamespace(nodeid=f"t.py::{name}[{'-'.join(map(str, params.values()))}]",
                           callspec=SimpleNamespace(params=params))


def test_the_pairwise_cut_covers_every_pair_with_fewer_cases():
    grid = [_case("f", a=a, b=b, c=c, d=d) for a in range(3) for b in range(3) for c in range(2) for d in "xyz"]
    plain = SimpleNamespace(nodeid="t.py::g")
    kept = pairwise_subset([plain, *grid])
    assert plain in kept and len(kept) < len(grid) // 2
    want = set()
    for case in grid:
        want |= set(combinations(case_values(case), 2))
    got = set()
    for case in kept[1:]:
        got |= set(combinations(case_values(case), 2))
    assert got == want
