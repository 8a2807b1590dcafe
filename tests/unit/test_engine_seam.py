"""A second engine is one module: a test-only engine that the planner, manifests and measurement accept.

`ToyServe` spells the three knobs its own way (`--batch-size`, `--mem-frac`, `--token-budget`), names
its metrics `toy_*`, and fails with its own texts. Nothing in the core or the controller changes to
run it: the reconcile loop tunes a ToyServe Deployment end to end against the in-memory world.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest

from batchtune.core.manifests import build_trial_deployment
from batchtune.core.planning import EngineLimits, SearchSpace, plan_candidates
from batchtune.core.promql import LabelNames, MetricNames, QueryContext, trial_queries
from batchtune.core.settings import Setting
from batchtune.core.vocabulary import M, Reason
from batchtune.engines import ENGINES, find_engine_container
from batchtune.engines.base import Engine, FailureSignature, KnobFlags, MetricConventions
from batchtune.engines.commandline import Arity


class ToyServe(Engine):
    name = "toyserve"
    display = "ToyServe"
    knobs = KnobFlags("batch-size", "mem-frac", "token-budget")
    metrics = MetricConventions(names={
        "e2e_request_latency": "toy_e2e_seconds", "time_to_first_token": "toy_ttft_seconds",
        "inter_token_latency": "toy_itl_seconds", "request_queue_time": "toy_queue_seconds",
        "generation_tokens": "toy_generated_tokens_total", "prompt_tokens": "toy_prompt_tokens_total",
        "request_success": "toy_requests_total", "num_preemptions": "toy_preemptions_total",
        "num_requests_running": "toy_running", "num_requests_waiting": "toy_waiting",
        "kv_cache_usage": "toy_cache_ratio", "cache_config_info": "toy_cache_info",
        "request_prompt_tokens": "toy_prompt_len", "request_generation_tokens": "toy_output_len",
        "iteration_tokens": "toy_step_tokens_total"}, model_label="model")
    failures = (FailureSignature(Reason.KV_CACHE_TOO_SMALL, ("toy: cache would not fit",)),)
    safe_extra_flags = frozenset({"fast"})
    default_port = 9000

    def entry(self, words: list[str]) -> tuple[int, str] | None:
        for i, word in enumerate(words):
            if os.path.basename(word) == "toyserve":
                return i + 1, "toyserve"
        return None

    def canonical(self, token: str) -> str:
        return token.lstrip("-").partition("=")[0]

    def arity(self, flag: str) -> Arity:
        return 0 if flag == "fast" else 1

    def invariant_violation(self, setting: Setting, limits: EngineLimits) -> str | None:
        budget = setting.max_num_batched_tokens
        if budget is not None and budget < 2 * setting.max_num_seqs:
            return f"toy: token-budget {budget} below twice batch-size {setting.max_num_seqs}"
        return None


TOY = ToyServe()


def toy_container(**extra: Any) -> dict[str, Any]:
    return {"name": "server", "image": "toy/server:1", "command": ["toyserve"],
            "args": ["--model", "toy-1b", "--batch-size", "8", "--mem-frac", "0.80"], **extra}


def test_the_engine_reads_and_rewrites_its_own_spelling():
    engine, container = find_engine_container({"containers": [toy_container()]}, None, (*ENGINES, TOY))
    assert engine is TOY
    invocation = TOY.read(container)
    assert (invocation.model, invocation.max_num_seqs, invocation.gpu_memory_utilization_percent) == ("toy-1b", 8, 80)
    new = TOY.rewrite(container, Setting(32, 90, 512), ["--fast"])
    assert new["args"] == ["--model", "toy-1b", "--batch-size", "32", "--mem-frac", "0.90", "--token-budget", "512",
                           "--fast"]
    assert TOY.check_extra_args(["--trust-remote-code"]) and not TOY.check_extra_args(["--fast"])


def test_the_planner_takes_the_engines_invariants():
    plan = plan_candidates(SearchSpace((8, 64), (90,), (64,)), lambda s: TOY.invariant_violation(s, EngineLimits()))
    assert [s.max_num_seqs for s in plan.candidates] == [8]
    assert plan.pruned[0].reason is Reason.ENGINE_INVARIANT and "toy:" in plan.pruned[0].message


def test_trial_manifests_carry_the_engines_flags():
    target = {"metadata": {"name": "toy"}, "spec": {"selector": {"matchLabels": {"app": "toy"}}, "template": {
        "metadata": {"labels": {"app": "toy"}}, "spec": {"containers": [toy_container()]}}}}
    manifest = build_trial_deployment(TOY, target, toy_container(), "bt", "uid", "ns", 3, Setting(16, 85))
    args = manifest["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--batch-size") + 1] == "16" and args[args.index("--mem-frac") + 1] == "0.85"
    assert "app" not in manifest["spec"]["template"]["metadata"]["labels"]


def test_measurement_queries_use_the_engines_metric_names_and_labels():
    ctx = QueryContext(MetricNames.build(TOY.metrics), LabelNames(model="model"), LabelNames(model=None), 95)
    queries = trial_queries(ctx, "ns", "pod-1", "toy-1b", 60)
    assert "toy_itl_seconds_bucket" in queries[M.ITL_MS] and 'model="toy-1b"' in queries[M.ITL_MS]
    assert not any("vllm:" in q for q in queries.values())
    assert "DCGM_FI_DEV_GPU_UTIL" in queries[M.GPU_UTIL_PERCENT]  # the GPU exporter is not the engine's


def test_startup_failures_are_classified_by_the_engine():
    assert TOY.classify_failure("FATAL toy: cache would not fit in 3 GiB") is Reason.KV_CACHE_TOO_SMALL
    assert TOY.classify_failure("No available memory for the cache blocks") is None  # vLLM's text, not ToyServe's


def test_the_reconcile_loop_tunes_a_toyserve_deployment(monkeypatch: pytest.MonkeyPatch):
    from fake_world import World, production_target, reset_backoff, spec

    reset_backoff()
    w = World(bt_spec=spec(searchSpace={"maxNumSeqs": {"values": [8, 16, 32]}, "extraArgs": ["--enforce-eager"]}))
    w.bt_spec["searchSpace"].pop("extraArgs")
    target = production_target()
    target["spec"]["template"]["spec"]["containers"] = [
        {**toy_container(), "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    w.deployments["llm"] = target
    _knobs_from_toy(monkeypatch)

    original = w.ports
    monkeypatch.setattr(w, "ports", lambda install=None: _with_engines(original(install)))
    assert w.run_until({"Succeeded", "Failed", "RolledBack", "Recommended"}) == "Succeeded", w.condition("Failed")
    container = w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0]
    assert "--batch-size" in container["args"] and "--max-num-seqs" not in container["args"]
    assert w.status["baseline"]["engine"] == "toyserve"


def _with_engines(ports: Any) -> Any:
    ports.engines = (*ENGINES, TOY)
    return ports


def _knobs_from_toy(monkeypatch: pytest.MonkeyPatch) -> None:
    import fake_world

    def knobs(container: Mapping[str, Any]) -> tuple[int, int]:
        invocation = TOY.read(container)
        return invocation.max_num_seqs or 0, invocation.gpu_memory_utilization_percent or 90

    monkeypatch.setattr(fake_world, "_knobs", knobs)
