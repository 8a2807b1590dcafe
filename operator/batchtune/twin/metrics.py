"""vLLM's Prometheus exposition for the twin server (V1 engine names, labels and buckets).

Names, help texts and bucket lists follow `vllm/v1/metrics/loggers.py` (see
`shared/reference/vllm-gpu-facts.md` §1.2). Every series carries `model_name` (the served model
name) and `engine="0"`. Counters are declared without `_total` and exposed with it, exactly as
prometheus_client does for vLLM. Latency histograms hold simulated seconds (wall seconds times
the time scale), so an SLO reads the same at any time scale.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"  # vLLM 0.32's /metrics (prometheus_client 0.26)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to and including max_value."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


@dataclass(frozen=True)
class CacheConfigInfo:
    """Labels of `vllm:cache_config_info` (every value a string in the exposition): a subset of vLLM 0.32's,
    which has about 35 and no `swap_space`; tests/unit/test_twin_conformance.py holds them to the real ones."""

    block_size: int
    num_gpu_blocks: int
    gpu_memory_utilization: float
    cache_dtype: str = "auto"
    kv_cache_size_tokens: int = 0
    enable_prefix_caching: bool = True
    num_cpu_blocks: int | None = None
    sliding_window: int | None = None

    def labels(self) -> dict[str, str]:
        return {
            "block_size": str(self.block_size),
            "cache_dtype": self.cache_dtype,
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "gpu_memory_utilization": str(self.gpu_memory_utilization),
            "kv_cache_size_tokens": str(self.kv_cache_size_tokens),
            "num_cpu_blocks": str(self.num_cpu_blocks),
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "sliding_window": str(self.sliding_window),
        }


class VllmMetrics:
    """One registry holding the series a single-engine vLLM V1 server exposes."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_info: CacheConfigInfo | None = None,
        *,
        legacy_gpu_cache_usage: bool = False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = (model_name, "0")
        reg = self.registry
        tokens_buckets = build_1_2_5_buckets(max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg, multiprocess_mode="mostrecent")

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets)

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        ).labels(*values)
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        ).labels(*values)
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        ).labels(*values)
        self.gpu_cache_usage_perc = (
            gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.").labels(*values)
            if legacy_gpu_cache_usage
            else None
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(*values)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*values)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(*values)
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.request_success = {
            reason: self._request_success.labels(model_name, "0", reason) for reason in ("stop", "length", "abort")
        }
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        ).labels(*values)
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        ).labels(*values)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        ).labels(*values)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        ).labels(*values)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens_buckets
        ).labels(*values)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens_buckets
        ).labels(*values)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens_buckets
        ).labels(*values)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens_buckets,
        ).labels(*values)
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        ).labels(*values)
        if cache_info is not None:
            info = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                ["engine", *cache_info.labels().keys()],
                registry=reg,
                multiprocess_mode="mostrecent",
            )
            info.labels(engine="0", **cache_info.labels()).set(1)
        sleep_state = Gauge(
            "vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means "
            "engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*labels, "sleep_state"], registry=reg, multiprocess_mode="mostrecent",
        )  # fmt: skip
        sleep_state.labels(model_name, "0", "awake").set(1)
        sleep_state.labels(model_name, "0", "weights_offloaded").set(0)
        sleep_state.labels(model_name, "0", "discard_all").set(0)

    def set_scheduler_state(self, running: int, waiting: int, kv_usage: float) -> None:
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_usage_perc.set(kv_usage)
        if self.gpu_cache_usage_perc is not None:
            self.gpu_cache_usage_perc.set(kv_usage)

    def observe_step(
        self, prompt_tokens: int, generation_tokens: int, preempted: int, scheduled_tokens: int | None = None
    ) -> None:
        """One engine step: prefill tokens, sampled tokens, preemptions, tokens scheduled in the step."""
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)
        if preempted:
            self.num_preemptions.inc(preempted)
        iteration = prompt_tokens + generation_tokens if scheduled_tokens is None else scheduled_tokens
        if iteration:
            self.iteration_tokens.observe(iteration)

    def observe_request_start(self, max_tokens: int) -> None:
        self.request_params_max_tokens.observe(max_tokens)
        self.request_max_num_generation_tokens.observe(max_tokens)
        self.request_params_n.observe(1)

    def observe_finished(
        self,
        *,
        finished_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        e2e_s: float,
        queue_s: float,
        prefill_s: float,
        decode_s: float,
    ) -> None:
        """One finished request; times in simulated seconds."""
        self.request_success.get(finished_reason, self.request_success["stop"]).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.e2e_request_latency.observe(e2e_s)
        self.request_queue_time.observe(queue_s)
        self.request_prefill_time.observe(prefill_s)
        self.request_decode_time.observe(decode_s)
        self.request_inference_time.observe(prefill_s + decode_s)
        if generation_tokens > 1:
            self.request_time_per_output_token.observe(decode_s / (generation_tokens - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
