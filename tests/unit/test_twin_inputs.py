"""What `batchtune twin calibrate` reads besides the figures: the measured KV pool (a /metrics scrape, the engine's
startup log, --metadata keys, a flag), the length spread (per-request lengths, the random range ratio, a closed
loop's default where nothing states it), and the careless files it refuses, each naming the file and the key."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from batchtune.cli import main
from batchtune.twin.config import ServeConfig
from batchtune.twin.observations import (
    CLOSED_LOOP_DEFAULT_SPREAD,
    Inputs,
    ObservationError,
    kv_pool_from_file,
    load_all,
    observation,
    parse_range_ratio,
)

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN_DIR = DATA / "golden" / "vllm-0.32.0-cpu"
GOLDEN = GOLDEN_DIR / "bench-result.json"
CPU = ["--model", "tiny-llama-v1", "--gpu", "CPU-node", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3",
       "--max-num-seqs", "8", "--enforce-eager"]
CFG = ServeConfig(model="tiny-llama-v1", gpu="CPU-node", max_num_seqs=8, max_model_len=2048, gpu_memory_utilization=0.3)


def result(**changes: object) -> dict:
    data = json.loads(GOLDEN.read_text())
    data.update(changes)
    return {k: v for k, v in data.items() if v is not ...}


def write(tmp_path: Path, name: str, content: object) -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def calibrate_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    code = main(["twin", "calibrate", *CPU, *argv, "-o", "json"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out) if captured.out.strip().startswith("{") else {}
    return code, doc, captured.err


# ---- careless files ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "message"), [
    pytest.param({"completed": 30, "failed": 970}, r"r\.json: key 'failed' is 970 of 1000 requests \(97%",
                 id="97-percent-failed"),
    pytest.param({"completed": 90, "failed": 10, "errors": ["", "Server disconnected"]},
                 r"key 'failed' is 10 of 100 requests \(10%.*the first error: 'Server disconnected'", id="10-percent"),
    pytest.param({"max_concurrency": ...}, r"r\.json: key 'max_concurrency' is missing, so the load is unknown",
                 id="no-max-concurrency"),
    pytest.param({"request_rate": ...}, r"r\.json: key 'request_rate' is missing.*one burst", id="no-request-rate"),
    pytest.param({"num_gpu_blocks": "4096"}, r"metadata key 'num_gpu_blocks' needs 'block_size'", id="blocks-alone"),
    pytest.param({"kv_cache_size_tokens": "lots"}, r"metadata key 'kv_cache_size_tokens' is 'lots'", id="bad-pool"),
    pytest.param({"random_range_ratio": "1.5"}, r"metadata key 'random_range_ratio' is '1.5'", id="bad-ratio"),
    pytest.param({"input_lens": [64, 64], "output_lens": [32]}, r"'input_lens' and 'output_lens' differ",
                 id="lens-differ"),
])
def test_careless_files_are_refused_naming_the_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            changes: dict, message: str) -> None:
    import re

    path = write(tmp_path, "r.json", result(**changes))
    code, _, err = calibrate_cli(capsys, "--observations", str(path))
    assert code == 2 and re.search(message, err), err


def test_a_few_failed_requests_are_a_note_not_a_refusal() -> None:
    obs = observation(result(completed=98, failed=2), CFG, "r.json")
    assert any("2 of 100 requests failed" in n for n in obs.notes)


def test_the_same_run_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = write(tmp_path, "a.json", result())
    copy = write(tmp_path, "b.json", result())
    code, _, err = calibrate_cli(capsys, "--observations", str(one), str(one))
    assert code == 2 and "a.json: given twice" in err
    code, _, err = calibrate_cli(capsys, "--observations", str(one), str(copy))
    assert code == 2 and "b.json: result b.json is the same as" in err and "a.json" in err
    both = write(tmp_path, "list.json", [result(), result()])
    with pytest.raises(ObservationError, match=r"result list.json\[1\] is the same as .*list.json\[0\]"):
        load_all([both], CFG)
    # two different runs at one load are not copies
    assert len(load_all([write(tmp_path, "c.json", [result(), result(duration=0.5)])], CFG)) == 2


def test_a_model_missing_from_the_catalog_at_tensor_parallel_2_gets_a_generic_fit(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["twin", "calibrate", "--model", "acme/secret-70b", "--gpu", "H100", "--tensor-parallel-size", "2",
                 "--max-num-seqs", "8", "--observations", str(GOLDEN), "-o", "json"])
    captured = capsys.readouterr()
    assert code in (0, 1), captured.err
    assert "attention heads" not in captured.err
    doc = json.loads(captured.out)
    assert doc["fit"] == "generic" and doc["setting"]["tensor_parallel_size"] == 2


# ---- the KV pool ---------------------------------------------------------------------------------------


def test_kv_pool_from_a_metrics_scrape_and_from_the_startup_log() -> None:
    tokens, note = kv_pool_from_file(GOLDEN_DIR / "metrics.txt", CFG)  # kv_cache_size_tokens="524288"
    assert tokens == 524288 and "vllm:cache_config_info" in note
    tokens, note = kv_pool_from_file(GOLDEN_DIR / "startup-ok.log")  # "CPU KV cache size: 524,288 tokens"
    assert tokens == 524288 and "startup log" in note


def test_kv_pool_labels_blocks_times_block_size_and_refusals(tmp_path: Path) -> None:
    scrape = write(tmp_path, "m.txt", 'vllm:cache_config_info{block_size="16",engine="0",'
                                      'gpu_memory_utilization="0.9",num_gpu_blocks="2000"} 1.0\n')
    gpu = ServeConfig(model="Llama-3.1-8B", gpu="H100")
    assert kv_pool_from_file(scrape, gpu)[0] == 32000
    with pytest.raises(ObservationError, match=r"m.txt: .*gpu_memory_utilization=\"0.9\", but the measured server ran "
                                               r"--gpu-memory-utilization 0.8: a scrape of another server"):
        kv_pool_from_file(scrape, gpu.replace(gpu_memory_utilization=0.8))
    two = write(tmp_path, "two.txt", 'vllm:cache_config_info{engine="0",kv_cache_size_tokens="100"} 1\n'
                                     'vllm:cache_config_info{engine="1",kv_cache_size_tokens="200"} 1\n')
    with pytest.raises(ObservationError, match="several KV pools"):
        kv_pool_from_file(two)
    with pytest.raises(ObservationError, match="neither a vllm:cache_config_info sample"):
        kv_pool_from_file(write(tmp_path, "x.txt", "vllm:num_requests_running 0\n"))


def test_the_measured_pool_reaches_the_fit_from_each_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = str(GOLDEN_DIR / "metrics.txt")
    pools = []
    for argv in (["--metrics", metrics], ["--kv-pool-tokens", "524288"], []):
        files = [str(GOLDEN)] if argv else [str(write(tmp_path, "m.json", result(kv_cache_size_tokens="524288")))]
        code, doc, err = calibrate_cli(capsys, *argv, "--observations", *files)
        assert code in (0, 1), err
        pools.append(doc["kvPoolTokens"])
        assert any("memory outside the KV pool" in n for n in doc["notes"]), doc["notes"]
    assert pools == [[524288]] * 3
    code, _, err = calibrate_cli(capsys, "--metrics", metrics, "--kv-pool-tokens", "5", "--observations", str(GOLDEN))
    assert code == 2 and "give one" in err


def test_a_measured_pool_sizes_the_cpu_twins_pool() -> None:
    from batchtune.twin.fit import _fit_memory
    from batchtune.twin.memory import plan_memory
    from batchtune.twin.params import TwinParams

    obs = observation(result(kv_cache_size_tokens="300000"), CFG, "r.json")
    notes: list[str] = []
    params = _fit_memory([obs], TwinParams(), notes, False, [])
    assert plan_memory(CFG, params).kv_cache_tokens == pytest.approx(300000, rel=0.001)


# ---- lengths ---------------------------------------------------------------------------------------------


def test_per_request_lengths_give_the_spread_and_failed_requests_are_left_out() -> None:
    ins = [40, 60, 80, 100, 120, 500]
    outs = [16, 24, 32, 40, 48, 0]
    obs = observation(result(input_lens=ins, output_lens=outs, errors=["", "", "", "", "", "timeout"],
                             max_concurrency=None, request_rate=5.0), CFG, "r.json")
    shape = obs.shape
    assert shape.input_len == pytest.approx(80) and shape.output_len == pytest.approx(32)
    # uniform +-r has std L r / sqrt 3: these five spread +-61 % in and +-61 % out
    assert shape.length_dist == "uniform" and shape.range_ratio == pytest.approx(0.612, abs=0.01)
    assert shape.output_ratio == pytest.approx(0.612, abs=0.01)
    assert any("per-request lengths of 5 requests" in n for n in obs.notes)


@pytest.mark.parametrize(("value", "expected"), [("0.3", (0.3, 0.3)), ('{"input": 0.2, "output": 0.5}', (0.2, 0.5)),
                                                 (0.25, (0.25, 0.25)), ('{"output": 0.4}', (0.0, 0.4))])
def test_range_ratio_as_vllm_writes_it(value: object, expected: tuple[float, float]) -> None:
    assert parse_range_ratio(value, "x") == expected


@pytest.mark.parametrize("value", ["1", "-0.1", "fast", '{"prompt": 0.2}', "[0.2]"])
def test_range_ratio_refusals(value: str) -> None:
    with pytest.raises(ObservationError, match="x"):
        parse_range_ratio(value, "x")


def test_range_ratio_from_metadata_or_the_flag_and_a_closed_loops_default() -> None:
    open_loop = {"max_concurrency": None, "request_rate": 5.0}
    stated = observation(result(random_range_ratio="0.5", **open_loop), CFG, "a")
    assert (stated.shape.range_ratio, stated.shape.output_ratio) == (0.5, 0.5)
    flagged = observation(result(**open_loop), CFG, "b", Inputs(range_ratio=(0.2, 0.4)))
    assert (flagged.shape.range_ratio, flagged.shape.output_ratio) == (0.2, 0.4)
    fixed = observation(result(**open_loop), CFG, "c")
    assert fixed.shape.length_dist == "fixed"
    # a closed loop whose lengths nothing states is simulated with the default spread, and says so
    closed = observation(result(), CFG, "d")
    assert closed.concurrency == 4 and closed.shape.length_dist == "uniform"
    assert closed.shape.range_ratio == closed.shape.output_ratio == CLOSED_LOOP_DEFAULT_SPREAD
    assert any("default spread" in n and "lengths not in the file" in n for n in closed.notes)


@pytest.mark.parametrize(("stated", "input_ratio"), [
    # a tokenizer's round trip: 64-66 tokens, +-2 % as a uniform spread
    pytest.param({"input_lens": [64, 64, 65, 64, 66, 64], "output_lens": [32] * 6}, 0.02, id="per-request-lengths"),
    pytest.param({"random_range_ratio": "0"}, 0.0, id="metadata-ratio-0"),
    pytest.param({"random_range_ratio": '{"input": 0.3}'}, 0.3, id="metadata-fixed-outputs"),
])
def test_a_closed_loops_stated_lengths_are_simulated_as_stated(stated: dict, input_ratio: float) -> None:
    """Fixed lengths stated (vllm bench --ignore-eos with its default range ratio 0, as the real-engine recording
    was made) are simulated fixed: the real engine runs such a closed loop in waves, which a floor on the spread
    broke up (tests/data/real-vllm-curve-long, TTFT at 16 streams)."""
    obs = observation(result(**stated), CFG, "r.json")
    assert obs.concurrency == 4
    assert obs.shape.output_ratio == 0.0 and obs.shape.output_cv2 == 0.0
    assert obs.shape.range_ratio == pytest.approx(input_ratio, abs=0.002)
    assert not any("default spread" in n for n in obs.notes)


def test_fixed_lengths_keep_the_closed_loops_waves_the_default_spread_breaks_them() -> None:
    """Fixed lengths: the simulation's clients finish together and queue for prefill together (TTFT at 4 streams
    far above one stream's), as the real engine's do; with the default spread they do not."""
    from batchtune.twin.fit import Observation, simulate
    from batchtune.twin.params import TwinParams
    from batchtune.twin.steady import Shape

    cfg = ServeConfig(model="Llama-3.1-70B", gpu="H100", tensor_parallel_size=4, max_num_seqs=64, max_model_len=4096)
    single = simulate(Observation(cfg, Shape(1024, 128), {}, concurrency=1, window_s=30), TwinParams())
    fixed = simulate(Observation(cfg, Shape(1024, 128), {}, concurrency=4, window_s=30), TwinParams())
    spread = simulate(Observation(cfg, Shape(1024, 128, "uniform", CLOSED_LOOP_DEFAULT_SPREAD), {}, concurrency=4,
                                  window_s=30), TwinParams())
    assert fixed["median_ttft_ms"] > 1.8 * single["median_ttft_ms"]
    assert spread["median_ttft_ms"] < 1.3 * single["median_ttft_ms"]


# ---- statistics -------------------------------------------------------------------------------------------


def test_a_median_equal_to_its_mean_is_one_figure_pasted_twice() -> None:
    obs = observation(result(median_itl_ms=2.4968737177401166), CFG, "r.json")  # the file's mean_itl_ms
    assert "median_itl_ms" not in obs.metrics and obs.metrics["mean_itl_ms"] == pytest.approx(2.4968737)
    assert any("median_itl_ms equals mean_itl_ms" in n for n in obs.notes)
    # equal means of two statistics are no such thing (fixed output lengths: mean ITL is mean TPOT)
    real = observation(result(), CFG, "r.json")
    assert "median_itl_ms" in real.metrics and real.metrics["mean_itl_ms"] == real.metrics["mean_tpot_ms"]
    assert not any("pasted" in n or "written twice" in n for n in real.notes)


def test_the_document_says_which_statistic_it_compared(capsys: pytest.CaptureFixture[str]) -> None:
    code, doc, _ = calibrate_cli(capsys, "--observations", str(GOLDEN), "--allow-untrusted")
    assert code == 0
    assert doc["statistics"]["itl"]["keys"] == ["median_itl_ms"] and "decode-only" in doc["statistics"]["itl"]["meaning"]
    assert "tpot" not in doc["statistics"]  # the same steps as ITL, counted once
    assert doc["lengths"][0]["simulated"].startswith("uniform")
    assert math.isclose(doc["physicalBounds"]["maxBandwidthEfficiency"], 0.95)
