"""One container run as a local process group: start, poll, signal, and re-adoption after an agent restart."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

# Return code of an adopted process that has gone: its real exit status died with the old agent.
EXIT_UNKNOWN = -1000


def start_ticks(pid: int) -> int | None:
    """The process start time in clock ticks since boot (/proc/PID/stat field 22), None if gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


LOWEST_NICENESS = 19


def lowest_cpu_priority(pid: int) -> None:
    """The process group `pid` leads at the lowest CPU priority: SCHED_IDLE (a waking normal task preempts it at
    once), niceness 19, and its session's autogroup at niceness 19. With autogroup scheduling
    (/proc/sys/kernel/sched_autogroup_enabled) a niceness orders processes only within a session, and each container
    is a session of its own, so the autogroup's niceness is what weighs it against the control plane's processes.
    Applied as the process starts (it has not started threads or children yet); a kernel without autogroups has no
    /proc/PID/autogroup, and the task's own priority is all there is."""
    with contextlib.suppress(ProcessLookupError):
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        os.setpriority(os.PRIO_PGRP, pid, LOWEST_NICENESS)
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        Path(f"/proc/{pid}/autogroup").write_text(str(LOWEST_NICENESS))


class ContainerProcess:
    """A container's process group (the leader's PID is the group ID)."""

    def __init__(self, pid: int, ticks: int, popen: subprocess.Popen[bytes] | None) -> None:
        self.pid = pid
        self.ticks = ticks
        self.popen = popen
        self.killed_by_agent = False
        self.returncode: int | None = None

    @classmethod
    def start(
        cls, argv: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike[str], log_path: str | os.PathLike[str],
        idle: bool = False,
    ) -> ContainerProcess:
        """Start the container's command in a session of its own; `idle`: at the lowest CPU priority
        (`lowest_cpu_priority`)."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            )
        if idle:
            lowest_cpu_priority(popen.pid)
        return cls(popen.pid, start_ticks(popen.pid) or 0, popen)

    @classmethod
    def adopt(cls, pid: int, ticks: int) -> ContainerProcess | None:
        """The process recorded by an earlier agent, if that very process (same start time) still runs."""
        if pid <= 1 or start_ticks(pid) != ticks:
            return None
        return cls(pid, ticks, None)

    def poll(self) -> int | None:
        """None while running; else the return code (negative: killed by that signal; EXIT_UNKNOWN: adopted)."""
        if self.returncode is not None:
            return self.returncode
        if self.popen is not None:
            code = self.popen.poll()
        else:
            code = None if start_ticks(self.pid) == self.ticks else EXIT_UNKNOWN
        if code is not None:
            self.returncode = code
            # The kubelet tears down the whole container; take any stragglers of the group with it.
            self.signal(signal.SIGKILL, mark=False)
        return code

    def signal(self, sig: int, mark: bool = True) -> None:
        if mark and sig in (signal.SIGTERM, signal.SIGKILL):
            self.killed_by_agent = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        """Wait up to `timeout` seconds for the exit; the return code or None."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
            return self.poll()
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.poll() is not None:
                return self.returncode
            time.sleep(0.05)
        return self.poll()
