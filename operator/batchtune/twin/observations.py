"""Reading `vllm bench serve --save-result` files as observations for `batchtune.twin.fit`.

A file holds one result object, a JSON list of them, or one object per line (`--append-result`).
What is read: `completed`, `total_input_tokens`, `total_output_tokens` (the request mix),
`max_concurrency` and `request_rate` (`"inf"` or a number; the load), `num_prompts` and `duration`
(the run), `output_throughput` / `request_throughput`, and whatever latency statistics are present
(`{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms`). Everything else is ignored. Keys added with
`vllm bench serve --metadata` that name serving flags (`max_num_seqs`, `gpu_memory_utilization`,
`max_num_batched_tokens`, ...) override the command line's for that result. A malformed result is
refused with the file, the result's index and the key.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from batchtune.twin.config import ServeConfig
from batchtune.twin.fit import Observation
from batchtune.twin.steady import Shape

MAX_FILE_BYTES = 64 * 1024 * 1024
LATENCY_KEY = re.compile(r"^(mean|median|std|p\d{1,2}(\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")
THROUGHPUT_KEYS = ("request_throughput", "output_throughput", "total_token_throughput")
# --metadata keys that change the setting of one result (vLLM's flag names with underscores).
SETTING_KEYS = {"max_num_seqs": int, "gpu_memory_utilization": float, "max_num_batched_tokens": int,
                "max_model_len": int, "tensor_parallel_size": int}


class ObservationError(ValueError):
    """A result file that cannot be read as an observation: names the file, the result and the key."""


def load_observations(path: str | Path, cfg: ServeConfig) -> list[Observation]:
    """Every result in the file as an Observation of `cfg` (overridden per result by metadata keys)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ObservationError(f"{path}: {size} bytes, more than the {MAX_FILE_BYTES} a result file may have")
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise ObservationError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ObservationError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    results = list(_results(text, str(path)))
    if not results:
        raise ObservationError(f"{path}: no result object in the file")
    return [observation(result, cfg, f"{path.name}" + (f"[{i}]" if len(results) > 1 else ""))
            for i, result in enumerate(results)]


def _results(text: str, where: str) -> Iterator[Mapping[str, Any]]:
    try:
        data = json.loads(text, parse_constant=_constant)
    except ValueError as first:
        # --append-result writes one object per line
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) < 2:
            raise ObservationError(f"{where}: not JSON: {first}") from None
        data = []
        for n, line in enumerate(lines, start=1):
            try:
                data.append(json.loads(line, parse_constant=_constant))
            except ValueError as exc:
                raise ObservationError(f"{where}: line {n}: not JSON: {exc}") from None
    items = data if isinstance(data, list) else [data]
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ObservationError(f"{where}[{i}]: expected a result object, got {type(item).__name__}")
        yield item


def _constant(name: str) -> float:
    # Python's json writes NaN/Infinity for non-finite floats (vllm bench serve does, e.g. std of one sample)
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


def observation(result: Mapping[str, Any], cfg: ServeConfig, source: str) -> Observation:  # noqa: C901
    """One result object as an Observation."""
    completed = _number(result, "completed", source, required=True)
    if completed is None or completed < 1:
        raise ObservationError(f"{source}: key 'completed' is {result.get('completed')!r}: no request completed, "
                               "so the result measures nothing")
    total_in = _number(result, "total_input_tokens", source, required=True)
    total_out = _number(result, "total_output_tokens", source, required=True)
    assert total_in is not None and total_out is not None
    if total_in <= 0 or total_out <= 0:
        key = "total_input_tokens" if total_in <= 0 else "total_output_tokens"
        raise ObservationError(f"{source}: key '{key}' is {result.get(key)!r}; expected a positive token count")
    rate = _rate(result, source)
    concurrency = _number(result, "max_concurrency", source)
    if concurrency is not None and concurrency < 1:
        raise ObservationError(f"{source}: key 'max_concurrency' is {result['max_concurrency']!r}; expected >= 1")
    num_prompts = _number(result, "num_prompts", source)
    duration = _number(result, "duration", source)
    metrics: dict[str, float] = {}
    for key in result:
        if key in THROUGHPUT_KEYS or LATENCY_KEY.match(str(key)) or key == "max_concurrent_requests":
            number = _number(result, key, source, optional_nan=True)  # e.g. std of a single sample
            if number is not None and math.isfinite(number):
                metrics[str(key)] = number
    if "output_throughput" not in metrics:
        if duration and duration > 0:
            metrics["output_throughput"] = total_out / duration
        elif "request_throughput" in metrics:
            metrics["output_throughput"] = metrics["request_throughput"] * total_out / completed
        elif "total_token_throughput" in metrics:
            metrics["output_throughput"] = metrics["total_token_throughput"] * total_out / (total_in + total_out)
        else:
            raise ObservationError(f"{source}: key 'output_throughput' is missing (and no 'duration', "
                                   "'request_throughput' or 'total_token_throughput' to derive it from)")
    # The load: --max-concurrency with --request-rate inf is a closed loop; a finite rate is Poisson
    # (capped by max_concurrency when that binds: read as the closed loop then); inf alone is a burst.
    prompts = int(num_prompts) if num_prompts and num_prompts >= 1 else int(completed)
    if rate is not None and math.isfinite(rate):
        closed = concurrency is not None and concurrency <= rate * _life_guess(metrics)
        load: dict[str, float | None] = {"concurrency": concurrency} if closed else {"rate": rate}
    elif concurrency is not None:
        load = {"concurrency": concurrency}
    else:
        load = {"rate": math.inf}
    overrides = {}
    for key, cast in SETTING_KEYS.items():
        if key in result and result[key] is not None:
            try:
                overrides[key] = cast(result[key])
            except (TypeError, ValueError):
                raise ObservationError(f"{source}: metadata key {key!r} is {result[key]!r}; expected a number") from None
    try:
        served = cfg.replace(**overrides) if overrides else cfg
    except ValueError as exc:
        raise ObservationError(f"{source}: metadata {overrides}: {exc}") from None
    shape = Shape(max(1.0, total_in / completed), max(1.0, total_out / completed))
    return Observation(served, shape, metrics, concurrency=load.get("concurrency"), rate=load.get("rate"),
                       num_prompts=prompts, window_s=float(duration or 60.0), source=source)


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
    return float(value)
