"""The GPU activity report file: atomic writes, stale and malformed reports read as idle."""

from __future__ import annotations

import json
import os

import pytest

from batchtune.gpu_activity import IDLE_GPU, read_activity, write_activity

BUSY = {"index": 0, "gpu_util_pct": 97.0, "sm_active": 0.62, "sm_occupancy": 0.31, "tensor_active": 0.2,
        "dram_active": 0.55, "fb_used_mib": 72000, "power_w": 540.0}  # fmt: skip


def test_round_trip_keeps_values(tmp_path):
    path = tmp_path / "gpu.json"
    write_activity(path, [BUSY, {**BUSY, "index": 1}], now=1000.0)
    gpus = read_activity(path, now=1001.0)
    assert gpus is not None and [g["index"] for g in gpus] == [0, 1]
    assert gpus[0]["sm_active"] == pytest.approx(0.62)
    assert gpus[0]["fb_used_mib"] == 72000


def test_write_leaves_no_temp_files(tmp_path):
    path = tmp_path / "sub" / "gpu.json"
    for i in range(5):
        write_activity(path, [BUSY], now=float(i))
    assert os.listdir(path.parent) == ["gpu.json"]


@pytest.mark.parametrize(
    ("content", "now"),
    [
        pytest.param(None, 0.0, id="missing"),
        pytest.param("{not json", 0.0, id="malformed"),
        pytest.param(json.dumps({"timestamp": 100.0, "gpus": [BUSY]}), 111.0, id="stale"),
        pytest.param(json.dumps({"gpus": [BUSY]}), 0.0, id="no-timestamp"),
        pytest.param(json.dumps({"timestamp": 0.0, "gpus": [{"gpu_util_pct": 5}]}), 0.0, id="no-index"),
        pytest.param(json.dumps([1, 2]), 0.0, id="not-an-object"),
    ],
)
def test_unusable_report_reads_none(tmp_path, content, now):
    path = tmp_path / "gpu.json"
    if content is not None:
        path.write_text(content)
    assert read_activity(path, now=now) is None


def test_missing_keys_read_idle(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"timestamp": 5.0, "gpus": [{"index": 0, "gpu_util_pct": 50}]}))
    (gpu,) = read_activity(path, now=5.0)
    assert gpu["gpu_util_pct"] == 50.0
    assert {k: gpu[k] for k in IDLE_GPU if k != "gpu_util_pct"} == {k: v for k, v in IDLE_GPU.items() if k != "gpu_util_pct"}


def test_entry_without_index_is_refused(tmp_path):
    with pytest.raises(ValueError, match="index"):
        write_activity(tmp_path / "gpu.json", [{"gpu_util_pct": 1.0}])
