"""Simulation only: pick from the nominal twin with no trial at all, as rapid-mode tools do.

NVIDIA Dynamo's AI Configurator (rapid mode) and Vidur-Search answer in seconds with no GPU, from a
model of the hardware that was never calibrated on the deployment. This baseline is that: the twin
guide ranks the candidate grid on the catalog's twin (`twin.guide.rank`, the same search TwinGuided
uses) at the scenario's SLO without headroom, and recommends its best at its predicted capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchtune.bench.scenarios import Scenario
from batchtune.bench.strategies.ours import UNTIMED, FitFn, deployment_for, plan_for
from batchtune.bench.types import Choice, Knobs, Load, Testbed


@dataclass(frozen=True)
class SimulationOnly:
    fits: FitFn | None = None
    """The nominal twin's memory prefilter (its rank refuses what does not start anyway)."""
    name: str = "sim_only"

    def tune(self, testbed: Testbed, scenario: Scenario, *, seed: int) -> Choice:
        from batchtune.twin.guide import rank

        _, _, plan = plan_for(scenario, self.fits)
        deployment = deployment_for(scenario, headroom_pct=0)
        ranked = rank(deployment, plan.candidates, budget_s=UNTIMED)
        if not ranked:
            return Choice(None, None, "the nominal twin predicts that no candidate meets the SLO")
        best = ranked[0]
        knobs = Knobs(best.setting.max_num_seqs, best.setting.gpu_memory_utilization_percent,
                      best.setting.max_num_batched_tokens)
        claimed = None
        if best.capacity_load is not None:
            claimed = Load("request_rate", best.capacity_load / 60.0) if deployment.open_loop else \
                Load("concurrency", float(best.capacity_load))
        return Choice(knobs, claimed, f"nominal twin's best: predicted {best.objective:.4g} at load "
                                      f"{best.capacity_load} (no trial)")
