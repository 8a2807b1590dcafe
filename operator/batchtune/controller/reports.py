"""The report ConfigMap, written off the reconcile path by one worker, one report at a time.

A tick only queues (namespace, name) with the status it decided on; the worker renders the tables,
the curves image (in a short-lived process: matplotlib's memory stays out of the operator) and the
self-contained HTML page, and writes `<bt>-report`. A newer request for the same BatchTuning replaces one still waiting, so a
burst of decisions renders each BatchTuning once.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from batchtune import report
from batchtune.core.manifests import LABEL_TUNING, label_value, owner_reference, report_name
from batchtune.report_html import html_report

log = logging.getLogger(__name__)


CONFIGMAP_BUDGET_BYTES = 1_000_000
"""What the report's files may hold in all: a ConfigMap's data and binaryData together must stay under
1 MiB (1,048,576 bytes), and the object's metadata needs some of it."""


def configmap(namespace: str, name: str, uid: str, spec: Mapping[str, Any], status: Mapping[str, Any],
              png: bytes | None, generated: str = "") -> dict[str, Any]:
    """The report ConfigMap's body: trials.csv, trials.json, report.html and (when rendered) curves.png.

    Over budget, what is least needed goes first: trials.json's indentation, then its per-step detail (both
    are in status), the image inside report.html (curves.png is beside it), report.html, curves.png, and last
    trials.json's trials. Each file left out is named in the log; `batchtune report --html` draws it from status.
    """
    tuning = report.Tuning.from_wire(namespace, name, spec, status)
    trials = tuning.status.trials
    summary = _summary(tuning)
    data = {"trials.csv": report.trials_csv(trials), "trials.json": report.trials_json(trials, summary),
            "report.html": html_report(tuning, png, generated)}
    binary = {"curves.png": png} if png else {}
    wire = [t.to_wire() for t in trials]

    def compact_json() -> None:
        data["trials.json"] = json.dumps({"summary": summary, "trials": wire}, separators=(",", ":"), sort_keys=True)

    def stepless_json() -> None:
        stepless = [t.model_copy(update={"steps": []}).to_wire() for t in trials]
        for trial in stepless:
            trial.pop("steps")
        data["trials.json"] = json.dumps({"summary": {**summary, "steps": "left out to fit the ConfigMap"},
                                          "trials": stepless}, separators=(",", ":"), sort_keys=True)

    def imageless_page() -> None:
        data["report.html"] = html_report(tuning, None, generated, "The curves image was left out of this page to "
                                                                   "fit the report ConfigMap: it is curves.png beside it.")

    def summary_json() -> None:
        data["trials.json"] = json.dumps({"summary": {**summary, "trials": "left out to fit the ConfigMap"}},
                                         sort_keys=True)

    shedding = [("trials.json's indentation", compact_json), ("trials.json's load steps", stepless_json),
                ("the image inside report.html", imageless_page), ("report.html", lambda: data.pop("report.html")),
                ("curves.png", binary.clear), ("trials.json's trials", summary_json)]
    left_out = []
    for what, shed in shedding:
        if _size(data, binary) <= CONFIGMAP_BUDGET_BYTES:
            break
        shed()
        left_out.append(what)
    if left_out:
        log.warning("Report for %s/%s left out %s to fit a ConfigMap; `batchtune report --html` draws it from "
                    "status", namespace, name, ", ".join(left_out))
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": report_name(name), "namespace": namespace, "labels": {LABEL_TUNING: label_value(name)},
                     "ownerReferences": [owner_reference(name, uid)]},
        "data": data,
    }
    if binary:
        body["binaryData"] = {k: base64.b64encode(v).decode() for k, v in binary.items()}
    return body


def _summary(tuning: report.Tuning) -> dict[str, Any]:
    """trials.json's summary: the decision, and the common load the curves are drawn at."""
    status = tuning.status
    return {"bestTrial": status.best_trial, "reason": status.recommendation.reason if status.recommendation else None,
            "knee": status.knee.to_wire() if status.knee else None, "phase": status.phase,
            "curveLoad": tuning.curve_load.to_wire() if tuning.curve_load else None}


def _size(data: Mapping[str, str], binary: Mapping[str, bytes]) -> int:
    # As the API server counts it: keys and values, binaryData by its decoded bytes.
    return sum(len(k) + len(v.encode()) for k, v in data.items()) + sum(len(k) + len(v) for k, v in binary.items())


def render_png(name: str, spec: Mapping[str, Any], status: Mapping[str, Any]) -> bytes | None:
    try:
        return report.curves_png_isolated(report.Tuning.from_wire("", name, spec, status), title=f"BatchTuning {name}")
    except Exception as exc:  # noqa: BLE001  # the tables are still worth writing without the image
        log.warning("Curves for %s not rendered: %s", name, exc)
        return None


class ReportQueue:
    """`ports.Reports`: one background worker; the latest request per BatchTuning wins."""

    def __init__(self, write: Any = None, render: Any = None) -> None:
        self._write = write
        self._render = render
        self._pending: OrderedDict[tuple[str, str], tuple[str, dict[str, Any], dict[str, Any]]] = OrderedDict()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, namespace: str, name: str, uid: str, spec: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        with self._lock:
            self._pending[(namespace, name)] = (uid, dict(spec), dict(status))
            self._pending.move_to_end((namespace, name))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="batchtune-reports", daemon=True)
                self._thread.start()
            self._lock.notify()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._lock.wait()
                (namespace, name), (uid, spec, status) = self._pending.popitem(last=False)
            from batchtune.controller.kube import upsert_configmap

            write, render = self._write or upsert_configmap, self._render or render_png
            try:
                generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
                write(configmap(namespace, name, uid, spec, status, render(name, spec, status), generated))
            except Exception as exc:  # noqa: BLE001  # a report is nice to have; the worker must go on
                log.warning("Report for %s/%s not written: %s", namespace, name, exc)

    def drain(self, timeout_s: float = 60) -> bool:
        """Wait until nothing is queued (tests); False on timeout."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.05)
        return False
