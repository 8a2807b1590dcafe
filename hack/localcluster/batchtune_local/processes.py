"""Starting, recognising and stopping the local cluster's own processes, by PID only."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Managed:
    """One process the cluster started: enough to find it again and to be sure it is still ours."""

    name: str
    pid: int
    start_ticks: int
    """Kernel start time of the process (field 22 of /proc/<pid>/stat); guards against PID reuse."""
    ports: tuple[int, ...]
    log: str


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks, or None if no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces; fields after it start past the last ')'.
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def is_alive(proc: Managed) -> bool:
    """True while the recorded process still runs (a zombie or a reused PID does not count)."""
    return start_ticks(proc.pid) == proc.start_ticks and _state(proc.pid) not in (None, "Z", "X")


def spawn(name: str, argv: list[str], log: Path, ports: tuple[int, ...] = (),
          env: dict[str, str] | None = None, cwd: Path | None = None) -> Managed:
    """Start `argv` in its own session (so a terminal's Ctrl-C does not reach it), output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=env, cwd=cwd, close_fds=True)
    ticks = start_ticks(child.pid)
    # Popen's handle is dropped on purpose: the process outlives this one; reap it via _reap later.
    child.returncode = 0
    return Managed(name=name, pid=child.pid, start_ticks=ticks or 0, ports=ports, log=str(log))


def _reap(pid: int) -> None:
    """Collect the exit status if the process is our child; harmless when it is not."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def session_members(sid: int) -> list[int]:
    """PIDs in session `sid` (our processes start their own session, so this finds their children)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def stop(proc: Managed, grace_s: float = 10.0) -> str:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; also ends what it left behind in its session.

    Returns what happened in a few words, for the caller's log line.
    """
    if not is_alive(proc):
        _reap(proc.pid)
        return "not running"
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(proc.pid)
        if not is_alive(proc):
            outcome = "stopped"
            break
        time.sleep(0.05)
    else:
        os.kill(proc.pid, signal.SIGKILL)
        while is_alive(proc):
            _reap(proc.pid)
            time.sleep(0.02)
        outcome = f"killed after {grace_s:g}s"
    # The session was created for this process, so anything still in it was started by it.
    leftovers = session_members(proc.pid)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if leftovers:
        outcome += f", killed {len(leftovers)} leftover process(es) of its session"
    return outcome


def listening_ports(host: str = "127.0.0.1") -> set[int]:
    """TCP ports in LISTEN state on `host` or on every address, from /proc/net/tcp."""
    wanted = {"".join(f"{int(o):02X}" for o in reversed(host.split("."))), "00000000"}
    ports = set()
    for table in ("/proc/net/tcp",):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            if fields[3] == "0A" and address in wanted:
                ports.add(int(port, 16))
    return ports


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago (all held open together while choosing)."""
    import socket

    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
