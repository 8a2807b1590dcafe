"""Benchmarks: tuning quality and cost of batchtune's strategies against the baselines users would pick.

`batchtune bench tuning` runs `run_bench` over `SCENARIOS` on the twin; see docs/benchmarks.md.
"""

from batchtune.bench.runner import BenchResult, ScenarioResult, StrategyRun, StrategySummary, run_bench, run_scenario
from batchtune.bench.scenarios import SCENARIOS, KnobGrid, Scenario, get_scenarios
from batchtune.bench.types import Choice, Knobs, Load, Reading, Slo, StartResult, Testbed

__all__ = [
    "SCENARIOS", "BenchResult", "Choice", "Knobs", "Load", "Reading", "Scenario", "ScenarioResult", "KnobGrid",
    "Slo", "StartResult", "StrategyRun", "StrategySummary", "Testbed", "get_scenarios", "run_bench", "run_scenario",
]
