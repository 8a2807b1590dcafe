"""The report ConfigMap's contents: CSV and JSON of the trial table, and the curves image."""

from __future__ import annotations

import csv
import io
import json

from fake_world import spec

from batchtune.api.models import TrialRecord
from batchtune.report import CSV_COLUMNS, Tuning, curves_png, curves_png_isolated, trials_csv, trials_json

TRIALS = [
    {"index": 0, "name": "t-0", "state": "Done", "verdict": "Met", "verdictReason": "chosen",
     "setting": {"maxNumSeqs": 16, "gpuMemoryUtilizationPercent": 95},
     "metrics": {"outputThroughput": 478.0, "itlMs": 26.7, "ttftMs": 451.0, "smActivePercent": 52.0}},
    {"index": 1, "name": "t-1", "state": "Infeasible", "reason": "OOMKilled", "verdict": "Violated",
     "setting": {"maxNumSeqs": 64, "gpuMemoryUtilizationPercent": 99, "maxNumBatchedTokens": 8192}},
]


RECORDS = [TrialRecord.model_validate(t) for t in TRIALS]


def tuning(trials: list[dict], **status: object) -> Tuning:
    return Tuning.from_wire("inference", "tune", spec(slo={"interTokenLatencyMilliseconds": 50}),
                            {"trials": trials, **status})


def test_csv_has_a_row_per_trial_and_blank_for_unknown():
    rows = list(csv.DictReader(io.StringIO(trials_csv(RECORDS))))
    assert [r["name"] for r in rows] == ["t-0", "t-1"]
    assert list(rows[0]) == CSV_COLUMNS
    assert rows[0]["outputThroughput"] == "478.0"
    assert rows[1]["outputThroughput"] == ""  # never measured: blank, not zero
    assert rows[1]["reason"] == "OOMKilled" and rows[1]["maxNumBatchedTokens"] == "8192"


def test_json_keeps_summary_and_trials():
    data = json.loads(trials_json(RECORDS, {"bestTrial": "t-0"}))
    assert data["summary"]["bestTrial"] == "t-0" and len(data["trials"]) == 2


def test_curves_image_is_a_png_even_with_unmeasured_trials():
    png = curves_png(tuning(TRIALS, bestTrial="t-0", knee={"maxNumSeqs": 16, "reason": "r"}))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert curves_png(tuning([]))[:4] == b"\x89PNG"


def test_isolated_render_gives_the_same_image():
    decided = tuning(TRIALS, bestTrial="t-0", knee={"maxNumSeqs": 16, "reason": "r"})
    png = curves_png_isolated(decided, title="BatchTuning tune")
    assert png == curves_png(decided, title="BatchTuning tune")
