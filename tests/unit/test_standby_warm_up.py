"""A standby imports, while it waits, every batchtune module a tick would import on first use
(`handlers.warm_up`): a takeover's first tick on a starved CPU does not pay for them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CONTROLLER = Path(__file__).resolve().parents[2] / "operator" / "batchtune" / "controller"
NOT_ON_A_TICK = {"main.py", "leader.py"}
"""The process's start and the election: they run before any tick."""


def lazy_imports() -> set[str]:
    """Every batchtune module a controller function imports inside its body."""
    found: set[str] = set()
    for path in CONTROLLER.glob("*.py"):
        if path.name in NOT_ON_A_TICK:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("batchtune"):
                        found.add(str(inner.module))
    return found


def test_the_walker_finds_the_lazy_imports() -> None:
    assert "batchtune.twin.prefilter" in lazy_imports()


def test_after_warm_up_every_lazy_import_of_a_tick_is_loaded() -> None:
    probe = (
        "import sys\n"
        "from batchtune.controller import handlers\n"
        "handlers.warm_up()\n"
        f"missing = sorted(m for m in {sorted(lazy_imports())!r} if m not in sys.modules)\n"
        "print(missing)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(CONTROLLER.parents[1]), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]", out.stdout
