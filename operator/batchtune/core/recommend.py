"""The recommendation: the chosen setting as production's new command line, and ready-made patches.

What production would run is exactly what the trials ran: the target's container rewritten by the
engine with the chosen knobs and the spec's extra args, every other word as it was.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from batchtune.core.objective import Objective
from batchtune.core.settings import Setting, percent_to_fraction

if TYPE_CHECKING:
    from batchtune.core.planning import SearchSpace
    from batchtune.engines import Engine


MAX_COMMAND_LINE_WORDS = 64
"""Words a container's `command` and `args` may have together: status keeps production's
command line and the recommended one whole (baseline, recommendation, applied), each list bounded in the CRD so the
largest BatchTuning fits in etcd (issue 22 section 9). A vLLM command line is 10 to 40 words."""
MAX_COMMAND_LINE_CHARACTERS = 4096
"""Characters a container's `command` and `args` may have together (a vLLM command line has a few hundred): status
keeps eight such lists, and the CRD bounds their total (issue 22 section 9), not each word, so one word may hold a
JSON-valued flag or a whole shell-form script."""
MAX_COMMAND_LINE_WORD_LENGTH = MAX_COMMAND_LINE_CHARACTERS
"""Characters one word may have: the whole command line's."""
MAX_COMMAND_LINE_JSON = 2 * MAX_COMMAND_LINE_CHARACTERS
"""Characters the command line may take spelled as JSON (escapes: a quote takes two, a character outside ASCII six),
so that the ready-made patches in status always hold it whole."""


def command_line_characters(words: Iterable[str]) -> int:
    """A command line's characters, its words together (what `MAX_COMMAND_LINE_CHARACTERS` bounds)."""
    return sum(len(word) for word in words)


@dataclass(frozen=True)
class ContainerArgs:
    command: tuple[str, ...] | None
    args: tuple[str, ...] | None

    @classmethod
    def of(cls, container: Mapping[str, Any]) -> ContainerArgs:
        command, args = container.get("command"), container.get("args")
        return cls(None if command is None else tuple(str(a) for a in command),
                   None if args is None else tuple(str(a) for a in args))

    def flat(self) -> list[str]:
        return list(self.command or ()) + list(self.args or ())

    def to_wire(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        if self.command is not None:
            out["command"] = list(self.command)
        if self.args is not None:
            out["args"] = list(self.args)
        return out


def command_line_problem(args: ContainerArgs, where: str) -> str | None:
    """Why status cannot keep this command line whole, or None: `where` names the container (its fields follow,
    `.command`, `.args`). A longer one is refused, never cut: a cut command line would run, and on rollback
    restore, a different container."""
    for field, words in (("command", args.command), ("args", args.args)):
        if words is None:
            continue
        if len(words) > MAX_COMMAND_LINE_WORDS:
            return (f"{where}.{field} has {len(words)} words, more than the {MAX_COMMAND_LINE_WORDS} batchtune keeps "
                    "in status; it refuses the target rather than cut its command line")
        for i, word in enumerate(words):
            if len(word) > MAX_COMMAND_LINE_WORD_LENGTH:
                return (f"{where}.{field}[{i}] is {len(word)} characters long, more than the "
                        f"{MAX_COMMAND_LINE_WORD_LENGTH} batchtune keeps in status; it refuses the target rather "
                        "than cut its command line (a long value can come from a file the container reads)")
    flat = args.flat()
    if len(flat) > MAX_COMMAND_LINE_WORDS:
        return (f"{where}.command and .args together have {len(flat)} words, more than the "
                f"{MAX_COMMAND_LINE_WORDS} batchtune keeps in status (status.recommendation.args is the whole command "
                "line); it refuses the target rather than cut its command line")
    characters, spelled = command_line_characters(flat), len(json.dumps(flat))
    if characters > MAX_COMMAND_LINE_CHARACTERS or spelled > MAX_COMMAND_LINE_JSON:
        return (f"{where}.command and .args together have {characters} characters ({spelled} spelled as JSON), more "
                f"than the {MAX_COMMAND_LINE_CHARACTERS} ({MAX_COMMAND_LINE_JSON}) batchtune keeps in status; it "
                "refuses the target rather than cut its command line (a long value can come from a file the "
                "container reads)")
    return None


@dataclass(frozen=True)
class Recommendation:
    setting: Setting
    container_name: str
    container: ContainerArgs
    """The container's command and args with the setting applied."""
    json_patch: str
    kustomize_patch: str
    helm_values: str


def unmeasured(setting: Setting, space: SearchSpace, measured: Iterable[Setting]) -> str | None:
    """Why production may not get `setting`, or None: it must be a point of spec.searchSpace that a trial of this
    generation measured. Status is no evidence (anyone who may write it can write any setting there); the spec and
    the trials bound what is applied."""
    if not space.contains(setting):
        return (f"the recommended setting {setting.label()} is outside spec.searchSpace (maxNumSeqs "
                f"{list(space.max_num_seqs)}, gpuMemoryUtilizationPercent {list(space.gpu_memory_utilization_percent)}"
                + (f", maxNumBatchedTokens {list(space.max_num_batched_tokens)}" if space.max_num_batched_tokens
                   else "") + ")")
    if setting not in set(measured):
        return f"no trial of this generation measured the recommended setting {setting.label()}"
    return None


def production_args(engine: Engine, container: Mapping[str, Any], setting: Setting,
                    extra_args: Sequence[str]) -> ContainerArgs:
    """Production's command line running `setting` and the trials' extra args."""
    return ContainerArgs.of(engine.rewrite(container, setting, extra_args))


def recommend(engine: Engine, target: Mapping[str, Any], container: Mapping[str, Any], setting: Setting,
              extra_args: Sequence[str]) -> Recommendation:
    new = engine.rewrite(container, setting, extra_args)
    name = str(container["name"])
    containers = ((target.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []
    index = next(i for i, c in enumerate(containers) if c.get("name") == name)
    ops = []
    for field_name in ("command", "args"):
        if new.get(field_name) != container.get(field_name):
            op = "replace" if field_name in container else "add"
            ops.append({"op": op, "path": f"/spec/template/spec/containers/{index}/{field_name}",
                        "value": new.get(field_name)})
    kustomize = kustomize_patch(target, name, new)
    knobs: dict[str, Any] = {"maxNumSeqs": setting.max_num_seqs,
                             "gpuMemoryUtilization": float(percent_to_fraction(setting.gpu_memory_utilization_percent))}
    if setting.max_num_batched_tokens:
        knobs["maxNumBatchedTokens"] = setting.max_num_batched_tokens
    helm = yaml.safe_dump({engine.name: knobs, "extraArgs": engine.setting_args(setting) + list(extra_args)},
                          sort_keys=False)
    return Recommendation(
        setting=setting, container_name=name, container=ContainerArgs.of(new),
        json_patch=json.dumps(ops, indent=2), kustomize_patch=kustomize,
        helm_values="# Values for charts that expose the engine's flags; adapt the keys to your chart.\n" + helm)


def kustomize_patch(target: Mapping[str, Any], container_name: str, container: Mapping[str, Any]) -> str:
    """A strategic-merge patch setting one container's command and args as `container` has them."""
    patch: dict[str, Any] = {"apiVersion": "apps/v1", "kind": "Deployment",
                             "metadata": {"name": (target.get("metadata") or {}).get("name")},
                             "spec": {"template": {"spec": {"containers": [
                                 {"name": container_name,
                                  **{k: container[k] for k in ("command", "args") if k in container}}]}}}}
    return yaml.safe_dump(patch, sort_keys=False)


def replicas_needed(capacity_per_second: float | None, peak_per_second: float | None) -> int | None:
    """Replicas that serve production's observed peak (all replicas together) at one replica's SLO capacity.

    The capacity is measured under the headroom-adjusted SLO limits, so the headroom is in it and is
    not taken off again. None when either figure is unknown or not positive.
    """
    if capacity_per_second is None or peak_per_second is None:
        return None
    if not (math.isfinite(capacity_per_second) and math.isfinite(peak_per_second)):
        return None
    if capacity_per_second <= 0 or peak_per_second <= 0:
        return None
    return max(1, math.ceil(peak_per_second / capacity_per_second))


@dataclass(frozen=True)
class ReplicaHint:
    replicas: int | None
    basis: str
    """How the number was reached, or why there is none."""


def replica_hint(objective: Objective | str, capacities: Sequence[float | None], peak_per_second: float | None,
                 peak_source: str, headroom_percent: int) -> ReplicaHint:
    """How many replicas of the chosen setting serve production's observed peak within the SLO.

    `capacities` are the chosen setting's SLO capacities, one per repeat (requests per second one
    replica held at the highest load that met the SLO less `headroom_percent`): the worst repeat
    counts. The headroom is counted once, there. Only objectives whose trials search that load
    (SloCapacity, Goodput) have a capacity; a fixed-load objective measured one load, not what a
    replica holds, and gets no hint rather than a guess.
    """
    objective = Objective(objective)
    if not objective.searches_capacity:
        return ReplicaHint(None, f"no replica hint: the {objective.value} objective measures one fixed load, not "
                                 "the load a replica holds within the SLO (use SloCapacity or Goodput)")
    known = [c for c in capacities if c is not None and math.isfinite(c) and c > 0]
    if not known or len(known) < len(capacities):
        return ReplicaHint(None, "no replica hint: the chosen setting's SLO capacity was not measured in every repeat")
    capacity = min(known)
    replicas = replicas_needed(capacity, peak_per_second)
    if replicas is None:
        return ReplicaHint(None, f"no replica hint: production's peak request rate is unknown ({peak_source})")
    assert peak_per_second is not None
    return ReplicaHint(replicas, f"ceil(peak {peak_per_second:.3g} req/s ({peak_source}) / SLO capacity "
                                 f"{capacity:.3g} req/s per replica) = {replicas}; the capacity already keeps "
                                 f"{headroom_percent}% headroom under the SLO targets, so no more is added")
