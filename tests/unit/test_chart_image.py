"""The operator image's Dockerfile (no Docker engine here): it parses, copies paths that exist, and
runs non-root with nothing written outside /tmp."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        out.append((op.upper(), rest.strip()))
    return out


def test_every_instruction_is_known():
    known = {"FROM", "WORKDIR", "COPY", "RUN", "LABEL", "ENV", "USER", "EXPOSE", "ENTRYPOINT", "CMD", "ARG"}
    assert {op for op, _ in instructions()} <= known


def test_base_is_python_311_slim_in_every_stage():
    bases = [rest.split()[0] for op, rest in instructions() if op == "FROM"]
    assert bases and all(b == "python:3.11-slim" for b in bases), bases


def test_copied_sources_exist_and_are_in_the_build_context():
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for op, rest in instructions():
        if op != "COPY" or rest.startswith("--from"):
            continue
        *sources, _dest = rest.split()
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: no such path"
            assert src.rstrip("/") in allowed, f"COPY {src}: excluded by .dockerignore"


def test_runs_as_the_non_root_user_the_chart_expects():
    users = [rest for op, rest in instructions() if op == "USER"]
    assert users[-1] == "65532:65532"
    values = yaml.safe_load((REPO / "charts" / "batchtune" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 65532


def test_runtime_writes_go_to_tmp():
    env = " ".join(rest for op, rest in instructions() if op == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert "MPLCONFIGDIR=/tmp" in env and "HOME=/tmp" in env


def test_entrypoint_is_the_cli_and_defaults_to_the_operator():
    ops = dict(instructions())
    assert json.loads(ops["ENTRYPOINT"]) == ["batchtune"]
    assert json.loads(ops["CMD"]) == ["operator"]
    scripts = (REPO / "pyproject.toml").read_text()
    assert 'batchtune = "batchtune.cli:main"' in scripts
