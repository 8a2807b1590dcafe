"""Inference engines behind one small interface (`Engine`); vLLM is the first.

    engine, container = find_engine_container(pod_spec, spec.target_ref.container_name)
    invocation = engine.read(container)                 # model, knobs, flags
    trial = engine.rewrite(container, setting, extra)   # only the knobs change
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from batchtune.core.settings import percent_to_fraction
from batchtune.engines.base import (
    Engine,
    FailureSignature,
    Invocation,
    KnobFlags,
    MetricConventions,
)
from batchtune.engines.commandline import ArgsError, UnsafeShell
from batchtune.engines.vllm import VLLM

ENGINES: tuple[Engine, ...] = (VLLM,)


def find_engine_container(pod_spec: Mapping[str, Any], name: str | None = None,
                          engines: Sequence[Engine] = ENGINES) -> tuple[Engine, dict[str, Any]]:
    """The container running an engine: the named one, else the only one whose command line is an engine's."""
    containers = list(pod_spec.get("containers") or [])
    names = [str(c.get("name")) for c in containers]
    if name is not None:
        return _named_container(containers, name, names, engines)
    found: list[tuple[Engine, dict[str, Any]]] = []
    unsafe: list[UnsafeShell] = []
    why: list[str] = []
    for c in containers:
        engine = _engine_of(c, engines, unsafe, why)
        if engine is not None:
            found.append((engine, c))
    if not found and len(unsafe) == 1:
        raise unsafe[0]  # it is the engine's container; say why it cannot be tuned, not that it is missing
    if len(found) == 1:
        return found[0]
    known = " or ".join(e.display for e in engines)
    if not found:
        raise ArgsError(",".join(names) or "?", f"no container runs {known}; set spec.targetRef.containerName"
                        + (f" ({'; '.join(why)})" if why else ""))
    raise ArgsError(",".join(str(c.get("name")) for _, c in found),
                    f"several containers run {known}; set spec.targetRef.containerName to choose one")


def _named_container(containers: list[dict[str, Any]], name: str, names: list[str],
                     engines: Sequence[Engine]) -> tuple[Engine, dict[str, Any]]:
    """spec.targetRef.containerName's container, which must run an engine that can be tuned."""
    for c in containers:
        if c.get("name") != name:
            continue
        for engine in engines:
            if engine.recognizes(c):
                engine.parse(c)  # raises UnsafeShell naming why it cannot be tuned
                return engine, c
        engines[0].parse(c)  # raises ArgsError naming why it is not the engine
    raise ArgsError(name, f"no such container in the pod template (containers: {', '.join(names) or 'none'})")


def _engine_of(container: dict[str, Any], engines: Sequence[Engine], unsafe: list[UnsafeShell],
               why: list[str]) -> Engine | None:
    """The first engine whose command line the container runs; None, noting in `unsafe` a container that runs one
    in a shell it cannot be tuned through, and in `why` what each engine found instead."""
    for engine in engines:
        try:
            engine.parse(container)
        except UnsafeShell as exc:
            unsafe.append(exc)
            return None
        except ArgsError as exc:
            why.append(str(exc))
            continue
        return engine
    return None


def engine_named(name: str) -> Engine:
    for engine in ENGINES:
        if engine.name == name:
            return engine
    raise KeyError(f"unknown engine {name!r} (known: {', '.join(e.name for e in ENGINES)})")


__all__ = [
    "ENGINES", "VLLM", "ArgsError", "Engine", "FailureSignature", "Invocation", "KnobFlags", "MetricConventions",
    "UnsafeShell", "engine_named", "find_engine_container", "percent_to_fraction",
]
