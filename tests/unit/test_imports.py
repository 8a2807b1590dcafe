"""Every module of the package imports on its own, first, in a fresh interpreter.

An import cycle hides when the usual entry point happens to import its modules in a kind order;
the image's smoke test imports them alphabetically and once caught controller.decide -> retune ->
plan -> decide. Here every module is the first one imported by its own interpreter.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

import pytest

import batchtune

MODULES = sorted(m.name for m in pkgutil.walk_packages(batchtune.__path__, "batchtune.")
                 if not m.name.endswith("__main__"))
# What the package's modules import from outside it (standard library and third party), as a whole import of the
# package leaves it: loaded once in the parent, so each child pays only for the package's own modules.
PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(" ".join(sorted({m.split(".")[0] for m in sys.modules if not m.startswith("__")} - {"batchtune"})))
"""
# One parent process with those dependencies loaded; each module is imported first by a fork of its own, in which no
# module of the package is loaded yet: the order of the package's own imports is what hides a cycle.
SCRIPT = """
import importlib, os, sys
for dep in os.environ["BATCHTUNE_IMPORT_DEPS"].split():
    try:
        importlib.import_module(dep)
    except ImportError:  # a name its owner registers itself (Cython's shared module, ...): the owner loads it
        pass
assert not [m for m in sys.modules if m == "batchtune" or m.startswith("batchtune.")], "a dependency loaded the package"
failed = []
for name in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
        except BaseException as exc:
            os.write(write, f"{type(exc).__name__}: {exc}".encode()[:4000])
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if status:
        failed.append(f"{name}: {message or f'exit status {status}'}")
print("\\n".join(failed))
"""


@pytest.mark.timeout(400)  # above the probe's and the run's own 120 + 240 s
def test_every_module_imports_first_in_its_own_interpreter():
    probe = subprocess.run([sys.executable, "-c", PROBE, *MODULES], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    env = dict(os.environ, BATCHTUNE_IMPORT_DEPS=probe.stdout)
    done = subprocess.run([sys.executable, "-c", SCRIPT, *MODULES], capture_output=True, text=True, timeout=240,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout
    assert len(MODULES) > 50


def test_the_operators_command_line_loads_no_numpy():
    # Every `batchtune` process builds the whole parser, the operator's included; the load generator's
    # statistics (numpy, ~14 MB of RSS) load only when a load run asks for them (batchtune.loadgen's PEP 562).
    script = ("import sys; from batchtune.cli import build_parser; build_parser(); "
              "print('numpy' in sys.modules, 'batchtune.loadgen.stats' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_the_load_generators_names_load_on_first_use():
    import batchtune.loadgen as loadgen
    from batchtune.loadgen.runner import LoadRun
    from batchtune.loadgen.stats import compute_result

    assert loadgen.LoadRun is LoadRun
    assert loadgen.compute_result is compute_result
    assert set(loadgen.__all__) <= set(loadgen._WHERE)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        loadgen.nothing  # noqa: B018


def test_the_operator_loads_no_git_client_plotting_or_numpy():
    # What `batchtune operator` imports before its first tick (controller/main.py's run): dulwich (~3 MB of RSS) loads
    # only when a PullRequest tick asks for a repository (controller.giterrors holds what the loop catches),
    # matplotlib only in the report image's own process, numpy only with the twin or the load generator.
    script = ("import sys; from batchtune.controller import handlers, telemetry; "
              "print(*(any(m == top or m.startswith(top + '.') for m in sys.modules) "
              "for top in ('dulwich', 'matplotlib', 'numpy')))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False"]
