"""PromQL escaping and builders; trial Deployment and load Job builders; `batchtune plan`."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchtune.api import MetricNames as MetricNamesSpec
from batchtune.core import Setting
from batchtune.core.manifests import (
    LoadProfile,
    build_load_job,
    build_trial_deployment,
    child_name,
    load_job_name,
    trial_name,
)
from batchtune.core.promql import (
    LabelNames,
    MetricNames,
    QueryContext,
    Selector,
    escape_label_value,
    escape_regex,
    pods_selector,
    production_queries,
    trial_queries,
)
from batchtune.engines import VLLM

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@pytest.mark.parametrize("raw, escaped", [
    pytest.param('a"b', 'a\\"b', id="quote"),
    pytest.param("a\\b", "a\\\\b", id="backslash"),
    pytest.param("a\nb", "a\\nb", id="newline"),
    pytest.param("a\tb\rc", "a\\tb\\rc", id="tab-cr"),
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


@given(st.text(max_size=20))
def test_escape_regex_matches_only_the_literal(value):
    assert re.fullmatch(escape_regex(value), value, flags=re.DOTALL)


@pytest.mark.parametrize("raw, escaped", [
    pytest.param("llm-1.a", "llm-1\\.a", id="dot"),
    pytest.param("a|b", "a\\|b", id="alternation"),
    pytest.param("x.*", "x\\.\\*", id="wildcard"),
])
def test_escape_regex(raw, escaped):
    assert escape_regex(raw) == escaped


def test_selector_escapes_values_and_rejects_bad_label_names():
    assert Selector({"pod": 'p"1'}).render() == '{pod="p\\"1"}'
    assert Selector({"a": "x"}, {"b": "y|z"}).render() == '{a="x",b=~"y|z"}'
    with pytest.raises(ValueError):
        Selector({"bad-name": "x"}).render()
    with pytest.raises(ValueError):
        LabelNames(pod="bad-name")


def _ctx(names: MetricNames | None = None, gpu_labels: LabelNames | None = None) -> QueryContext:
    return QueryContext(names or MetricNames.build(VLLM.metrics), LabelNames(),
                        gpu_labels or LabelNames(model=None), 95)


def test_trial_queries():
    q = trial_queries(_ctx(), "ns", 'trial"0', "m", 60)
    assert q["ttftMs"] == (
        '1000 * histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket'
        '{namespace="ns",pod="trial\\"0",model_name="m"}[60s])))'
    )
    assert "(vllm:kv_cache_usage_perc" in q["kvCacheUsagePercent"] and "vllm:gpu_cache_usage_perc" in q["kvCacheUsagePercent"]
    assert q["outputThroughput"] == 'sum(rate(vllm:generation_tokens_total{namespace="ns",pod="trial\\"0",model_name="m"}[60s]))'
    assert "model_name" not in q["gpuUtilPercent"]
    assert q["powerWatts"].startswith("sum(")  # a tensor-parallel pod draws on all its GPUs

    names = MetricNames.build(VLLM.metrics, {"kvCacheUsage": "vllm:gpu_cache_usage_perc"})
    q = trial_queries(_ctx(names), "ns", "p", None, 30)
    assert " or " not in q["kvCacheUsagePercent"] and "model_name" not in q["e2eMs"]
    with pytest.raises(ValueError, match="unknown metric key"):
        MetricNames.build(VLLM.metrics, {"nope": "x"})
    with pytest.raises(ValueError, match="not a valid Prometheus metric name"):
        MetricNames.build(VLLM.metrics, {"gpuUtil": "x{} or up"})


def test_gpu_series_use_the_gpu_label_names():
    q = trial_queries(_ctx(gpu_labels=LabelNames("exported_pod", "exported_namespace", None)), "ns", "p", "m", 60)
    assert q["gpuUtilPercent"] == 'avg(avg_over_time(DCGM_FI_DEV_GPU_UTIL{exported_namespace="ns",exported_pod="p"}[60s]))'
    assert 'namespace="ns",pod="p"' in q["ttftMs"]


@pytest.mark.parametrize("overrides, role, candidates", [
    pytest.param(None, "inter_token_latency", ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
                 id="legacy-alias-queried"),
    pytest.param(None, "e2e_request_latency", ("vllm:e2e_request_latency_seconds",), id="no-alias"),
    pytest.param({"inter_token_latency": "my_itl"}, "inter_token_latency", ("my_itl",), id="override-drops-alias"),
    pytest.param(MetricNamesSpec(kv_cache_usage="vllm:gpu_cache_usage_perc"), "kv_cache_usage",
                 ("vllm:gpu_cache_usage_perc",), id="from-the-api-model"),
])
def test_metric_names_candidates(overrides, role, candidates):
    if isinstance(overrides, MetricNamesSpec):
        names = overrides.core(VLLM.metrics)
    else:
        names = MetricNames.build(VLLM.metrics, overrides)
    assert names.candidates(role) == candidates
    assert names["gpu_util"] == "DCGM_FI_DEV_GPU_UTIL"


def test_pods_selector_escapes_pod_names_for_regex_and_promql():
    sel = pods_selector(LabelNames(), 'ns"x', ["llm-2", "llm-1.a"])
    assert sel.render() == '{namespace="ns\\"x",pod=~"llm-1\\\\.a|llm-2"}'
    assert pods_selector(LabelNames(), "ns", []).render().endswith('pod=~"^$"}')
    assert pods_selector(LabelNames(), "ns", ["a"], model="m").render() == '{namespace="ns",model_name="m",pod=~"a"}'


def test_production_queries_count_failed_requests_by_finish_reason():
    sel = pods_selector(LabelNames(), "ns", ["a"])
    q = production_queries(_ctx(), sel, 300, "finished_reason", ("abort", "error"))
    assert q["failedThroughput"] == \
        'sum(rate(vllm:request_success_total{namespace="ns",pod=~"a",finished_reason=~"abort|error"}[300s]))'
    assert q["requests"] == 'sum(increase(vllm:request_success_total{namespace="ns",pod=~"a"}[300s]))'
    assert "failedThroughput" not in production_queries(_ctx(), sel, 300, None, ())


def _offsets_follow_selectors(query: str) -> bool:
    """PromQL's `offset` modifies a vector selector or subquery only: `sum(x) offset 5m` does not parse."""
    return all(query[: m.start()].rstrip().endswith(("}", "]")) for m in re.finditer(r"\boffset\b", query))


@pytest.mark.parametrize("which", ["trial-waitingGrowth", "production-inSystemGrowth"])
def test_offset_modifiers_follow_a_selector(which):
    if which == "trial-waitingGrowth":
        query = trial_queries(_ctx(), "ns", "p", "m", 60)["waitingGrowth"]
    else:
        query = production_queries(_ctx(), pods_selector(LabelNames(), "ns", ["a"]), 300, None, ())["inSystemGrowth"]
    assert "offset" in query and _offsets_follow_selectors(query), query


TARGET = {
    "apiVersion": "apps/v1", "kind": "Deployment",
    "metadata": {"name": "llm", "namespace": "prod", "uid": "u", "resourceVersion": "9"},
    "spec": {
        "replicas": 4,
        "selector": {"matchLabels": {"app": "llm"},
                     "matchExpressions": [{"key": "track", "operator": "In", "values": ["stable"]}]},
        "template": {
            "metadata": {"labels": {"app": "llm", "track": "stable", "tier": "gpu", "team": "a"},
                         "creationTimestamp": None},
            "spec": {"containers": [
                {"name": "proxy", "image": "envoy", "command": ["envoy"]},
                {"name": "vllm", "image": "vllm/vllm-openai", "args": ["m", "--max-num-seqs", "256", "--port", "8000"]},
            ]},
        },
    },
    "status": {"replicas": 4},
}
CONTAINER = TARGET["spec"]["template"]["spec"]["containers"][1]


def _trial(**kw):
    args = dict(extra_args=["--enforce-eager"], service_selectors=[{"tier": "gpu"}, {"team": "b"}])
    return build_trial_deployment(VLLM, TARGET, CONTAINER, "bt", "uid-1", "prod", 3, Setting(64, 85), **(args | kw))


def test_build_trial_deployment():
    d = _trial()
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert "app" not in labels and "tier" not in labels and labels["team"] == "a"
    assert d["spec"]["selector"]["matchLabels"] == {"batchtune.io/tuning": "bt", "batchtune.io/trial": "3"}
    assert d["metadata"]["name"] == "bt-trial-3" and d["spec"]["replicas"] == 1
    assert d["metadata"]["ownerReferences"] == [{"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning", "name": "bt",
                                                 "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert "status" not in d and "creationTimestamp" not in d["spec"]["template"]["metadata"]
    vllm = d["spec"]["template"]["spec"]["containers"][1]
    inv = VLLM.read(vllm)
    assert (inv.max_num_seqs, inv.gpu_memory_utilization_percent, inv.flags["port"]) == (64, 85, "8000")
    assert "enforce-eager" in inv.flags
    assert d["spec"]["template"]["spec"]["containers"][0] == TARGET["spec"]["template"]["spec"]["containers"][0]
    assert TARGET["spec"]["template"]["spec"]["containers"][1]["args"][2] == "256"  # target untouched
    assert "nodeSelector" not in d["spec"]["template"]["spec"]
    assert _trial() == _trial()


def _selects(selector: dict, labels: dict) -> bool:
    """A Deployment's label selector (matchLabels and In/Exists expressions) against pod labels."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for e in selector.get("matchExpressions") or []:
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
    return True


@pytest.mark.parametrize("selector, services, gone, kept", [
    pytest.param({"matchLabels": {"app": "llm"}}, [], {"app"}, {"track", "tier", "team"}, id="match-labels"),
    pytest.param({"matchLabels": {"app": "llm"}, "matchExpressions": [{"key": "track", "operator": "In", "values": ["stable"]}]},
                 [], {"app", "track"}, {"tier", "team"}, id="match-expressions-keys"),
    pytest.param({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, [], {"tier"}, {"app", "track", "team"},
                 id="exists-expression"),
    pytest.param({"matchLabels": {"app": "llm"}}, [{"tier": "gpu", "team": "a"}], {"app", "tier", "team"}, {"track"},
                 id="matching-service-loses-all-its-keys"),
    pytest.param({"matchLabels": {"app": "llm"}}, [{"tier": "gpu", "team": "b"}, {"app": "llm"}], {"app"},
                 {"track", "tier", "team"}, id="non-matching-services-keep-labels"),
])
def test_trial_pods_never_match_production(selector, services, gone, kept):
    target = {**TARGET, "spec": {**TARGET["spec"], "selector": selector}}
    d = build_trial_deployment(VLLM, target, CONTAINER, "bt", "uid-1", "prod", 0, Setting(8, 90),
                               service_selectors=services)
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert not gone & set(labels) and kept <= set(labels)
    assert not _selects(selector, labels)
    assert not any(all(labels.get(k) == v for k, v in s.items()) for s in services)
    assert _selects(d["spec"]["selector"], labels)  # the trial Deployment still owns its pod


def test_trial_is_pinned_to_productions_gpu_product():
    target = {**TARGET, "spec": {**TARGET["spec"], "template": {
        **TARGET["spec"]["template"], "spec": {**TARGET["spec"]["template"]["spec"], "nodeSelector": {"pool": "gpu"}}}}}
    d = build_trial_deployment(VLLM, target, CONTAINER, "bt", "uid-1", "prod", 0, Setting(8, 90), gpu_product="NVIDIA-H100-80GB-HBM3")
    assert d["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "nodeSelector" not in TARGET["spec"]["template"]["spec"]


@pytest.mark.parametrize("name", [
    pytest.param("bt", id="short"),
    pytest.param("x" * 63, id="63-chars"),
    pytest.param("a" * 39 + "-" + "b" * 23, id="63-chars-cut-at-a-dash"),
    pytest.param("a" * 200, id="200-chars"),
])
def test_child_names_are_valid_and_fit_63(name):
    names = [trial_name(name, 255), trial_name(name, 1), load_job_name(name, 255, 4, 9, 9), load_job_name(name, 1, 0, 0, 0),
             child_name(name, "report")]
    for child in names:
        assert len(child) <= 63 and DNS_LABEL.match(child), child
    assert len(set(names)) == len(names)
    assert trial_name(name, 1) != trial_name(name + "z", 1)
    assert load_job_name(name, 1, 0, 0, 0) != load_job_name(name, 1, 0, 0, 1)


def test_load_job_names_one_object_per_run():
    assert load_job_name("bt", 2, 0, 1, 2) == "bt-trial-2-s0r1a2"


PROFILE = LoadProfile(concurrency=32, duration_seconds=60, warmup_seconds=10)


def _job(profile: LoadProfile = PROFILE, base_url: str = "http://10.0.0.7:8000"):
    return build_load_job("bt", "uid-1", "prod", 2, load_job_name("bt", 2, 0, 0, 0), image="img", base_url=base_url,
                          model="m", profile=profile)


def test_build_load_job():
    job = _job()
    spec = job["spec"]
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 2 * 70 + 120
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    container = spec["template"]["spec"]["containers"][0]
    assert container["image"] == "img" and container["command"] == ["batchtune"]
    args = container["args"]
    assert args[:5] == ["loadgen", "--base-url", "http://10.0.0.7:8000", "--model", "m"]
    assert args[args.index("--concurrency") + 1] == "32" and args[args.index("--duration") + 1] == "70"
    assert "--allow-non-loopback" in args and "--request-rate" not in args
    assert job["metadata"]["name"] == "bt-trial-2-s0r0a0" and job["metadata"]["ownerReferences"][0]["controller"] is True


def test_open_loop_load_job_sends_a_rate():
    args = _job(LoadProfile(requests_per_minute=90, burstiness=0.5), base_url="http://127.0.0.1:8000")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--request-rate") + 1] == "1.5" and args[args.index("--burstiness") + 1] == "0.5"
    assert "--concurrency" not in args and "--allow-non-loopback" not in args


def test_load_job_runs_under_the_restricted_profile():
    pod = _job()["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["readOnlyRootFilesystem"] is True
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts == {"tmp": "/tmp"} and "emptyDir" in volumes["tmp"]


@pytest.mark.parametrize("kwargs, message", [
    pytest.param({"concurrency": 1, "requests_per_minute": 60}, "exactly one of concurrency", id="both-modes"),
    pytest.param({}, "exactly one of concurrency", id="no-mode"),
    pytest.param({"concurrency": 1, "duration_seconds": None}, "one of duration_seconds and num_prompts", id="unbounded"),
])
def test_load_profile_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoadProfile(**kwargs)


def test_load_profile_bound_covers_warmup_and_measurement():
    assert LoadProfile(concurrency=1, duration_seconds=60, warmup_seconds=30).bound_seconds() == 2 * 90 + 120
    assert LoadProfile(concurrency=1, duration_seconds=None, num_prompts=100, warmup_seconds=0).bound_seconds() == 2 * 600 + 120


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


def test_workload_queries_read_the_histograms_the_rate_series_and_the_prefix_cache():
    from batchtune.core.promql import rate_window_seconds, workload_queries

    sel = pods_selector(LabelNames(), "prod", ["llm-0"])
    q = workload_queries(_ctx(), sel, 3600, 60)
    assert q["promptBuckets"] == ('sum by (le) (increase(vllm:request_prompt_tokens_bucket'
                                  '{namespace="prod",pod=~"llm-0"}[3600s]))')
    assert "vllm:request_generation_tokens_bucket" in q["outputBuckets"]
    assert q["promptMean"].startswith("sum(increase(vllm:request_prompt_tokens_sum{")
    assert q["requestCounts"].endswith(")[3600s:60s]") and "[60s]" in q["requestCounts"]
    assert "vllm:prefix_cache_hits_total" in q["prefixHits"] and "vllm:gpu_prefix_cache_hits_total" in q["prefixHits"]
    assert rate_window_seconds(15) == 60 and rate_window_seconds(30) == 120
    with pytest.raises(ValueError, match="shorter than the 120s rate window"):
        workload_queries(_ctx(), sel, 60, 120)


def test_workload_queries_honour_overrides_and_an_engine_without_prefix_counters():
    from batchtune.core.promql import workload_queries
    from batchtune.engines.base import MetricConventions

    names = MetricNamesSpec(request_generation_tokens="my:out_len").core(VLLM.metrics)
    q = workload_queries(_ctx(names), Selector({"namespace": "p"}), 3600, 60)
    assert "my:out_len_bucket" in q["outputBuckets"] and "vllm:request_generation_tokens" not in q["outputBuckets"]
    bare = MetricConventions(names={k: v for k, v in VLLM.metrics.names.items() if "prefix" not in k})
    q = workload_queries(_ctx(MetricNames.build(bare)), Selector({"namespace": "p"}), 3600, 60)
    assert "prefixHits" not in q and "prefixQueries" not in q


def test_a_load_job_samples_production_lengths_within_the_context():
    args = _job(LoadProfile(requests_per_minute=90, burstiness=0.5, prompt_lengths="100:3,200:1",
                            output_lengths="50:4", max_model_len=2048))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--prompt-buckets") + 1] == "100:3,200:1"
    assert args[args.index("--output-buckets") + 1] == "50:4"
    assert args[args.index("--max-model-len") + 1] == "2048"
    assert "--prompt-buckets" not in _job()["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_trace_load_job_mounts_its_configmap_read_only_and_replays_it():
    profile = LoadProfile(trace_speed_percent=150, trace_config_map="chat-trace", trace_key="day.jsonl")
    job = _job(profile)
    pod = job["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--trace") + 1] == "/trace/trace.jsonl"
    assert args[args.index("--trace-speed-percent") + 1] == "150"
    assert "--concurrency" not in args and "--request-rate" not in args
    assert {"name": "trace", "configMap": {"name": "chat-trace", "items": [{"key": "day.jsonl", "path": "trace.jsonl"}]}} \
        in pod["volumes"]
    assert {"name": "trace", "mountPath": "/trace", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert pod["automountServiceAccountToken"] is False  # the Job reads the ConfigMap through the kubelet, no token
    assert "configMap" not in str(_job()["spec"]["template"]["spec"]["volumes"])


@pytest.mark.parametrize("kwargs", [
    pytest.param({"trace_speed_percent": 100}, id="speed-without-configmap"),
    pytest.param({"concurrency": 4, "trace_speed_percent": 100, "trace_config_map": "t"}, id="trace-and-concurrency"),
])
def test_a_trace_profile_is_one_loop_with_its_configmap(kwargs):
    with pytest.raises(ValueError):
        LoadProfile(**kwargs)
