"""Suite-wide hooks: long integration work is scheduled first, and tests near their timeout are named.

- Integration tests run in lanes (pytest-xdist, `--dist loadgroup`, each worker with clusters of its own; see
  hack/test-suite). A module whose tests share an expensive module-scoped fixture marks itself
  `xdist_group(...)`, so one worker runs it whole. (xdist's own loadgroup renames items to carry the group, which
  pytest 9.2 no longer honours: the first worker writes each test's group to a file and GroupScheduling reads it.)
  Work units are ordered by their expected length, the sum of their tests' explicit timeouts (a test without one
  counts as short), so the longest start first and the lanes finish together.
- Every test's setup, call and teardown together are held against its effective timeout (pytest-timeout's
  marker, else the ini's). The summary names each test that used more than NEAR_TIMEOUT of it, and each test
  that ran longer than LONG_S without an explicit timeout of its own.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

NEAR_TIMEOUT = 0.6
"""A test that takes more than this share of its timeout is one slow machine away from failing."""
LONG_S = 60.0
"""A test that runs this long states its own timeout (`@pytest.mark.timeout(N)`) with headroom."""
SHORT_WEIGHT_S = 30.0
"""The expected length of a test without an explicit timeout, for ordering."""


def explicit_timeout(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return None
    value = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
    return float(value) if value is not None else None


def effective_timeout(item: pytest.Item) -> float | None:
    explicit = explicit_timeout(item)
    if explicit is not None:
        return explicit
    raw = item.config.getini("timeout")
    return float(raw) if raw not in (None, "") and float(raw) > 0 else None


def work_unit(item: pytest.Item) -> str:
    """The unit loadgroup schedules: the item's xdist group, else the item itself."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.kwargs.get("name", marker.args[0] if marker.args else "default"))
    return item.nodeid


GROUPS_KEY = "batchtune_groups_file"


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or config.getoption("dist", "no") != "loadgroup":
        return
    handle, path = tempfile.mkstemp(prefix="batchtune-xdist-groups-", suffix=".json")
    os.close(handle)
    config.stash[GROUPS_STASH] = Path(path)


GROUPS_STASH = pytest.StashKey[Path]()


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(GROUPS_STASH, None)
    if path is not None:
        path.unlink(missing_ok=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # noqa: ANN001  # xdist's WorkerController
    path = node.config.stash.get(GROUPS_STASH, None)
    if path is not None:
        node.workerinput[GROUPS_KEY] = str(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    path = config.stash.get(GROUPS_STASH, None)
    if path is None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """loadgroup's units: a test's xdist group as its first worker wrote it down, else the test alone."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                text = path.read_text(encoding="utf-8")
                self.groups = json.loads(text) if text.strip() else {}
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    worker = getattr(config, "workerinput", {})
    if GROUPS_KEY in worker and worker.get("workerid") == "gw0":
        groups = {i.nodeid: work_unit(i) for i in items if i.get_closest_marker("xdist_group")}
        Path(worker[GROUPS_KEY]).write_text(json.dumps(groups), encoding="utf-8")
    for item in items:
        timeout = effective_timeout(item)
        item.user_properties.append(("timeout_s", timeout))
        item.user_properties.append(("explicit_timeout", explicit_timeout(item) is not None))
    integration = [i for i in items if i.get_closest_marker("integration")]
    if not integration:
        return
    weight: dict[str, float] = defaultdict(float)
    first_seen: dict[str, int] = {}
    for index, item in enumerate(integration):
        unit = work_unit(item)
        weight[unit] += explicit_timeout(item) or SHORT_WEIGHT_S
        first_seen.setdefault(unit, index)
    position = {id(item): index for index, item in enumerate(integration)}
    # Longest units first; a unit's tests stay together and in their own order (some modules rely on it).
    integration.sort(key=lambda i: (-weight[work_unit(i)], first_seen[work_unit(i)], position[id(i)]))
    others = [i for i in items if not i.get_closest_marker("integration")]
    items[:] = others + integration


class Clock:
    """Each test's total time over its phases, and what it was allowed."""

    def __init__(self) -> None:
        self.took: dict[str, float] = defaultdict(float)
        self.allowed: dict[str, float | None] = {}
        self.explicit: dict[str, bool] = {}

    def add(self, report: pytest.TestReport) -> None:
        self.took[report.nodeid] += report.duration
        props = dict(report.user_properties)
        if "timeout_s" in props:
            self.allowed[report.nodeid] = props["timeout_s"]
            self.explicit[report.nodeid] = bool(props.get("explicit_timeout"))

    def warnings(self) -> list[str]:
        lines = []
        for nodeid, took in sorted(self.took.items(), key=lambda kv: -kv[1]):
            allowed = self.allowed.get(nodeid)
            if allowed and took > NEAR_TIMEOUT * allowed:
                lines.append(f"NEAR TIMEOUT  {nodeid}: {took:.0f} s of its {allowed:.0f} s ({took / allowed:.0%})")
            if took > LONG_S and not self.explicit.get(nodeid, False):
                lines.append(f"NO OWN TIMEOUT  {nodeid}: {took:.0f} s under the default timeout")
        return lines


CLOCK = Clock()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    CLOCK.add(report)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    if hasattr(config, "workerinput"):  # an xdist worker: the controller summarises
        return
    lines = CLOCK.warnings()
    if lines:
        terminalreporter.section("tests near their timeout")
        for line in lines:
            terminalreporter.write_line(line)
