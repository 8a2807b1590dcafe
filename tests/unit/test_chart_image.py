"""The operator image as hack/image/build configures it agrees with the chart, read statically (the
image itself is built and run by tests/integration/test_image.py): user 65532, writes only to /tmp,
entrypoint the CLI, and the chart's default image is the one `make image` tags."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "hack" / "image" / "build"
CHART = REPO / "charts" / "batchtune"


def config_flags() -> dict[str, list[str]]:
    """The `bah config ...` flags of the build script, as flag -> values (in order)."""
    text = BUILD.read_text()
    block = re.search(r"^bah config \\\n(.*?)\"\$ctr\"\n", text, re.S | re.M)
    assert block, "no `bah config` call in hack/image/build"
    words = shlex.split(block.group(1).replace("\\\n", " "))
    flags: dict[str, list[str]] = {}
    for flag, value in zip(words[::2], words[1::2], strict=True):
        flags.setdefault(flag, []).append(value)
    return flags


def script_value(name: str) -> str:
    match = re.search(rf"^{name}=(\S+)$", BUILD.read_text(), re.M)
    assert match, f"{name}= not set in hack/image/build"
    return match.group(1)


def test_runs_as_the_non_root_user_the_chart_expects():
    uid = script_value("UID_GID")
    assert config_flags()["--user"] == ["$UID_GID:$UID_GID"] and uid == "65532"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["podSecurityContext"]["runAsGroup"] == int(uid)
    assert values["securityContext"]["readOnlyRootFilesystem"] is True
    assert "batchtune:x:$UID_GID:$UID_GID:" in BUILD.read_text()


def test_runtime_writes_go_to_tmp():
    env = dict(e.split("=", 1) for e in config_flags()["--env"])
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["HOME"] == "/tmp" and env["MPLCONFIGDIR"].startswith("/tmp/")
    assert env["XDG_CACHE_HOME"].startswith("/tmp/")
    assert env["PATH"].split(":")[0] == "/opt/batchtune/bin"
    assert config_flags()["--workingdir"] == ["/tmp"]


def test_entrypoint_is_the_cli_and_defaults_to_the_operator():
    flags = config_flags()
    assert [json.loads(v) for v in flags["--entrypoint"]] == [["batchtune"]]
    assert [json.loads(v) for v in flags["--cmd"]] == [["operator"]]
    assert 'batchtune = "batchtune.cli:main"' in (REPO / "pyproject.toml").read_text()


def test_the_chart_default_is_the_image_make_image_tags():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image = yaml.safe_load((CHART / "values.yaml").read_text())["image"]
    # `make image` tags batchtune:<version>; the chart's tag defaults to appVersion.
    assert script_value("NAME") == "batchtune" and script_value("IMAGE") == "$NAME:$VERSION"
    assert image["repository"] == "batchtune" and image["tag"] == "" and chart["appVersion"] == version


def test_no_made_up_registry_or_dockerfile():
    assert not (REPO / "Dockerfile").exists(), "the image is built by hack/image/build, not a Dockerfile"
    for path in [*CHART.rglob("*"), *(REPO / "manifests").rglob("*.yaml"), *(REPO / "docs").glob("*.md"),
                 REPO / "README.md", *(REPO / "hack" / "demo").glob("*.yaml")]:
        if path.is_file():
            assert "ghcr.io" not in path.read_text(errors="replace"), path
