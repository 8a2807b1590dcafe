"""The HTML report: its sections, the curves at one common load, and that nothing from a BatchTuning can
inject markup or script into it."""

from __future__ import annotations

import base64
import copy
import functools
import json
from html.parser import HTMLParser

import pytest
from fake_world import World, production_target, reset_backoff, spec

from batchtune.api.models import (
    MAX_TRIALS_IN_STATUS,
    Condition,
    ContainerArgs,
    Knee,
    PrunedSetting,
    Setting,
    TrialPrediction,
    WorkloadRecord,
)
from batchtune.controller import reports
from batchtune.controller.reports import CONFIGMAP_BUDGET_BYTES, configmap
from batchtune.report import Tuning, curve_picture, curves_png
from batchtune.report_html import CSP, html_report, predictions

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
EVIL = ('<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'
        "\"'><iframe src=https://evil.example/></td></tr></table><style>body{display:none}</style>&amp;$x^$")
TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "span", "b", "dl", "dt", "dd",
        "pre", "table", "thead", "tbody", "tr", "th", "td", "ul", "li", "img", "div"}


@functools.cache
def _tuned() -> str:
    reset_backoff()
    w = World(bt_spec=spec(searchSpace={"maxNumSeqs": {"values": [8, 16, 32, 64]}}))
    w.deployments["llm"] = production_target()
    w.run_until({"Succeeded"})
    reset_backoff()
    return json.dumps({"metadata": {"name": "tune", "namespace": "inference"}, "spec": w.bt_spec, "status": w.status})


def tuned() -> dict:
    """A BatchTuning the reconcile loop took to Succeeded in the in-memory world."""
    return json.loads(_tuned())


def typed(bt: dict) -> Tuning:
    """The BatchTuning parsed once, as the CLI and the report writer parse it before rendering."""
    return Tuning.from_wire(bt["metadata"]["namespace"], bt["metadata"]["name"], bt["spec"], bt["status"])


class Page(HTMLParser):
    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.stack: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def count(self, tag: str) -> int:
        return sum(1 for t, _ in self.tags if t == tag)


def test_the_page_has_the_decision_curves_trials_predictions_and_workload():
    bt = tuned()
    page = html_report(typed(bt), PNG, "2026-12-01 08:00 UTC")
    parsed = Page(page)
    text = " ".join(parsed.text)
    for heading in ("Decision", "Curves", "Trials", "Predicted against measured", "The workload this decision holds for"):
        assert heading in text
    status = bt["status"]
    assert status["recommendation"]["reason"] in text
    assert " ".join(status["recommendation"]["args"]) in text
    assert "600 requests/min (open loop)" in text and "production's peak" in text
    # One row per trial, the chosen one marked.
    rows = [a for t, a in parsed.tags if t == "tr"]
    assert len(rows) - 1 >= len(status["trials"])  # the trial table's rows (+ its header), and other tables
    assert ("tr", {"class": "best"}) in parsed.tags
    for trial in status["trials"]:
        assert trial["name"] in text
    # The image inline, nothing fetched.
    images = [a for t, a in parsed.tags if t == "img"]
    assert [i["src"] for i in images] == ["data:image/png;base64," + base64.b64encode(PNG).decode()]
    assert ("meta", {"http-equiv": "Content-Security-Policy", "content": CSP}) in parsed.tags
    assert "300 prompt / 100 output tokens" not in text  # spec.load's lengths, not production's: not fromProduction
    assert "512 prompt / 128 output tokens per request (spec.load)" in text
    assert status["workload"]["summary"] in text  # the workload the decision holds for, in status's words


def test_a_measured_production_workload_is_shown_with_its_rates():
    bt = tuned()
    bt["status"]["workload"] = {"source": "production", "summary": "production over 3600s: chat, 2.5 req/s",
                                "inputTokens": 300, "outputTokens": 100, "requestsPerSecond": 2.5,
                                "peakRequestsPerSecond": 4.0, "lookbackSeconds": 3600, "replicas": 2}
    text = " ".join(Page(html_report(typed(bt), PNG)).text)
    assert "production over 3600s: chat, 2.5 req/s" in text
    assert "300 prompt / 100 output tokens per request (production's measured profile, mean)" in text
    assert "2.5 req/s mean, 4 req/s peak over 3600 s (2 replicas together)" in text


def test_nothing_from_the_batchtuning_becomes_markup_or_script():
    # The typed parse refuses a string in a number or enum field; the renderer must escape it all the same, so the
    # forged values are set past validation (model_copy, model_construct).
    tuning = typed(tuned())
    spec, status = tuning.spec, tuning.status
    spec = spec.model_copy(update={"target_ref": spec.target_ref.model_copy(update={"name": EVIL}),
                                   "load": spec.load.model_copy(update={"generator": EVIL})})
    assert status.recommendation and status.baseline and status.applied and status.plan and status.plan.curve_load
    trials = []
    for trial in status.trials:
        trials.append(trial.model_copy(update={
            "name": EVIL, "message": EVIL, "verdict_reason": EVIL, "reason": EVIL, "state": EVIL,
            "setting": trial.setting.model_copy(update={"max_num_batched_tokens": EVIL}),
            "prediction": TrialPrediction(objective=1.0, metrics={"itlMs": 10.0})}))
    steps = trials[0].steps
    steps[-1] = steps[-1].model_copy(update={"verdict_reason": EVIL, "verdict": EVIL, "metrics": None})
    trials[0] = trials[0].model_copy(update={"state": "Done", "curve_step": None, "steps": steps})
    plan = status.plan.model_copy(update={"notes": ["memory prefilter: " + EVIL], "model": EVIL, "gpu_product": EVIL,
                                          "curve_load": status.plan.curve_load.model_copy(update={"source": EVIL})})
    status = status.model_copy(update={
        "phase": EVIL, "best_setting": EVIL, "best_trial": EVIL, "trials": trials, "plan": plan,
        "knee": Knee.model_construct(max_num_seqs=EVIL, reason=EVIL),
        "recommendation": status.recommendation.model_copy(update={
            "reason": EVIL, "args": [EVIL, "--max-num-seqs", EVIL], "replicas_hint": EVIL}),
        "baseline": status.baseline.model_copy(update={"args": [EVIL]}),
        "applied": status.applied.model_copy(update={"previous": ContainerArgs(args=[EVIL])}),
        "conditions": [*status.conditions, Condition.model_construct(
            type=EVIL, status="True", reason=EVIL, message=EVIL, last_transition_time=EVIL)],
        "workload": WorkloadRecord.model_construct(input_tokens=EVIL, output_tokens=EVIL, requests_per_minute=EVIL,
                                                   source=EVIL),
        "pruned": [PrunedSetting.model_construct(
            setting=Setting.model_construct(max_num_seqs=EVIL, gpu_memory_utilization_percent=EVIL),
            reason="DoesNotFitMemory", message=EVIL)],
    })
    page = html_report(Tuning(EVIL, EVIL, spec, status), PNG, EVIL)
    parsed = Page(page)
    assert {t for t, _ in parsed.tags} <= TAGS
    assert parsed.count("img") == 1 and parsed.count("script") == 0 and parsed.count("iframe") == 0
    assert parsed.count("style") == 1 and parsed.count("table") == page.count("<table>")
    for tag, attrs in parsed.tags:
        assert not any(k.startswith("on") for k in attrs), (tag, attrs)
        for key in ("src", "href", "action", "srcset", "background"):
            assert key not in attrs or (tag == "img" and attrs[key].startswith("data:image/png;base64,"))
    # Every hostile string arrives as text, whole: escaped, not dropped.
    text = "".join(parsed.text)
    assert text.count(EVIL) >= 20
    assert "<script>" not in page and "onerror=\"" not in page and "<iframe" not in page


def test_a_done_trial_without_a_common_load_reading_is_named_not_drawn_elsewhere():
    bt = tuned()
    trial = bt["status"]["trials"][1]
    trial.pop("curveStep")
    curve = next(s for s in trial["steps"] if s.get("purpose") == "Curve")
    curve.pop("metrics")
    curve.update(verdict="Unknown", verdictReason="not measured at the common load: LoadGeneratorFailed: 3 attempts")
    picture = curve_picture(typed(bt).status.trials, typed(bt).curve_load)
    assert trial["name"] not in [p.name for p in picture.points]
    assert len(picture.points) == len(bt["status"]["trials"]) - 1
    assert picture.missing == [f"{trial['name']} (seqs 16, gmu 90%): not measured at the common load: "
                               "LoadGeneratorFailed: 3 attempts"]
    # Each point is the trial's curve step, at the common load, never its capacity step.
    for point in picture.points:
        source = next(t for t in bt["status"]["trials"] if t["name"] == point.name)
        assert point.metrics == source["steps"][source["curveStep"]]["metrics"]
        assert source["steps"][source["curveStep"]]["load"] == 600
    text = " ".join(Page(html_report(typed(bt), PNG)).text)
    assert "LoadGeneratorFailed: 3 attempts" in text and "Not drawn" in text


@pytest.mark.parametrize("off, says", [
    pytest.param(False, "holds no common curve load", id="old-status"),
    pytest.param(True, "spec.report.curveLoad.type is Off", id="curves-off"),
])
def test_a_status_without_a_common_load_says_so(off, says):
    bt = tuned()
    bt["status"]["plan"].pop("curveLoad")
    for trial in bt["status"]["trials"]:
        trial.pop("curveStep", None)
        trial["steps"] = [s for s in trial["steps"] if s.get("purpose") != "Curve"]
    if off:
        bt["spec"]["report"] = {"curveLoad": {"type": "Off"}}
    picture = curve_picture(typed(bt).status.trials, None, off)
    assert picture.points == [] and says in picture.why_none
    assert says in " ".join(Page(html_report(typed(bt), PNG)).text)
    png = curves_png(typed(bt))
    assert png.startswith(b"\x89PNG")


def test_a_latency_beyond_the_histogram_is_drawn_at_a_ceiling_and_named_in_the_table(monkeypatch):
    # At a common load a small batch can be overloaded: its percentile is past the histogram's last bucket,
    # which status holds as 1e12 ms. The panel keeps the finite curve's scale; the table says it in words.
    import matplotlib.pyplot as plt

    from batchtune.api.models import BEYOND_LAST_BUCKET_MS
    from batchtune.report import latency_ceiling

    bt = tuned()
    trials = bt["status"]["trials"]
    smallest = min((t for t in trials if t["state"] == "Done"), key=lambda t: t["setting"]["maxNumSeqs"])
    step = smallest["steps"][smallest["curveStep"]]
    step["metrics"].update(ttftMs=BEYOND_LAST_BUCKET_MS, itlMs=BEYOND_LAST_BUCKET_MS)
    step["verdict"] = "Violated"
    picture = curve_picture(typed(bt).status.trials, typed(bt).curve_load)
    finite = max(v for p in picture.points for k, v in p.metrics.items()
                 if k in ("ttftMs", "itlMs", "e2eMs") and v < BEYOND_LAST_BUCKET_MS)
    ceiling = latency_ceiling(picture.points, typed(bt).spec.slo)
    assert ceiling == 4 * max(finite, *(v for k, v in bt["spec"]["slo"].items() if k.endswith("Milliseconds")))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    curves_png(typed(bt))
    latency_axis = figures[0].axes[2]
    assert latency_axis.get_ylim()[1] <= ceiling * 4 < BEYOND_LAST_BUCKET_MS / 1000
    assert any("beyond the latency histogram" in t.get_text() for t in latency_axis.texts)
    text = " ".join(Page(html_report(typed(bt), PNG)).text)
    assert "beyond histogram" in text and "1,000,000,000,000" not in text


def test_the_curves_image_survives_hostile_text():
    bt = tuned()
    trial = bt["status"]["trials"][0]
    trial.pop("curveStep")
    next(s for s in trial["steps"] if s.get("purpose") == "Curve").update(verdictReason="$\\frac{1}{0}$ $x^$ " + EVIL)
    bt["status"]["plan"]["curveLoad"]["source"] = "$\\undefined{$ " + EVIL
    bt["status"].update(bestTrial=EVIL, knee={"maxNumSeqs": 16, "reason": EVIL})
    png = curves_png(typed(bt), title="$_$" + EVIL)
    assert png.startswith(b"\x89PNG") and len(png) > 20_000


def test_twin_predictions_slot_in_where_a_trial_carries_them():
    bt = tuned()
    trial = bt["status"]["trials"][2]
    measured = trial["metrics"]["itlMs"]
    trial["prediction"] = {"objective": 1.0,
                           "metrics": {"itlMs": measured * 1.1, "sloCapacity": trial["metrics"]["sloCapacity"]}}
    bt["status"]["trials"][3]["prediction"] = {"objective": 1.0, "metrics": {"outputThroughput": 1.0}}
    trials = typed(bt).status.trials
    assert predictions(trials[2]) == trial["prediction"]["metrics"]
    assert predictions(trials[3]) == {"outputThroughput": 1.0}
    assert predictions(trials[0]) is None
    text = " ".join(Page(html_report(typed(bt), PNG)).text)
    assert "+10.0%" in text and "+0.0%" in text and "inter-token latency (ms)" in text
    del trial["prediction"], bt["status"]["trials"][3]["prediction"]
    assert "No trial carries a performance prediction" in " ".join(Page(html_report(typed(bt), PNG)).text)


def test_a_twin_guided_prediction_is_held_against_the_first_step_it_predicted():
    bt = tuned()
    trial = next(t for t in bt["status"]["trials"] if len([s for s in t["steps"] if s.get("purpose") != "Curve"]) > 1)
    first = trial["steps"][0]
    first["metrics"]["outputThroughput"] = trial["metrics"]["outputThroughput"] / 2  # a lower load's figure
    trial["prediction"] = {"objective": 1.0, "capacityLoad": first["load"],
                           "metrics": {"outputThroughput": first["metrics"]["outputThroughput"] * 1.2}}
    assert first["metrics"]["outputThroughput"] != trial["metrics"]["outputThroughput"]  # not the deciding step
    text = " ".join(Page(html_report(typed(bt), PNG)).text)
    assert "+20.0%" in text


def test_the_memory_prefilter_is_held_against_what_the_trials_found():
    bt = tuned()
    status = bt["status"]
    status["plan"]["notes"] = ["memory prefilter: twin model of Llama-3.1-8B on H100-SXM"]
    status["trials"][3].update(state="Infeasible", reason="KvCacheTooSmall", verdict="Violated")
    status["pruned"] = [{"setting": {"maxNumSeqs": 1024, "gpuMemoryUtilizationPercent": 90},
                         "reason": "DoesNotFitMemory", "message": "KV cache holds 301 sequences"}]
    text = " ".join(Page(html_report(typed(bt), PNG)).text)
    assert f"{len(status['trials'])} settings tried, all predicted to fit; 1 did not." in text
    assert "did not fit: KvCacheTooSmall" in text and "KV cache holds 301 sequences" in text


@pytest.mark.parametrize("budget", [
    pytest.param(None, id="the-real-budget"),
    # Status is bounded (at most MAX_TRIALS_IN_STATUS trials, issue 22), so its largest report fits the real budget
    # before the last stages; a smaller budget makes the same status go through every stage.
    pytest.param(80_000, id="a-budget-that-reaches-every-stage"),
])
def test_the_configmap_carries_the_page_and_stays_under_a_mebibyte(monkeypatch, budget):
    bt = tuned()
    png = curves_png(typed(bt))
    body = configmap("inference", "tune", "uid-1", bt["spec"], bt["status"], png)
    page = body["data"]["report.html"]
    assert base64.b64encode(png).decode() in page and body["binaryData"]["curves.png"]
    sizes = [*range(1, 8), *range(8, MAX_TRIALS_IN_STATUS, 8), MAX_TRIALS_IN_STATUS]
    if budget is not None:
        monkeypatch.setattr(reports, "CONFIGMAP_BUDGET_BYTES", budget)
        png, sizes = png[:20_000], list(range(1, MAX_TRIALS_IN_STATUS + 1))  # a 20 kB image, every trial count
    # A status as large as status can be: the least needed goes first, and the ConfigMap never breaks.
    big = copy.deepcopy(bt["status"])
    big["trials"] = [dict(copy.deepcopy(bt["status"]["trials"][i % 4]), index=i, name=f"tune-trial-{i}",
                          message="m" * 2000, verdictReason="v" * 500)
                     for i in range(MAX_TRIALS_IN_STATUS)]  # each text at its status bound (or cut to it)
    shed = []
    for size in sizes:
        body = configmap("inference", "tune", "uid-1", bt["spec"], dict(big, trials=big["trials"][:size]), png)
        total = sum(len(k) + len(v.encode()) for k, v in body["data"].items()) + \
            sum(len(k) + len(base64.b64decode(v)) for k, v in (body.get("binaryData") or {}).items())
        assert total <= reports.CONFIGMAP_BUDGET_BYTES <= CONFIGMAP_BUDGET_BYTES < 1_048_576, size
        page = body["data"].get("report.html", "")
        json_ = json.loads(body["data"]["trials.json"])
        # In shedding order: trials.json's indentation, its steps, the page's image, the page, curves.png, trials.
        kept = ("\n  " in body["data"]["trials.json"], "steps" in json.dumps(json_.get("trials", [{}])[:1]),
                "data:image/png" in page, bool(page), "binaryData" in body, "trials" in json_)
        k = kept.index(True) if True in kept else len(kept)
        assert kept == (False,) * k + (True,) * (len(kept) - k), (size, kept)  # the least needed went first
        if page and "data:image/png" not in page:
            assert "it is curves.png beside it" in page
        shed.append(k)
    if budget is None:
        assert shed == sorted(shed) and "trials" in json_, shed  # the largest status keeps its trials in the report
    else:
        assert shed == sorted(shed) and set(range(6)) <= set(shed), shed  # every stage reached, in order


def test_the_twins_calibration_verdict_and_what_the_search_did_with_it():
    bt = tuned()
    bt["status"]["twin"] = {"basis": "b", "verdict": "Untrusted", "mode": "measure", "observations": 4,
                            "reason": "2 of 8 residuals outside their tolerance; held at its physical bound <b>x</b>",
                            "parameters": {"bwScale": 1.1176}}
    text = " ".join(Page(html_report(typed(bt), None)).text)
    assert "The twin's calibration" in text and "Untrusted" in text
    assert "the twin does not steer: trials are chosen by measuring (Adaptive)" in text
    assert "no trial was chosen by it while it stayed Untrusted" in text
    assert "held at its physical bound <b>x</b>" in text  # escaped: text, not markup
    assert "bwScale" in text and "1.12" in text
    del bt["status"]["twin"]
    assert "The twin's calibration" not in " ".join(Page(html_report(typed(bt), None)).text)
