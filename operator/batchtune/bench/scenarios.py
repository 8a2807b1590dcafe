"""The tuning benchmark's scenarios: model x GPU x workload x SLO, with the grids the oracle and the
strategies search."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from batchtune.bench.types import Knobs, Load, LoadKind, ObjectiveKind, Slo

if TYPE_CHECKING:
    from batchtune.twin.predict import LengthDist

# The oracle's fine grid: max-num-seqs in ~1.25x steps, gmu every 2 points (plus 97, where the
# runtime-OOM rule starts).
ORACLE_MAX_NUM_SEQS: tuple[int, ...] = (
    8, 12, 16, 20, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
    320, 384, 448, 512, 640, 768, 896, 1024,
)
ORACLE_GMU_PCT: tuple[int, ...] = (80, 82, 84, 86, 88, 90, 92, 94, 96, 97, 98)

# What a user hands a tuner: the usual power-of-two batch sizes and a few gmu steps.
TUNER_MAX_NUM_SEQS: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)
TUNER_GMU_PCT: tuple[int, ...] = (85, 90, 92, 94, 96, 98)


@dataclass(frozen=True)
class KnobGrid:
    """Candidate values per knob over the bench's `Knobs` (None: the engine's token budget); the product is the grid.
    A tuner's grid reaches the core as its `core.planning.SearchSpace` (`bench.evaluate.TrialProtocol.spec`)."""

    max_num_seqs: tuple[int, ...]
    gpu_memory_utilization_pct: tuple[int, ...]
    max_num_batched_tokens: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "gpu_memory_utilization_pct", "max_num_batched_tokens"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"search space {name} is empty")
            if len(set(values)) != len(values):
                raise ValueError(f"search space {name} has duplicates: {values}")
        if sorted(self.max_num_seqs) != list(self.max_num_seqs):
            raise ValueError(f"search space max_num_seqs must be ascending: {self.max_num_seqs}")
        if sorted(self.gpu_memory_utilization_pct) != list(self.gpu_memory_utilization_pct):
            raise ValueError(f"search space gpu_memory_utilization_pct must be ascending: {self.gpu_memory_utilization_pct}")

    def grid(self) -> list[Knobs]:
        return [
            Knobs(mns, gmu, mbt)
            for mbt in self.max_num_batched_tokens
            for gmu in self.gpu_memory_utilization_pct
            for mns in self.max_num_seqs
        ]

    @property
    def size(self) -> int:
        return len(self.max_num_seqs) * len(self.gpu_memory_utilization_pct) * len(self.max_num_batched_tokens)


@dataclass(frozen=True)
class Scenario:
    """One tuning problem. The objective is SLO capacity (the highest load of `load_kind` meeting every
    SLO) or, for `throughput`, output tokens/s at the fixed `load` while meeting the SLO."""

    name: str
    summary: str
    model: str
    gpu: str
    input_len: int
    output_len: int
    slo: Slo
    objective: ObjectiveKind = "capacity"
    load_kind: LoadKind = "request_rate"
    load: Load | None = None
    """The fixed offered load of a `throughput` scenario."""
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    length_dist: LengthDist = "fixed"
    tuner_space: KnobGrid = field(
        default_factory=lambda: KnobGrid(TUNER_MAX_NUM_SEQS, TUNER_GMU_PCT)
    )
    oracle_space: KnobGrid = field(
        default_factory=lambda: KnobGrid(ORACLE_MAX_NUM_SEQS, ORACLE_GMU_PCT)
    )
    measure_s: float = 60.0
    """Measured window of one load step (`spec.trial.measureSeconds`); long generations need longer."""
    sim_window_s: float | None = None
    """Simulated length of a measured window; None: `measure_s`. `--quick` shortens it (billing keeps
    `measure_s`), trading fidelity for speed."""
    expected_rate: float = 10.0
    """Open loop: the request rate (req/s) the user puts in `spec.load`, where the first load search starts."""
    default_gmu_pct: int = 90
    """What an untuned deployment runs with (vLLM's long-standing default)."""
    tags: tuple[str, ...] = ()
    quick: bool = False
    expect_best_gmu_below_max: bool = False
    """The scenario exists to show the best gmu is not the largest; the oracle must confirm it."""
    expect_preemptions: bool = False
    """KV-bound: the oracle's saturation runs at the largest batches must preempt."""

    def __post_init__(self) -> None:
        if self.objective == "throughput" and self.load is None:
            raise ValueError(f"scenario {self.name}: a throughput objective needs a fixed load")
        if self.objective == "capacity" and self.load is not None:
            raise ValueError(f"scenario {self.name}: a capacity objective searches the load; drop load={self.load}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"scenario {self.name}: input_len/output_len must be >= 1, got {self.input_len}/{self.output_len}")

    @property
    def window_s(self) -> float:
        return self.sim_window_s or self.measure_s

    def quick_variant(self) -> Scenario:
        """Cheaper to simulate: 20 s windows (enough turnovers for short outputs) and the oracle on the
        tuners' grid plus the midpoints of max-num-seqs."""
        seqs = sorted(set(self.tuner_space.max_num_seqs) | {
            int(round((a * b) ** 0.5)) for a, b in zip(self.tuner_space.max_num_seqs, self.tuner_space.max_num_seqs[1:], strict=False)
        })
        oracle = KnobGrid(tuple(seqs), self.tuner_space.gpu_memory_utilization_pct,
                             self.tuner_space.max_num_batched_tokens)
        return replace(self, sim_window_s=min(self.measure_s, 20.0), oracle_space=oracle)

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size

    @property
    def objective_unit(self) -> str:
        """Capacity is the request throughput sustained at the highest load meeting the SLO (as the
        operator's `sloCapacity`), for closed and open loops alike."""
        return "tok/s" if self.objective == "throughput" else "req/s"


def _space(mns: tuple[int, ...], gmu: tuple[int, ...], mbt: tuple[int | None, ...] = (None,)) -> KnobGrid:
    return KnobGrid(mns, gmu, mbt)


LLAMA8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA70B = "meta-llama/Llama-3.1-70B-Instruct"
QWEN7B = "Qwen/Qwen2.5-7B-Instruct"
MISTRAL7B = "mistralai/Mistral-7B-Instruct-v0.3"

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        name="chat-8b-h100-tight",
        summary="interactive chat, tight TTFT and ITL",
        model=LLAMA8B, gpu="H100", input_len=512, output_len=256,
        slo=Slo({"p95_ttft_ms": 250.0, "p95_itl_ms": 20.0}),
        tags=("tight", "short-output"), quick=True,
    ),
    Scenario(
        name="chat-8b-h100-loose",
        summary="chat with relaxed latency: capacity near saturation",
        model=LLAMA8B, gpu="H100", input_len=512, output_len=256,
        slo=Slo({"p95_ttft_ms": 2000.0, "p95_itl_ms": 80.0}),
        tags=("loose",),
    ),
    Scenario(
        name="rag-8b-a100-e2el",
        summary="long prompt, short answer (auto_tune's default shape), P99 E2E limit",
        model=LLAMA8B, gpu="A100-80GB", input_len=4000, output_len=16,
        slo=Slo({"p99_e2el_ms": 2000.0}),
        tags=("short-output", "prefill-heavy"),
    ),
    Scenario(
        name="codegen-8b-l4-long",
        summary="short prompt, long generations on a small GPU",
        model=LLAMA8B, gpu="L4", input_len=256, output_len=1024, max_model_len=4096,
        slo=Slo({"p95_ttft_ms": 1500.0, "p95_itl_ms": 120.0}),
        load_kind="concurrency", measure_s=300.0,
        tags=("long-output",),
    ),
    Scenario(
        name="kvbound-8b-l4-longctx",
        summary="long contexts on a 24 GB GPU: the KV cache binds, large batches preempt",
        model=LLAMA8B, gpu="L4", input_len=3000, output_len=1000, max_model_len=8192,
        slo=Slo({"p95_ttft_ms": 6000.0, "p95_itl_ms": 200.0}),
        load_kind="concurrency", measure_s=300.0,
        tags=("kv-bound", "long-output", "loose"), expect_preemptions=True,
    ),
    Scenario(
        name="kvbound-70b-a100x2-longctx",
        summary="70B on two A100s with 8k contexts: KV-bound, preemptions past the knee",
        model=LLAMA70B, gpu="A100-80GB", tensor_parallel_size=2, input_len=6000, output_len=1500,
        max_model_len=16384,
        slo=Slo({"p95_ttft_ms": 8000.0, "p95_itl_ms": 150.0}),
        load_kind="concurrency", measure_s=300.0,
        tags=("kv-bound", "long-output", "tp2"), expect_preemptions=True,
    ),
    Scenario(
        name="oom-8b-h100-bigbudget",
        summary="large token budget: gmu 0.97+ runs out of memory at runtime, the best gmu is below the max",
        model=LLAMA8B, gpu="H100", input_len=2000, output_len=512, max_model_len=32768,
        slo=Slo({"p95_ttft_ms": 3000.0, "p95_itl_ms": 60.0}),
        tuner_space=_space(TUNER_MAX_NUM_SEQS, TUNER_GMU_PCT, (16384, 32768)),
        oracle_space=_space(ORACLE_MAX_NUM_SEQS, ORACLE_GMU_PCT, (16384, 32768)),
        tags=("gmu-below-max", "big-token-budget"), quick=True, expect_best_gmu_below_max=True,
    ),
    Scenario(
        name="offline-8b-h100-throughput",
        summary="batch job: output tokens/s at 1024 concurrent requests, loose E2E limit",
        model=LLAMA8B, gpu="H100", input_len=1024, output_len=512,
        slo=Slo({"p99_e2el_ms": 120000.0}),
        objective="throughput", load=Load("concurrency", 1024.0), measure_s=120.0,
        tags=("loose", "throughput-objective"),
    ),
    Scenario(
        name="stream-8b-h100-throughput-itl",
        summary="output tokens/s at 256 concurrent streams: a tight ITL against queueing (TTFT)",
        model=LLAMA8B, gpu="H100", input_len=1024, output_len=256,
        slo=Slo({"p95_itl_ms": 40.0, "p95_ttft_ms": 15000.0}),
        objective="throughput", load=Load("concurrency", 256.0),
        tuner_space=_space(TUNER_MAX_NUM_SEQS, TUNER_GMU_PCT, (2048, 8192)),
        oracle_space=_space(ORACLE_MAX_NUM_SEQS, ORACLE_GMU_PCT, (2048, 8192)),
        tags=("tight", "throughput-objective"),
    ),
    Scenario(
        name="chat-qwen7b-a10g",
        summary="GQA-light model on a 24 GB GPU, moderate SLO",
        model=QWEN7B, gpu="A10G", input_len=1024, output_len=256, max_model_len=8192,
        slo=Slo({"p95_ttft_ms": 1000.0, "p95_itl_ms": 60.0}),
        tags=("small-gpu",),
    ),
    Scenario(
        name="chat-mistral7b-a100-tight",
        summary="tight TTFT on A100 (2048-token default budget)",
        model=MISTRAL7B, gpu="A100-80GB", input_len=1500, output_len=300,
        slo=Slo({"p95_ttft_ms": 300.0, "p95_itl_ms": 30.0}),
        tags=("tight",),
    ),
    Scenario(
        name="classify-8b-h100-shortout",
        summary="classification: 1k prompt, 8 output tokens, P99 TTFT",
        model=LLAMA8B, gpu="H100", input_len=1024, output_len=8,
        slo=Slo({"p99_ttft_ms": 500.0}),
        tags=("short-output", "prefill-heavy"),
    ),
    Scenario(
        name="agent-70b-h100x2-loose",
        summary="70B on two H100s, long outputs, loose SLO",
        model=LLAMA70B, gpu="H100", tensor_parallel_size=2, input_len=2000, output_len=800,
        max_model_len=16384,
        slo=Slo({"p95_ttft_ms": 5000.0, "p95_itl_ms": 100.0}), measure_s=180.0, expected_rate=2.0,
        tags=("loose", "long-output", "tp2"),
    ),
)


def get_scenarios(names: list[str] | None = None, *, quick: bool = False) -> list[Scenario]:
    """Scenarios by name (in the given order), else all; `quick`: the quick subset (when no names are
    given) at quick fidelity."""
    by_name = {s.name: s for s in SCENARIOS}
    if names:
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"unknown scenario(s) {unknown}; known: {', '.join(by_name)}")
        picked = [by_name[n] for n in names]
        return [s.quick_variant() for s in picked] if quick else picked
    return [s.quick_variant() for s in SCENARIOS if s.quick] if quick else list(SCENARIOS)
