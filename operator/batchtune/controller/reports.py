"""The report ConfigMap, written off the reconcile path by one worker, one report at a time.

A tick only queues (namespace, name) with the status it decided on; the worker renders the tables
and the curves image (in a short-lived process: matplotlib's memory stays out of the operator) and
writes `<bt>-report`. A newer request for the same BatchTuning replaces one still waiting, so a
burst of decisions renders each BatchTuning once.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from batchtune import report
from batchtune.core.manifests import LABEL_TUNING, label_value, owner_reference, report_name

log = logging.getLogger(__name__)


def configmap(namespace: str, name: str, uid: str, spec: Mapping[str, Any], status: Mapping[str, Any],
              png: bytes | None) -> dict[str, Any]:
    """The report ConfigMap's body: trials.csv, trials.json and (when rendered) curves.png."""
    trials = list(status.get("trials") or [])
    summary = {"bestTrial": status.get("bestTrial"), "reason": (status.get("recommendation") or {}).get("reason"),
               "knee": status.get("knee"), "phase": status.get("phase")}
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": report_name(name), "namespace": namespace, "labels": {LABEL_TUNING: label_value(name)},
                     "ownerReferences": [owner_reference(name, uid)]},
        "data": {"trials.csv": report.trials_csv(trials), "trials.json": report.trials_json(trials, summary)},
    }
    if png:
        body["binaryData"] = {"curves.png": base64.b64encode(png).decode()}
    return body


def render_png(name: str, spec: Mapping[str, Any], status: Mapping[str, Any]) -> bytes | None:
    slo = dict(spec.get("slo") or {})
    try:
        return report.curves_png_isolated(list(status.get("trials") or []), chosen=status.get("bestTrial"),
                                          knee_seqs=(status.get("knee") or {}).get("maxNumSeqs"), slo=slo,
                                          percentile=str(slo.get("percentile", "P95")), title=f"BatchTuning {name}")
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
                write(configmap(namespace, name, uid, spec, status, render(name, spec, status)))
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
