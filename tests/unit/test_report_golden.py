"""The report's files for one fixed BatchTuning, byte for byte (tests/data/report, rendered by main before the
renderers read the typed status): reading status through the typed models changed no character of the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchtune.cli.report import report_files
from batchtune.controller.reports import configmap

DATA = Path(__file__).resolve().parents[1] / "data" / "report"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64


def sample() -> dict:
    return json.loads((DATA / "batchtuning.json").read_text())


@pytest.mark.parametrize("name", ["report.html", "trials.csv", "trials.json"])
def test_the_report_configmap_holds_the_golden_files(name):
    bt = sample()
    body = configmap("inference", "tune", "uid-1", bt["spec"], bt["status"], PNG, "2026-12-01 08:00 UTC")
    assert body["data"][name] == (DATA / name).read_text()


def test_the_cli_draws_the_golden_trial_table_from_status():
    files, _ = report_files(sample(), None)
    assert files["trials.csv"].decode() == (DATA / "trials.csv").read_text()
