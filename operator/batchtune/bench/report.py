"""Rendering a benchmark result: rich tables for the terminal, Markdown for docs, JSON for machines."""

from __future__ import annotations

import json
from typing import Any

from batchtune.bench.policy import POLICY_HEADROOM_PCT
from batchtune.bench.runner import (
    BASELINE,
    GPU_MINUTES_RATIO_TARGET,
    RECHECK_REPEATS,
    REFERENCE,
    REGRET_TARGET,
    BenchResult,
    ScenarioResult,
    StrategyRun,
)


def _ratio(result: ScenarioResult, run: StrategyRun) -> str:
    base = next((r for r in result.runs if r.strategy == BASELINE), None)
    if base is None or base.gpu_minutes <= 0:
        return "-"
    return f"{run.gpu_minutes / base.gpu_minutes:.2f}"


def _recheck(run: StrategyRun) -> str:
    if run.chosen is None:
        return "none chosen"
    head = "VIOLATES" if run.violates else "ok"
    return f"{head} ({run.noisy_violations}/{RECHECK_REPEATS} noisy)"


def realities(result: BenchResult) -> str:
    """Which realities the result stands on, and whether they were held out from the rules' development."""
    from batchtune.bench.seeds import format_seeds

    if not result.truth_seeds:
        return f"truth {result.truth} (no truth seeds)"
    dev = format_seeds(result.development_truth_seeds)
    state = (f"held out (the rules were developed on truth seed(s) {dev})" if result.held_out
             else f"NOT held out: includes the development truth seed(s) {dev}")
    return f"truth {result.truth}, truth seeds {format_seeds(result.truth_seeds)}, {state}"


def detail_rows(result: BenchResult) -> list[list[str]]:
    rows = []
    for sc in result.scenarios:
        for run in sc.runs:
            rows.append([
                sc.case, run.strategy, run.chosen or "-", f"{run.objective:.3g}",
                f"{100 * run.regret:.1f}%", _recheck(run), str(run.trials), f"{run.gpu_minutes:.1f}", _ratio(sc, run),
            ])
    return rows


DETAIL_HEADERS = ["scenario", "strategy", "chosen", "objective", "regret", "SLO re-check", "trials", "GPU-min",
                  f"x {BASELINE}"]
ORACLE_HEADERS = ["scenario", "objective", "oracle best", "value", "tuner-grid best (regret floor)",
                  "feasible/grid", "best gmu < max", "preempt/s at max batch"]
SUMMARY_HEADERS = ["strategy", "mean regret", "max regret", f"regret <= {REGRET_TARGET:.0%}", "violating choices",
                   "no choice", f"median GPU-min x {BASELINE}", f"same, where {BASELINE} chose", "total GPU-min",
                   "mean trials", "regret <= 1%", "regret <= 3%", f"GPU-min < {REFERENCE}"]


def _floor(sc: ScenarioResult) -> float:
    return 0.0 if sc.oracle_objective <= 0 else 100 * max(0.0, 1 - sc.tuner_grid_best / sc.oracle_objective)


def oracle_rows(result: BenchResult) -> list[list[str]]:
    return [[
        sc.case, sc.objective_unit, sc.oracle_setting, f"{sc.oracle_objective:.3g}",
        f"{sc.tuner_grid_best:.3g} ({_floor(sc):.1f}%)", f"{sc.oracle_feasible}/{sc.oracle_grid}", "yes" if sc.best_gmu_below_max else "no",
        f"{sc.saturation_preemptions_per_s:.2f}",
    ] for sc in result.scenarios]


def summary_rows(result: BenchResult) -> list[list[str]]:
    n = len(result.scenarios)
    return [[
        s.strategy, f"{100 * s.mean_regret:.1f}%", f"{100 * s.max_regret:.1f}%",
        f"{s.scenarios_within_regret_target}/{n}", str(s.violating_choices), str(s.no_choice),
        "-" if s.median_gpu_minutes_ratio is None else f"{s.median_gpu_minutes_ratio:.2f}",
        "-" if s.median_gpu_minutes_ratio_where_baseline_chose is None
        else f"{s.median_gpu_minutes_ratio_where_baseline_chose:.2f}",
        f"{s.total_gpu_minutes:.0f}", f"{s.mean_trials:.1f}", f"{s.within_1pct}/{n}", f"{s.within_3pct}/{n}",
        "-" if s.cheaper_than_reference is None else f"{s.cheaper_than_reference}/{n}",
    ] for s in result.summary]


PREDICTION_HEADERS = ["scenario", "strategy", "trial setting", "predicted", "measured", "predicted load",
                      "first step load", "first step agrees", "furthest from its prediction"]


def prediction_rows(result: BenchResult) -> list[list[str]]:
    """Every trial a twin-guided strategy launched on a prediction: predicted against measured."""

    def num(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, (int, float)) else "-"

    rows = []
    for sc in result.scenarios:
        for run in sc.runs:
            for p in run.predictions:
                if "setting" not in p:
                    continue
                agrees = p.get("agrees")
                rows.append([sc.case, run.strategy, str(p["setting"]), num(p.get("predicted_objective")),
                             num(p.get("measured_objective")), num(p.get("predicted_load")),
                             num(p.get("first_step_load")), "-" if agrees is None else ("yes" if agrees else "no"),
                             str(p.get("worst") or "")])
    return rows


PAIRED_HEADERS = ["default", "against", "cases", "default better / worse / tied",
                  "mean regret difference (other - default)", "95% bootstrap CI", "sign test p (two-sided)"]
DISTRIBUTION_HEADERS = ["strategy", "cases", "policy regret median / p90 / max", "policy regret <= 1%",
                        "policy regret <= 3%", "raw regret median / p90 / max", "raw regret <= 1%", "raw regret <= 3%",
                        "SLO-violating", "no choice", "unsafe (burst OOM)"]
POLICY_HEADERS = ["case", "oracle best (unconstrained)", "value", "policy's pick (headroom, knee)", "value",
                  "the policy gives up"]


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%" if value == value else "-"


def paired_rows(result: BenchResult) -> list[list[str]]:
    from batchtune.bench.paired import paired_comparisons

    return [[
        c.default, c.other, str(c.cases), f"{c.default_better} / {c.other_better} / {c.ties}",
        _pct(c.mean_difference), f"[{_pct(c.ci_low)}, {_pct(c.ci_high)}]", f"{c.sign_test_p:.3g}",
    ] for c in paired_comparisons(result.scenarios, seed=result.seed)]


def distribution_rows(result: BenchResult) -> list[list[str]]:
    from batchtune.bench.paired import distributions

    def three(a: float, b: float, c: float) -> str:
        return f"{100 * a:.1f}% / {100 * b:.1f}% / {100 * c:.1f}%"

    return [[
        d.strategy, str(d.cases), three(d.policy_median, d.policy_p90, d.policy_max),
        f"{d.policy_within_1pct}/{d.cases}", f"{d.policy_within_3pct}/{d.cases}", three(d.median, d.p90, d.max),
        f"{d.within_1pct}/{d.cases}", f"{d.within_3pct}/{d.cases}", str(d.violating), str(d.no_choice), str(d.unsafe),
    ] for d in distributions(result.scenarios)]


def policy_rows(result: BenchResult) -> list[list[str]]:
    return [[
        sc.case, sc.oracle_setting, f"{sc.oracle_objective:.3g}", sc.policy_setting or "none",
        f"{sc.policy_objective:.3g}", f"{100 * sc.policy_gives_up:.1f}%",
    ] for sc in result.scenarios]


BAND_HEADERS = ["case", "setting", "capacity (recorded load)", "objective (mean of repeats)", "repeats' spread",
                "band width"]
RECORDED_HEADERS = ["case", "strategy", "chosen", "claimed load", "objective", "its repeats", "regret",
                    "within the best's band", "trials", "load steps (at a lower recorded load)", "node-min"]


def band_rows(result: BenchResult) -> list[list[str]]:
    """The recorded engine (`bench.recorded`): each setting's capacity and its repeats' spread there."""
    rows = []
    for sc in result.scenarios:
        for b in sc.noise_bands:
            width = b["high"] - b["low"]
            rel = f" ({100 * width / b['objective']:.0f}%)" if b["objective"] > 0 else ""
            rows.append([sc.case, b["setting"], b["load"] or "none", f"{b['objective']:.3g}",
                         f"{b['low']:.3g}-{b['high']:.3g}", f"{width:.3g}{rel}"])
    return rows


def recorded_rows(result: BenchResult) -> list[list[str]]:
    """Each strategy's choice on the recorded engine against the recorded best's noise band."""
    rows = []
    for sc in result.scenarios:
        if not sc.noise_bands:
            continue
        bands = {b["setting"]: b for b in sc.noise_bands}
        for run in sc.runs:
            band = bands.get(run.chosen or "")
            within = "-" if run.within_noise_band is None else ("yes" if run.within_noise_band else "no")
            rows.append([sc.case, run.strategy, run.chosen or "-", run.claimed_load or "-", f"{run.objective:.3g}",
                         f"{band['low']:.3g}-{band['high']:.3g}" if band else "-", f"{100 * run.regret:.1f}%", within,
                         str(run.trials), f"{run.load_steps} ({run.lower_load_steps})", f"{run.gpu_minutes:.1f}"])
    return rows


def print_tables(result: BenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for title, headers, rows in (
        ("Oracle (noise-free exhaustive grid)", ORACLE_HEADERS, oracle_rows(result)),
        ("Strategies per scenario", DETAIL_HEADERS, detail_rows(result)),
        (f"Summary (targets: regret <= {REGRET_TARGET:.0%} everywhere, no violating choice, "
         f"median GPU-min <= {GPU_MINUTES_RATIO_TARGET:.0%} of {BASELINE})", SUMMARY_HEADERS, summary_rows(result)),
        ("Regret per strategy over the cases (scenario x truth seed)", DISTRIBUTION_HEADERS, distribution_rows(result)),
        ("The default paired with each strategy, case by case", PAIRED_HEADERS, paired_rows(result)),
        ("What the selection policy itself gives up (the truth's values, the strategies' grid)", POLICY_HEADERS,
         policy_rows(result)),
        ("The recorded engine: each setting's capacity and its repeats' spread", BAND_HEADERS, band_rows(result)),
        ("The recorded engine: each choice against the best's noise band", RECORDED_HEADERS, recorded_rows(result)),
    ):
        if not rows and headers in (BAND_HEADERS, RECORDED_HEADERS):
            continue
        table = Table(title=title, title_justify="left")
        for header in headers:
            table.add_column(header, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for check in result.checks:
        console.print(f"[red]Scenario check failed:[/red] {check}")
    console.print(f"{realities(result)}; seed {result.seed}, noise {result.noise:g}, {len(result.scenarios)} cases "
                  f"in {result.seconds:.0f} s")


def markdown(result: BenchResult) -> str:
    def table(headers: list[str], rows: list[list[str]]) -> str:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
        return "\n".join(lines)

    parts = [
        "### Summary", table(SUMMARY_HEADERS, summary_rows(result)),
        "### Regret per strategy over the cases (scenario x truth seed)",
        table(DISTRIBUTION_HEADERS, distribution_rows(result)),
        "### The default paired with each strategy, case by case",
        "Per case the regret difference, other minus the default (> 0 favours the default); the sign test drops "
        "ties, the bootstrap resamples the cases.",
        table(PAIRED_HEADERS, paired_rows(result)),
        "### What the selection policy itself gives up",
        f"The policy-consistent oracle: `core.selection` (SLO less {POLICY_HEADROOM_PCT}% headroom, the knee rule) "
        "applied to every setting of the strategies' grid at its true value; policy regret is against its pick, "
        "raw regret against the unconstrained best of the fine grid.",
        table(POLICY_HEADERS, policy_rows(result)),
        "### Oracle", table(ORACLE_HEADERS, oracle_rows(result)),
        "### Per scenario", table(DETAIL_HEADERS, detail_rows(result)),
    ]
    if any(sc.noise_bands for sc in result.scenarios):
        parts += ["### The recorded engine: each setting's capacity and its repeats' spread",
                  "Capacity: the highest recorded concurrency whose mean of the repeats meets the SLO; the spread: "
                  "the repeats' request throughput there.", table(BAND_HEADERS, band_rows(result)),
                  "### The recorded engine: each choice against the best's noise band",
                  "Within the band: the choice's highest repeat reaches the best's lowest. Load steps in brackets: "
                  "those served at the next lower recorded concurrency (billed as asked).",
                  table(RECORDED_HEADERS, recorded_rows(result))]
    predicted = prediction_rows(result)
    if predicted:
        parts += ["### Predicted against measured (trials launched on a twin's prediction)",
                  table(PREDICTION_HEADERS, predicted)]
    if result.checks:
        parts += ["### Scenario checks that failed", "\n".join(f"- {c}" for c in result.checks)]
    parts.append(f"{realities(result)}; seed {result.seed}, noise {result.noise:g}, {len(result.scenarios)} cases "
                 f"(scenario x truth seed), {result.seconds:.0f} s")
    return "\n\n".join(parts) + "\n"


def to_json(result: BenchResult) -> str:
    data: dict[str, Any] = result.to_json()
    data["baseline"] = BASELINE
    data["held_out"] = result.held_out
    data["targets"] = {"regret": REGRET_TARGET, "gpu_minutes_ratio": GPU_MINUTES_RATIO_TARGET}
    return json.dumps(data, indent=2, default=str)
