"""What the load generator sends: request lengths and arrival gaps, sampled or replayed. Deterministic per seed.

- Lengths: fixed (`input_len`/`output_len`, optionally spread uniformly by `range_ratio`, as `vllm bench
  serve --random-range-ratio`), or drawn from production's length histograms (`core.workload`).
  With the engine's context length known, a prompt plus its output always fits in it (the engine
  would refuse the request otherwise, and the refusal would read as an error rate).
- Arrivals: gamma-distributed gaps with shape `burstiness` and mean 1/rate, as `vllm bench serve
  --burstiness` (1: Poisson; below 1: burstier; above 1: more regular).
- A trace (JSONL, one request a line: `{"offset_seconds": 0.5, "prompt_tokens": 812, "output_tokens": 96}`)
  is replayed as is: each request at its offset from the start, with its lengths. A speed in percent
  scales the offsets (200: twice as fast), which is how a capacity search walks a trace's load.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from batchtune.core.workload import LengthDistribution
from batchtune.files import InputFileError, parse_json, read_text

MAX_TRACE_REQUESTS = 1_000_000
MAX_TOKENS = 1_000_000


def draw_fixed(rng: random.Random, length: int, ratio: float) -> int:
    """A length uniform in [length * (1 - ratio), length * (1 + ratio)], or `length` with ratio 0."""
    if ratio <= 0:
        return length
    return max(1, rng.randint(int(length * (1 - ratio)), int(math.ceil(length * (1 + ratio)))))


def fit_context(prompt: int, output: int, max_model_len: int | None) -> tuple[int, int]:
    """The lengths cut so that prompt + output fits the context (the prompt may arrive one token long)."""
    if not max_model_len or max_model_len < 3:
        return prompt, output
    output = max(1, min(output, max_model_len - 2))
    return max(1, min(prompt, max_model_len - output - 1)), output


@dataclass(frozen=True)
class LengthSampler:
    """Prompt and output lengths for each request."""

    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prompts: LengthDistribution | None = None
    outputs: LengthDistribution | None = None
    max_model_len: int | None = None

    def draw(self, rng: random.Random) -> tuple[int, int]:
        prompt = self.prompts.sample(rng) if self.prompts is not None else draw_fixed(rng, self.input_len,
                                                                                      self.range_ratio)
        output = self.outputs.sample(rng) if self.outputs is not None else draw_fixed(rng, self.output_len,
                                                                                      self.range_ratio)
        return fit_context(prompt, output, self.max_model_len)


def arrival_gap(rng: random.Random, rate_per_second: float, burstiness: float) -> float:
    """Seconds to the next request: gamma with shape `burstiness` and mean 1/rate."""
    if not rate_per_second > 0 or not math.isfinite(rate_per_second):
        raise ValueError(f"rate {rate_per_second!r} must be a positive finite number")
    if not burstiness > 0:
        raise ValueError(f"burstiness {burstiness!r} must be > 0")
    return rng.gammavariate(burstiness, 1.0 / (rate_per_second * burstiness))


@dataclass(frozen=True)
class TraceRequest:
    offset_seconds: float
    prompt_tokens: int
    output_tokens: int


class TraceError(ValueError):
    """A trace line that is not a request; the message names the line, never echoes its content.

    The trace comes from a ConfigMap the load Job mounts and the operator never reads; its error
    reaches status through the Job's termination message, so it must not carry the ConfigMap's data.
    """


def _count(value: object, key: str, line: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        raise TraceError(f"trace line {line}: {key} must be an integer 1..{MAX_TOKENS}")
    return value


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """Requests of a JSONL trace, ordered by offset; blank lines are skipped, anything else is refused."""
    out: list[TraceRequest] = []
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        if len(out) >= MAX_TRACE_REQUESTS:
            raise TraceError(f"trace line {number}: more than {MAX_TRACE_REQUESTS} requests")
        try:
            item = parse_json(text, "trace", nonfinite=True)  # the offset is checked finite below
        except InputFileError:
            raise TraceError(f"trace line {number}: not JSON, or nested too deeply") from None
        if not isinstance(item, dict):
            raise TraceError(f"trace line {number}: not a JSON object")
        unknown = set(item) - {"offset_seconds", "prompt_tokens", "output_tokens"}
        if unknown:
            raise TraceError(f"trace line {number}: {len(unknown)} unknown key(s); a request has only "
                             "offset_seconds, prompt_tokens and output_tokens")
        offset = item.get("offset_seconds")
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset) or offset < 0:
            raise TraceError(f"trace line {number}: offset_seconds must be a number >= 0")
        out.append(TraceRequest(float(offset), _count(item.get("prompt_tokens"), "prompt_tokens", number),
                                _count(item.get("output_tokens"), "output_tokens", number)))
    if not out:
        raise TraceError("the trace holds no request")
    out.sort(key=lambda r: r.offset_seconds)
    return out


def read_trace(path: str) -> list[TraceRequest]:
    """The trace file's requests; InputFileError naming the file and the line."""
    try:
        return parse_trace(read_text(path).splitlines())
    except TraceError as exc:
        raise InputFileError(path, str(exc)) from None


def trace_lines(requests: Iterable[TraceRequest]) -> str:
    """The JSONL text of a trace (what `batchtune workload capture --trace-out` writes)."""
    return "".join(json.dumps({"offset_seconds": round(r.offset_seconds, 3), "prompt_tokens": r.prompt_tokens,
                               "output_tokens": r.output_tokens}) + "\n" for r in requests)


def synthesize_trace(count: int, rate_per_second: float, burstiness: float, lengths: LengthSampler,
                     seed: int) -> list[TraceRequest]:
    """A trace with the profile's shape: `count` requests, gamma arrivals, lengths from the sampler."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        prompt, output = lengths.draw(rng)
        out.append(TraceRequest(t, prompt, output))
        t += arrival_gap(rng, rate_per_second, burstiness)
    return out
