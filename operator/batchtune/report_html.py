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
from typing import Any

from batchtune.api.models import BEYOND_LAST_BUCKET_MS
from batchtune.core.vocabulary import MEMORY_REASONS, M, Reason
from batchtune.report import curve_picture

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


def _m(obj: Any, *keys: str) -> Any:
    """obj[k1][k2]..., None where a level is missing or not a mapping (status is read, never trusted)."""
    for key in keys:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _d(obj: Any, *keys: str) -> Mapping[str, Any]:
    """Like `_m`, but a mapping always ({} where missing)."""
    found = _m(obj, *keys)
    return found if isinstance(found, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


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


def _args(words: Any) -> str:
    return " ".join(str(w) for w in _list(words))


def _setting(setting: Any) -> str:
    if not isinstance(setting, Mapping):
        return ""
    out = f"max-num-seqs {setting.get('maxNumSeqs')}, gmu {setting.get('gpuMemoryUtilizationPercent')}%"
    return out + (f", mbt {setting['maxNumBatchedTokens']}" if setting.get("maxNumBatchedTokens") else "")


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


def _decision(bt: Mapping[str, Any]) -> str:
    status = _d(bt, "status")
    rec = _d(status, "recommendation")
    conditions = [c for c in _list(_m(status, "conditions")) if isinstance(c, Mapping)]
    final = next((c for c in conditions if c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True"),
                 None)
    applied = _d(status, "applied")
    out = ["<h2>Decision</h2>"]
    if not rec and not final:
        out.append('<p class="muted">No decision yet: the tuning is in phase '
                   f"{h(_m(status, 'phase') or 'Pending')}.</p>")
    out.append(_dl([
        ("Chosen setting", h(_setting(rec.get("setting"))) or h(_m(status, "bestSetting"))),
        ("Best trial", h(_m(status, "bestTrial"))),
        ("Why", h(rec.get("reason"))),
        ("Knee", h(f"max-num-seqs {_m(status, 'knee', 'maxNumSeqs')}: {_m(status, 'knee', 'reason')}")
         if _m(status, "knee", "maxNumSeqs") else ""),
        ("Replicas for production's peak", h(rec.get("replicasHint"))),
        ("Outcome", h(f"{final.get('reason')}: {final.get('message')}") if final else ""),
        ("Applied at", h(applied.get("appliedAt"))),
        ("Verified at", h(applied.get("verifiedAt"))),
        ("Rolled back at", h(applied.get("rolledBackAt"))),
    ]))
    baseline = _args(_m(status, "baseline", "args"))
    if baseline:
        out.append(f"<h3>Production's command line before tuning</h3><pre>{h(baseline)}</pre>")
    if rec.get("args"):
        out.append(f"<h3>Recommended command line</h3><pre>{h(_args(rec.get('args')))}</pre>")
    for label, key in (("Previous container args (restored on rollback)", "previous"), ("Applied", "new")):
        words = _m(applied, key, "args")
        if words:
            out.append(f"<h3>{h(label)}</h3><pre>{h(_args(words))}</pre>")
    return "".join(out)


def _curves(bt: Mapping[str, Any], png: bytes | None, no_image: str) -> str:
    status = _d(bt, "status")
    off = _m(bt, "spec", "report", "curveLoad", "type") == "Off"
    picture = curve_picture([t for t in _list(status.get("trials")) if isinstance(t, Mapping)],
                            _m(status, "plan", "curveLoad"), off)
    out = ["<h2>Curves</h2>"]
    if picture.load:
        out.append(f"<p>GPU utilization, throughput and {h(_m(bt, 'spec', 'slo', 'percentile') or 'P95')} latency "
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


def _trials(bt: Mapping[str, Any]) -> str:
    status = _d(bt, "status")
    trials = [t for t in _list(status.get("trials")) if isinstance(t, Mapping)]
    best = status.get("bestTrial")
    rows, classes = [], []
    for trial in trials[:MAX_TABLE_ROWS]:
        setting = _d(trial, "setting")
        metrics = _d(trial, "metrics")
        steps = _list(trial.get("steps"))
        at = trial.get("curveStep")
        curve = steps[at] if isinstance(at, int) and not isinstance(at, bool) and 0 <= at < len(steps) else None
        curve_metrics = _d(curve, "metrics")
        gpu = metrics.get(M.SM_ACTIVE_PERCENT, metrics.get(M.GPU_UTIL_PERCENT))
        why = str(trial.get("verdictReason") or trial.get("message") or trial.get("reason") or "")
        rows.append([h(trial.get("name")), h(setting.get("maxNumSeqs")), h(setting.get("gpuMemoryUtilizationPercent")),
                     h(setting.get("maxNumBatchedTokens")), h(trial.get("state")), _verdict(trial.get("verdict")),
                     h(_num(metrics.get(M.SLO_CAPACITY))), h(_num(metrics.get(M.SLO_CAPACITY_LOAD))),
                     h(_num(metrics.get(M.OUTPUT_THROUGHPUT))), h(_ms(metrics.get(M.TTFT_MS))),
                     h(_ms(metrics.get(M.ITL_MS))), h(_ms(metrics.get(M.E2E_MS))), h(_num(gpu)),
                     h(_num(metrics.get(M.KV_CACHE_USAGE_PEAK_PERCENT))),
                     h(_num(_m(curve_metrics, M.OUTPUT_THROUGHPUT))), h(_ms(_m(curve_metrics, M.ITL_MS))),
                     _verdict(_m(curve, "verdict")), _long(why)])
        classes.append("best" if best and trial.get("name") == best else "")
    out = [f"<h2>Trials</h2><p class=\"sub\">{len(trials)} trials; latencies at the SLO percentile; the bold row "
           "is the chosen one. SLO capacity is the highest load the trial's search found within every SLO.</p>",
           _trial_table(rows, classes) if rows else '<p class="muted">No trial has started yet.</p>']
    if len(trials) > MAX_TABLE_ROWS:
        out.append(f'<p class="muted">{len(trials) - MAX_TABLE_ROWS} more trials in trials.csv.</p>')
    return "".join(out)


def _trial_table(rows: list[list[str]], classes: list[str]) -> str:
    # Columns nothing filled in (mbt not searched, no common load, ...) are left out.
    keep = [j for j, head in enumerate(TRIAL_HEAD) if head in ("trial", "state", "why") or any(r[j] for r in rows)]
    numeric = frozenset(i for i, j in enumerate(keep) if 6 <= j <= 15)
    table = _table([h(TRIAL_HEAD[j]) for j in keep], [[r[j] for j in keep] for r in rows], classes, numeric)
    return f'<div class="wide">{table}</div>'


def predictions(trial: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The twin's prediction of a trial's metrics (strategy TwinGuided: `prediction.metrics`, the same keys as
    `metrics`; `predicted` is read too). None: not predicted."""
    for found in (trial.get("predicted"), _m(trial, "prediction", "metrics")):
        if isinstance(found, Mapping) and found:
            return found
    return None


def _predicted(bt: Mapping[str, Any]) -> str:  # noqa: C901
    status = _d(bt, "status")
    trials = [t for t in _list(status.get("trials")) if isinstance(t, Mapping)]
    notes = [str(n) for n in _list(_m(status, "plan", "notes"))]
    prefilter = next((n for n in notes if n.startswith("memory prefilter")), None)
    used = prefilter is not None and not prefilter.startswith("memory prefilter skipped")
    out = ["<h2>Predicted against measured</h2>", "<h3>The twin's memory prefilter</h3>"]
    if prefilter is None:
        prefilter = next((n for n in notes if "prefilter" in n), "")
    out.append(f"<p>{h(prefilter) or 'No prefilter note in this status.'}</p>")
    if used:
        rows, misses = [], 0
        for trial in trials[:MAX_TABLE_ROWS]:
            reason = trial.get("reason")
            state = trial.get("state")
            if reason in MEMORY_FAILURES:
                measured, agree = f"did not fit: {reason}", "no"
                misses += 1
            elif state in ("Done",) or trial.get("readyAt"):
                measured, agree = "started and served", "yes"
            elif state in ("Failed", "Infeasible"):
                measured, agree = f"{state}: {reason}", "unknown"
            else:
                measured, agree = str(state or ""), ""
            rows.append([h(trial.get("name")), h(_setting(trial.get("setting"))), "fits", h(measured), h(agree)])
        pruned = [p for p in _list(status.get("pruned")) if isinstance(p, Mapping)]
        memory = [p for p in pruned if p.get("reason") == Reason.DOES_NOT_FIT_MEMORY]
        out.append(f"<p>{len(trials)} settings tried, all predicted to fit; {misses} did not. "
                   f"{len(memory)} settings predicted not to fit were never tried (no GPU time spent on them).</p>")
        if rows:
            out.append(_table(["trial", "setting", "twin predicted", "measured", "agree"], rows))
        if memory:
            out.append(_table(["setting", "twin predicted", "why"],
                              [[h(_setting(p.get("setting"))), "does not fit", h(p.get("message") or p.get("memoryReason"))]
                               for p in memory[:MAX_TABLE_ROWS]]))
    predicted = [(t, p) for t in trials if (p := predictions(t)) is not None]
    out.append("<h3>The twin's performance predictions</h3>")
    if not predicted:
        out.append('<p class="muted">No trial carries a performance prediction (the strategy did not predict '
                   "with the twin).</p>")
    else:
        rows = []
        for trial, pred in predicted[:MAX_TABLE_ROWS]:
            # TwinGuided predicts the figures at its predicted capacity, where the trial's first step ran:
            # that step is what the prediction is held against (else the trial's own figures).
            steps = [s for s in _list(trial.get("steps")) if isinstance(s, Mapping) and s.get("purpose") != "Curve"]
            at = _m(trial, "prediction", "capacityLoad")
            # Of the steps at that load (a short bracketing one, then the full window), the full window's.
            at_load = [s for s in steps if at is not None and s.get("load") == at]
            first = next((s for s in at_load if s.get("purpose") != "Bracket"), at_load[0] if at_load else None)
            figures = _d(first, "metrics") if first is not None else _d(trial, "metrics")
            for key, words, unit in COMPARED:
                p, m = pred.get(key), figures.get(key)
                if not _num(p) and not _num(m):
                    continue
                error = ""
                if _num(p) and _num(m) and m:
                    error = f"{100 * (p - m) / abs(m):+.1f}%"
                rows.append([h(trial.get("name")), h(_setting(trial.get("setting"))), h(f"{words} ({unit})"),
                             h(_num(p)), h(_num(m)), h(error)])
        out.append(_table(["trial", "setting", "figure", "predicted", "measured", "error"], rows,
                          numeric=frozenset({3, 4, 5})))
    return "".join(out)


def _workload(bt: Mapping[str, Any]) -> str:
    spec = _d(bt, "spec")
    status = _d(bt, "status")
    load = _d(spec, "load")
    workload = _d(status, "workload")
    slo = _d(spec, "slo")
    plan = _d(status, "plan")
    percentile = slo.get("percentile") or "P95"
    targets = ", ".join(f"{percentile} {name} {slo[key]} ms" for key, name in (
        ("ttftMilliseconds", "TTFT"), ("interTokenLatencyMilliseconds", "inter-token latency"),
        ("e2eLatencyMilliseconds", "end-to-end latency")) if slo.get(key))
    source = workload.get("source")
    measured = source == "production"
    origin = {"production": "production's measured profile, mean", "spec": "spec.load",
              "trace": "the trace"}.get(str(source), f"from {source}" if source else "spec.load")
    tokens = (f"{workload.get('inputTokens')} prompt / {workload.get('outputTokens')} output tokens per request "
              f"({origin})" if workload.get("inputTokens") else
              f"{load.get('inputTokens', 512)} prompt / {load.get('outputTokens', 128)} output tokens per request "
              "(spec.load)")
    if measured and workload.get("requestsPerSecond") is not None:
        rate = (f"{_num(workload['requestsPerSecond'])} req/s mean, {_num(workload.get('peakRequestsPerSecond'))} "
                f"req/s peak over {workload.get('lookbackSeconds')} s"
                + (f" ({workload['replicas']} replicas together)" if workload.get("replicas") else ""))
    elif measured and workload.get("requestsPerMinute"):
        rate = f"{workload['requestsPerMinute']} requests/min over the lookback"
    else:
        rate = ""
    if load.get("concurrency"):
        search_load = f"{load['concurrency']} concurrent requests (spec.load.concurrency)"
    elif load.get("requestsPerMinute"):
        search_load = f"{load['requestsPerMinute']} requests/min (spec.load.requestsPerMinute)"
    else:
        search_load = "searched per trial (SLO capacity)" if _m(spec, "objective", "type") in (None, "SloCapacity") \
            else "each trial's max-num-seqs in flight"
    out = ["<h2>The workload this decision holds for</h2>",
           '<p class="sub">A setting is best for a workload: this is the one the trials ran, and the decision '
           "holds while production's traffic looks like it.</p>",
           _dl([
               ("Workload", h(workload.get("summary"))),
               ("Model", h(plan.get("model"))), ("GPU", h(plan.get("gpuProduct"))),
               ("Request shape", h(tokens)),
               ("Production's rate", h(rate)),
               ("Load of the search", h(search_load)), ("Load generator", h(load.get("generator") or "Builtin")),
               ("Curves' common load", h(_curve_words(plan.get("curveLoad")))),
               ("SLO", h(f"{targets}; errors at most {slo.get('maxErrorRatePercent', 1)}%; "
                         f"{slo.get('headroomPercent', 10)}% headroom") if targets else ""),
               ("Objective", h(_m(spec, "objective", "type") or "SloCapacity")),
               ("Strategy", h(_m(spec, "strategy", "type") or "Adaptive")),
               ("GPU time", h(f"{status.get('gpuMinutes')} GPU-minutes") if status.get("gpuMinutes") is not None
                else ""),
           ])]
    return "".join(out)


def _curve_words(curve: Any) -> str:
    if not isinstance(curve, Mapping):
        return ""
    if curve.get("requestsPerMinute"):
        return f"{curve['requestsPerMinute']} requests/min ({curve.get('source', '')})"
    if curve.get("concurrency"):
        return f"{curve['concurrency']} concurrent requests ({curve.get('source', '')})"
    return ""


def _conditions(bt: Mapping[str, Any]) -> str:
    conditions = [c for c in _list(_m(bt, "status", "conditions")) if isinstance(c, Mapping)]
    if not conditions:
        return ""
    rows = [[h(c.get("type")), h(c.get("status")), h(c.get("reason")), h(c.get("message")),
             h(c.get("lastTransitionTime"))] for c in conditions]
    return "<h2>Conditions</h2>" + _table(["type", "status", "reason", "message", "since"], rows)


def html_report(bt: Mapping[str, Any], png: bytes | None, generated: str = "",
                no_image: str = "The curves image was not rendered (see the operator's log).") -> str:
    """The whole page for one BatchTuning (its metadata, spec and status) and its curves image; `no_image`
    says why there is none."""
    meta = _d(bt, "metadata")
    status = _d(bt, "status")
    name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    target = _m(bt, "spec", "targetRef", "name")
    phase = status.get("phase") or "Pending"
    sub = f"Target Deployment {target}" + (f" · generated {generated}" if generated else "")
    body = "".join([
        f"<h1>BatchTuning {h(name)} <span class=\"badge {h(phase)}\">{h(phase)}</span></h1>",
        f'<p class="sub">{h(sub)}</p>',
        _decision(bt), _curves(bt, png, no_image), _trials(bt), _predicted(bt), _workload(bt), _conditions(bt),
        '<p class="muted">Written by batchtune. Self-contained: no script, no external resource.</p>',
    ])
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>batchtune report: {h(name)}</title><style>{STYLE}</style></head>"
            f"<body>{body}</body></html>\n")
