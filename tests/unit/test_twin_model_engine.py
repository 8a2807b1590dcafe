"""The V1 scheduler inside the twin engine: limits, budget, decode-first, preemption, determinism."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchtune.twin.config import ServeConfig
from batchtune.twin.engine import RequestTooLong, SimEngine


def _drain(engine: SimEngine, now: float = 0.0, max_steps: int = 100_000) -> tuple[float, list]:
    outcomes = []
    while engine.has_work() and len(outcomes) < max_steps:
        out = engine.step(now)
        assert out is not None
        outcomes.append(out)
        now += out.duration_s
    return now, outcomes


def _busy_step(engine: SimEngine, now: float):  # type: ignore[no-untyped-def]
    """The next step that ran on the GPU (skips waits for the API server's input processing)."""
    while True:
        out = engine.step(now)
        assert out is not None
        if out.prompt_tokens or out.decode_tokens:
            return out, now + out.duration_s
        now += out.duration_s


def test_running_never_exceeds_max_num_seqs_and_budget_holds() -> None:
    cfg = ServeConfig(model="Llama-3.1-8B", gpu="H100", max_num_seqs=16, max_num_batched_tokens=1024)
    engine = SimEngine(cfg)
    for i in range(64):
        engine.add_request(f"r{i}", 700, 20, 0.0)
    _, outcomes = _drain(engine)
    assert max(o.num_running for o in outcomes) == 16
    assert all(o.prompt_tokens + o.decode_tokens <= 1024 for o in outcomes)
    assert sum(1 for o in outcomes for e in o.emitted if e.finished) == 64


def test_every_request_gets_exactly_max_tokens() -> None:
    engine = SimEngine(ServeConfig(model="Qwen2.5-0.5B", gpu="L4", max_num_seqs=8))
    wanted = {f"r{i}": 5 + i for i in range(20)}
    for req_id, n in wanted.items():
        engine.add_request(req_id, 100 + 10 * int(req_id[1:]), n, 0.0)
    _, outcomes = _drain(engine)
    counts: dict[str, int] = {}
    for out in outcomes:
        for event in out.emitted:
            counts[event.req_id] = counts.get(event.req_id, 0) + 1
            assert event.first == (counts[event.req_id] == 1)
            assert event.finished == (counts[event.req_id] == wanted[event.req_id])
    assert counts == wanted


def test_decodes_are_scheduled_before_new_prefills() -> None:
    engine = SimEngine(ServeConfig(model="Llama-3.1-8B", gpu="H100", max_num_batched_tokens=2048))
    engine.add_request("old", 100, 50, 0.0)
    first, now = _busy_step(engine, 0.0)
    assert first.emitted[0].first
    engine.add_request("new", 4000, 10, now)
    second, now = _busy_step(engine, now)
    while not second.prompt_tokens:  # "new" is still being tokenized by the API server
        second, now = _busy_step(engine, now)
    # the running request decodes (1 token) and the new prompt gets the rest of the budget, chunked
    assert second.decode_tokens == 1 and second.prompt_tokens == 2047
    assert [e.req_id for e in second.emitted] == ["old"]


def test_preemption_recomputes_newest_and_blocks_admission() -> None:
    # A tiny pool: L4 + Llama-3.1-8B at max_model_len 4096 gives a few thousand tokens of KV.
    cfg = ServeConfig(model="Llama-3.1-8B", gpu="L4", gpu_memory_utilization=0.83, max_model_len=4096)
    engine = SimEngine(cfg)
    pool = engine.memory.kv_cache_tokens
    n = pool // 1000 + 4
    for i in range(n):
        engine.add_request(f"r{i}", 500, 1500, 0.0)
    _, outcomes = _drain(engine)
    preempting = [o for o in outcomes if o.preempted]
    assert preempting, f"expected preemptions with a {pool}-token pool"
    assert engine.num_preemptions == sum(o.preempted for o in outcomes)
    assert all(o.kv_usage <= 1.0 for o in outcomes)
    assert sum(1 for o in outcomes for e in o.emitted if e.finished) == n


def test_request_longer_than_max_model_len_is_rejected() -> None:
    engine = SimEngine(ServeConfig(model="Llama-2-7B", gpu="A100-80GB"))
    with pytest.raises(RequestTooLong, match="maximum context length is 4096 tokens"):
        engine.add_request("x", 4000, 200, 0.0)


def test_abort_frees_blocks() -> None:
    engine = SimEngine(ServeConfig(model="Llama-3.1-8B", gpu="H100"))
    engine.add_request("a", 3000, 100, 0.0)
    _busy_step(engine, 0.0)
    assert engine.free_blocks < engine.memory.num_gpu_blocks
    assert engine.abort("a") and not engine.has_work()
    assert engine.free_blocks == engine.memory.num_gpu_blocks
    assert engine.step(1.0) is None


def test_signals_are_in_range_and_fb_is_flat() -> None:
    engine = SimEngine(ServeConfig(model="Llama-3.1-8B", gpu="H100"))
    for i in range(32):
        engine.add_request(str(i), 512, 64, 0.0)
    _, outcomes = _drain(engine)
    gpu = engine.cfg.gpu
    for o in outcomes:
        assert 0 <= o.sm_occupancy <= o.sm_active <= 1 and 0 <= o.dram_active <= 1 and 0 <= o.tensor_active <= 1
        assert gpu.idle_w <= o.power_w <= gpu.tdp_w
    prefill_step = max(outcomes, key=lambda o: o.prompt_tokens)
    decode_step = outcomes[-2]
    assert prefill_step.prompt_tokens >= 512 and decode_step.prompt_tokens == 0
    assert prefill_step.tensor_active > decode_step.tensor_active
    assert decode_step.dram_active > prefill_step.dram_active
    assert engine.fb_used_mib == engine.memory.fb_used_mib


@settings(max_examples=25, deadline=None)
@given(seqs=st.integers(1, 64), budget_extra=st.integers(0, 4096),
       reqs=st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 300)), min_size=1, max_size=40))
def test_scheduler_invariants(seqs: int, budget_extra: int, reqs: list[tuple[int, int]]) -> None:
    cfg = ServeConfig(model="Qwen2.5-0.5B", gpu="L4", max_num_seqs=seqs, max_num_batched_tokens=seqs + budget_extra,
                      max_model_len=4096, gpu_memory_utilization=0.3)
    engine = SimEngine(cfg)
    for i, (prompt, out) in enumerate(reqs):
        engine.add_request(str(i), prompt, out, 0.0)
    _, outcomes = _drain(engine)
    assert sum(1 for o in outcomes for e in o.emitted if e.finished) == len(reqs)
    for o in outcomes:
        assert o.num_running <= seqs
        assert o.prompt_tokens + o.decode_tokens <= cfg.max_num_batched_tokens
        assert o.duration_s > 0
    assert engine.free_blocks == engine.memory.num_gpu_blocks


def test_same_seed_same_trajectory() -> None:
    def run() -> list[float]:
        engine = SimEngine(ServeConfig(model="Llama-3.1-8B", gpu="A100-80GB"), seed=3, jitter=0.05)
        for i in range(20):
            engine.add_request(str(i), 300 + i, 40, 0.0)
        return [o.duration_s for o in _drain(engine)[1]]
    assert run() == run()
