"""Smoke test of the operator image that `make image` builds (hack/image/build): the OCI archive in
out/ is unpacked with buildah (vfs storage, chroot isolation) and its commands are run inside it.

`make image` runs before the tier (`make test`, `make test-integration`); the fixture runs it again, a no-op when
out/ holds an image of the current sources. Needs root, like the build
(debootstrap, buildah's chroot isolation); skipped, saying so, only when buildah cannot run here.
Marked `integration` too, so `make test-unit` (-m 'not integration') never builds an image.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# `make test` and `make test-integration` build the image first, so the fixture's `make image` is a no-op check.
pytestmark = [pytest.mark.integration, pytest.mark.image, pytest.mark.timeout(300), pytest.mark.xdist_group("image")]

REPO = Path(__file__).resolve().parents[2]
ARCHIVE = REPO / "out" / "batchtune-image.oci.tar"
INFO = REPO / "out" / "batchtune-image.json"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
USER = "65532:65532"

# Imports every module of the operator's package (not __main__, which would run the CLI), then pyplot:
# a dependency missing from the image, or stripped from it, fails here.
IMPORT_ALL = """
import importlib, pkgutil, batchtune
names = [m.name for m in pkgutil.walk_packages(batchtune.__path__, "batchtune.")
         if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
import matplotlib.pyplot
print(batchtune.__version__, len(names))
"""


@dataclass(frozen=True)
class Image:
    buildah: list[str]  # buildah with this test's own storage
    container: str
    rootfs: Path  # the container's root filesystem on this machine (buildah mount)
    config: dict  # OCIv1 image config (buildah inspect)

    def run(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """argv inside the image as its configured user, environment and working directory."""
        proc = subprocess.run([*self.buildah, "run", "--isolation", "chroot", self.container, "--", *argv],
                              capture_output=True, text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"{argv} in the image: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc


def buildah_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the image build and buildah's chroot isolation need root (debootstrap, mounts)"
    return None


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    reason = buildah_unavailable()
    if reason:
        pytest.skip(f"buildah cannot run here: {reason}")
    # Builds when missing or stale, installing buildah/debootstrap/skopeo with apt when they are missing.
    build = subprocess.run(["make", "-s", "image"], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert build.returncode == 0, f"make image failed:\n{build.stdout}\n{build.stderr[-4000:]}"
    assert ARCHIVE.is_file(), f"make image left no {ARCHIVE}"
    storage = tmp_path_factory.mktemp("buildah")
    buildah = [shutil.which("buildah") or "buildah", "--root", str(storage / "root"),
               "--runroot", str(storage / "run"), "--storage-driver", "vfs"]
    container = subprocess.run([*buildah, "from", "-q", f"oci-archive:{ARCHIVE}"],
                               capture_output=True, text=True, check=True, timeout=300).stdout.strip()
    try:
        rootfs = Path(subprocess.run([*buildah, "mount", container], capture_output=True, text=True,
                                     check=True).stdout.strip())
        inspect = json.loads(subprocess.run([*buildah, "inspect", "--type", "container", container],
                                            capture_output=True, text=True, check=True).stdout)
        yield Image(buildah, container, rootfs, inspect["OCIv1"]["config"])
    finally:
        subprocess.run([*buildah, "rm", container], capture_output=True)
        shutil.rmtree(storage, ignore_errors=True)


def test_info_file_names_the_image_and_its_digest(image: Image):
    info = json.loads(INFO.read_text())
    assert info["image"] == f"batchtune:{VERSION}" and info["tag"] == VERSION
    assert info["digest"].startswith("sha256:") and len(info["digest"]) == 71
    index = json.loads(subprocess.run(["tar", "-xOf", str(ARCHIVE), "index.json"], capture_output=True,
                                      check=True).stdout)
    assert [m["digest"] for m in index["manifests"]] == [info["digest"]]


def test_config_runs_the_cli_as_the_non_root_user(image: Image):
    config = image.config
    assert config["User"] == USER
    assert config["Entrypoint"] == ["batchtune"]
    assert config["Cmd"] == ["operator"]
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["HOME"] == "/tmp" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["MPLCONFIGDIR"].startswith("/tmp/")
    assert image.run("id", "-u").stdout.strip() == "65532"
    passwd = (image.rootfs / "etc" / "passwd").read_text()
    assert "batchtune:x:65532:65532:" in passwd


def test_help_and_operator_help(image: Image):
    out = image.run("batchtune", "--help").stdout
    assert "usage: batchtune" in out and "operator" in out
    out = image.run("batchtune", "operator", "--help").stdout
    assert "usage: batchtune operator" in out
    assert image.run("batchtune", "--version").stdout.strip() == f"batchtune {VERSION}"


def test_no_test_infrastructure_pip_or_compilers_inside(image: Image):
    sites = list(image.rootfs.glob("opt/batchtune/lib/python3*/site-packages"))
    assert len(sites) == 1, sites
    site = sites[0]
    top = {p.name.split("-")[0].lower() for p in site.iterdir()}
    assert "batchtune" in top
    for unwanted in ("batchtune_local", "nodeagent", "pytest", "_pytest", "tests", "pip", "hypothesis"):
        assert unwanted not in top, f"{unwanted} in the image's site-packages"
    package = site / "batchtune"
    assert not list(package.rglob("nodeagent")) and not list(package.rglob("localcluster"))
    assert not list(site.rglob("batchtune_local*"))
    for compiler in ("gcc", "cc", "g++", "x86_64-linux-gnu-gcc-12"):
        assert not (image.rootfs / "usr" / "bin" / compiler).exists(), compiler
    assert not list(image.rootfs.glob("var/lib/apt/lists/*_Packages"))


def test_runs_on_a_read_only_root_with_only_tmp_writable(image: Image):
    """What the chart does (readOnlyRootFilesystem, an emptyDir on /tmp), reproduced here: the image's
    root filesystem bind-mounted read-only in a private mount namespace, a tmpfs on /tmp, and the
    image's own user, environment and working directory (buildah's run cannot make the root read-only)."""
    root = shlex.quote(str(image.rootfs))
    env = " ".join(shlex.quote(e) for e in ["/usr/bin/env", "-i", *image.config["Env"]])
    workdir = shlex.quote(image.config.get("WorkingDir") or "/")
    inner = (f"cd {workdir} && batchtune --help >/dev/null && python - && "
             "if touch /opt/batchtune/x 2>/dev/null; then echo the root is writable; exit 1; fi")
    script = (f"mount --bind {root} {root} && mount -o remount,bind,ro {root} && "
              f"mount -t proc proc {root}/proc && mount -t tmpfs -o mode=1777 tmpfs {root}/tmp && "
              f"mount --rbind /dev {root}/dev && "
              f"exec chroot --userspec={USER} {root} {env} /bin/sh -c {shlex.quote(inner)}")
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script],
                          input=IMPORT_ALL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    version, modules = proc.stdout.split()
    assert version == VERSION and int(modules) > 10
    assert "Read-only file system" not in proc.stderr, proc.stderr


@pytest.mark.timeout(600)  # above the rebuild's own 540 s bound (a warm build: ~50 s quiet, ~160 s under load)
def test_a_rebuild_of_the_same_sources_repeats_the_digest_the_archive_and_the_sbom(image: Image, tmp_path: Path):
    """`make image` twice from one commit gives the same image: digest, archive bytes and SBOM.

    The check is one more forced build of the same checkout into another out/ (the cached base root
    filesystem is reused, so it costs a warm build: ~50 s on a quiet machine, ~160 s under load; the
    debootstrap of the base is not repeated, and the base tarball is an input of both builds).
    """
    first = json.loads(INFO.read_text())
    out = tmp_path / "out"
    env = {**os.environ, "BATCHTUNE_IMAGE_FORCE": "1", "BATCHTUNE_IMAGE_OUT": str(out)}
    build = subprocess.run(["hack/image/build"], cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert build.returncode == 0, build.stderr[-4000:]
    again = json.loads((out / "batchtune-image.json").read_text())
    assert again["inputs"] == first["inputs"], "the sources changed between the two builds"
    assert again["digest"] == first["digest"]
    assert again["archive_sha256"] == first["archive_sha256"]
    assert (out / "batchtune-image.spdx.json").read_bytes() == (REPO / "out" / "batchtune-image.spdx.json").read_bytes()


def test_the_sbom_lists_what_is_installed_inside(image: Image):
    sbom = json.loads((image.rootfs / "opt" / "batchtune" / "sbom.spdx.json").read_text())
    assert sbom["spdxVersion"] == "SPDX-2.3"
    assert sbom == json.loads((REPO / "out" / "batchtune-image.spdx.json").read_text())
    names = {p["name"]: p["versionInfo"] for p in sbom["packages"]}
    assert names["batchtune"] == VERSION and "python3" in names and "dulwich" in names
    freeze = image.run("/opt/batchtune/bin/python", "-c",
                       "import importlib.metadata as m; print('\\n'.join(d.name + '==' + d.version "
                       "for d in m.distributions()))").stdout.split()
    for line in freeze:
        name, _, version = line.partition("==")
        assert names.get(name) == version, line
    pinned = {line for line in (REPO / "hack" / "image" / "requirements.lock").read_text().splitlines()
              if line and not line.startswith("#")}
    assert {f"{n}=={v}" for n, v in (x.partition("==")[::2] for x in freeze) if n != "batchtune"} <= pinned
