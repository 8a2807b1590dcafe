"""The tuning report as one self-contained HTML page: the decision and why, the curves, the trial table,
predicted against measured where a twin predicted, and the workload the decision holds for.

Everything in it comes from a BatchTuning, whose author (and whoever can write its status) is less
trusted than whoever opens the report: every value is HTML-escaped, the page carries no script and
loads nothing (the curves are an inline PNG data URI), and its Content-Security-Policy forbids scripts,
frames and any fetch, so an escaping slip still could not run code or call out. It works offline.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic_core import to_jsonable_python

from batchtune.api.models import (
    BEYOND_LAST_BUCKET_MS,
    BatchTuningStatus,
    ConditionStatus,
    CurveLoadRecord,
    LoadStepRecord,
    ObjectiveType,
    PlanRecord,
    Setting,
    TrialRecord,
    WorkloadRecord,
)
from batchtune.core.vocabulary import MEMORY_REASONS, ConditionType, M, Reason, StepPurpose, TrialState
from batchtune.report import Tuning, curve_picture, curve_step

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
MAX_TABLE_ROWS = 300
"""Rows past this (trials, pruned settings) are counted, not listed: the page stays small enough for the
report ConfigMap."""

# Metric keys a prediction is compared on, with their words and units.
COMPARED = ((M.SLO_CAPACITY, "SLO capacity", "req/s"), (M.OUTPUT_THROUGHPUT, "output throughput", "tok/s"),
            (M.REQUEST_THROUGHPUT, "request throughput", "req/s"), (M.ITL_MS, "inter-token latency", "ms"),
            (M.TTFT_MS, "TTFT", "ms"), (M.E2E_MS, "end-to-end latency", "ms"),
            (M.KV_CACHE_USAGE_PERCENT, "KV-cache usage", "%"))
MEMORY_FAILURES = frozenset({*MEMORY_REASONS, Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH})

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1200px;
padding:16px 24px;color:#1d2327;background:#fff}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #dde;padding-bottom:3px}
h3{font-size:15px;margin:16px 0 6px}.sub{color:#5a6470;margin:0 0 10px}
table{border-collapse:collapse;margin:6px 0 10px;font-size:13px}
th,td{border:1px solid #d5d9de;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f1f3f5}td:last-child{min-width:200px;max-width:380px}.wide{overflow-x:auto}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.best td{background:#e6f4ea;font-weight:600}.Met{color:#137333}.Violated{color:#b3261e}.Unknown{color:#8a6d00}
code,pre{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,monospace;background:#f6f8fa}
pre{padding:8px;white-space:pre-wrap;word-break:break-all;border:1px solid #e1e4e8}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;background:#e8eaed;font-weight:600}
.badge.Succeeded,.badge.Recommended{background:#ceead6}.badge.Failed,.badge.RolledBack{background:#fad2cf}
dl{display:grid;grid-template-columns:max-content auto;gap:3px 14px;margin:6px 0}dt{color:#5a6470}dd{margin:0}
img.curves{max-width:100%;height:auto;border:1px solid #e1e4e8}.note{color:#b3261e}.muted{color:#5a6470}
"""


def h(value: Any) -> str:
    """Text for HTML: escaped, quotes included (safe in attributes and elements alike)."""
    return html.escape("" if value is None else str(value), quote=True)


def _time(moment: datetime | None) -> str | None:
    """A status timestamp as status holds it (2025-01-01T10:40:00Z)."""
    return None if moment is None else str(to_jsonable_python(moment))


def _ms(value: Any) -> str:
    """A latency: status holds one beyond the histogram's last bucket as BEYOND_LAST_BUCKET_MS."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= BEYOND_LAST_BUCKET_MS:
        return "beyond histogram"
    return _num(value)


def _num(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return ""
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 10:
        return f"{value:,.0f}"
    return f"{value:,.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"


def _args(words: Sequence[str] | None) -> str:
    return " ".join(words or ())


def _setting(setting: Setting | None) -> str:
    if setting is None:
        return ""
    out = f"max-num-seqs {setting.max_num_seqs}, gmu {setting.gpu_memory_utilization_percent}%"
    return out + (f", mbt {setting.max_num_batched_tokens}" if setting.max_num_batched_tokens else "")


def _table(head: Sequence[str], rows: Iterable[Sequence[str]], classes: Sequence[str] = (),
           numeric: frozenset[int] = frozenset()) -> str:
    """A table from already-escaped cells."""
    out = ["<table><thead><tr>", *(f"<th>{c}</th>" for c in head), "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        cls = classes[i] if i < len(classes) and classes[i] else ""
        out.append(f'<tr class="{h(cls)}">' if cls else "<tr>")
        out.extend(f'<td class="n">{c}</td>' if j in numeric else f"<td>{c}</td>" for j, c in enumerate(row))
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _dl(items: Iterable[tuple[str, str]]) -> str:
    """A definition list from (label, already-escaped value) pairs, empty values left out."""
    body = "".join(f"<dt>{h(k)}</dt><dd>{v}</dd>" for k, v in items if v)
    return f"<dl>{body}</dl>" if body else ""


def _long(text: str, limit: int = 240) -> str:
    """Long text cut in a table cell, whole in its tooltip."""
    if len(text) <= limit:
        return h(text)
    return f'<span title="{h(text)}">{h(text[: limit - 1])}…</span>'


def _verdict(value: Any) -> str:
    text = h(value)
    return f'<span class="{text}">{text}</span>' if text else ""


# ---- sections ----------------------------------------------------------------------------------


def _decision(status: BatchTuningStatus) -> str:
    rec = status.recommendation
    final = next((c for c in status.conditions if c.type in (ConditionType.SUCCEEDED, ConditionType.FAILED)
                  and c.status == ConditionStatus.TRUE), None)
    applied = status.applied
    out = ["<h2>Decision</h2>"]
    if rec is None and final is None:
        out.append('<p class="muted">No decision yet: the tuning is in phase '
                   f"{h(status.phase or 'Pending')}.</p>")
    out.append(_dl([
        ("Chosen setting", h(_setting(rec.setting if rec else None)) or h(status.best_setting)),
        ("Best trial", h(status.best_trial)),
        ("Why", h(rec.reason if rec else None)),
        ("Knee", h(f"max-num-seqs {status.knee.max_num_seqs}: {status.knee.reason}") if status.knee else ""),
        ("Replicas for production's peak", h(rec.replicas_hint if rec else None)),
        ("Outcome", h(f"{final.reason}: {final.message}") if final else ""),
        ("Applied at", h(_time(applied.applied_at) if applied else None)),
        ("Verified at", h(_time(applied.verified_at) if applied else None)),
        ("Rolled back at", h(_time(applied.rolled_back_at) if applied else None)),
    ]))
    baseline = _args(status.baseline.args if status.baseline else None)
    if baseline:
        out.append(f"<h3>Production's command line before tuning</h3><pre>{h(baseline)}</pre>")
    if rec is not None and rec.args:
        out.append(f"<h3>Recommended command line</h3><pre>{h(_args(rec.args))}</pre>")
    if applied is not None:
        for label, container in (("Previous container args (restored on rollback)", applied.previous),
                                 ("Applied", applied.new)):
            if container is not None and container.args:
                out.append(f"<h3>{h(label)}</h3><pre>{h(_args(container.args))}</pre>")
    return "".join(out)


def _curves(tuning: Tuning, png: bytes | None, no_image: str) -> str:
    picture = curve_picture(tuning.status.trials, tuning.curve_load, tuning.curves_off)
    out = ["<h2>Curves</h2>"]
    if picture.load:
        out.append(f"<p>GPU utilization, throughput and {h(tuning.spec.slo.percentile)} latency "
                   f"against max-num-seqs, every trial at one offered load: <b>{h(picture.load)}</b> "
                   f"({h(picture.source)}). That step is for this picture only; the decision rests on each "
                   "trial's own search. SLO capacity, which each trial reaches at its own load, has its own "
                   "panel.</p>")
    else:
        out.append(f'<p class="note">{h(picture.why_none)}. The capacity panel still shows each trial at its '
                   "own highest passing load.</p>")
    if png:
        data = base64.b64encode(png).decode("ascii")
        out.append(f'<img class="curves" id="curves" src="data:image/png;base64,{data}" '
                   'alt="GPU utilization, throughput and latency against max-num-seqs at one offered load, '
                   'and SLO capacity per trial">')
    else:
        out.append(f'<p class="note">{h(no_image)}</p>')
    if picture.missing:
        items = "".join(f"<li>{h(m)}</li>" for m in picture.missing)
        out.append(f'<p class="note">Not drawn (no reading at the common load; never drawn at another):</p>'
                   f"<ul>{items}</ul>")
    return "".join(out)


TRIAL_HEAD = ("trial", "max-num-seqs", "gmu %", "mbt", "state", "verdict", "SLO capacity req/s", "at load",
              "output tok/s", "TTFT ms", "ITL ms", "E2E ms", "GPU / SM %", "KV peak %",
              "common load: tok/s", "common load: ITL ms", "common load: verdict", "why")


def _trials(status: BatchTuningStatus) -> str:
    trials = status.trials
    best = status.best_trial
    rows = [_trial_row(trial) for trial in trials[:MAX_TABLE_ROWS]]
    classes = ["best" if best and trial.name == best else "" for trial in trials[:MAX_TABLE_ROWS]]
    out = [f"<h2>Trials</h2><p class=\"sub\">{len(trials)} trials; latencies at the SLO percentile; the bold row "
           "is the chosen one. SLO capacity is the highest load the trial's search found within every SLO.</p>",
           _trial_table(rows, classes) if rows else '<p class="muted">No trial has started yet.</p>']
    if len(trials) > MAX_TABLE_ROWS:
        out.append(f'<p class="muted">{len(trials) - MAX_TABLE_ROWS} more trials in trials.csv.</p>')
    return "".join(out)


def _trial_row(trial: TrialRecord) -> list[str]:
    """One row of TRIAL_HEAD, already escaped."""
    setting, metrics = trial.setting, trial.metrics or {}
    curve = curve_step(trial)
    curve_metrics = (curve.metrics if curve else None) or {}
    gpu = metrics.get(M.SM_ACTIVE_PERCENT, metrics.get(M.GPU_UTIL_PERCENT))
    why = str(trial.verdict_reason or trial.message or trial.reason or "")
    return [h(trial.name), h(setting.max_num_seqs), h(setting.gpu_memory_utilization_percent),
            h(setting.max_num_batched_tokens), h(trial.state), _verdict(trial.verdict),
            h(_num(metrics.get(M.SLO_CAPACITY))), h(_num(metrics.get(M.SLO_CAPACITY_LOAD))),
            h(_num(metrics.get(M.OUTPUT_THROUGHPUT))), h(_ms(metrics.get(M.TTFT_MS))),
            h(_ms(metrics.get(M.ITL_MS))), h(_ms(metrics.get(M.E2E_MS))), h(_num(gpu)),
            h(_num(metrics.get(M.KV_CACHE_USAGE_PEAK_PERCENT))),
            h(_num(curve_metrics.get(M.OUTPUT_THROUGHPUT))), h(_ms(curve_metrics.get(M.ITL_MS))),
            _verdict(curve.verdict if curve else None), _long(why)]


def _trial_table(rows: list[list[str]], classes: list[str]) -> str:
    # Columns nothing filled in (mbt not searched, no common load, ...) are left out.
    keep = [j for j, head in enumerate(TRIAL_HEAD) if head in ("trial", "state", "why") or any(r[j] for r in rows)]
    numeric = frozenset(i for i, j in enumerate(keep) if 6 <= j <= 15)
    table = _table([h(TRIAL_HEAD[j]) for j in keep], [[r[j] for j in keep] for r in rows], classes, numeric)
    return f'<div class="wide">{table}</div>'


def predictions(trial: TrialRecord) -> Mapping[str, float] | None:
    """The twin's prediction of a trial's metrics (strategy TwinGuided: `prediction.metrics`, the same keys as
    `metrics`). None: not predicted."""
    return trial.prediction.metrics if trial.prediction is not None and trial.prediction.metrics else None


def _predicted(status: BatchTuningStatus) -> str:
    return "".join(["<h2>Predicted against measured</h2>", _prefilter(status), _calibration(status),
                    _performance(status.trials)])


def _prefilter(status: BatchTuningStatus) -> str:
    """The twin's memory prefilter: which settings it let through, and whether they fitted when tried."""
    notes = status.plan.notes if status.plan else []
    prefilter = next((n for n in notes if n.startswith("memory prefilter")), None)
    used = prefilter is not None and not prefilter.startswith("memory prefilter skipped")
    if prefilter is None:
        prefilter = next((n for n in notes if "prefilter" in n), "")
    out = ["<h3>The twin's memory prefilter</h3>", f"<p>{h(prefilter) or 'No prefilter note in this status.'}</p>"]
    if not used:
        return "".join(out)
    trials = status.trials
    rows, misses = [], 0
    for trial in trials[:MAX_TABLE_ROWS]:
        measured, agree = _fitted(trial)
        misses += agree == "no"
        rows.append([h(trial.name), h(_setting(trial.setting)), "fits", h(measured), h(agree)])
    memory = [p for p in status.pruned if p.reason == Reason.DOES_NOT_FIT_MEMORY]
    out.append(f"<p>{len(trials)} settings tried, all predicted to fit; {misses} did not. "
               f"{len(memory)} settings predicted not to fit were never tried (no GPU time spent on them).</p>")
    if rows:
        out.append(_table(["trial", "setting", "twin predicted", "measured", "agree"], rows))
    if memory:
        out.append(_table(["setting", "twin predicted", "why"],
                          [[h(_setting(p.setting)), "does not fit", h(p.message or p.memory_reason)]
                           for p in memory[:MAX_TABLE_ROWS]]))
    return "".join(out)


def _fitted(trial: TrialRecord) -> tuple[str, str]:
    """(what the trial found about memory, whether that agrees with the prefilter's "fits")."""
    if trial.reason in MEMORY_FAILURES:
        return f"did not fit: {trial.reason}", "no"
    if trial.state == TrialState.DONE or trial.ready_at:
        return "started and served", "yes"
    if trial.state in (TrialState.FAILED, TrialState.INFEASIBLE):
        return f"{trial.state}: {trial.reason}", "unknown"
    return str(trial.state or ""), ""


def _performance(trials: Sequence[TrialRecord]) -> str:
    """The twin's performance predictions against what the trials measured."""
    predicted = [(t, twin) for t in trials if (twin := predictions(t)) is not None]
    out = ["<h3>The twin's performance predictions</h3>"]
    if not predicted:
        out.append('<p class="muted">No trial carries a performance prediction (the strategy did not predict '
                   "with the twin).</p>")
        return "".join(out)
    rows = []
    for trial, pred in predicted[:MAX_TABLE_ROWS]:
        figures = _predicted_figures(trial)
        for key, words, unit in COMPARED:
            p, m = pred.get(key), figures.get(key)
            if not _num(p) and not _num(m):
                continue
            error = ""
            if p is not None and m and _num(p) and _num(m):
                error = f"{100 * (p - m) / abs(m):+.1f}%"
            rows.append([h(trial.name), h(_setting(trial.setting)), h(f"{words} ({unit})"),
                         h(_num(p)), h(_num(m)), h(error)])
    out.append(_table(["trial", "setting", "figure", "predicted", "measured", "error"], rows,
                      numeric=frozenset({3, 4, 5})))
    return "".join(out)


def _predicted_figures(trial: TrialRecord) -> Mapping[str, float]:
    """What a prediction is held against: TwinGuided predicts the figures at its predicted capacity, where the
    trial's first step ran (else the trial's own figures)."""
    at = trial.prediction.capacity_load if trial.prediction else None
    # Of the steps at that load (a short bracketing one, then the full window), the full window's.
    at_load = [s for s in trial.steps if s.purpose != StepPurpose.CURVE and at is not None and s.load == at]
    first: LoadStepRecord | None = next((s for s in at_load if s.purpose != StepPurpose.BRACKET),
                                        at_load[0] if at_load else None)
    if first is not None:
        return first.metrics or {}
    return trial.metrics or {}


MODE_WORDS = {
    "calibrate": "the next trial calibrates the twin",
    "confirm": "the twin steers: the next trial confirms its best prediction",
    "measure": "the twin does not steer: trials are chosen by measuring (Adaptive)",
}


def _calibration(status: BatchTuningStatus) -> str:
    """Strategy TwinGuided: the calibration's verdict, why, and what the search does with it."""
    twin = status.twin
    if twin is None:
        return ""
    verdict = str(twin.verdict or "unknown")
    mode = str(twin.mode or "")
    css = "Met" if verdict in ("Trusted", "Nominal") else "Violated"
    out = ["<h3>The twin's calibration</h3>",
           f'<p>Verdict <span class="{css}">{h(verdict)}</span> on {h(twin.observations)} measured load '
           f"step(s); {h(MODE_WORDS.get(mode, mode or 'no decision recorded'))}.</p>"]
    if verdict == "Untrusted":
        out.append("<p>An Untrusted calibration's predictions missed the measurements it was fitted on (or needed "
                   "a parameter past its physical bound): no trial was chosen by it while it stayed Untrusted.</p>")
    if twin.reason:
        out.append(f"<p>{_long(twin.reason, 1000)}</p>")
    if twin.parameters:
        out.append(_table(["fitted parameter", "value"],
                          [[h(k), h(_num(v))] for k, v in list(twin.parameters.items())[:40]],
                          numeric=frozenset({1})))
    return "".join(out)


def _workload(tuning: Tuning) -> str:
    spec, status = tuning.spec, tuning.status
    load, slo = spec.load, spec.slo
    workload = status.workload or WorkloadRecord()
    plan = status.plan or PlanRecord()
    targets = ", ".join(f"{slo.percentile} {name} {target} ms" for name, target in (
        ("TTFT", slo.ttft_milliseconds), ("inter-token latency", slo.inter_token_latency_milliseconds),
        ("end-to-end latency", slo.e2e_latency_milliseconds)) if target)
    if load.concurrency:
        search_load = f"{load.concurrency} concurrent requests (spec.load.concurrency)"
    elif load.requests_per_minute:
        search_load = f"{load.requests_per_minute} requests/min (spec.load.requestsPerMinute)"
    else:
        search_load = ("searched per trial (SLO capacity)" if spec.objective.type == ObjectiveType.SLO_CAPACITY
                       else "each trial's max-num-seqs in flight")
    out = ["<h2>The workload this decision holds for</h2>",
           '<p class="sub">A setting is best for a workload: this is the one the trials ran, and the decision '
           "holds while production's traffic looks like it.</p>",
           _dl([
               ("Workload", h(workload.summary)),
               ("Model", h(plan.model)), ("GPU", h(plan.gpu_product)),
               ("Request shape", h(_request_shape(tuning, workload))),
               ("Production's rate", h(_production_rate(workload))),
               ("Load of the search", h(search_load)), ("Load generator", h(load.generator)),
               ("Curves' common load", h(_curve_words(plan.curve_load))),
               ("SLO", h(f"{targets}; errors at most {slo.max_error_rate_percent}%; "
                         f"{slo.headroom_percent}% headroom") if targets else ""),
               ("Objective", h(spec.objective.type)),
               ("Strategy", h(spec.strategy.type)),
               # float(): an unset gpuMinutes is the model's int default, which status writes as 0.0
               ("GPU time", h(f"{float(status.gpu_minutes)} GPU-minutes") if tuning.written else ""),
           ])]
    return "".join(out)


def _request_shape(tuning: Tuning, workload: WorkloadRecord) -> str:
    """Tokens per request: the workload the trials ran where one was recorded, else spec.load's."""
    source = workload.source
    origin = {"production": "production's measured profile, mean", "spec": "spec.load",
              "trace": "the trace"}.get(str(source), f"from {source}" if source else "spec.load")
    if workload.input_tokens:
        return (f"{workload.input_tokens} prompt / {workload.output_tokens} output tokens per request "
                f"({origin})")
    load = tuning.spec.load
    return f"{load.input_tokens} prompt / {load.output_tokens} output tokens per request (spec.load)"


def _production_rate(workload: WorkloadRecord) -> str:
    """Production's measured request rate; empty when the workload was not measured in production."""
    if workload.source != "production":
        return ""
    if workload.requests_per_second is not None:
        return (f"{_num(workload.requests_per_second)} req/s mean, {_num(workload.peak_requests_per_second)} "
                f"req/s peak over {workload.lookback_seconds} s"
                + (f" ({workload.replicas} replicas together)" if workload.replicas else ""))
    if workload.requests_per_minute:
        return f"{workload.requests_per_minute} requests/min over the lookback"
    return ""


def _curve_words(curve: CurveLoadRecord | None) -> str:
    if curve is None:
        return ""
    if curve.requests_per_minute:
        return f"{curve.requests_per_minute} requests/min ({curve.source})"
    if curve.concurrency:
        return f"{curve.concurrency} concurrent requests ({curve.source})"
    return ""


def _conditions(status: BatchTuningStatus) -> str:
    if not status.conditions:
        return ""
    rows = [[h(c.type), h(c.status), h(c.reason), h(c.message), h(_time(c.last_transition_time))]
            for c in status.conditions]
    return "<h2>Conditions</h2>" + _table(["type", "status", "reason", "message", "since"], rows)


def html_report(tuning: Tuning, png: bytes | None, generated: str = "",
                no_image: str = "The curves image was not rendered (see the operator's log).") -> str:
    """The whole page for one BatchTuning (its names, spec and status, parsed once by the caller) and its curves
    image; `no_image` says why there is none."""
    status = tuning.status
    name = f"{tuning.namespace}/{tuning.name}"
    phase = status.phase or "Pending"
    sub = f"Target Deployment {tuning.spec.target_ref.name}" + (f" · generated {generated}" if generated else "")
    body = "".join([
        f"<h1>BatchTuning {h(name)} <span class=\"badge {h(phase)}\">{h(phase)}</span></h1>",
        f'<p class="sub">{h(sub)}</p>',
        _decision(status), _curves(tuning, png, no_image), _trials(status), _predicted(status), _workload(tuning),
        _conditions(status),
        '<p class="muted">Written by batchtune. Self-contained: no script, no external resource.</p>',
    ])
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>batchtune report: {h(name)}</title><style>{STYLE}</style></head>"
            f"<body>{body}</body></html>\n")
