"""The operator's wheel holds the product only: no node agent, no local cluster, no tests."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_wheel_ships_no_test_tooling(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel, = tmp_path.glob("batchtune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("batchtune/controller/") for n in names)
    assert any(n == "batchtune/engines/vllm_flags.json" for n in names)  # package data the engine reads
    leaked = [n for n in names if n.startswith(("batchtune_local", "tests/")) or "/nodeagent/" in n
              or "/localcluster/" in n]
    assert leaked == []
