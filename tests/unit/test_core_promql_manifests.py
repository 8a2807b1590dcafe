"""PromQL escaping and builders; trial Deployment and load Job builders; `batchtune plan`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchtune.core import (
    LoadProfile,
    MetricNames,
    Setting,
    build_load_job,
    build_trial_deployment,
    escape_label_value,
    read_vllm_settings,
    selector,
    trial_name,
    trial_queries,
)


@pytest.mark.parametrize("raw, escaped", [
    pytest.param('a"b', 'a\\"b', id="quote"),
    pytest.param("a\\b", "a\\\\b", id="backslash"),
    pytest.param("a\nb", "a\\nb", id="newline"),
    pytest.param('x"} or vector(1) #', 'x\\"} or vector(1) #', id="injection"),
])
def test_escape_label_value(raw, escaped):
    assert escape_label_value(raw) == escaped


def _unescape(text: str) -> str:
    """Read a PromQL double-quoted string body back (the escapes Prometheus' lexer accepts)."""
    out, i = [], 0
    table = {"\\": "\\", '"': '"', "n": "\n", "r": "\r", "t": "\t"}
    while i < len(text):
        if text[i] == "\\":
            out.append(table[text[i + 1]])
            i += 2
            continue
        assert text[i] not in '"\n', "an unescaped quote or newline would end the string"
        out.append(text[i])
        i += 1
    return "".join(out)


@given(st.text())
def test_escape_round_trips_and_stays_inside_quotes(value):
    assert _unescape(escape_label_value(value)) == value


def test_selector_rejects_bad_label_names():
    assert selector({"pod": 'p"1'}) == '{pod="p\\"1"}'
    with pytest.raises(ValueError):
        selector({"bad-name": "x"})


def test_trial_queries():
    q = trial_queries(namespace="ns", pod='trial"0', model="m", window_s=60, percentile=95)
    assert q["ttftMs"] == (
        '1000 * histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket'
        '{namespace="ns",pod="trial\\"0",model_name="m"}[60s])))'
    )
    assert "(vllm:kv_cache_usage_perc" in q["kvCacheUsagePercent"] and "vllm:gpu_cache_usage_perc" in q["kvCacheUsagePercent"]
    assert q["outputThroughput"] == 'sum(rate(vllm:generation_tokens_total{namespace="ns",pod="trial\\"0",model_name="m"}[60s]))'
    assert "model_name" not in q["gpuUtilPercent"]
    names = MetricNames().with_overrides({"kvCacheUsage": "vllm:gpu_cache_usage_perc"})
    q = trial_queries(namespace="ns", pod="p", model=None, window_s=30, names=names)
    assert " or " not in q["kvCacheUsagePercent"] and "model_name" not in q["e2eMs"]
    with pytest.raises(ValueError, match="unknown metric key"):
        MetricNames().with_overrides({"nope": "x"})
    with pytest.raises(ValueError, match="not a valid Prometheus metric name"):
        MetricNames().with_overrides({"gpuUtil": "x{} or up"})


TARGET = {
    "apiVersion": "apps/v1", "kind": "Deployment",
    "metadata": {"name": "llm", "namespace": "prod", "uid": "u", "resourceVersion": "9"},
    "spec": {
        "replicas": 4, "selector": {"matchLabels": {"app": "llm"}},
        "template": {
            "metadata": {"labels": {"app": "llm", "tier": "gpu", "team": "a"}, "creationTimestamp": None},
            "spec": {"containers": [
                {"name": "proxy", "image": "envoy", "command": ["envoy"]},
                {"name": "vllm", "image": "vllm/vllm-openai", "args": ["m", "--max-num-seqs", "256", "--port", "8000"]},
            ]},
        },
    },
    "status": {"replicas": 4},
}


def test_build_trial_deployment():
    d = build_trial_deployment(TARGET, "bt", "uid-1", "prod", 3, Setting(64, 85), ["--enforce-eager"],
                               service_selectors=[{"tier": "gpu"}, {"team": "b"}])
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert "app" not in labels and "tier" not in labels and labels["team"] == "a"
    assert d["spec"]["selector"]["matchLabels"] == {"batchtune.io/tuning": "bt", "batchtune.io/trial": "3"}
    assert d["metadata"]["name"] == "bt-trial-3" and d["spec"]["replicas"] == 1
    assert d["metadata"]["ownerReferences"] == [{"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning", "name": "bt",
                                                 "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert "status" not in d and "creationTimestamp" not in d["spec"]["template"]["metadata"]
    vllm = d["spec"]["template"]["spec"]["containers"][1]
    inv = read_vllm_settings(vllm)
    assert (inv.max_num_seqs, inv.gpu_memory_utilization_percent, inv.flags["port"]) == (64, 85, "8000")
    assert "enforce-eager" in inv.flags
    assert d["spec"]["template"]["spec"]["containers"][0] == TARGET["spec"]["template"]["spec"]["containers"][0]
    assert TARGET["spec"]["template"]["spec"]["containers"][1]["args"][2] == "256"  # target untouched
    assert build_trial_deployment(TARGET, "bt", "uid-1", "prod", 3, Setting(64, 85)) == \
        build_trial_deployment(TARGET, "bt", "uid-1", "prod", 3, Setting(64, 85))


@pytest.mark.parametrize("name", ["bt", "x" * 63, "a" * 200])
def test_trial_names_fit_63(name):
    assert len(trial_name(name, 255)) <= 63
    assert trial_name(name, 1) != trial_name(name + "z", 1)


@pytest.mark.parametrize("generator, expect", [
    pytest.param("Builtin", ["loadgen", "--base-url", "http://10.0.0.7:8000"], id="builtin"),
    pytest.param("VllmBench", ["vllm bench serve"], id="vllm-bench"),
])
def test_build_load_job(generator, expect):
    job = build_load_job("bt", "uid-1", "prod", 2, generator=generator, image="img", base_url="http://10.0.0.7:8000",
                         model="m", profile=LoadProfile(concurrency=32, duration_seconds=60, warmup_seconds=10))
    spec = job["spec"]
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 2 * 70 + 120
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    container = spec["template"]["spec"]["containers"][0]
    text = " ".join(container.get("args", []))
    for fragment in expect:
        assert fragment in text
    assert job["metadata"]["name"] == "bt-load-2" and job["metadata"]["ownerReferences"][0]["controller"] is True


def test_load_profile_requires_one_mode():
    with pytest.raises(ValueError, match="exactly one of concurrency"):
        LoadProfile(concurrency=1, requests_per_minute=60)


def test_cli_plan(tmp_path, capsys):
    from batchtune.cli import main

    assert main(["plan", "-f", "manifests/samples/batchtuning-minimal.yaml"]) == 0
    out = capsys.readouterr().out
    assert "seqs=8 gmu=90%" in out and "first asks" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: batchtune.io/v1alpha1\nkind: BatchTuning\nmetadata: {name: x}\n"
        "spec: {targetRef: {name: d}, searchSpace: {maxNumSeqs: {values: [0]}}, slo: {e2eLatencyMilliseconds: 1},"
        " prometheus: {url: 'http://p'}}\n"
    )
    assert main(["plan", "-f", str(bad)]) == 1
    assert "spec.searchSpace.maxNumSeqs.values[0]" in capsys.readouterr().out
    empty = tmp_path / "empty.yaml"
    empty.write_text(
        "apiVersion: batchtune.io/v1alpha1\nkind: BatchTuning\nmetadata: {name: x}\n"
        "spec: {targetRef: {name: d}, searchSpace: {maxNumSeqs: {values: [512]}, maxNumBatchedTokens: [256]},"
        " slo: {e2eLatencyMilliseconds: 100}, prometheus: {url: 'http://p'}}\n"
    )
    assert main(["plan", "-f", str(empty)]) == 1
    assert "no candidate setting is left" in capsys.readouterr().out
