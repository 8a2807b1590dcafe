"""The twin server: a real-time OpenAI-API server whose timing comes from the twin engine.

One asyncio task runs the engine: `out = engine.step(now)`, sleep until the step's absolute
deadline (`duration_s / time_scale` after the previous deadline, so sleep jitter and the
engine's own compute time do not accumulate), then hand each `TokenEvent` to its request's
queue. Request handlers stream those tokens as SSE chunks in vLLM's format.

Clocks: the engine and the Prometheus histograms run on simulated seconds, taken at scheduled
step boundaries, so /metrics shows the latencies the modelled GPU would have at any time scale.
HTTP clients see wall time. The simulated clock is kept in simulated seconds (`now + duration_s`,
as `predict` advances it) and each wall deadline derived from it (`t0 + sim / time_scale`), never
the other way round: a simulated time read back from a rounded wall deadline can fall a rounding
error short of the end of an idle wait, and the rest of that wait is below the wall clock's float
resolution (3.6e-12 s after 4.5 h of uptime), so it never ends.

While "the model loads", /health and the API answer 503 (the socket is already bound; a real
vLLM refuses or stalls connections at that point, both fail a readiness probe the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from batchtune.gpu_activity import write_activity
from batchtune.loadgen.prompts import count_text_tokens, filler_token_text
from batchtune.twin.metrics import CONTENT_TYPE, CacheConfigInfo, VllmMetrics

VLLM_VERSION = "0.11.0"
CHAT_TEMPLATE_TOKENS_PER_MESSAGE = 5
CHAT_TEMPLATE_TOKENS_FIXED = 3
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default, as OpenAI's legacy API
NATURAL_LENGTH_RANGE = (64, 512)  # output length at which the twin "emits EOS" when ignore_eos is off
MAX_LAG_S = 0.25  # past this much wall lag the step clock restarts instead of catching up
SPIN_BEFORE_DEADLINE_S = 0.001  # epoll rounds timeouts up to 1 ms; the last ms is spent yielding


@dataclass(frozen=True)
class ServerOptions:
    """How the server runs (everything that is not the serving config itself)."""

    served_model_name: str
    """Name in /v1/models, the `model` field and the `model_name` metric label."""
    host: str = "127.0.0.1"
    port: int = 8000
    time_scale: float = 1.0
    """Simulated seconds per wall second."""
    activity_file: str | None = None
    """Where to write the GPU activity report once per wall second."""
    gpu_count: int = 1
    """GPU entries in the activity report."""
    activity_interval_s: float = 1.0
    stats_log_interval_s: float = 5.0
    """Wall seconds between vLLM's `Engine 000: Avg prompt throughput ...` lines (0 = off)."""
    legacy_gpu_cache_usage: bool = False
    """Also expose the deprecated `vllm:gpu_cache_usage_perc`."""
    root_model: str | None = None
    """The model path (`root` in /v1/models)."""
    exit_on_runtime_oom: bool = True
    """SIGKILL the own process on a runtime OOM, as the kernel OOM killer would (exit 137)."""
    termination_message_path: str | None = None


@dataclass
class _Stream:
    """One request in flight: its queue of token events and its timeline (simulated seconds)."""

    req_id: str
    prompt_tokens: int
    max_tokens: int
    reason_at_end: str
    arrival_sim: float
    queue: asyncio.Queue[bool] = field(default_factory=asyncio.Queue)
    generated: int = 0
    first_sim: float = 0.0
    last_sim: float = 0.0
    done: bool = False


@dataclass
class StepTiming:
    """Scheduled vs actual step ends (wall seconds), for the benchmark."""

    steps: int = 0
    scheduled_s: float = 0.0
    abs_error_s: float = 0.0
    max_error_s: float = 0.0
    errors: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=20000))
    restarts: int = 0

    def record(self, duration: float, late_by: float) -> None:
        self.steps += 1
        self.scheduled_s += duration
        self.abs_error_s += abs(late_by)
        self.max_error_s = max(self.max_error_s, abs(late_by))
        self.errors.append((duration, late_by))

    def summary(self) -> dict[str, float]:
        """Step timing error: |actual - scheduled step end| relative to the step's scheduled length."""
        rel = sorted(abs(late) / dur for dur, late in self.errors if dur > 0)

        def pct(p: float) -> float:
            return rel[min(len(rel) - 1, int(p / 100 * len(rel)))] if rel else 0.0

        return {
            "steps": self.steps,
            "mean_step_ms": 1000 * self.scheduled_s / self.steps if self.steps else 0.0,
            "mean_abs_error_ms": 1000 * self.abs_error_s / self.steps if self.steps else 0.0,
            "max_abs_error_ms": 1000 * self.max_error_s,
            "error_fraction": self.abs_error_s / self.scheduled_s if self.scheduled_s else 0.0,
            "p50_relative_error": pct(50),
            "p95_relative_error": pct(95),
            "p99_relative_error": pct(99),
            "clock_restarts": self.restarts,
        }


@dataclass
class _Activity:
    """Busy time and time-weighted GPU signals since the last report (wall seconds)."""

    busy: float = 0.0
    sm_active: float = 0.0
    sm_occupancy: float = 0.0
    tensor_active: float = 0.0
    dram_active: float = 0.0
    power: float = 0.0

    def add(self, out: Any, wall: float) -> None:
        if not (getattr(out, "prompt_tokens", 0) or getattr(out, "decode_tokens", 0)):
            return  # the engine waiting on the API server: nothing ran on the GPU
        self.busy += wall
        self.sm_active += getattr(out, "sm_active", 0.0) * wall
        self.sm_occupancy += getattr(out, "sm_occupancy", 0.0) * wall
        self.tensor_active += getattr(out, "tensor_active", 0.0) * wall
        self.dram_active += getattr(out, "dram_active", 0.0) * wall
        self.power += getattr(out, "power_w", 0.0) * wall


class OpenAIError(Exception):
    """vLLM 0.32's error body: {"error": {"message", "type", "param", "code"}}. With `param`, the message ends
    in vLLM's ` (parameter=NAME, value=VALUE)`."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None,
                 value: Any = None):  # fmt: skip
        if param is not None and value is not None:
            message = f"{message} (parameter={param}, value={value})"
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return web.json_response(body, status=self.status)


class TwinServer:
    """The OpenAI-API front end and the real-time step loop around one engine."""

    def __init__(self, engine: Any, options: ServerOptions, *, on_log: Callable[[str, str, str], None] | None = None):
        self.engine = engine
        self.options = options
        self.cfg = engine.cfg if hasattr(engine, "cfg") else None
        self.memory = getattr(engine, "memory", None)
        self._emit_log = on_log or _print_log
        self.ts = float(options.time_scale)
        self.max_model_len = int(getattr(self.cfg, "max_model_len", 0) or getattr(self.memory, "max_model_len", 4096))
        cache_info = None
        if self.memory is not None:
            cache_info = CacheConfigInfo(
                block_size=int(self.memory.block_size),
                num_gpu_blocks=int(self.memory.num_gpu_blocks),
                gpu_memory_utilization=float(getattr(self.cfg, "gpu_memory_utilization", 0.9)),
                cache_dtype=str(getattr(self.cfg, "kv_cache_dtype", "auto")),
                kv_cache_size_tokens=int(self.memory.kv_cache_tokens),
            )
        self.metrics = VllmMetrics(
            options.served_model_name,
            self.max_model_len,
            cache_info,
            legacy_gpu_cache_usage=options.legacy_gpu_cache_usage,
        )
        self.ready = False
        self.timing = StepTiming()
        self.created = int(time.time())
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._t0 = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._work = asyncio.Event()
        self._deadline: float | None = None
        """Wall time at which the current step ends (None while idle)."""
        self._sim_deadline = 0.0
        """The same moment in simulated seconds: where the engine's clock stands."""
        self._idle_arrival: float | None = None
        """Simulated arrival of the first request since the engine went idle: where its next step starts."""
        self._tasks: list[asyncio.Task[Any]] = []
        self._runner: web.AppRunner | None = None
        self._activity = _Activity()
        self._stats = {"prompt": 0, "generation": 0, "preempted": 0, "running": 0, "waiting": 0, "kv": 0.0}
        self.failure: BaseException | None = None
        self.stopped = asyncio.Event()
        self.app = self._build_app()

    # --- clocks --------------------------------------------------------------------------------
    def sim_time(self, wall: float) -> float:
        return (wall - self._t0) * self.ts

    def wall_time(self, sim: float) -> float:
        return self._t0 + sim / self.ts

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the socket and start the step loop and reporters (the API answers 503 until `mark_ready`)."""
        self._loop = asyncio.get_running_loop()
        self._t0 = self._now()
        # Streams stalled by the stopped step loop would hold a graceful shutdown for its default 60 s.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.options.host, self.options.port, backlog=1024, reuse_address=True)
        await site.start()
        self._tasks.append(asyncio.create_task(self._step_loop(), name="twin-step-loop"))
        if self.options.activity_file:
            self._tasks.append(asyncio.create_task(self._activity_loop(), name="twin-gpu-activity"))
        if self.options.stats_log_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._stats_loop(), name="twin-stats-log"))

    @property
    def bound_port(self) -> int:
        assert self._runner is not None
        for site in self._runner.sites:
            server = getattr(site, "_server", None)
            if server is not None and server.sockets:
                return int(server.sockets[0].getsockname()[1])
        return self.options.port

    def mark_ready(self) -> None:
        self.ready = True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._runner is not None:
            await self._runner.cleanup()
        self.stopped.set()

    # --- the step loop -------------------------------------------------------------------------
    async def _step_loop(self) -> None:
        loop = self._now
        while True:
            if not self.engine.has_work():
                self._deadline = None
                self._work.clear()
                self._publish_idle()
                await self._work.wait()
                continue
            wall = loop()
            if self._deadline is None:  # from idle: the GPU starts at the first arrival, not when the host woke
                start = self.sim_time(wall) if self._idle_arrival is None else self._idle_arrival
                self._deadline, self._sim_deadline, self._idle_arrival = self.wall_time(start), start, None
            if wall - self._deadline > MAX_LAG_S:
                self.timing.restarts += 1
                self._deadline, self._sim_deadline = wall, self.sim_time(wall)
            sim_start = self._sim_deadline
            try:
                out = self.engine.step(sim_start)
            except Exception as exc:  # noqa: BLE001 - the engine dying is the server dying
                self._die(exc)
                return
            if out is None:  # work that cannot be scheduled (nothing fits): wait for an arrival or abort
                self._deadline = None
                self._work.clear()
                await self._work.wait()
                continue
            # Advanced in simulated seconds: an idle wait of `ready - now` then ends exactly at `ready`.
            sim_end = sim_start + out.duration_s
            wall_duration = out.duration_s / self.ts
            deadline = self.wall_time(sim_end)
            self._deadline, self._sim_deadline = deadline, sim_end
            await _sleep_until(loop, deadline)
            actual = loop()
            self.timing.record(wall_duration, actual - deadline)
            self._activity.add(out, wall_duration)
            self._deliver(out, sim_end)

    def _die(self, exc: BaseException) -> None:
        self.failure = exc
        text = str(exc)
        self._emit_log("ERROR", "core.py:700", f"EngineCore encountered a fatal error.\n{text}")
        if self.options.termination_message_path:
            _write_text(self.options.termination_message_path, text[-4000:])
        from batchtune.twin.memory import RuntimeOutOfMemory

        if isinstance(exc, RuntimeOutOfMemory) and self.options.exit_on_runtime_oom:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # the kernel OOM killer's signal: the parent sees 137
        for stream in list(self._streams.values()):  # end the open responses instead of leaving them hanging
            stream.done = True
            stream.queue.put_nowait(True)
        self._streams.clear()
        self.stopped.set()

    def _deliver(self, out: Any, sim_end: float) -> None:
        m = self.metrics
        # vLLM's generation_tokens counts every sampled token, the first ones (after prefill) too.
        m.observe_step(int(out.prompt_tokens), len(out.emitted), int(out.preempted),
                       int(out.prompt_tokens) + int(out.decode_tokens))
        m.set_scheduler_state(int(out.num_running), int(out.num_waiting), float(out.kv_usage))
        st = self._stats
        st["prompt"] += int(out.prompt_tokens)
        st["generation"] += len(out.emitted)
        st["preempted"] += int(out.preempted)
        st["running"], st["waiting"], st["kv"] = int(out.num_running), int(out.num_waiting), float(out.kv_usage)
        itl = m.inter_token_latency
        for event in out.emitted:
            stream = self._streams.get(event.req_id)
            if stream is None or stream.done:
                continue
            stream.generated += 1
            if stream.generated == 1:
                stream.first_sim = sim_end
                m.time_to_first_token.observe(sim_end - stream.arrival_sim)
            else:
                itl.observe(sim_end - stream.last_sim)
            stream.last_sim = sim_end
            finished = bool(event.finished) or stream.generated >= stream.max_tokens
            if finished and not event.finished:
                self.engine.abort(event.req_id)
            if finished:
                stream.done = True
                self._streams.pop(stream.req_id, None)
                self._observe_finished(stream, stream.reason_at_end)
            stream.queue.put_nowait(finished)

    def _observe_finished(self, stream: _Stream, reason: str) -> None:
        # The engine does not report scheduling times: the first step's share is "prefill".
        e2e = stream.last_sim - stream.arrival_sim
        ttft = stream.first_sim - stream.arrival_sim
        self.metrics.observe_finished(
            finished_reason=reason,
            prompt_tokens=stream.prompt_tokens,
            generation_tokens=stream.generated,
            e2e_s=e2e,
            queue_s=max(0.0, ttft * 0.5) if stream.generated else e2e,
            prefill_s=ttft * 0.5 if stream.generated else 0.0,
            decode_s=max(0.0, stream.last_sim - stream.first_sim),
        )

    def _publish_idle(self) -> None:
        self.metrics.set_scheduler_state(0, 0, 0.0)

    # --- requests -------------------------------------------------------------------------------
    def submit(self, prompt_tokens: int, max_tokens: int, reason_at_end: str = "length") -> _Stream:
        """Add a request to the engine and return its stream (tokens arrive on `stream.queue`)."""
        wall = self._now()
        # A request that arrives while the loop is late counts as arriving at the next step start.
        arrival = self.sim_time(wall) if self._deadline is None else min(self.sim_time(wall), self._sim_deadline)
        if self._deadline is None and self._idle_arrival is None:
            self._idle_arrival = arrival
        req_id = f"req-{next(self._ids)}"
        stream = _Stream(req_id, prompt_tokens, max_tokens, reason_at_end, arrival)
        self._streams[req_id] = stream
        self.metrics.observe_request_start(max_tokens)
        self.engine.add_request(req_id, prompt_tokens, max_tokens, arrival)
        self._work.set()
        return stream

    def abort(self, stream: _Stream) -> None:
        if stream.done:
            return
        stream.done = True
        self._streams.pop(stream.req_id, None)
        self.engine.abort(stream.req_id)
        self.metrics.request_success["abort"].inc()
        self._work.set()

    # --- HTTP -----------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ping", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/twin/timing", self._timing)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    def _not_ready(self) -> web.Response | None:
        if self.failure is not None:
            return web.json_response({"error": "engine dead"}, status=500)
        if not self.ready:
            return web.json_response({"status": "loading"}, status=503)
        return None

    async def _health(self, _request: web.Request) -> web.Response:
        return self._not_ready() or web.Response(status=200)

    async def _version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def _timing(self, request: web.Request) -> web.Response:
        summary = self.timing.summary()
        if request.query.get("reset"):  # benchmarks drop the warm-up
            self.timing = StepTiming()
        return web.json_response(summary)

    async def _models(self, _request: web.Request) -> web.Response:
        blocked = self._not_ready()
        if blocked:
            return blocked
        name = self.options.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.options.root_model or name,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    def _parse(self, body: Any, chat: bool) -> tuple[int, int, str, bool, bool, int]:
        """(prompt_tokens, tokens to generate, finish reason, stream, include_usage, seed for text)."""
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in (self.options.served_model_name, self.options.root_model):
            raise OpenAIError(404, f"The model `{model}` does not exist. Valid aliases: "
                              f"{self.options.served_model_name}.", "NotFoundError", param="model")
        prompt_tokens, key, token_ids = _chat_prompt(body) if chat else _completion_prompt(body)
        max_tokens = self._max_tokens(body, chat, prompt_tokens, token_ids)
        stream = bool(body.get("stream", False))
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage", False)) if isinstance(options, dict) else False
        seed = zlib.crc32(key.encode("utf-8", "replace"))
        reason = "length"
        if not body.get("ignore_eos", False):
            low, high = NATURAL_LENGTH_RANGE
            natural = low + seed % (high - low + 1)
            if natural < max_tokens:
                max_tokens, reason = natural, "stop"
        return prompt_tokens, max_tokens, reason, stream, include_usage, seed

    def _max_tokens(self, body: dict[str, Any], chat: bool, prompt_tokens: int, token_ids: bool) -> int:
        """The tokens to generate as vLLM bounds them by max-model-len, refusing what vLLM refuses."""
        max_param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        raw_max = body.get(max_param)
        limit = self.max_model_len
        if raw_max is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if not chat else limit - prompt_tokens
        elif isinstance(raw_max, int) and not isinstance(raw_max, bool) and raw_max >= 1:
            max_tokens = raw_max
        else:
            raise OpenAIError(400, f"{max_param} must be at least 1, got {raw_max!r}.", param=max_param, value=raw_max)
        # vLLM 0.32: max_tokens alone over max-model-len is refused; a prompt over it is refused (a text prompt
        # is tokenized up to max-model-len + 1 tokens, hence "at least"); prompt + max_tokens over it is not:
        # max_tokens is lowered to what fits (finish_reason "length").
        if max_tokens > limit:
            raise OpenAIError(400, f"{max_param}={max_tokens} cannot be greater than max_model_len={limit}. "
                              "Please request fewer output tokens.", param=max_param, value=max_tokens)  # fmt: skip
        if prompt_tokens > limit:
            shown, qualifier = (prompt_tokens, "") if token_ids else (limit + 1, "at least ")
            raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                              f"contains {qualifier}{shown} input tokens, which exceeds this limit even without any "
                              "output tokens. Please reduce the length of the input prompt.", param="input_tokens",
                              value=shown)  # fmt: skip
        max_tokens = min(max_tokens, limit - prompt_tokens)
        if max_tokens < 1:
            raise OpenAIError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens",
                              value=max_tokens)  # fmt: skip
        return max_tokens

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        blocked = self._not_ready()
        if blocked:
            return blocked
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return OpenAIError(400, "request body is not valid JSON").response()
        try:
            prompt_tokens, max_tokens, reason, streaming, include_usage, seed = self._parse(body, chat)
        except OpenAIError as exc:
            return exc.response()
        try:
            stream = self.submit(prompt_tokens, max_tokens, reason)
        except ValueError as exc:  # the engine's RequestTooLong and input checks
            return OpenAIError(400, str(exc)).response()
        fmt = _ChunkFormat(chat, self.options.served_model_name, seed)
        try:
            if streaming:
                return await self._stream_response(request, stream, fmt, include_usage, reason)
            return await self._whole_response(stream, fmt, reason)
        finally:
            if not stream.done:
                self.abort(stream)

    async def _whole_response(self, stream: _Stream, fmt: _ChunkFormat, reason: str) -> web.Response:
        while not await stream.queue.get():
            pass
        text = "".join(fmt.token_text(i) for i in range(stream.generated))
        return web.json_response(fmt.whole(text, reason, stream.prompt_tokens, stream.generated))

    async def _stream_response(
        self, request: web.Request, stream: _Stream, fmt: _ChunkFormat, include_usage: bool, reason: str
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            await self._write_stream(resp, stream, fmt, include_usage, reason)
        except ConnectionResetError:  # the client went away mid-stream: the caller aborts the request
            pass
        return resp

    async def _write_stream(
        self, resp: web.StreamResponse, stream: _Stream, fmt: _ChunkFormat, include_usage: bool, reason: str
    ) -> None:
        if chat_first := fmt.role_chunk():
            await resp.write(chat_first)
        sent = 0
        finished = False
        queue = stream.queue
        while not finished:
            finished = await queue.get()
            while not finished and not queue.empty():  # a slow reader gets the backlog in one write
                finished = queue.get_nowait()
            # Count tokens, not wake-ups: a dying engine wakes the stream without a token.
            new_tokens = stream.generated - sent
            parts = []
            for _ in range(new_tokens):
                is_last = finished and sent == stream.generated - 1
                parts.append(fmt.token_chunk(sent, reason if is_last else None))
                sent += 1
            if parts:
                await resp.write(b"".join(parts))
        tail = []
        if include_usage:
            tail.append(fmt.usage_chunk(stream.prompt_tokens, stream.generated))
        tail.append(b"data: [DONE]\n\n")
        await resp.write(b"".join(tail))
        await resp.write_eof()

    # --- reporters ------------------------------------------------------------------------------
    async def _activity_loop(self) -> None:
        path = self.options.activity_file
        assert path
        last = self._now()
        while True:
            await asyncio.sleep(self.options.activity_interval_s)
            now = self._now()
            elapsed = max(now - last, 1e-6)
            last = now
            try:
                write_activity(path, self.activity_snapshot(elapsed))
            except OSError as exc:
                self._emit_log("WARNING", "twin", f"Could not write GPU activity to {path}: {exc}")

    def activity_snapshot(self, elapsed: float) -> list[dict[str, Any]]:
        """The GPU entries for the last `elapsed` wall seconds, and reset the accumulators."""
        acc, self._activity = self._activity, _Activity()
        busy = min(acc.busy, elapsed)
        scale = 1.0 / max(acc.busy, elapsed)
        gpu = getattr(self.cfg, "gpu", None)
        idle_w = float(getattr(gpu, "idle_w", 60.0))
        fb_used = float(getattr(self.engine, "fb_used_mib", 0) or 0) if self.ready else 0.0
        idle_fraction = max(0.0, 1.0 - busy / elapsed)
        entry = {
            "gpu_util_pct": 100.0 * busy / elapsed,
            "sm_active": acc.sm_active * scale,
            "sm_occupancy": acc.sm_occupancy * scale,
            "tensor_active": acc.tensor_active * scale,
            "dram_active": acc.dram_active * scale,
            "fb_used_mib": fb_used,
            "power_w": acc.power * scale + idle_w * idle_fraction,
        }
        return [{"index": i, **entry} for i in range(max(1, self.options.gpu_count))]

    async def _stats_loop(self) -> None:
        interval = self.options.stats_log_interval_s
        while True:
            await asyncio.sleep(interval)
            st = self._stats
            if not (st["prompt"] or st["generation"] or st["running"] or st["waiting"]):
                continue
            sim_interval = interval * self.ts
            line = (
                f"Engine 000: Avg prompt throughput: {st['prompt'] / sim_interval:.1f} tokens/s, "
                f"Avg generation throughput: {st['generation'] / sim_interval:.1f} tokens/s, "
                f"Running: {st['running']} reqs, Waiting: {st['waiting']} reqs, "
            )
            if st["preempted"]:
                line += f"Preemptions: {st['preempted']}, "
            line += f"GPU KV cache usage: {100 * st['kv']:.1f}%, Prefix cache hit rate: 0.0%"
            self._emit_log("INFO", "loggers.py:127", line)
            st.update(prompt=0, generation=0, preempted=0)
            if not self.engine.has_work():
                st.update(running=0, waiting=0, kv=0.0)


class _ChunkFormat:
    """Pre-encoded JSON pieces of vLLM's response chunks for one request."""

    def __init__(self, chat: bool, model: str, seed: int):
        self.chat = chat
        self.seed = seed
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.rid, self.created, self.model = rid, created, model
        self.head = (
            '{"id":' + json.dumps(rid) + ',"object":"' + obj + '","created":' + str(created)
            + ',"model":' + json.dumps(model) + ',"choices":['
        )  # fmt: skip

    def token_text(self, index: int) -> str:
        return filler_token_text(index, self.seed)

    def role_chunk(self) -> bytes | None:
        if not self.chat:
            return None
        choice = '{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}'
        return ("data: " + self.head + choice + "]}\n\n").encode()

    def token_chunk(self, index: int, finish_reason: str | None) -> bytes:
        text = json.dumps(self.token_text(index))
        reason = "null" if finish_reason is None else f'"{finish_reason}"'
        if self.chat:
            choice = '{"index":0,"delta":{"content":' + text + '},"logprobs":null,"finish_reason":' + reason + "}"
        else:
            choice = ('{"index":0,"text":' + text + ',"logprobs":null,"finish_reason":' + reason
                      + ',"stop_reason":null}')  # fmt: skip
        return ("data: " + self.head + choice + "]}\n\n").encode()

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = _usage(prompt_tokens, completion_tokens)
        return ("data: " + self.head + '],"usage":' + json.dumps(usage, separators=(",", ":")) + "}\n\n").encode()

    def whole(self, text: str, reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None,
                      "prompt_logprobs": None}  # fmt: skip
            obj = "text_completion"
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": _usage(prompt_tokens, completion_tokens),
        }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


async def _sleep_until(clock: Callable[[], float], deadline: float) -> None:
    """Sleep to an absolute deadline; the last couple of ms by yielding, since epoll rounds up to 1 ms."""
    remaining = deadline - clock()
    if remaining > SPIN_BEFORE_DEADLINE_S:
        await asyncio.sleep(remaining - SPIN_BEFORE_DEADLINE_S)
    while clock() < deadline:
        await asyncio.sleep(0)


def _print_log(level: str, source: str, message: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"{level} {stamp} [{source}] {message}", flush=True)


def _write_text(path: str, text: str) -> None:
    try:
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError:
        pass


def _chat_prompt(body: dict[str, Any]) -> tuple[int, str, bool]:
    """(prompt tokens with the chat template's, the text the reply's seed is drawn from, False: not token ids)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages: a non-empty list is required")
    text_tokens = 0
    joined = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):  # content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        content = content or ""
        joined.append(content)
        text_tokens += count_text_tokens(content) if content.strip() else 0
    prompt_tokens = text_tokens + CHAT_TEMPLATE_TOKENS_PER_MESSAGE * len(messages) + CHAT_TEMPLATE_TOKENS_FIXED
    return prompt_tokens, "\n".join(joined), False


def _completion_prompt(body: dict[str, Any]) -> tuple[int, str, bool]:
    """(prompt tokens, the text the reply's seed is drawn from, whether the prompt is token ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    token_ids = isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
    if isinstance(prompt, str):
        return (count_text_tokens(prompt) if prompt.strip() else 1), prompt, token_ids
    if isinstance(prompt, list) and token_ids:
        return len(prompt), ",".join(map(str, prompt[:64])), token_ids
    raise OpenAIError(400, "prompt: a string, or a list of token ids, is required (batches unsupported)")
