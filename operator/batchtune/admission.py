"""What the operator refuses in a spec before planning, beyond the CRD: one definition, called by the operator's
planning (controller/plan.py) and by `batchtune validate` (cli/validate.py), so the two give the same verdict in
the same words.

The install-independent rules live in the typed models (`batchtune.api`: image references, label names, keys);
these are the engine's rules on extra flags and the install's bounds (`core.install.Install`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchtune.api import ApplyMode, BatchTuningSpec, Generator
from batchtune.core.install import Install
from batchtune.core.policy import git_url_problem, load_image_problem, prometheus_url_problem
from batchtune.engines import Engine

ALLOW_NUMERICS_FIELD = "spec.apply.allowNumericsChange"


@dataclass
class Review:
    """A spec judged against the engine and the install."""

    invalid: list[str] = field(default_factory=list)
    """What no install allows (InvalidSpec): each message names the field and the value."""
    not_allowed: list[str] = field(default_factory=list)
    """What this install does not allow (NotAllowed)."""
    notes: list[str] = field(default_factory=list)
    """What the operator will do otherwise than the spec reads, or what only the cluster can decide."""


def review(engine: Engine, spec: BatchTuningSpec, install: Install, production_image: str | None) -> Review:
    """The engine's and the install's verdict on `spec`; `production_image` None: not known (offline)."""
    out = Review()
    for i, item in enumerate(spec.search_space.extra_args or ()):
        out.invalid += [f"spec.searchSpace.extraArgs[{i}] {p}" for p in engine.check_extra_args([item], install.extra_flags)]
    unconfirmed = numerics_unconfirmed(engine, spec)
    if unconfirmed and spec.apply.mode in (None, ApplyMode.AUTO):  # Recommend and PullRequest leave it to a person
        out.notes.append(numerics_message(unconfirmed))
    allowed = list(install.load_images)
    bench = spec.load.generator is Generator.VLLM_BENCH
    if bench:
        if engine.bench_argv("http://x", "m", None, 1, 1, 1, None, 1, 1, 0, "/tmp", "r.json") is None:
            out.not_allowed.append(f"spec.load.generator VllmBench: {engine.display} has no benchmark client; "
                                   "use Builtin")
        if production_image is not None:
            allowed.append(production_image)  # the engine's own bench, from production's image
    image = load_image_problem(spec.load.image, install.operator_image, allowed)
    if image and bench and production_image is None and "is not an image this install allows" in image:
        out.notes.append(f"spec.load.image {spec.load.image!r} must be the target's own image (VllmBench) or one of "
                         "load.allowedImages; the target's image is checked on the cluster")
    elif image:
        out.not_allowed.append(image)
    budget = spec.strategy.max_gpu_minutes
    if budget is not None and budget > install.max_gpu_minutes:
        out.notes.append(f"spec.strategy.maxGpuMinutes {budget} is above this install's ceiling "
                         f"({install.max_gpu_minutes}, Helm value maxGpuMinutesPerTuning): the operator holds the "
                         f"tuning to {install.max_gpu_minutes}")
    return out


def url_problems(spec: BatchTuningSpec, install: Install) -> list[str]:
    """The install's URL bounds as the operator applies them when it first queries Prometheus (controller/tick.py)
    and when it writes to Git (controller/gitdelivery.py). A forge API URL derived from the repository's is
    checked on the cluster only."""
    problems = []
    prometheus = prometheus_url_problem(spec.prometheus.url, install.prometheus_urls)
    if prometheus:
        problems.append(prometheus)
    git = spec.apply.git
    if git is not None:
        problem = git_url_problem(git.url, install.git_urls)
        if problem is None and git.forge is not None and git.forge.api_url:
            problem = git_url_problem(git.forge.api_url, install.git_urls, "spec.apply.git.forge.apiUrl")
        if problem:
            problems.append(problem)
    return problems


def numerics_unconfirmed(engine: Engine, spec: BatchTuningSpec) -> list[str]:
    """The extra flags that change production's outputs which the spec has not said Auto may apply."""
    if spec.apply.allow_numerics_change:
        return []
    return engine.numerics_in(list(spec.search_space.extra_args or ()))


def numerics_message(flags: list[str]) -> str:
    return (f"spec.searchSpace.extraArgs {', '.join(flags)} change(s) what production outputs (numerics or "
            f"sampling): Auto does not apply them unless {ALLOW_NUMERICS_FIELD} is true; the tuning ends Recommended "
            "(or opens a pull request with spec.apply.git)")


def install_flag_problems(engine: Engine, flags: list[str]) -> list[str]:
    """Why each of an install's extra flags (canonical names) cannot be allowed: unknown to the engine, or a knob."""
    problems = []
    for flag in flags:
        if flag in engine.knobs.all():
            problems.append(f"--{flag} is a knob batchtune tunes; it cannot be an allowed extra flag")
        elif not engine.knows(flag):
            problems.append(f"--{flag} is not a {engine.display} flag (spelled in full, no dashes in front)")
    return problems
