"""The measured SLO capacity as an autoscaler: HPA and KEDA manifests, validated against the real schemas.

The KEDA ScaledObject is checked against KEDA's own CRD (v2.20.2, tests/data/keda); the HPA against the
API server's autoscaling/v2 schema by tests/integration/test_autoscale.py (server-side dry run), which
also makes a real HPA scale the twin-backed production through prometheus-adapter.
"""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from batchtune.cli.recommend import NoRecommendation, autoscaler_text
from batchtune.core import autoscale
from batchtune.core.settings import Setting

DATA = Path(__file__).resolve().parents[1] / "data" / "keda" / "keda.sh_scaledobjects.yaml"


def tuning(capacities=(2.5, 2.25), objective="SloCapacity") -> dict:
    setting = {"maxNumSeqs": 32, "gpuMemoryUtilizationPercent": 90}
    trials = [{"name": f"tune-trial-{i}", "index": i, "setting": setting, "state": "Done",
               "metrics": {"sloCapacity": c}} for i, c in enumerate(capacities)]
    trials.append({"name": "tune-trial-9", "index": 9, "setting": {"maxNumSeqs": 8, "gpuMemoryUtilizationPercent": 90},
                   "state": "Done", "metrics": {"sloCapacity": 9.0}})
    return {"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning",
            "metadata": {"name": "tune", "namespace": "inference"},
            "spec": {"targetRef": {"name": "llm"}, "searchSpace": {"maxNumSeqs": {"values": [8, 32]}},
                     "objective": {"type": objective},
                     "slo": {"interTokenLatencyMilliseconds": 60, "headroomPercent": 15},
                     "prometheus": {"url": "http://prometheus.monitoring:9090"}},
            "status": {"phase": "Succeeded", "bestTrial": "tune-trial-0", "trials": trials,
                       "recommendation": {"setting": setting, "reason": "r", "replicasHint": 3}}}


def capacity_of(bt: dict) -> autoscale.Capacity:
    """What the operator exports and `recommend -o hpa` targets, through the controller's status conversion."""
    from batchtune.api import parse_spec, parse_status
    from batchtune.controller import records

    meta = bt["metadata"]
    return records.capacity(meta["namespace"], meta["name"], parse_spec(bt["spec"]), parse_status(bt["status"]))


def test_capacity_is_the_worst_repeat_of_the_chosen_setting():
    cap = capacity_of(tuning())
    assert (cap.namespace, cap.deployment, cap.requests_per_second, cap.headroom_percent, cap.replicas_hint) == \
        ("inference", "llm", 2.25, 15, 3)


@pytest.mark.parametrize("trials, message", [
    pytest.param([], "not measured in every repeat", id="no-trial-at-the-setting"),
    pytest.param([(2.5, True), (None, True)], "not measured in every repeat", id="a-repeat-unmeasured"),
    pytest.param([(2.5, True), (float("nan"), True)], "not measured in every repeat", id="a-repeat-nan"),
    pytest.param([(0.0, True)], "not measured in every repeat", id="zero"),
])
def test_capacity_needs_every_finished_repeat_measured(trials, message):
    chosen = Setting(32, 90)
    measured = [autoscale.Measured(chosen, done, value) for value, done in trials]
    measured.append(autoscale.Measured(Setting(8, 90), True, 9.0))  # another setting's figure never counts
    with pytest.raises(autoscale.NoCapacity, match=message):
        autoscale.capacity("inference/tune", "inference", "llm", chosen, measured, 10)


def test_capacity_skips_unfinished_trials_and_needs_a_recommendation():
    chosen = Setting(32, 90)
    measured = [autoscale.Measured(chosen, True, 3.0), autoscale.Measured(chosen, False, None)]
    assert autoscale.capacity("inference/tune", "inference", "llm", chosen, measured, 10).requests_per_second == 3.0
    with pytest.raises(autoscale.NoCapacity, match="no recommendation yet"):
        autoscale.capacity("inference/tune", "inference", "llm", None, measured, 10)


def test_hpa_targets_the_capacity_per_pod():
    hpa = autoscale.hpa(capacity_of(tuning()))
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm"}
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {"metric": {"name": "vllm_requests_per_second"},
                                                                "target": {"type": "AverageValue", "averageValue": "2250m"}}}]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    assert "15% headroom" in hpa["metadata"]["annotations"]["batchtune.io/target"]


def test_keda_scaled_object_matches_kedas_crd():
    crd = yaml.safe_load(DATA.read_text())
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")["schema"]["openAPIV3Schema"]
    obj = autoscale.keda(capacity_of(tuning()), "http://prometheus.monitoring:9090", max_replicas=4)
    jsonschema.validate(obj, schema)
    trigger = obj["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "2.25"
    assert trigger["metadata"]["query"] == ('sum(rate(vllm:request_success_total{namespace="inference",'
                                            'pod=~"llm-[a-z0-9]+-[a-z0-9]+"}[1m]))')
    bad = {**obj, "spec": {**obj["spec"], "triggers": [{"metadata": {}}]}}  # the schema really checks
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_adapter_rule_names_the_metric_the_hpa_reads():
    rule = autoscale.adapter_rule()
    assert rule["name"] == {"matches": "^vllm:request_success_total$", "as": autoscale.HPA_METRIC}
    assert "rate(<<.Series>>{<<.LabelMatchers>>}[1m])" in rule["metricsQuery"]


@pytest.mark.parametrize("output", ["hpa", "keda"])
def test_cli_text_is_yaml_with_the_adapter_rule_in_a_comment(output):
    text, note = autoscaler_text(tuning(), output, max_replicas=5)
    doc = yaml.safe_load(text)
    assert doc["kind"] == ("HorizontalPodAutoscaler" if output == "hpa" else "ScaledObject")
    assert "2.25 req/s per replica" in note
    if output == "hpa":
        rule = yaml.safe_load("\n".join(line[2:] for line in text.splitlines() if line.startswith("# ")
                                        and not line.startswith("# HorizontalPodAutoscaler")
                                        and not line.startswith("# It needs")))
        assert rule["rules"][0]["name"]["as"] == "vllm_requests_per_second"


@pytest.mark.parametrize("bt, message", [
    pytest.param({**tuning(), "status": {}}, "has no recommendation yet", id="no-recommendation"),
    pytest.param(tuning(capacities=(2.5, None)), "not measured in every repeat", id="a-repeat-unmeasured"),
])
def test_no_capacity_says_why(bt, message):
    with pytest.raises(NoRecommendation, match=message):
        autoscaler_text(bt, "hpa")


def test_replica_bounds_are_checked():
    with pytest.raises(ValueError, match="1 <= min"):
        autoscale.hpa(capacity_of(tuning()), min_replicas=3, max_replicas=2)


def test_operator_exports_capacity_and_knobs_and_forgets_them():
    from prometheus_client import generate_latest

    from batchtune.api import parse_spec, parse_status
    from batchtune.controller import telemetry

    bt = tuning()
    telemetry.export_decision("inference", "tune", parse_spec(bt["spec"]), parse_status(bt["status"]))
    text = generate_latest().decode()
    labels = 'batchtuning="tune",deployment="llm",namespace="inference"'
    assert f"batchtune_slo_capacity_requests_per_second{{{labels}}} 2.25" in text
    assert 'batchtune_setting_value{batchtuning="tune",deployment="llm",knob="maxNumSeqs",namespace="inference"} 32.0' \
        in text
    assert f"batchtune_slo_headroom_percent{{{labels}}} 15.0" in text
    telemetry.forget("inference", "tune")
    assert "batchtune_slo_capacity_requests_per_second{" not in generate_latest().decode()
