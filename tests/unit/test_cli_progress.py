"""`batchtune status --watch` in a log: one line per thing that happened (batchtune.cli.progress)."""

from __future__ import annotations

import copy
import io

import cli_fakes
import pytest
from rich.console import Console

from batchtune.api import InvalidBatchTuning
from batchtune.cli import status as st
from batchtune.cli.progress import changes
from batchtune.client import ApiUnreachable


def test_a_first_read_says_where_the_tuning_is():
    lines = changes(None, cli_fakes.trialing())
    assert lines[0] == "trial llama-8b-trial-0 started (max-num-seqs=16 gpu-memory-utilization=90%)"
    assert any(line.startswith("trial llama-8b-trial-2 started") for line in lines)
    assert lines[-1] == "phase Trialing (Planned): 6 trials planned"


def test_nothing_changed_prints_nothing():
    assert changes(cli_fakes.trialing(), cli_fakes.trialing()) == []


def test_a_trial_measured_names_its_verdict_and_figures():
    before = cli_fakes.trialing()
    after = copy.deepcopy(before)
    after["status"]["trials"][2].update({"state": "Done", "verdict": "Met", "verdictReason": "p95 ITL 31 ms",
                                         "metrics": cli_fakes._metrics(1980.7, 31.0, 84.0)})
    assert changes(before, after) == [
        "trial llama-8b-trial-2 measured (max-num-seqs=64 gpu-memory-utilization=90%): SLO Met, "
        "throughput 1,981 tok/s, ITL 31 ms, TTFT 180 ms, GPU 84% - p95 ITL 31 ms"]


def test_an_overloaded_step_reads_overloaded_not_a_huge_number():
    before = cli_fakes.trialing()
    after = copy.deepcopy(before)
    after["status"]["trials"][2].update({"state": "Done", "verdict": "Violated",
                                         "metrics": {"itlMs": 1e12, "outputThroughput": 10.0}})
    assert "ITL overloaded" in changes(before, after)[0]


def test_a_failed_trial_names_its_reason_and_message():
    before = cli_fakes.trialing()
    after = copy.deepcopy(before)
    after["status"]["trials"].append(cli_fakes._trial(3, 512, "Infeasible", "Violated", reason="KvCacheTooSmall",
                                                      message="No available memory for the cache blocks."))
    assert changes(before, after) == [
        "trial llama-8b-trial-3 started (max-num-seqs=512 gpu-memory-utilization=90%)",
        "trial llama-8b-trial-3 infeasible (max-num-seqs=512 gpu-memory-utilization=90%): KvCacheTooSmall: "
        "No available memory for the cache blocks."]


def test_choice_patch_and_verify_are_each_a_line_with_the_args_diff():
    before = cli_fakes.trialing()
    after = cli_fakes.succeeded()
    lines = changes(before, after)
    assert "chose max-num-seqs 128, gmu 90% (trial llama-8b-trial-3)" in lines
    assert "production llama-8b patched: args --max-num-seqs 256 -> 128" in lines
    assert "production verified at 2025-01-01T10:40:00Z" in lines
    assert any(line.startswith("phase Succeeded (Verified)") for line in lines)


def test_a_rollback_shows_the_exact_args_restored():
    before = cli_fakes.succeeded()
    after = copy.deepcopy(before)
    after["status"]["phase"] = "RolledBack"
    after["status"]["applied"].pop("verifiedAt")
    before["status"]["applied"].pop("verifiedAt")
    after["status"]["applied"]["rolledBackAt"] = "2025-01-01T10:41:00Z"
    lines = changes(before, after)
    assert ("production rolled back at 2025-01-01T10:41:00Z to: meta-llama/Llama-3.1-8B-Instruct --max-num-seqs 256"
            in lines)


@pytest.mark.parametrize("previous, new, diff", [
    pytest.param(["--max-num-seqs=8"], ["--max-num-seqs=64"], "--max-num-seqs=8 -> --max-num-seqs=64", id="equals-form"),
    pytest.param(["m", "--enforce-eager", "--max-num-seqs=8"], ["m", "--enforce-eager", "--max-num-seqs=64"],
                 "--max-num-seqs=8 -> --max-num-seqs=64", id="after-a-boolean-flag"),
    pytest.param(["m", "--port", "8000"], ["m", "--port", "8000", "--gpu-memory-utilization", "0.95"],
                 "added --gpu-memory-utilization 0.95", id="added"),
    pytest.param(["m", "--max-num-seqs", "8", "--port", "1"], ["m", "--port", "1"], "removed --max-num-seqs 8", id="removed"),
])
def test_args_diff_names_each_change(previous, new, diff):
    before = cli_fakes.trialing()
    after = copy.deepcopy(before)
    after["status"]["applied"] = {"target": "t", "previous": {"args": previous}, "new": {"args": new},
                                  "appliedAt": "2025-01-01T10:30:00Z"}
    assert changes(before, after) == [f"production t patched: args {diff}"]


def test_hostile_strings_are_escaped():
    before = cli_fakes.trialing()
    after = copy.deepcopy(before)
    after["status"]["trials"][2].update({"state": "Failed", "reason": "CrashLoopBackOff",
                                         "message": "boom\x1b[2J\x07"})
    (line,) = changes(before, after)
    assert "\x1b" not in line and "\x07" not in line and "\\x1b[2J" in line


def test_garbage_status_is_refused_naming_each_field():
    with pytest.raises(InvalidBatchTuning) as caught:
        changes({"status": {}}, {"status": {"trials": "nope", "phase": 3, "applied": []}})
    assert caught.value.paths == ["status.phase", "status.trials", "status.applied"]
    with pytest.raises(InvalidBatchTuning, match="status: must be an object"):
        changes({"status": "x"}, {"status": {}})


@pytest.mark.parametrize("terminal", [False, True], ids=["log", "tty"])
def test_watch_prints_lines_in_a_log_and_the_table_in_a_terminal(terminal, monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(st, "console", lambda: Console(file=buffer, width=200, force_terminal=terminal))
    sequence = [ApiUnreachable("connection refused"), ApiUnreachable("connection refused"), cli_fakes.succeeded()]

    def fetch():
        item = sequence.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    assert st.watch(fetch, cli_fakes.trialing(), interval=0) == 0
    out = buffer.getvalue()
    if terminal:
        assert "production llama-8b patched" not in out
    else:
        assert out.count("API unreachable") == 1  # said once per outage, not per poll
        assert "production llama-8b patched: args --max-num-seqs 256 -> 128" in out
        assert out.index("patched") < out.index("Decision:")  # the full status comes once, at the end
