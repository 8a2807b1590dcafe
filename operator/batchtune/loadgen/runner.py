"""Real HTTP load against an OpenAI-compatible endpoint (streaming, to measure TTFT and ITL).

Arrival modes, as `vllm bench serve`: closed loop (`concurrency` streams, each sending its next
request when the previous one ends; `request_rate=inf`) or open loop (gamma arrivals at
`request_rate` with shape `burstiness`, optionally capped at `concurrency` in flight); or a trace
replayed as is (`trace`, its offsets scaled by `trace_speed_percent`). Lengths are fixed, spread,
sampled from production's histograms, or the trace's (`loadgen.workload`). The run always has two
bounds: `num_prompts` requests sent (warm-up included) and `duration_s`, a hard stop that cancels the
requests still in flight. With `steady_warmup` the warm-up ends at the first check where the load has
settled (`core.warmup.settled`), at most at `warmup_s`, and the hard stop moves with it: the measure window
keeps its length `duration_s - warmup_s`.

Time inputs and outputs are in simulated seconds: with `time_scale` X (the twin runs X times
faster than a real GPU) a 120 s window lasts 12 wall seconds, a 5 req/s rate sends 50 per wall
second, and every latency is reported multiplied back by X.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp

from batchtune.core.warmup import STEADY_CHECK_S, LoadSample, WarmupEnd, settled
from batchtune.core.workload import LengthDistribution
from batchtune.loadgen.prompts import FILLER_WORDS, Prompts
from batchtune.loadgen.stats import (
    DEFAULT_PERCENTILE_METRICS,
    DEFAULT_PERCENTILES,
    ClientWindow,
    RequestRecord,
    compute_result,
)
from batchtune.loadgen.workload import LengthSampler, TraceRequest, arrival_gap

CHAT_ENDPOINT = "/v1/chat/completions"


class TargetRefused(ValueError):
    """The target is not a loopback address and non-loopback load was not allowed."""


@dataclass(frozen=True)
class LoadRun:
    """One run of the load generator: what load to send, where, and for how long (spec.load, the api model, is
    what a trial's runs drive; this is one run's every setting)."""

    base_url: str = "http://127.0.0.1:8000"
    """Scheme, host and port of the server; the endpoint path is appended."""
    endpoint: str = "/v1/completions"
    """`/v1/completions` or `/v1/chat/completions`."""
    model: str | None = None
    """Model name to request; None: the first of GET /v1/models."""
    input_len: int = 1024
    """Prompt tokens per request (the twin counts words * 1.3)."""
    output_len: int = 128
    """`max_tokens` per request."""
    range_ratio: float = 0.0
    """Lengths drawn uniformly in [len * (1 - r), len * (1 + r)]; 0 = fixed."""
    concurrency: int | None = None
    """Closed-loop streams (request_rate inf) or the in-flight cap (finite rate)."""
    request_rate: float = math.inf
    """Poisson arrival rate in requests per simulated second; inf = closed loop / all at once."""
    burstiness: float = 1.0
    """Gamma shape of inter-arrival times; 1 = Poisson."""
    num_prompts: int = 1000
    """Hard cap on requests sent, warm-up included."""
    duration_s: float = 600.0
    """Hard cap on the run (simulated seconds, warm-up included); in-flight requests are cancelled."""
    warmup_s: float = 0.0
    """Simulated seconds at the start whose requests are excluded from the statistics."""
    steady_warmup: bool = False
    """End the warm-up at the first check where the load has settled (core/warmup.py), at most at `warmup_s`;
    the measure window keeps its length (`duration_s - warmup_s`). Never for a trace replay."""
    seed: int = 0
    ignore_eos: bool = True
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    time_scale: float = 1.0
    """The twin's time scale: wall durations are simulated ones divided by it."""
    allow_non_loopback: bool = False
    """Send load to addresses outside 127.0.0.0/8 (the operator's in-cluster Job sets it)."""
    ready_timeout_s: float = 60.0
    """Wall seconds to wait for GET /v1/models to answer before starting."""
    prompt_lengths: LengthDistribution | None = None
    """Production's prompt-length histogram to sample each prompt from (instead of input_len)."""
    output_lengths: LengthDistribution | None = None
    """Production's output-length histogram to sample each `max_tokens` from (instead of output_len)."""
    max_model_len: int | None = None
    """The engine's context length: a sampled prompt plus its output is cut to fit."""
    trace: tuple[TraceRequest, ...] = ()
    """Requests to replay as they are (arrival offsets and lengths), instead of sampled ones."""
    trace_speed_percent: float = 100.0
    """Replay speed of the trace (200: offsets halved)."""
    goodput_ms: tuple[tuple[str, float], ...] = ()
    """Per-request targets (`ttft`, `tpot`, `e2el` in ms): `request_goodput` counts the completed requests that
    met them all, as `vllm bench serve --goodput`."""

    def __post_init__(self) -> None:
        checks = [
            ("input_len", self.input_len >= 1),
            ("output_len", self.output_len >= 1),
            ("num_prompts", self.num_prompts >= 1),
            ("duration_s", self.duration_s > 0),
            ("warmup_s", 0 <= self.warmup_s < self.duration_s),
            ("request_rate", self.request_rate > 0),
            ("time_scale", self.time_scale > 0),
            ("range_ratio", 0 <= self.range_ratio < 1),
            ("burstiness", self.burstiness > 0),
            ("trace_speed_percent", self.trace_speed_percent > 0),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 3),
            ("goodput_ms", all(k in ("ttft", "tpot", "e2el") and v > 0 for k, v in self.goodput_ms)),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"invalid load spec: {name}={getattr(self, name)!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"invalid load spec: concurrency={self.concurrency!r} (must be >= 1)")
        if self.endpoint not in ("/v1/completions", CHAT_ENDPOINT):
            raise ValueError(f"invalid load spec: endpoint={self.endpoint!r} (use /v1/completions or {CHAT_ENDPOINT})")


def check_target(base_url: str, allow_non_loopback: bool) -> None:
    """Refuse a target outside loopback unless allowed; never resolves names through DNS."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"base_url {base_url!r} is not an http(s) URL with a host")
    if allow_non_loopback:
        return
    host = parts.hostname
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise TargetRefused(
            f"refusing to send load to {host!r} in base_url {base_url!r}: not a loopback address "
            "(127.0.0.0/8); pass --allow-non-loopback to allow it"
        )


@dataclass
class _Tally:
    """Shared counters the streams update as tokens arrive."""

    window_start: float
    window_tokens: int = 0
    per_second: Counter[int] = field(default_factory=Counter)
    in_flight: int = 0
    max_in_flight: int = 0
    tokens: int = 0
    """Output tokens received since the load started (the steady-state test's rate)."""
    finished: int = 0
    """Requests ended since the load started."""

    def token(self, at: float, count: int = 1) -> None:
        self.tokens += count
        if at >= self.window_start:
            self.window_tokens += count
            self.per_second[int(at - self.window_start)] += count


def _payload(spec: LoadRun, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": spec.ignore_eos,
    }
    if spec.endpoint == CHAT_ENDPOINT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(data: dict[str, Any], chat: bool) -> str | None:
    choices = data.get("choices")
    if not choices:
        return None
    choice = choices[0]
    # Parsed JSON: a chunk's text is a string or null.
    if chat:
        return cast("str | None", (choice.get("delta") or {}).get("content"))
    return cast("str | None", choice.get("text"))


async def _send(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], record: RequestRecord, tally: _Tally, chat: bool
) -> None:
    """Stream one request, filling `record`; never raises except on cancellation."""
    loop = asyncio.get_running_loop()
    chunks = 0
    usage_tokens: int | None = None
    last = record.sent_at
    tally.in_flight += 1
    tally.max_in_flight = max(tally.max_in_flight, tally.in_flight)
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                record.error = f"HTTP {resp.status}: {text}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data_text = line[5:].strip()
                if data_text == b"[DONE]":
                    break
                data = json.loads(data_text)
                if "error" in data:
                    record.error = str(data["error"])[:300]
                    return
                chunk_text = _chunk_text(data, chat)
                if chunk_text:  # as vllm bench: empty deltas (the chat role chunk) are not tokens
                    now = loop.time()
                    if chunks == 0:
                        record.ttft_s = now - record.sent_at
                    else:
                        record.itls_s.append(now - last)
                    last = now
                    record.last_token_at = now
                    chunks += 1
                    tally.token(now)
                usage = data.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
        _finish(record, tally, loop.time(), chunks, usage_tokens)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        tally.in_flight -= 1
        tally.finished += 1
        if not record.finished_at:
            record.finished_at = loop.time()


def _finish(record: RequestRecord, tally: _Tally, finished: float, chunks: int, usage_tokens: int | None) -> None:
    """A stream that ended: its end-to-end latency and tokens (the usage count where the server sent one)."""
    record.finished_at = finished
    record.e2el_s = finished - record.sent_at
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if usage_tokens is not None and usage_tokens > chunks:
        tally.token(finished, usage_tokens - chunks)  # servers that pack several tokens per chunk
    record.success = chunks > 0 or record.output_tokens > 0
    if not record.success:
        record.error = "no tokens in the response"


async def first_model(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str:
    """The first model id of GET /v1/models, retrying until the server answers or time runs out."""
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt"
    while True:
        try:
            async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
                if resp.status == 200:
                    models = (await resp.json()).get("data") or []
                    if models:
                        return str(models[0]["id"])
                    last_error = "GET /v1/models returned no models"
                else:
                    last_error = f"GET /v1/models returned HTTP {resp.status}"
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise ConnectionError(f"server at {base_url} not ready after {timeout_s:.0f}s: {last_error}")
        await asyncio.sleep(0.2)


async def engine_word_tokens(session: aiohttp.ClientSession, base_url: str, model: str) -> Prompts:
    """Prompts sized by what each filler word costs the engine's tokenizer (vLLM's POST /tokenize).

    Each word is measured after a leading word (`the W` less `the`), so the count is that of a word
    inside a prompt, whatever the tokenizer does at a text's start; prompts start with that leading
    word, at its own cost. Without a tokenizer API (the twin), the twin's rule.
    """

    async def count(text: str) -> int | None:
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        try:
            async with session.post(base_url + "/tokenize", json=body,
                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status != 200:
                    return None
                answer = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        value = answer.get("count") if isinstance(answer, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    lead = FILLER_WORDS[0]
    base = await count(lead)
    if base is None:
        return Prompts()  # no tokenizer API (the twin): one request, not one per word
    counts = await asyncio.gather(*(count(f"{lead} {word}") for word in FILLER_WORDS))
    if any(c is None for c in counts):
        return Prompts()
    return Prompts({word: c - base for word, c in zip(FILLER_WORDS, counts, strict=True) if c is not None}, base)


async def run_load(spec: LoadRun, *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the load and return the `vllm bench serve`-style result dict (setup and result keys)."""
    check_target(spec.base_url, spec.allow_non_loopback)
    say = log or (lambda _msg: None)
    base = spec.base_url.rstrip("/")
    # A connection per request: reusing a kept-alive one races uvicorn's keep-alive close (vLLM's server), and
    # the request fails with "Server disconnected" / "Can not write request body" (aiohttp#6138, uvicorn#824).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = spec.model or await first_model(session, base, spec.ready_timeout_s)
        prompts = await engine_word_tokens(session, base, model)
        run = _Run(spec, session, base + spec.endpoint, model, prompts, say)
        await run.drive()
    return run.result()


class _Run:
    """One run of the load generator once its model and prompts are known: the requests, the warm-up's end, the
    window."""

    def __init__(self, spec: LoadRun, session: aiohttp.ClientSession, url: str, model: str, prompts: Prompts,
                 say: Callable[[str], None]) -> None:
        self.spec, self.session, self.url, self.model, self.prompts, self.say = spec, session, url, model, prompts, say
        self.chat = spec.endpoint == CHAT_ENDPOINT
        self.rng = random.Random(spec.seed)
        self.loop = asyncio.get_running_loop()
        self.started = self.loop.time()
        self.wall_offset = time.time() - self.started
        self.warmup_end = self.started + spec.warmup_s / spec.time_scale
        self.hard_stop = self.started + spec.duration_s / spec.time_scale
        self.tally = _Tally(window_start=self.warmup_end)
        self.records: list[RequestRecord] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.issued = 0
        self.ended_by = WarmupEnd.TIME
        self.stopped_early = False
        self.end = self.started
        say(
            f"Started load on {url} model={model} input_len={spec.input_len} output_len={spec.output_len} "
            f"concurrency={spec.concurrency} request_rate={spec.request_rate} num_prompts={spec.num_prompts} "
            f"duration={spec.duration_s}s warmup={spec.warmup_s}s time_scale={spec.time_scale} "
            f"prompts={'sized by the engine tokenizer' if prompts.exact else 'sized by the twin rule'}"
        )
        self.sampler = LengthSampler(spec.input_len, spec.output_len, spec.range_ratio, spec.prompt_lengths,
                                     spec.output_lengths, spec.max_model_len)

    # ---- the requests ------------------------------------------------------------------------------

    def next_request(self) -> tuple[RequestRecord, dict[str, Any]]:
        spec = self.spec
        if spec.trace:
            traced = spec.trace[self.issued]
            prompt_tokens, max_tokens = traced.prompt_tokens, traced.output_tokens
        else:
            prompt_tokens, max_tokens = self.sampler.draw(self.rng)
        self.issued += 1
        record = RequestRecord(sent_at=0.0, prompt_tokens=prompt_tokens)
        self.records.append(record)
        return record, _payload(spec, self.model, self.prompts.make(prompt_tokens, self.rng), max_tokens)

    async def one(self, record: RequestRecord, body: dict[str, Any]) -> None:
        record.sent_at = self.loop.time()
        await _send(self.session, self.url, body, record, self.tally, self.chat)

    async def closed_loop_stream(self) -> None:
        while self.issued < self.spec.num_prompts and self.loop.time() < self.hard_stop:
            await self.one(*self.next_request())

    async def open_loop(self) -> None:
        spec = self.spec
        semaphore = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
        next_at = self.started
        wall_rate = spec.request_rate * spec.time_scale
        timed = math.isfinite(wall_rate)

        async def gated(record: RequestRecord, body: dict[str, Any]) -> None:
            if semaphore is None:
                await self.one(record, body)
                return
            async with semaphore:
                if self.loop.time() < self.hard_stop:
                    await self.one(record, body)

        limit = min(spec.num_prompts, len(spec.trace)) if spec.trace else spec.num_prompts
        while self.issued < limit:
            if spec.trace:
                # Replayed as is: the trace's own offsets (scaled by speed and the twin's time scale).
                next_at = self.started + spec.trace[self.issued].offset_seconds * 100.0 / spec.trace_speed_percent \
                    / spec.time_scale
            elif timed:
                next_at += arrival_gap(self.rng, wall_rate, spec.burstiness)
            if spec.trace or timed:
                if next_at >= self.hard_stop:
                    break
                await asyncio.sleep(max(0.0, next_at - self.loop.time()))
            task = asyncio.create_task(gated(*self.next_request()))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        if self.tasks:
            await asyncio.wait(set(self.tasks))

    # ---- the run -----------------------------------------------------------------------------------

    async def drive(self) -> None:
        """Send the load until it ends or the hard stop, ending the warm-up early once the load has settled."""
        spec = self.spec
        driver: asyncio.Future[Any]  # awaited for its end only
        if spec.concurrency and not math.isfinite(spec.request_rate) and not spec.trace:
            driver = asyncio.gather(*(self.closed_loop_stream() for _ in range(spec.concurrency)))
        else:
            driver = asyncio.ensure_future(self.open_loop())
        try:
            await self.watch(driver)
        finally:
            driver.cancel()
            for task in list(self.tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await driver
        self.end = self.hard_stop if self.stopped_early else max((r.finished_at for r in self.records),
                                                                 default=self.loop.time())

    async def watch(self, driver: asyncio.Future[Any]) -> None:
        """Wait for the load to end. The steady-state test samples the counters every check until the load settles
        or the warm-up's time is up; settled, the window starts now and the hard stop moves with it (the window
        keeps its length)."""
        spec = self.spec
        checking = spec.steady_warmup and not spec.trace and spec.warmup_s > 0
        streams = spec.concurrency if not math.isfinite(spec.request_rate) else None
        samples = [LoadSample(at_s=0.0, issued=0, finished=0, in_flight=0, output_tokens=0)]  # the load's start
        next_check = self.started + STEADY_CHECK_S / spec.time_scale
        while True:
            until = min(self.hard_stop, next_check) if checking else self.hard_stop
            await asyncio.wait({driver}, timeout=max(0.0, until - self.loop.time()))
            now = self.loop.time()
            if driver.done():
                return
            if now >= self.hard_stop:
                self.stopped_early = True
                return
            if not checking or now < next_check:
                continue
            next_check += STEADY_CHECK_S / spec.time_scale
            if now >= self.warmup_end:
                checking = False
                continue
            samples.append(LoadSample(at_s=(now - self.started) * spec.time_scale, issued=self.issued,
                                      finished=self.tally.finished, in_flight=self.tally.in_flight,
                                      output_tokens=self.tally.tokens))
            if settled(samples, streams):
                self.hard_stop -= self.warmup_end - now
                self.warmup_end = self.tally.window_start = now
                self.ended_by, checking = WarmupEnd.STEADY, False
                self.say(f"Ended the warm-up at {(now - self.started) * spec.time_scale:.1f}s: the load has settled")

    def result(self) -> dict[str, Any]:
        """The `vllm bench serve`-style result: the run's setup, then the window's figures."""
        spec, end, warmup_end = self.spec, self.end, self.warmup_end
        if end < warmup_end:
            self.say(f"Warning: the run ended {warmup_end - end:.2f}s (wall) before the warm-up did; no measurements")
        # Requests cancelled by the hard stop are neither completed nor failed: they were in flight at its end.
        per_second = [count for second, count in self.tally.per_second.items() if warmup_end + second + 1 <= end]
        window = ClientWindow(
            start=warmup_end,
            end=max(end, warmup_end),
            output_tokens=self.tally.window_tokens,
            max_output_tokens_per_s=float(max(per_second, default=0)),
            max_concurrent_requests=self.tally.max_in_flight,
        )
        result = compute_result(
            self.records,
            window,
            percentile_metrics=spec.percentile_metrics,
            percentiles=spec.percentiles,
            time_scale=spec.time_scale,
            wall_offset=self.wall_offset,
            goodput_ms=spec.goodput_ms,
        )
        return {**self.setup(), **result}

    def setup(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "date": time.strftime("%Y%m%d-%H%M%S"),
            "endpoint_type": "openai-chat" if self.chat else "openai",
            "backend": "openai-chat" if self.chat else "openai",
            "label": None,
            "model_id": self.model,
            "tokenizer_id": self.model,
            "num_prompts": spec.num_prompts,
            "request_rate": spec.request_rate if math.isfinite(spec.request_rate) else "inf",
            "burstiness": spec.burstiness,
            "length_source": "trace" if spec.trace else "histogram" if spec.prompt_lengths or spec.output_lengths
            else "fixed",
            "trace_requests": len(spec.trace) or None,
            "trace_speed_percent": spec.trace_speed_percent if spec.trace else None,
            "max_concurrency": spec.concurrency,
            "input_len": spec.input_len,
            "output_len": spec.output_len,
            "warmup_seconds": spec.warmup_s,
            "warmup_steady": spec.steady_warmup,
            "warmup_ended": self.ended_by.value,
            "warmup_elapsed_s": round((self.warmup_end - self.started) * spec.time_scale, 3),
            "duration_limit": spec.duration_s,
            "stopped_by_duration": self.stopped_early,
            "requests_sent": self.issued,
            "time_scale": spec.time_scale,
        }


def run_load_sync(spec: LoadRun, *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`run_load` in a fresh event loop."""
    return asyncio.run(run_load(spec, log=log))


def format_report(result: dict[str, Any]) -> str:
    """The text block `vllm bench serve` prints, for logs."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, key: str, fmt: str = "{:<10.2f}") -> None:
        if key in result and result[key] is not None:
            lines.append(f"{label:<40} " + fmt.format(result[key]))

    row("Successful requests:", "completed", "{:<10}")
    row("Failed requests:", "failed", "{:<10}")
    row("Maximum request concurrency:", "max_concurrency", "{}")
    row("Benchmark duration (s):", "duration")
    row("Total input tokens:", "total_input_tokens", "{:<10}")
    row("Total generated tokens:", "total_output_tokens", "{:<10}")
    row("Request throughput (req/s):", "request_throughput")
    row("Output token throughput (tok/s):", "output_throughput")
    row("Total token throughput (tok/s):", "total_token_throughput")
    for metric, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                          ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):  # fmt: skip
        keys = [k for k in result if k.endswith(f"_{metric}_ms") and not k.startswith("std_")]
        if not keys:
            continue
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for key in keys:
            stat = key.split("_")[0]
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            row(f"{label} {metric.upper()} (ms):", key)
    lines.append("=" * 50)
    return "\n".join(lines)
