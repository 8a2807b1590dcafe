"""`batchtune twin calibrate` on real `vllm bench serve` result files, robustness to what such files hold, errors
that name the file and key, and `twin predict --calibration`."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from batchtune.cli import main
from batchtune.twin.config import ServeConfig
from batchtune.twin.observations import ObservationError, load_observations

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "golden" / "vllm-0.32.0-cpu" / "bench-result.json"
SAMPLE = DATA / "bench-results" / "vllm-0.32.0-cpu-c16.json"
CPU = ["--model", "tiny-llama-v1", "--gpu", "CPU-node", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"]


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict]:
    code = main(argv)
    out = capsys.readouterr().out
    return code, (json.loads(out) if code in (0, 1) and out.strip().startswith("{") else {})


def test_calibrates_on_real_vllm_cpu_results(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, doc = run_json(capsys, ["twin", "calibrate", *CPU, "--max-num-seqs", "8", "--enforce-eager",
                                  "--observations", str(GOLDEN), "-o", "json"])
    assert code == 0
    assert doc["fit"] == "catalog" and doc["catalogModel"] == "tiny-llama-v1" and doc["observations"] == 1
    assert doc["setting"]["max_num_seqs"] == 8 and doc["setting"]["enforce_eager"] is True
    assert {r["key"] for r in doc["residuals"]} >= {"output_throughput", "median_itl_ms", "median_ttft_ms"}
    assert all(abs(r["errorPercent"]) <= r["tolerancePercent"] for r in doc["residuals"])
    assert doc["verdict"] == "Trusted"
    # the fit is then what predict uses
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(doc))
    common = ["--model", "tiny-llama-v1", "--gpu", "batchtune-CPU-node", "--max-num-seqs", "8", "--max-model-len",
              "2048", "--gpu-memory-utilization", "0.3", "--input-len", "64", "--output-len", "32",
              "--concurrency", "4", "--num-prompts", "20", "-o", "json"]
    code, calibrated = run_json(capsys, ["twin", "predict", *common, "--calibration", str(path)])
    _, nominal = run_json(capsys, ["twin", "predict", *common])
    assert code == 0
    measured = json.loads(GOLDEN.read_text())["output_throughput"]
    assert abs(calibrated["output_throughput"] / measured - 1) < abs(nominal["output_throughput"] / measured - 1)


def test_bundled_cpu_streaming_and_two_files(capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_json(capsys, ["twin", "calibrate", *CPU, "--max-num-seqs", "16", "--observations", str(SAMPLE),
                                  str(GOLDEN), "-o", "json"])
    assert doc["observations"] == 2
    assert code == (0 if doc["verdict"] == "Trusted" else 1)  # Untrusted exits 1 (the document is still written)
    keys = {(r["source"].split()[0], r["key"]) for r in doc["residuals"]}
    assert ("vllm-0.32.0-cpu-c16.json", "median_itl_ms") not in keys  # bundled tokens: ITL reads ~0
    assert doc["verdict"] in ("Trusted", "Untrusted") and doc["reason"]


def test_model_missing_from_the_catalog_gets_a_generic_fit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, doc = run_json(capsys, ["twin", "calibrate", "--model", "acme/never-heard-of-it", "--gpu", "MI300X-ish",
                                  "--max-num-seqs", "8", "--observations", str(GOLDEN), "-o", "json"])
    assert code == 0 and doc["fit"] == "generic" and "generic" in doc["parameters"]
    assert any("not in the catalog" in n for n in doc["notes"])
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    code, out = run_json(capsys, ["twin", "predict", "--model", "acme/never-heard-of-it", "--gpu", "MI300X-ish",
                                  "--max-num-seqs", "8", "--input-len", "64", "--output-len", "32", "--concurrency",
                                  "4", "--calibration", str(path), "-o", "json"])
    assert code == 0 and out["median_itl_ms"] > 0
    assert main(["twin", "predict", "--model", "Llama-3.1-8B", "--gpu", "H100", "--input-len", "64", "--output-len",
                 "32", "--concurrency", "4", "--calibration", str(path)]) == 2
    assert "a calibration describes one deployment" in capsys.readouterr().err


def result(**changes: object) -> dict:
    data = json.loads(GOLDEN.read_text())
    data.update(changes)
    return {k: v for k, v in data.items() if v is not ...}


@pytest.mark.parametrize("content", [
    pytest.param(lambda: json.dumps([result(), result(max_concurrency=2)]), id="list-of-results"),
    pytest.param(lambda: json.dumps(result()) + "\n" + json.dumps(result(max_concurrency=2)) + "\n", id="json-lines"),
    pytest.param(lambda: json.dumps(result(request_rate=5.0, max_concurrency=None)), id="poisson-rate"),
    pytest.param(lambda: json.dumps(result(request_rate="12.5", max_concurrency=None)), id="rate-as-string"),
    pytest.param(lambda: json.dumps(result(max_concurrency=None)), id="burst-rate-inf"),
    pytest.param(lambda: json.dumps(result(median_ttft_ms=..., median_itl_ms=..., latencies=..., queue_times=...,
                                           p99_ttft_ms=..., std_ttft_ms=...)), id="optional-keys-missing"),
    pytest.param(lambda: json.dumps(result(goodput={"x": 1}, label="run-7", extra_key=[1, 2]))
                 .replace('"std_itl_ms": 0.8509413627561295', '"std_itl_ms": NaN'), id="extra-keys-and-nan"),
    pytest.param(lambda: json.dumps(result(output_throughput=..., request_throughput=...)), id="throughput-from-duration"),
    pytest.param(lambda: json.dumps(result(max_num_seqs=4)), id="metadata-setting"),
])
def test_real_world_result_files_are_read(tmp_path: Path, content) -> None:  # noqa: ANN001
    path = tmp_path / "r.json"
    path.write_text(content())
    cfg = ServeConfig(model="tiny-llama-v1", gpu="CPU-node", max_num_seqs=8, max_model_len=2048,
                      gpu_memory_utilization=0.3)
    observations = load_observations(path, cfg)
    assert observations and all(o.shape.input_len > 60 and o.shape.output_len == 32 for o in observations)
    first = observations[0]
    assert first.concurrency is not None or first.rate is not None
    assert "output_throughput" in first.metrics or "request_throughput" in first.metrics


def test_load_semantics() -> None:
    cfg = ServeConfig(model="tiny-llama-v1", gpu="CPU-node", max_num_seqs=8, max_model_len=2048,
                      gpu_memory_utilization=0.3)
    from batchtune.twin.observations import observation

    closed = observation(result(), cfg, "a")
    assert closed.concurrency == 4 and closed.rate is None and closed.num_prompts == 20
    poisson = observation(result(request_rate=5.0, max_concurrency=None), cfg, "b")
    assert poisson.rate == 5.0 and poisson.concurrency is None
    burst = observation(result(max_concurrency=None), cfg, "c")
    assert burst.rate == math.inf and burst.burst
    assert observation(result(max_num_seqs=4), cfg, "d").cfg.max_num_seqs == 4


@pytest.mark.parametrize(("content", "message"), [
    pytest.param("{not json", "r.json: not JSON", id="not-json"),
    pytest.param("[]", "r.json: no result object", id="empty-list"),
    pytest.param("[1, 2]", r"r.json\[0\]: expected a result object, got int", id="not-an-object"),
    pytest.param(json.dumps(result(completed=...)), "r.json: key 'completed' is missing", id="missing-completed"),
    pytest.param(json.dumps(result(completed=0)), "r.json: key 'completed' is 0", id="nothing-completed"),
    pytest.param(json.dumps(result(total_output_tokens="lots")), "key 'total_output_tokens' is 'lots'",
                 id="bad-number"),
    pytest.param(json.dumps(result(request_rate="fast")), "key 'request_rate' is 'fast'", id="bad-rate"),
    pytest.param(json.dumps(result(request_rate=-1)), "key 'request_rate' is -1", id="negative-rate"),
    pytest.param(json.dumps(result(max_concurrency=0)), "key 'max_concurrency' is 0", id="zero-concurrency"),
    pytest.param(json.dumps([result(), result(total_input_tokens=...)]),
                 r"r.json\[1\]: key 'total_input_tokens' is missing", id="second-of-a-list"),
    pytest.param(json.dumps(result(output_throughput=..., request_throughput=..., duration=...,
                                   total_token_throughput=...)),
                 "key 'output_throughput' is missing", id="no-throughput-at-all"),
])
def test_bad_files_name_the_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                                         message: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(content)
    assert main(["twin", "calibrate", *CPU, "--observations", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err), err
    with pytest.raises(ObservationError):
        load_observations(path, ServeConfig(model="tiny-llama-v1", gpu="CPU-node", max_model_len=2048,
                                            gpu_memory_utilization=0.3))


def test_a_missing_file_and_an_unknown_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["twin", "calibrate", *CPU, "--observations", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["twin", "predict", "--model", "Llama-3.1-8B", "--gpu", "H100", "--input-len", "1", "--output-len", "1",
              "--concurrency", "1", "--no-such-flag"])


def untrusted_result(tmp_path: Path) -> Path:
    """The golden run with a TTFT the CPU node's physics cannot produce next to its throughput."""
    path = tmp_path / "slow-ttft.json"
    path.write_text(json.dumps(result(median_ttft_ms=900.0, mean_ttft_ms=950.0)))
    return path


def test_an_untrusted_calibration_exits_1_unless_allowed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["twin", "calibrate", *CPU, "--max-num-seqs", "8", "--observations", str(untrusted_result(tmp_path)),
            "-o", "json"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # the document is still written
    assert doc["verdict"] == "Untrusted" and "median_ttft_ms" in doc["reason"]
    assert captured.err.startswith("Untrusted: ") and "--allow-untrusted" in captured.err
    assert main([*argv, "--allow-untrusted"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "Untrusted"


def test_predict_refuses_an_untrusted_calibration_unless_allowed(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    main(["twin", "calibrate", *CPU, "--max-num-seqs", "8", "--observations", str(untrusted_result(tmp_path)),
          "-o", "json", "--allow-untrusted"])
    path = tmp_path / "untrusted.json"
    path.write_text(capsys.readouterr().out)
    common = ["twin", "predict", "--model", "tiny-llama-v1", "--gpu", "CPU-node", "--max-num-seqs", "8",
              "--max-model-len", "2048", "--gpu-memory-utilization", "0.3", "--input-len", "64", "--output-len", "32",
              "--concurrency", "4", "--duration", "5", "-o", "json", "--calibration", str(path)]
    assert main(common) == 2
    err = capsys.readouterr().err
    assert "untrusted.json: the calibration's verdict is 'Untrusted', not 'Trusted'" in err
    assert "median_ttft_ms" in err and "--allow-untrusted" in err
    assert main([*common, "--allow-untrusted"]) == 0
    assert json.loads(capsys.readouterr().out)["output_throughput"] > 0


def test_predict_spreads_a_closed_loops_lengths_unless_told(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["twin", "predict", "--model", "Llama-3.1-8B", "--gpu", "H100", "--input-len", "512", "--output-len", "64",
            "--duration", "5", "-o", "json"]
    assert main([*base, "--concurrency", "8"]) == 0
    closed = json.loads(capsys.readouterr().out)
    assert closed["length_dist"] == "uniform" and closed["random_range_ratio"] == 0.1
    assert main([*base, "--concurrency", "8", "--length-dist", "fixed"]) == 0
    assert json.loads(capsys.readouterr().out)["length_dist"] == "fixed"
    assert main([*base, "--rate", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["length_dist"] == "fixed"
    assert main([*base, "--rate", "2", "--range-ratio", "0.3"]) == 0
    assert json.loads(capsys.readouterr().out)["random_range_ratio"] == 0.3
    assert main([*base, "--rate", "2", "--length-dist", "fixed", "--range-ratio", "0.3"]) == 2
    assert "--range-ratio applies to --length-dist uniform" in capsys.readouterr().err
