"""The engine seam: everything batchtune knows about one inference server, behind one small class.

An engine says how its command line reads (entry point, flags and their spellings), which flags are
the three tuned knobs, which extra flags a BatchTuning may add, its metric names and labels, how its
startup failures read, and how it reports readiness. The planner, the manifests, the measurement and
the twin ask the engine; none of them names a flag or a metric itself. docs/engines.md shows how to
add one (one module plus its tests).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from batchtune.core.planning import EngineLimits
from batchtune.core.settings import Setting, percent_to_fraction
from batchtune.core.vocabulary import Reason
from batchtune.engines import commandline
from batchtune.engines.commandline import ArgsError, Arity, CommandLine, Grammar

# Kubernetes expands $(VAR) in command and args: a spec must never smuggle a value in through it.
_K8S_EXPANSION = re.compile(r"\$\([A-Za-z_][A-Za-z0-9_]*\)")

# Metric roles an engine names (CRD `spec.prometheus.metricNames` keys, snake_case).
ENGINE_METRIC_ROLES = (
    "e2e_request_latency", "time_to_first_token", "inter_token_latency", "request_queue_time",
    "generation_tokens", "prompt_tokens", "request_success", "num_preemptions", "num_requests_running",
    "num_requests_waiting", "kv_cache_usage", "cache_config_info", "request_prompt_tokens",
    "request_generation_tokens", "iteration_tokens", "prefix_cache_queries", "prefix_cache_hits",
)


@dataclass(frozen=True)
class Invocation:
    """What a container runs, read for the baseline."""

    engine: str
    container: str
    form: str
    """How the engine is started: an entry point name, "entrypoint" (the image's own), or "shell+..."."""
    model: str | None
    served_model: str | None
    """The model label the engine puts on its metrics and the name requests use."""
    flags: Mapping[str, str | None]
    """Canonical flag name (no leading dashes) -> last value (None for switches)."""
    argv: tuple[str, ...]
    """The engine's own argv after its entry point, as written."""
    max_num_seqs: int | None = None
    gpu_memory_utilization_percent: int | None = None
    max_num_batched_tokens: int | None = None

    def setting(self, default_gpu_memory_utilization_percent: int, default_max_num_seqs: int | None = None) -> Setting | None:
        """The baseline as a Setting (engine defaults filled in where given), or None if unknown."""
        seqs = self.max_num_seqs if self.max_num_seqs is not None else default_max_num_seqs
        if seqs is None:
            return None
        gmu = self.gpu_memory_utilization_percent or default_gpu_memory_utilization_percent
        return Setting(seqs, gmu, self.max_num_batched_tokens)


@dataclass(frozen=True)
class FlagValue:
    """What an extra flag's value may be, so a typo fails validation instead of every trial after a model load."""

    kind: Literal["switch", "int", "choice", "word", "any"]
    """switch: no value; int: a decimal integer in [low, high]; choice: one of `choices`; word: [A-Za-z0-9_.-]+;
    any: a many-word or optional value, not checked beyond the control-character rule."""
    low: int = 0
    high: int = 2**31 - 1
    choices: tuple[str, ...] = ()

    def problem(self, value: str | None) -> str | None:
        """Why `value` is not this flag's value, or None."""
        if self.kind == "switch":
            return None if value is None else f"is a switch and takes no value (got {value!r})"
        if self.kind == "any":
            return None
        if value is None or value == "":
            return "needs a value (--name=value)"
        if self.kind == "int":
            if not re.fullmatch(r"-?[0-9]{1,12}", value):
                return f"takes a whole number (got {value!r})"
            if not self.low <= int(value) <= self.high:
                return f"takes a whole number from {self.low} to {self.high} (got {value})"
        elif self.kind == "choice" and value not in self.choices:
            return f"takes one of {', '.join(self.choices)} (got {value!r})"
        elif self.kind == "word" and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", value):
            return f"takes a word of letters, digits, '_', '.' or '-' (got {value!r})"
        return None


@dataclass(frozen=True)
class KnobFlags:
    """The engine's flag (canonical, no dashes) for each tuned knob."""

    max_num_seqs: str
    gpu_memory_utilization: str
    max_num_batched_tokens: str

    def all(self) -> tuple[str, str, str]:
        return (self.max_num_seqs, self.gpu_memory_utilization, self.max_num_batched_tokens)


@dataclass(frozen=True)
class FailureSignature:
    """A startup failure as the engine prints it (lower-case substrings of its log or exit message)."""

    reason: Reason
    texts: tuple[str, ...]


@dataclass(frozen=True)
class MetricConventions:
    names: Mapping[str, str]
    """Role -> the engine's current metric name."""
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Role -> older names of the same series, queried as `current or legacy` unless overridden."""
    model_label: str | None = "model_name"
    finished_reason_label: str | None = None
    error_finish_reasons: tuple[str, ...] = ()
    """Finish reasons of failed requests. Not relied on alone: a client disconnect may not count."""
    http_requests: str | None = None
    """The API server's request counter (fast failures never reach the engine's own counters)."""
    http_status_label: str = "status"
    http_error_statuses: tuple[str, ...] = ()
    http_handler_label: str = "handler"
    inference_handlers: tuple[str, ...] = ()


class Engine(ABC):
    """One inference engine. Subclasses set the class attributes and implement the grammar."""

    name: str
    display: str
    knobs: KnobFlags
    metrics: MetricConventions
    failures: tuple[FailureSignature, ...]
    readiness_path: str = "/health"
    default_port: int = 8000
    default_gpu_memory_utilization_percent: int = 90
    default_max_num_seqs: int | None = None
    """The engine's own --max-num-seqs when none is given, where it does not depend on the hardware."""
    safe_extra_flags: frozenset[str] = frozenset()
    """Flags a BatchTuning's `extraArgs` may add to trials (and so to production) by default: batching,
    scheduling and memory only; nothing that loads code, changes identity (model, name, host, port),
    changes or logs what production serves, or sets a tuned knob behind the search's back. An install
    may allow more (`Install.extra_flags`)."""
    extra_flag_values: Mapping[str, FlagValue] = {}
    """The value each default-allowed flag takes; a flag not listed is checked by its arity only."""
    numerics_flags: frozenset[str] = frozenset()
    """Flags that change what the model outputs (numerics, sampling): applied in Auto only when the spec says
    so (`spec.apply.allowNumericsChange`)."""

    # ---- grammar ------------------------------------------------------------------------

    @abstractmethod
    def entry(self, words: list[str]) -> tuple[int, str] | None:
        """(index where the engine's argv starts, form) in a word list, or None."""

    @abstractmethod
    def canonical(self, token: str) -> str:
        """A flag as the engine's parser resolves it: `--max_num_seq=8` -> `max-num-seqs`."""

    @abstractmethod
    def arity(self, flag: str) -> Arity:
        """How many words a canonical flag reads (0 for switches)."""

    def knows(self, flag: str) -> bool:
        """Whether a canonical flag (no dashes) is one of the engine's own, spelled in full."""
        return self.canonical(f"--{flag}") == flag

    def image_runs_engine(self, container: Mapping[str, Any], args: list[str]) -> bool:
        """With no command, whether the image's own entrypoint is this engine."""
        return False

    @property
    def grammar(self) -> Grammar:
        return Grammar(self.entry, self.canonical, self.arity)

    # ---- reading and rewriting a container ---------------------------------------------------

    def parse(self, container: Mapping[str, Any]) -> CommandLine:
        return commandline.parse(container, self.grammar, self.image_runs_engine, f"run {self.display}")

    def recognizes(self, container: Mapping[str, Any]) -> bool:
        try:
            self.parse(container)
        except commandline.UnsafeShell:
            return True  # it is ours; reading it fails for a reason worth reporting
        except ArgsError:
            return False
        return True

    def read(self, container: Mapping[str, Any]) -> Invocation:
        """The model, the knobs' current values and every other flag; `ArgsError` names what is wrong."""
        parsed = self.parse(container)
        flags = dict(parsed.flags)
        model = self.model_of(parsed)
        return Invocation(
            engine=self.name, container=parsed.container, form=parsed.form, model=model,
            served_model=self.served_model_of(flags, model), flags=flags, argv=parsed.argv,
            max_num_seqs=_int_flag(parsed, self.knobs.max_num_seqs),
            gpu_memory_utilization_percent=_percent_flag(parsed, self.knobs.gpu_memory_utilization),
            max_num_batched_tokens=_int_flag(parsed, self.knobs.max_num_batched_tokens),
        )

    def model_of(self, parsed: CommandLine) -> str | None:
        return parsed.flags.get("model") or (parsed.positionals[0] if parsed.positionals else None)

    def served_model_of(self, flags: Mapping[str, str | None], model: str | None) -> str | None:
        return model

    def setting_flags(self, setting: Setting) -> dict[str, str]:
        """Canonical flag -> value text for a setting (exact decimal text, no float rounding)."""
        flags = {
            self.knobs.max_num_seqs: str(setting.max_num_seqs),
            self.knobs.gpu_memory_utilization: percent_to_fraction(setting.gpu_memory_utilization_percent),
        }
        if setting.max_num_batched_tokens is not None:
            flags[self.knobs.max_num_batched_tokens] = str(setting.max_num_batched_tokens)
        return flags

    def setting_args(self, setting: Setting) -> list[str]:
        return [word for flag, value in self.setting_flags(setting).items() for word in (f"--{flag}", value)]

    def rewrite(self, container: Mapping[str, Any], setting: Setting, extra_args: Sequence[str] = ()) -> dict[str, Any]:
        """A copy of the container running `setting` (and `extra_args`); every other word stays."""
        flags: dict[str, str | None] = dict(self.setting_flags(setting))
        for canon, _, value in self.parse_flags(extra_args):
            flags[canon] = value
        return commandline.rewrite(self.parse(container), container, flags)

    def parse_flags(self, args: Sequence[str], what: str = "extra arg") -> list[tuple[str, str, str | None]]:
        return commandline.parse_flag_list(args, self.grammar, what)

    def check_extra_args(self, args: Sequence[str], also_allowed: Iterable[str] = ()) -> list[str]:
        """Why each of `spec.searchSpace.extraArgs` may not be added (empty: all allowed).

        Allowed: `safe_extra_flags` and `also_allowed` (the install's), spelled in full, each value of its type.
        """
        problems: list[str] = []
        for arg in args:
            if _K8S_EXPANSION.search(arg) or "\x00" in arg or any(ord(c) < 32 for c in arg):
                problems.append(f"{arg!r}: Kubernetes $(VAR) expansion and control characters are not allowed")
        try:
            parsed = self.parse_flags(args, "extraArgs item")
        except ValueError as exc:
            return problems + [str(exc)]
        allowed = self.safe_extra_flags | frozenset(also_allowed)
        for canon, spelled, value in parsed:
            shown = spelled if value is None else f"{spelled}={value}"
            if canon in self.knobs.all():
                problems.append(f"{spelled!r} sets a knob batchtune tunes ({self.display} --{canon}); "
                                "list its candidates under searchSpace instead")
            elif canon not in allowed:
                problems.append(f"{spelled!r} (--{canon}) is not a flag this install lets a BatchTuning add to "
                                f"{self.display}; allowed: {', '.join('--' + f for f in sorted(allowed))} "
                                "(Helm value searchSpace.allowedExtraFlags allows more)")
            elif spelled.lstrip("-") != canon:
                problems.append(f"{shown!r}: spell the flag in full, --{canon}")
            else:
                problem = self.flag_value(canon).problem(value)
                if problem:
                    problems.append(f"{shown!r}: --{canon} {problem}")
        return problems

    def flag_value(self, flag: str) -> FlagValue:
        """The value a canonical flag takes: its declared type, else a switch or a word by its arity."""
        declared = self.extra_flag_values.get(flag)
        if declared is not None:
            return declared
        arity = self.arity(flag)
        if arity == 0:
            return FlagValue("switch")
        return FlagValue("word") if arity == 1 else FlagValue("any")

    def numerics_in(self, args: Sequence[str]) -> list[str]:
        """The flags of `args` (as written) that change what the model outputs (`numerics_flags`)."""
        try:
            parsed = self.parse_flags(args, "extraArgs item")
        except ValueError:
            return []
        return [spelled for canon, spelled, _ in parsed if canon in self.numerics_flags]

    # ---- the engine's own load generator ----------------------------------------------------

    def bench_argv(self, base_url: str, model: str, tokenizer: str | None, input_tokens: int, output_tokens: int,
                   concurrency: int | None, requests_per_minute: int | None, num_prompts: int, warmups: int,
                   seed: int, result_dir: str, result_file: str, *, burstiness: float = 1.0,
                   goodput_ms: Sequence[tuple[str, int]] = ()) -> list[str] | None:
        """The command of the engine's own benchmark client for one load run, or None when it has none.

        `burstiness` is the gamma shape of open-loop arrivals (1: Poisson), as `vllm bench serve` means it;
        `goodput_ms` the per-request targets (`ttft`, `tpot`, `e2el`) its goodput counts against.
        """
        return None

    # ---- the engine's limits ------------------------------------------------------------------

    def trial_flags(self, flags: Mapping[str, str | None], extra_args: Sequence[str] = ()) -> dict[str, str | None]:
        """A trial's flags: production's `flags` with `spec.searchSpace.extraArgs` after them, as the engine reads them.

        Extra args come last on a trial's command line, so they win; `--no-X` there also cancels `--X`
        (and the other way round), as a boolean flag pair does.
        """
        merged = dict(flags)
        for canon, _, value in self.parse_flags(extra_args, "extraArgs item"):
            base = canon.removeprefix("no-")
            merged.pop(base, None)
            merged.pop(f"no-{base}", None)
            merged[canon] = value
        return merged

    def limits(self, flags: Mapping[str, str | None], extra_args: Sequence[str] = ()) -> EngineLimits:
        """The engine's own limits on a trial with production's `flags` and the spec's `extra_args`."""
        return EngineLimits()

    def invariant_violation(self, setting: Setting, limits: EngineLimits) -> str | None:
        """The engine's own refusal to start with this setting, quoted, or None."""
        return None

    def classify_failure(self, message: str) -> Reason | None:
        """The reason a startup/exit message gives, or None when it says nothing we know."""
        text = message.lower()
        for signature in self.failures:
            if any(t in text for t in signature.texts):
                return signature.reason
        return None

    def serving_port(self, container: Mapping[str, Any]) -> int:
        """The port the engine serves on: its port flag, else a containerPort named http, else the first."""
        try:
            port = self.read(container).flags.get("port")
            if port is not None:
                return int(port)
        except (ArgsError, ValueError):
            pass
        ports = list(container.get("ports") or [])
        for p in ports:
            if p.get("name") == "http" and p.get("containerPort"):
                return int(p["containerPort"])
        if ports and ports[0].get("containerPort"):
            return int(ports[0]["containerPort"])
        return self.default_port


def _int_flag(parsed: CommandLine, flag: str) -> int | None:
    value = parsed.flags.get(flag)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ArgsError(parsed.container, f"--{flag} value {value!r} is not an integer") from None


def _percent_flag(parsed: CommandLine, flag: str) -> int | None:
    value = parsed.flags.get(flag)
    if value is None:
        return None
    try:
        fraction = float(value)
    except ValueError:
        raise ArgsError(parsed.container, f"--{flag} value {value!r} is not a number") from None
    if not 0 < fraction <= 1:
        raise ArgsError(parsed.container, f"--{flag} value {value!r} is outside (0, 1]")
    return int(fraction * 100 + 0.5)
