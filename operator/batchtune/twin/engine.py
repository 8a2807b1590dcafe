"""The vLLM V1 engine core, simulated: scheduler, KV block pool and step-time model.

Clock-agnostic: callers pass `now` into `add_request`/`step` and decide what a step's
`duration_s` means (the real-time server sleeps it; `predict` advances a virtual clock).

Scheduling follows `vllm/v1/core/sched/scheduler.py` (FCFS):
- RUNNING requests first, in admission order, each taking what it still needs (1 token when
  decoding, the rest of its prompt when prefilling) from the per-step token budget; a prompt
  longer than the remaining budget is chunked.
- When the block pool cannot hold a running request's new tokens, the newest running request is
  preempted (recompute: its blocks are freed, its progress reset, it goes to the FRONT of the
  waiting queue), repeatedly, until the allocation fits.
- WAITING requests are admitted while budget remains, fewer than `max_num_seqs` run and their
  blocks fit, and only in a step without preemptions.
Prefix caching is not modelled (random prompts, as `vllm bench serve --dataset-name random`).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from batchtune.twin.config import ServeConfig
from batchtune.twin.memory import (
    MemoryPlan,
    RuntimeOutOfMemory,
    StartupFailure,
    cudagraph_capture_sizes,
    plan_memory,
    weight_bytes,
)
from batchtune.twin.perf import StepCost, StepCostModel, nominal_params

if TYPE_CHECKING:
    from batchtune.twin.params import TwinParams

__all__ = ["SimEngine", "StepOutcome", "TokenEvent", "RequestTooLong", "StartupFailure", "RuntimeOutOfMemory"]


class RequestTooLong(ValueError):
    """A request whose prompt plus max_tokens exceeds max_model_len (vLLM answers HTTP 400)."""


class TokenEvent(NamedTuple):
    req_id: str
    first: bool
    finished: bool


@dataclass(frozen=True, slots=True)
class StepOutcome:
    duration_s: float
    """Simulated (unscaled) wall time of the step."""
    emitted: tuple[TokenEvent, ...]
    num_running: int
    num_waiting: int
    kv_usage: float
    preempted: int
    prompt_tokens: int
    decode_tokens: int
    sm_active: float
    sm_occupancy: float
    tensor_active: float
    dram_active: float
    power_w: float


class _Request:
    __slots__ = ("req_id", "prompt", "max_tokens", "arrival", "ready", "computed", "output", "blocks", "new",
                 "t_first", "t_last", "preemptions", "data")

    def __init__(self, req_id: str, prompt: int, max_tokens: int, arrival: float):
        self.req_id = req_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.ready = arrival  # when the API server has handed it to the engine core
        self.computed = 0  # tokens whose KV is in the cache
        self.output = 0  # tokens generated so far
        self.blocks = 0
        self.new = 0  # tokens scheduled in the current step
        self.t_first = -1.0
        self.t_last = -1.0
        self.preemptions = 0
        self.data: object = None  # caller's bookkeeping (predict keeps its per-request record here)


class _Step(NamedTuple):
    """Internal, allocation-light result of one step (predict reads this directly)."""

    duration: float
    t_end: float
    emitted: list[_Request]  # that produced a token, in schedule order
    finished: list[_Request]  # that finished this step
    contiguous: int  # non-first tokens whose previous token came from the previous step
    gaps: list[float]  # inter-token gaps (s) of non-first tokens that are not contiguous
    preempted: int
    prompt_tokens: int
    decode_tokens: int
    t_gpu: float
    nbytes: float
    flops: float
    idle: bool = False
    """True for a wait while requests are still in the API server (nothing ran on the GPU)."""


class _Batch:
    """One step's schedule while it is built: the token budget and KV blocks left, what runs, and its work."""

    __slots__ = ("budget", "free", "scheduled", "preempted", "prompt_tokens", "decode_tokens", "kv_read", "attn_qk",
                 "prefilling")

    def __init__(self, budget: int, free: int) -> None:
        self.budget = budget
        self.free = free
        self.scheduled: list[_Request] = []
        self.preempted = 0
        self.prompt_tokens = 0
        self.decode_tokens = 0
        self.kv_read = 0
        self.attn_qk = 0.0
        self.prefilling = 0


class SimEngine:
    """vLLM V1 engine core + GPU, simulated, on a virtual or real clock (`batchtune.engines.Engine` is something else:
    the adapter that reads and writes a real engine's command line). Raises StartupFailure if `cfg` cannot boot.

    `params`: a deployment's own figures (`batchtune.twin.params`); None is the catalog's twin."""

    def __init__(self, cfg: ServeConfig, seed: int = 0, jitter: float = 0.0, params: TwinParams | None = None):
        self.cfg = cfg
        self.params = params = params or nominal_params()
        self.memory: MemoryPlan = plan_memory(cfg, params)
        self.fb_used_mib: int = self.memory.fb_used_mib
        sizes = cudagraph_capture_sizes(cfg)
        self._cost: StepCost = params.generic if params.generic is not None else \
            StepCostModel.for_config(cfg, weight_bytes(cfg), max(sizes) if sizes else 0, params)
        self._frontend_per_request = params.frontend_per_request_s
        self._frontend_per_token = params.frontend_per_prompt_token_s
        self._max_prefills = params.max_prefills_per_step
        self._rng = random.Random(seed)
        self._jitter = jitter
        self._block = cfg.block_size
        self._budget = cfg.max_num_batched_tokens
        self._max_seqs = cfg.max_num_seqs
        self._chunked = cfg.enable_chunked_prefill
        self._total_blocks = self.memory.num_gpu_blocks
        self.free_blocks = self.memory.num_gpu_blocks
        self.running: list[_Request] = []
        self.waiting: deque[_Request] = deque()
        self._by_id: dict[str, _Request] = {}
        self._last_step_end = float("-inf")
        self._frontend_free = float("-inf")
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_tokens: int, max_tokens: int, now: float) -> None:
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(f"prompt_tokens and max_tokens must be >= 1, got {prompt_tokens}, {max_tokens}")
        limit = self.cfg.max_model_len
        if prompt_tokens + max_tokens > limit:
            raise RequestTooLong(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.")
        if req_id in self._by_id:
            raise ValueError(f"duplicate req_id {req_id!r}")
        self._add(_Request(req_id, prompt_tokens, max_tokens, now))

    def _add(self, req: _Request) -> None:
        """Queue a validated request behind the API server's input processing (one FIFO CPU)."""
        start = req.arrival if req.arrival > self._frontend_free else self._frontend_free
        req.ready = start + self._frontend_per_request + self._frontend_per_token * req.prompt
        self._frontend_free = req.ready
        self._by_id[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str) -> bool:
        req = self._by_id.pop(req_id, None)
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self.free_blocks += req.blocks
            req.blocks = 0
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        """vLLM's `1 - free/(num_gpu_blocks - 1)` (one block is the reserved null block)."""
        usable = max(1, self._total_blocks - 1)
        return min(1.0, (self._total_blocks - self.free_blocks) / usable)

    # ---- one engine step --------------------------------------------------------------------------
    def step(self, now: float) -> StepOutcome | None:
        """Schedule and run one step starting at `now`; None when there is nothing to do."""
        result = self._run(now)
        if result is None:
            return None
        emitted = tuple(TokenEvent(r.req_id, r.output == 1, r.output >= r.max_tokens) for r in result.emitted)
        if result.idle:
            sm = occ = tensor = dram = 0.0
            power = self.cfg.gpu.idle_w
        else:
            sm, occ, tensor, dram, power = self._cost.signals(result.duration, result.t_gpu, result.nbytes,
                                                              result.flops)
        return StepOutcome(
            duration_s=result.duration, emitted=emitted, num_running=len(self.running),
            num_waiting=len(self.waiting), kv_usage=self.kv_usage, preempted=result.preempted,
            prompt_tokens=result.prompt_tokens, decode_tokens=result.decode_tokens, sm_active=sm,
            sm_occupancy=occ, tensor_active=tensor, dram_active=dram, power_w=power)

    def _run(self, now: float) -> _Step | None:
        running = self.running
        waiting = self.waiting
        if not running and not waiting:
            return None
        batch = _Batch(self._budget, self.free_blocks)
        self._schedule_running(batch)
        if not batch.preempted:
            self._admit_waiting(batch, now)
        scheduled, prompt_tokens, decode_tokens = batch.scheduled, batch.prompt_tokens, batch.decode_tokens
        preempted = batch.preempted
        self.free_blocks = batch.free
        if not scheduled:
            if waiting and not running and waiting[0].ready > now:
                # The engine waits for the API server to hand over the next request.
                wait = waiting[0].ready - now
                return _Step(wait, now + wait, [], [], 0, [], 0, 0, 0, 0.0, 0.0, 0.0, True)
            return None
        num_tokens = prompt_tokens + decode_tokens
        oom_at = self.memory.runtime_oom_tokens
        if oom_at is not None and num_tokens >= oom_at:
            raise RuntimeOutOfMemory(self.memory.runtime_oom_message(num_tokens))
        duration, t_gpu, nbytes, flops = self._cost.step_time(num_tokens, len(scheduled), batch.kv_read,
                                                              batch.attn_qk, prompt_tokens)
        if self._jitter:
            duration *= max(0.2, 1.0 + self._rng.gauss(0.0, self._jitter))
        t_end = now + duration
        emitted, finished, contiguous, gaps = self._emit(scheduled, t_end)
        if finished:
            for r in finished:
                self.free_blocks += r.blocks
                r.blocks = 0
                del self._by_id[r.req_id]
            self.running = [r for r in running if r.output < r.max_tokens]
        self._last_step_end = t_end
        self.num_preemptions += preempted
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += len(emitted)
        return _Step(duration, t_end, emitted, finished, contiguous, gaps, preempted, prompt_tokens,
                     decode_tokens, t_gpu, nbytes, flops)

    def _schedule_running(self, batch: _Batch) -> None:
        """vLLM's first pass: the running requests in order, each its next tokens within the budget; short of KV
        blocks, the newest running requests are preempted (back to the waiting queue's front, recomputed later)."""
        running, waiting = self.running, self.waiting
        bs = self._block
        budget, free, scheduled = batch.budget, batch.free, batch.scheduled
        preempted = prompt_tokens = decode_tokens = kv_read = prefilling = 0
        attn_qk = 0.0
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            computed = r.computed
            num_new = r.prompt + r.output - computed
            if num_new > budget:
                num_new = budget
            need = (computed + num_new + bs - 1) // bs - r.blocks
            if need > 0:
                if need > free:
                    self_preempted = False
                    while need > free:
                        victim = running.pop()  # the newest running request
                        free += victim.blocks
                        victim.blocks = 0
                        victim.computed = 0
                        victim.preemptions += 1
                        preempted += 1
                        waiting.appendleft(victim)
                        if victim is r:
                            self_preempted = True
                            break
                    if self_preempted:
                        break
                free -= need
                r.blocks += need
            r.new = num_new
            scheduled.append(r)
            budget -= num_new
            if num_new == 1 and computed >= r.prompt:
                decode_tokens += 1
                kv_read += computed + 1
                attn_qk += computed + 1
            else:
                prompt_tokens += num_new
                kv_read += computed + num_new
                attn_qk += num_new * (computed + num_new * 0.5)
                prefilling += 1
            i += 1
        batch.budget, batch.free = budget, free
        batch.preempted, batch.prompt_tokens, batch.decode_tokens = preempted, prompt_tokens, decode_tokens
        batch.kv_read, batch.attn_qk, batch.prefilling = kv_read, attn_qk, prefilling

    def _admit_waiting(self, batch: _Batch, now: float) -> None:
        """vLLM's second pass, only in a step that preempted nothing: waiting requests join while the budget,
        max-num-seqs, the prefill limit and the free KV blocks allow."""
        running, waiting = self.running, self.waiting
        bs = self._block
        budget, free, scheduled = batch.budget, batch.free, batch.scheduled
        prompt_tokens, kv_read, attn_qk, prefilling = batch.prompt_tokens, batch.kv_read, batch.attn_qk, batch.prefilling
        max_seqs = self._max_seqs
        chunked = self._chunked
        max_prefills = self._max_prefills
        while waiting and budget > 0 and len(running) < max_seqs:
            if max_prefills is not None and prefilling >= max_prefills:
                break
            prefilling += 1
            r = waiting[0]
            if r.ready > now:
                break  # still in the API server (tokenization, request setup)
            num_new = r.prompt + r.output
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            need = (num_new + bs - 1) // bs
            if need > free:
                break
            waiting.popleft()
            running.append(r)
            free -= need
            r.blocks = need
            r.computed = 0
            r.new = num_new
            scheduled.append(r)
            budget -= num_new
            prompt_tokens += num_new
            kv_read += num_new
            attn_qk += num_new * num_new * 0.5
        batch.budget, batch.free = budget, free
        batch.prompt_tokens, batch.kv_read, batch.attn_qk, batch.prefilling = prompt_tokens, kv_read, attn_qk, prefilling

    def _emit(self, scheduled: list[_Request], t_end: float) -> tuple[list[_Request], list[_Request], int, list[float]]:
        """The step's tokens: (requests that emitted one, those that finished, how many emitted right after the
        previous step, the gaps of those that waited longer)."""
        emitted: list[_Request] = []
        finished: list[_Request] = []
        gaps: list[float] = []
        contiguous = 0
        prev_end = self._last_step_end
        for r in scheduled:
            r.computed += r.new
            if r.computed == r.prompt + r.output:
                r.output += 1
                emitted.append(r)
                if r.output == 1:
                    r.t_first = t_end
                elif r.t_last == prev_end:
                    contiguous += 1
                else:
                    gaps.append(t_end - r.t_last)
                r.t_last = t_end
                if r.output >= r.max_tokens:
                    finished.append(r)
        return emitted, finished, contiguous, gaps
