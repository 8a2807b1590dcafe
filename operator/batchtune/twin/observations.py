"""Reading `vllm bench serve --save-result` files as observations for `batchtune.twin.fit`.

A file holds one result object, a JSON list of them, or one object per line (`--append-result`).
What is read: `completed` and `failed`, `total_input_tokens`, `total_output_tokens` (the request mix),
`max_concurrency` and `request_rate` (`"inf"` or a number; the load: both keys must be there, as `vllm
bench serve` writes them, `max_concurrency` null for no limit), `num_prompts` and `duration` (the run),
`output_throughput` / `request_throughput`, whatever latency statistics are present
(`{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms`), and with `--save-detailed` the per-request
`input_lens` / `output_lens` (and `errors`, to leave failed requests out). Everything else is ignored.

Keys added with `vllm bench serve --metadata KEY=VALUE` say what the file cannot:
- serving flags (`max_num_seqs`, `gpu_memory_utilization`, `max_num_batched_tokens`, ...) override the
  command line's for that result;
- the engine's KV pool: `kv_cache_size_tokens`, or `num_gpu_blocks` with `block_size` (the labels of
  `vllm:cache_config_info`);
- `random_range_ratio` (a number, or vLLM's `{"input": r, "output": r}`): how the random dataset spread
  the lengths (vllm bench serve does not save its arguments).

The command line can give the pool (`Inputs.kv_pool_tokens`, e.g. from a `/metrics` scrape or the engine's
startup log: `kv_pool_from_file`) and the range ratio for every result served at its own setting.

Lengths in simulation: per-request lengths give the spread measured; else the range ratio; else, for a closed
loop, `CLOSED_LOOP_DEFAULT_SPREAD`, and for an open loop vllm bench serve's default (0, fixed lengths). What
the file or the command line states is simulated as it is, fixed lengths too: a closed loop of fixed-length
requests runs in waves on the real engine (every request of the batch ends in the same step and the
replacements are prefilled together; tests/data/real-vllm-curve-long, max-num-seqs 16: median TTFT 9, 12, 16,
27 and 48 ms at 1, 2, 4, 8 and 16 streams), which a floor on the spread broke up (the twin's TTFT -62 % at 16
streams). Only where nothing is known does a closed loop get the default spread, so that a guess of fixed
lengths does not hold the simulation's clients in step for the whole run.

A malformed or careless result is refused with the file, the result's index and the key: nothing
completed, more than `MAX_FAILED_SHARE` of the requests failed, the load keys missing, the same result
twice (`load_all`, across files too).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchtune.files import InputFileError, json_lines, parse_json, read_text
from batchtune.twin.config import ServeConfig
from batchtune.twin.fit import Observation
from batchtune.twin.steady import Shape

MAX_FILE_BYTES = 64 * 1024 * 1024
LATENCY_KEY = re.compile(r"^(mean|median|std|p\d{1,2}(\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")
THROUGHPUT_KEYS = ("request_throughput", "output_throughput", "total_token_throughput")
# --metadata keys that change the setting of one result (vLLM's flag names with underscores).
SETTING_KEYS = {"max_num_seqs": int, "gpu_memory_utilization": float, "max_num_batched_tokens": int,
                "max_model_len": int, "tensor_parallel_size": int}
MAX_FAILED_SHARE = 0.05
"""More failed requests than this share of those sent: the run measured a failing server, not its speed."""
CLOSED_LOOP_DEFAULT_SPREAD = 0.1
"""The length spread (uniform +-10 %) of a closed loop whose lengths nothing states (see the module docstring)."""
MAX_FITTED_RATIO = 0.95


class ObservationError(ValueError):
    """A result file that cannot be read as an observation: names the file, the result and the key."""


@dataclass(frozen=True)
class Inputs:
    """What the command line adds to the results served at its own setting."""

    kv_pool_tokens: int | None = None
    """The engine's KV pool in tokens (a `/metrics` scrape, the startup log, or a number)."""
    kv_pool_source: str = ""
    """Where the pool came from, for the notes."""
    range_ratio: tuple[float, float] | None = None
    """The random dataset's range ratio (input, output): `vllm bench serve --random-range-ratio`."""

    def __post_init__(self) -> None:
        if self.kv_pool_tokens is not None and (isinstance(self.kv_pool_tokens, bool) or self.kv_pool_tokens < 1):
            raise ValueError(f"the KV pool must be a positive number of tokens, got {self.kv_pool_tokens!r}")
        if self.range_ratio is not None and not all(0 <= r < 1 for r in self.range_ratio):
            raise ValueError(f"the random range ratio must be in [0, 1), got {self.range_ratio!r}")


def load_all(paths: Sequence[str | Path], cfg: ServeConfig, inputs: Inputs | None = None) -> list[Observation]:
    """Every result of every file, refusing a file given twice and a result that repeats another."""
    seen_paths: dict[Path, str] = {}
    seen: dict[str, str] = {}
    out: list[Observation] = []
    for path in paths:
        resolved = Path(path).resolve()
        if resolved in seen_paths:
            raise ObservationError(f"{path}: given twice (as {seen_paths[resolved]} too): each run counts once")
        seen_paths[resolved] = str(path)
        out.extend(load_observations(path, cfg, inputs, seen))
    return out


def load_observations(path: str | Path, cfg: ServeConfig, inputs: Inputs | None = None,
                      seen: dict[str, str] | None = None) -> list[Observation]:
    """Every result in the file as an Observation of `cfg` (overridden per result by metadata keys).

    `seen`: fingerprints of results already read (other files), to refuse a copy."""
    path = Path(path)
    text = _read(path, "a result file")
    results = list(_results(text, str(path)))
    if not results:
        raise ObservationError(f"{path}: no result object in the file")
    seen = {} if seen is None else seen
    out = []
    for i, result in enumerate(results):
        source = f"{path.name}" + (f"[{i}]" if len(results) > 1 else "")
        fingerprint = hashlib.sha256(json.dumps(result, sort_keys=True, default=str).encode()).hexdigest()
        if fingerprint in seen:
            raise ObservationError(f"{path}: result {source} is the same as {seen[fingerprint]} (a copy of one run: "
                                   "each run counts once; remove one of them)")
        seen[fingerprint] = f"{path}" + (f"[{i}]" if len(results) > 1 else "")
        out.append(observation(result, cfg, source, inputs))
    return out


def _read(path: Path, what: str) -> str:
    try:
        return read_text(path, MAX_FILE_BYTES)
    except InputFileError as exc:
        raise ObservationError(f"{exc} ({what})") from None


def _results(text: str, where: str) -> Iterator[Mapping[str, Any]]:
    # vllm bench serve writes NaN (the std of one sample) and Infinity (an unbounded request rate): each key's
    # reader below checks its number.
    try:
        data = parse_json(text, where, nonfinite=True)
    except InputFileError as first:
        # --append-result writes one object per line
        if len([line for line in text.splitlines() if line.strip()]) < 2:
            raise ObservationError(str(first)) from None
        try:
            data = [value for _, value in json_lines(text.splitlines(), where, nonfinite=True)]
        except InputFileError as exc:
            raise ObservationError(str(exc)) from None
    items = data if isinstance(data, list) else [data]
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ObservationError(f"{where}[{i}]: expected a result object, got {type(item).__name__}")
        yield item


def observation(result: Mapping[str, Any], cfg: ServeConfig, source: str, inputs: Inputs | None = None) -> Observation:
    """One result object as an Observation."""
    inputs = inputs or Inputs()
    notes: list[str] = []
    completed = _number(result, "completed", source, required=True)
    if completed is None or completed < 1:
        raise ObservationError(f"{source}: key 'completed' is {result.get('completed')!r}: no request completed, "
                               "so the result measures nothing")
    _check_failed(result, completed, source, notes)
    total_in = _number(result, "total_input_tokens", source, required=True)
    total_out = _number(result, "total_output_tokens", source, required=True)
    assert total_in is not None and total_out is not None
    if total_in <= 0 or total_out <= 0:
        key = "total_input_tokens" if total_in <= 0 else "total_output_tokens"
        raise ObservationError(f"{source}: key '{key}' is {result.get(key)!r}; expected a positive token count")
    duration = _number(result, "duration", source)
    metrics = _metrics(result, source, completed, total_in, total_out, duration)
    _pasted_twice(metrics, completed, source, notes)
    load = _load(result, source, metrics)
    num_prompts = _number(result, "num_prompts", source)
    prompts = int(num_prompts) if num_prompts and num_prompts >= 1 else int(completed)
    served = _served(result, cfg, source)
    pool = _kv_pool(result, source)
    if pool is None and inputs.kv_pool_tokens is not None and served == cfg:
        pool = inputs.kv_pool_tokens
    shape = _shape(result, total_in / completed, total_out / completed, source, inputs,
                   closed=load.get("concurrency") is not None, notes=notes)
    return Observation(served, shape, metrics, concurrency=load.get("concurrency"), rate=load.get("rate"),
                       num_prompts=prompts, window_s=float(duration or 60.0), kv_pool_tokens=pool, source=source,
                       notes=tuple(notes))


def _metrics(result: Mapping[str, Any], source: str, completed: float, total_in: float, total_out: float,
             duration: float | None) -> dict[str, float]:
    """The throughputs and latency statistics present (output throughput derived where only others are)."""
    metrics: dict[str, float] = {}
    for key in result:
        if key in THROUGHPUT_KEYS or LATENCY_KEY.match(str(key)) or key == "max_concurrent_requests":
            number = _number(result, key, source, optional_nan=True)  # e.g. std of a single sample
            if number is not None and math.isfinite(number):
                metrics[str(key)] = number
    if "output_throughput" in metrics:
        return metrics
    if duration and duration > 0:
        metrics["output_throughput"] = total_out / duration
    elif "request_throughput" in metrics:
        metrics["output_throughput"] = metrics["request_throughput"] * total_out / completed
    elif "total_token_throughput" in metrics:
        metrics["output_throughput"] = metrics["total_token_throughput"] * total_out / (total_in + total_out)
    else:
        raise ObservationError(f"{source}: key 'output_throughput' is missing (and no 'duration', "
                               "'request_throughput' or 'total_token_throughput' to derive it from)")
    return metrics


def _load(result: Mapping[str, Any], source: str, metrics: Mapping[str, float]) -> dict[str, float | None]:
    """--max-concurrency with --request-rate inf is a closed loop; a finite rate is Poisson (capped by
    max_concurrency when that binds: read as the closed loop then); inf alone is a burst."""
    for key in ("request_rate", "max_concurrency"):
        if key not in result:
            raise ObservationError(
                f"{source}: key {key!r} is missing, so the load is unknown (read without it, the run would be "
                "taken for one burst of every prompt at once); `vllm bench serve --save-result` writes "
                "request_rate (\"inf\" or req/s) and max_concurrency (null: no limit)")
    rate = _rate(result, source)
    concurrency = _number(result, "max_concurrency", source)
    if concurrency is not None and concurrency < 1:
        raise ObservationError(f"{source}: key 'max_concurrency' is {result['max_concurrency']!r}; expected >= 1")
    if rate is not None and math.isfinite(rate):
        closed = concurrency is not None and concurrency <= rate * _life_guess(metrics)
        return {"concurrency": concurrency} if closed else {"rate": rate}
    if concurrency is not None:
        return {"concurrency": concurrency}
    return {"rate": math.inf}


def _served(result: Mapping[str, Any], cfg: ServeConfig, source: str) -> ServeConfig:
    """The command line's setting, overridden by the result's --metadata serving keys."""
    overrides = {}
    for key, cast in SETTING_KEYS.items():
        if key in result and result[key] is not None:
            try:
                overrides[key] = cast(result[key])
            except (TypeError, ValueError):
                raise ObservationError(f"{source}: metadata key {key!r} is {result[key]!r}; expected a number") from None
    try:
        return cfg.replace(**overrides) if overrides else cfg
    except ValueError as exc:
        raise ObservationError(f"{source}: metadata {overrides}: {exc}") from None


def _check_failed(result: Mapping[str, Any], completed: float, source: str, notes: list[str]) -> None:
    failed = _number(result, "failed", source)
    if not failed or failed <= 0:
        return
    share = failed / (completed + failed)
    errors = [e for e in result.get("errors") or [] if isinstance(e, str) and e.strip()]
    first = f"; the first error: {errors[0].strip()[:160]!r}" if errors else ""
    if share > MAX_FAILED_SHARE:
        raise ObservationError(
            f"{source}: key 'failed' is {failed:g} of {completed + failed:g} requests ({share:.0%}, more than the "
            f"{MAX_FAILED_SHARE:.0%} a measurement may lose): the run measured a failing server, not its speed"
            f"{first}")
    notes.append(f"{source}: {failed:g} of {completed + failed:g} requests failed ({share:.1%}); fitted on the "
                 "completed ones")


def _pasted_twice(metrics: dict[str, float], completed: float, source: str, notes: list[str]) -> None:
    """A median equal to its mean to the digit over several requests is one summary figure written twice (a
    table's "ITL" pasted into both keys): fit it as the mean, which is what such a figure is."""
    for name in ("ttft", "tpot", "itl", "e2el"):
        median, mean = metrics.get(f"median_{name}_ms"), metrics.get(f"mean_{name}_ms")
        std = metrics.get(f"std_{name}_ms")
        if median is None or mean is None or median != mean or completed < 3 or std == 0:
            continue
        del metrics[f"median_{name}_ms"]
        notes.append(f"{source}: median_{name}_ms equals mean_{name}_ms to the digit ({mean:g}): one summary "
                     "figure written twice, fitted as the mean")


def _kv_pool(result: Mapping[str, Any], source: str) -> int | None:
    """The engine's KV pool from --metadata keys (the labels of vllm:cache_config_info), or None."""
    if result.get("kv_cache_size_tokens") is not None:
        tokens = _positive_int(result, "kv_cache_size_tokens", source)
        return tokens
    if result.get("num_gpu_blocks") is not None:
        blocks = _positive_int(result, "num_gpu_blocks", source)
        if result.get("block_size") is None:
            raise ObservationError(f"{source}: metadata key 'num_gpu_blocks' needs 'block_size' beside it (both "
                                   "are labels of vllm:cache_config_info; vLLM's block size is 16 on GPUs, 128 on CPU)")
        return blocks * _positive_int(result, "block_size", source)
    return None


def _positive_int(result: Mapping[str, Any], key: str, source: str) -> int:
    value = result[key]
    try:
        number = float(str(value).replace(",", ""))
    except ValueError:
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number < 1 or number != int(number):
        raise ObservationError(f"{source}: metadata key {key!r} is {value!r}; expected a positive whole number")
    return int(number)


def _shape(result: Mapping[str, Any], mean_in: float, mean_out: float, source: str, inputs: Inputs, *,
           closed: bool, notes: list[str]) -> Shape:
    """The request mix as simulated: measured means, the measured or stated spread, else a closed loop's default."""
    lens = _per_request_lengths(result, source)
    if lens is not None:
        ins, outs = lens
        mean_in, mean_out = statistics.fmean(ins), statistics.fmean(outs)
        ratios = (_uniform_ratio(ins), _uniform_ratio(outs))
        how = f"per-request lengths of {len(ins)} requests: spread +-{ratios[0]:.0%} in, +-{ratios[1]:.0%} out"
    elif result.get("random_range_ratio") is not None:
        ratios = parse_range_ratio(result["random_range_ratio"], f"{source}: metadata key 'random_range_ratio'")
        how = f"random range ratio {ratios[0]:g} in, {ratios[1]:g} out (metadata)"
    elif inputs.range_ratio is not None:
        ratios = inputs.range_ratio
        how = f"random range ratio {ratios[0]:g} in, {ratios[1]:g} out (--random-range-ratio)"
    elif closed:
        # Nothing says how the lengths spread: a closed loop gets the default dispersion, not vllm bench's
        # default of fixed lengths, whose clients the simulation would keep in step for the whole run.
        ratios = (CLOSED_LOOP_DEFAULT_SPREAD, CLOSED_LOOP_DEFAULT_SPREAD)
        how = (f"lengths not in the file: a closed loop is simulated with the default spread "
               f"+-{CLOSED_LOOP_DEFAULT_SPREAD:.0%} (give --save-detailed's lengths or --random-range-ratio to "
               "simulate what the client sent)")
    else:
        ratios = (0.0, 0.0)
        how = "lengths not in the file: vllm bench serve's default, fixed (--random-range-ratio 0)"
    if lens is not None or ratios != (0.0, 0.0):
        notes.append(f"{source}: {how}")
    spread = ratios != (0.0, 0.0)
    return Shape(max(1.0, mean_in), max(1.0, mean_out), length_dist="uniform" if spread else "fixed",
                 range_ratio=ratios[0], output_range_ratio=ratios[1])


def _per_request_lengths(result: Mapping[str, Any], source: str) -> tuple[list[float], list[float]] | None:
    """`--save-detailed`'s input_lens and output_lens of the requests that succeeded, or None."""
    ins, outs = result.get("input_lens"), result.get("output_lens")
    if ins is None or outs is None:
        return None
    for key, values in (("input_lens", ins), ("output_lens", outs)):
        if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   and math.isfinite(v) and v >= 0 for v in values):
            raise ObservationError(f"{source}: key {key!r} is not a list of token counts")
    if len(ins) != len(outs):
        raise ObservationError(f"{source}: keys 'input_lens' and 'output_lens' differ in length "
                               f"({len(ins)} and {len(outs)}): not one run's requests")
    errors = result.get("errors")
    ok = [i for i in range(len(ins)) if outs[i] > 0 and not (isinstance(errors, list) and i < len(errors)
                                                             and isinstance(errors[i], str) and errors[i].strip())]
    if len(ok) < 2:
        return None
    return [float(ins[i]) for i in ok], [float(outs[i]) for i in ok]


def _uniform_ratio(values: Sequence[float]) -> float:
    """The range ratio of a uniform distribution with these values' coefficient of variation (std = L r / sqrt 3)."""
    mean = statistics.fmean(values)
    if mean <= 0:
        return 0.0
    cv = statistics.pstdev(values) / mean
    ratio = math.sqrt(3) * cv
    return 0.0 if ratio < 0.005 else min(MAX_FITTED_RATIO, round(ratio, 3))


def parse_range_ratio(value: object, where: str) -> tuple[float, float]:
    """vLLM's --random-range-ratio: a number for both, or `{"input": r, "output": r}`; each in [0, 1)."""
    data: object = value
    if isinstance(value, str):
        text = value.strip()
        try:
            data = json.loads(text) if text.startswith("{") else float(text)
        except ValueError:
            raise ObservationError(f"{where} is {value!r}; expected a number in [0, 1) or "
                                   "{\"input\": r, \"output\": r}") from None
    if isinstance(data, Mapping):
        unknown = sorted(set(data) - {"input", "output"})
        if unknown:
            raise ObservationError(f"{where}: unknown key(s) {unknown}; known: ['input', 'output']")
        pair = (data.get("input", 0.0), data.get("output", 0.0))
    else:
        pair = (data, data)
    out = []
    for r in pair:
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise ObservationError(f"{where} is {value!r}; each ratio must be a number in [0, 1)")
        out.append(float(r))
    return out[0], out[1]


# ---- the measured KV pool --------------------------------------------------------------------------

CACHE_CONFIG_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
LOG_POOL = re.compile(r"\b(?:GPU|CPU) KV cache size: ([\d,]+) tokens")


def kv_pool_from_file(path: str | Path, cfg: ServeConfig | None = None) -> tuple[int, str]:
    """The KV pool (tokens) in a `/metrics` scrape (`vllm:cache_config_info`) or an engine's startup log
    (`GPU KV cache size: N tokens`), and a note saying where it came from. `cfg`: the measured setting, whose
    --gpu-memory-utilization a GPU scrape must agree with (else it is another server's)."""
    path = Path(path)
    text = _read(path, "a metrics or log file")
    pools: set[int] = set()
    found = False
    for match in CACHE_CONFIG_INFO.finditer(text):
        found = True
        labels = dict(LABEL.findall(match.group("labels")))
        tokens = _label_int(labels, "kv_cache_size_tokens")
        if tokens is None:
            blocks, block = _label_int(labels, "num_gpu_blocks"), _label_int(labels, "block_size")
            tokens = blocks * block if blocks and block else None
        if tokens is None:
            raise ObservationError(f"{path}: vllm:cache_config_info has neither kv_cache_size_tokens nor "
                                   "num_gpu_blocks and block_size")
        gmu = labels.get("gpu_memory_utilization")
        if cfg is not None and not cfg.gpu.is_cpu and gmu not in (None, "None"):
            try:
                scraped = float(gmu)
            except ValueError:
                scraped = math.nan
            if not math.isclose(scraped, cfg.gpu_memory_utilization, abs_tol=1e-6):
                raise ObservationError(
                    f"{path}: vllm:cache_config_info says gpu_memory_utilization=\"{gmu}\", but the measured server "
                    f"ran --gpu-memory-utilization {cfg.gpu_memory_utilization:g}: a scrape of another server?")
        pools.add(tokens)
    if not found:
        pools.update(int(m.group(1).replace(",", "")) for m in LOG_POOL.finditer(text))
        if not pools:
            raise ObservationError(f"{path}: neither a vllm:cache_config_info sample (a `curl /metrics` scrape) nor a "
                                   "\"KV cache size: N tokens\" line (the engine's startup log)")
    if len(pools) > 1:
        raise ObservationError(f"{path}: several KV pools ({sorted(pools)}): engines of different settings; give the "
                               "scrape of the measured server alone")
    tokens = pools.pop()
    if tokens < 1:
        raise ObservationError(f"{path}: a KV pool of {tokens} tokens")
    kind = "vllm:cache_config_info" if found else "the startup log's KV cache size"
    return tokens, f"KV pool {tokens} tokens from {path.name} ({kind})"


def _label_int(labels: Mapping[str, str], key: str) -> int | None:
    value = labels.get(key)
    if value is None or value in ("None", ""):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number >= 1 else None


# ---- helpers ---------------------------------------------------------------------------------------


def _life_guess(metrics: Mapping[str, float]) -> float:
    e2e = metrics.get("mean_e2el_ms") or metrics.get("median_e2el_ms")
    return e2e / 1000 if e2e else math.inf


def _rate(result: Mapping[str, Any], source: str) -> float | None:
    value = result.get("request_rate")
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("inf", "infinity", "+inf"):
            return math.inf
        try:
            value = float(text)
        except ValueError:
            raise ObservationError(f"{source}: key 'request_rate' is {result['request_rate']!r}; expected a number "
                                   "or \"inf\"") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ObservationError(f"{source}: key 'request_rate' is {result['request_rate']!r}; expected a positive "
                               "number or \"inf\"")
    return float(value)


def _number(result: Mapping[str, Any], key: str, source: str, required: bool = False,
            optional_nan: bool = False) -> float | None:
    if key not in result or result[key] is None:
        if required:
            raise ObservationError(f"{source}: key {key!r} is missing (a `vllm bench serve --save-result` file has it)")
        return None
    value = result[key]
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ObservationError(f"{source}: key {key!r} is {result[key]!r}; expected a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ObservationError(f"{source}: key {key!r} is {result[key]!r}; expected a number")
    if math.isnan(value):
        if optional_nan:
            return None
        raise ObservationError(f"{source}: key {key!r} is {result[key]!r}; expected a number")
    if math.isinf(value):
        raise ObservationError(f"{source}: key {key!r} is {result[key]!r}; expected a finite number")
    return float(value)
