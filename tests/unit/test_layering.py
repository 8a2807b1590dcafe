"""The layering contracts `make lint` checks (pyproject.toml, lint-imports) still cover the whole package.

A forbidden-imports contract lists modules by name: a new top-level module the core's list does not name could be
imported by the core without the linter noticing. The contracts themselves run in `make lint`.
"""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import batchtune

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def contracts() -> list[dict]:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]


def test_the_core_contract_names_every_other_top_level_module():
    core = next(c for c in contracts() if c.get("source_modules") == ["batchtune.core"])
    top = {f"batchtune.{m.name}" for m in pkgutil.iter_modules(batchtune.__path__)} - {"batchtune.core",
                                                                                        "batchtune.__main__"}
    assert top - set(core["forbidden_modules"]) == set()
    assert set(core["forbidden_modules"]) - top == set()  # no stale names either


def test_every_controller_phase_is_in_the_independence_contract():
    phases = next(c for c in contracts() if c["type"] == "independence")["modules"]
    from batchtune.controller.reconcile import STEPS

    assert {f"{step.__module__}" for step in STEPS.values()} <= set(phases)


def test_the_cycle_contract_covers_the_whole_package():
    assert any(c["type"] == "acyclic_siblings" and c["ancestors"] == ["batchtune"] for c in contracts())
