"""The suite's own scheduling (tests/conftest.py): xdist groups stay on one worker, the longest work goes first,
and a test near its timeout is named in the summary. Run on a throwaway test tree with the suite's conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
TESTS = '''
import os, time, pathlib, pytest
pytestmark = pytest.mark.integration

def where(name):
    (pathlib.Path(__file__).parent / f"ran-{name}").write_text(os.environ.get("PYTEST_XDIST_WORKER", "none"))

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    where(f"grouped-{i}")

@pytest.mark.parametrize("i", range(4))
def test_spread(i):
    time.sleep(0.5)
    where(f"spread-{i}")

@pytest.mark.timeout(1)
def test_slow_for_its_timeout():
    time.sleep(0.7)
'''


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    integration: x\ntimeout = 300\n")
    (tmp_path / "test_sample.py").write_text(TESTS)
    return tmp_path


def run(tree: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not the outer run's worker
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "-rA", *args],
                          cwd=tree, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return done.stdout


def test_a_group_runs_on_one_worker_and_others_spread(tree):
    out = run(tree, "-n", "3", "--dist", "loadgroup", "--no-loadscope-reorder")
    grouped = {p.read_text() for p in tree.glob("ran-grouped-*")}
    spread = {p.read_text() for p in tree.glob("ran-spread-*")}
    assert len(list(tree.glob("ran-grouped-*"))) == 4 and len(grouped) == 1, (grouped, out[-2000:])
    assert len(spread) >= 2 and grouped <= {"gw0", "gw1", "gw2"}, (spread, out[-2000:])


def test_longest_work_first_and_a_slow_test_is_named(tree):
    out = run(tree, "-v")
    order = [line.split("::")[1].split()[0] for line in out.splitlines() if line.startswith("test_sample.py::")]
    # The group (4 tests x 30 s expected) outweighs each lone test; the 1 s-timeout test weighs least.
    assert order[:4] == [f"test_grouped[{i}]" for i in range(4)] and order[-1] == "test_slow_for_its_timeout", order
    assert "NEAR TIMEOUT  test_sample.py::test_slow_for_its_timeout" in out, out[-2000:]
