"""Every file a CLI command reads, given what a careless user or an attacker would give it: each ends in a non-zero
exit and a clear line naming the file, never a traceback (issue 22, section 8).

The inputs: nesting deeper than the interpreter's recursion limit, Infinity, NaN, 1e400, an integer too long to
convert, several YAML documents, binary garbage, an empty file, a directory, a missing file, and values of the wrong
shape (a list, a string, a number, null).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchtune.cli import main

DEEP_JSON = "[" * 100_000 + "]" * 100_000
HOSTILE = {
    "deep-json": DEEP_JSON,
    "deep-json-object": '{"a": ' * 50_000 + "1" + "}" * 50_000,
    "deep-yaml-flow": "[" * 5_000 + "]" * 5_000,
    "deep-json-under-the-recursion-limit": "[" * 500 + "]" * 500,
    "infinity": '{"offset_seconds": Infinity, "prompt_tokens": 1, "output_tokens": 1, "completed": Infinity}',
    "nan": '{"offset_seconds": NaN, "prompt_tokens": NaN, "output_tokens": 1, "completed": NaN}',
    "overflow": '{"offset_seconds": 1e400, "prompt_tokens": 1e400, "output_tokens": 1, "completed": 1e400}',
    "huge-integer": '{"completed": ' + "9" * 5000 + "}",
    "multi-document": "{}\n---\n{}\n",
    "binary": bytes(range(256)) * 8,
    "empty": "",
    "blank": "\n\n  \n",
    "list": "[1, 2, 3]",
    "string": '"hello"',
    "number": "42",
    "null": "null",
    "fields-of-the-wrong-shape": '{"completed": [1], "errors_sample": 5, "date": {}, "duration": "x", "kind": 3, '
                                 '"gpus": {}, "scenarios": 7, "offset_seconds": []}',
}

CPU = ["--model", "tiny-llama-v1", "--gpu", "CPU-node", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"]
PREDICT = ["twin", "predict", "--model", "tiny-llama-v1", "--gpu", "CPU-node", "--max-num-seqs", "8",
           "--gpu-memory-utilization", "0.3",
           "--max-model-len", "2048", "--input-len", "64", "--output-len", "32", "--concurrency", "4",
           "--num-prompts", "20"]
ROOT = Path(__file__).resolve().parents[2]
BATCHTUNING = ROOT / "manifests" / "samples" / "batchtuning-minimal.yaml"

# Each CLI entry that reads a file: argv with {f} for the hostile file.
ENTRIES = {
    "loadgen-trace": ["loadgen", "--trace", "{f}", "--base-url", "http://127.0.0.1:9", "--quiet"],
    "loadgen-summarize-result": ["loadgen", "--summarize-result", "{f}"],
    "twin-calibrate-observations": ["twin", "calibrate", *CPU, "--observations", "{f}"],
    "twin-calibrate-metrics": ["twin", "calibrate", *CPU, "--metrics", "{f}", "--observations",
                               str(ROOT / "tests" / "data" / "golden" / "vllm-0.32.0-cpu" / "bench-result.json")],
    "twin-calibrate-catalog": ["twin", "calibrate", *CPU, "--catalog", "{f}", "--observations", "{f}"],
    "twin-predict-calibration": [*PREDICT, "--calibration", "{f}"],
    "twin-predict-catalog": [*PREDICT, "--catalog", "{f}"],
    "plan-target": ["plan", "-f", str(BATCHTUNING), "--target", "{f}"],
    "plan-file": ["plan", "-f", "{f}"],
    "validate-file": ["validate", "-f", "{f}"],
    "bench-render": ["bench", "tuning", "--render", "{f}"],
}
# What a format legitimately accepts: the metrics file is text scanned for one sample, so only its outcome counts.
TRIED = len(ENTRIES) * (len(HOSTILE) + 2)  # + a directory and a missing file


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("content", list(HOSTILE), ids=list(HOSTILE))
@pytest.mark.parametrize("entry", list(ENTRIES), ids=list(ENTRIES))
def test_a_hostile_file_ends_in_one_line_naming_it(entry: str, content: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / f"hostile-{content}.in"
    data = HOSTILE[content]
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    code, out = _run([a.replace("{f}", str(path)) for a in ENTRIES[entry]], capsys)
    assert code != 0, out
    assert "Traceback" not in out
    named = [line for line in out.splitlines() if path.name in line]
    assert named, out[-2000:]
    assert all(len(line) < 2000 for line in named), "one clear line, not the file's content"


@pytest.mark.parametrize("entry", list(ENTRIES), ids=list(ENTRIES))
@pytest.mark.parametrize("kind", ["directory", "missing"])
def test_a_path_that_is_no_file_is_named(entry: str, kind: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "not-a-file"
    if kind == "directory":
        path.mkdir()
    code, out = _run([a.replace("{f}", str(path)) for a in ENTRIES[entry]], capsys)
    assert code != 0 and "Traceback" not in out
    assert any("not-a-file" in line for line in out.splitlines()), out


def test_plan_target_takes_the_deployment_of_a_multi_document_file(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    """The repository's own demo: a Deployment and its Service in one file."""
    target = ROOT / "hack" / "demo" / "production.yaml"
    assert target.read_text().count("\n---") == 1
    code, out = _run(["plan", "-f", str(BATCHTUNING), "--target", str(target)], capsys)
    assert code == 0, out
    assert "baseline" in out
    two = tmp_path / "two.yaml"
    two.write_text(target.read_text() + "\n---\n" + target.read_text().split("\n---")[0])
    code, out = _run(["plan", "-f", str(BATCHTUNING), "--target", str(two)], capsys)
    assert code != 0 and "2 Deployments: give a file with one" in out and "document 3 (Service)" not in out
    service = tmp_path / "service.yaml"
    service.write_text(target.read_text().split("---")[1])
    code, out = _run(["plan", "-f", str(BATCHTUNING), "--target", str(service)], capsys)
    assert code != 0 and "no Deployment among 1 document(s): document 1 (Service)" in out


@pytest.mark.parametrize("shape, field", [
    pytest.param("spec: []", "spec: expected an object", id="spec-a-list"),
    pytest.param("spec: {template: {spec: {containers: {a: 1}}}}", "spec.template.spec.containers: expected a list",
                 id="containers-a-mapping"),
    pytest.param("spec: {template: {spec: {containers: [{name: vllm, args: [1, 2]}]}}}",
                 "spec.template.spec.containers[0].args[0]: expected a string", id="args-numbers"),
    pytest.param("spec: {template: {spec: {containers: [7]}}}", "spec.template.spec.containers[0]: expected an object",
                 id="container-a-number"),
])
def test_plan_target_of_the_wrong_shape_names_the_field(shape: str, field: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "deploy.yaml"
    target.write_text(f"apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: x}}\n{shape}\n")
    code, out = _run(["plan", "-f", str(BATCHTUNING), "--target", str(target)], capsys)
    assert code != 0 and f"deploy.yaml: {field}" in out, out


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize("key", ["num_prompts", "max_concurrency", "total_input_tokens", "completed", "duration"])
def test_calibrate_refuses_an_infinite_figure_naming_the_key(key: str, value: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    golden = ROOT / "tests" / "data" / "golden" / "vllm-0.32.0-cpu" / "bench-result.json"
    import json

    result = json.loads(golden.read_text())
    text = json.dumps({**result, key: "__X__"}).replace('"__X__"', value)
    path = tmp_path / "inf.json"
    path.write_text(text)
    code, out = _run(["twin", "calibrate", *CPU, "--max-num-seqs", "8", "--observations", str(path)], capsys)
    assert code == 2 and f"inf.json: key {key!r} is" in out and "finite" in out, out


def test_summarize_result_with_a_wrong_shaped_field_names_the_file(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "result.json"
    path.write_text('{"completed": 3, "errors_sample": 5}')
    code, out = _run(["loadgen", "--summarize-result", str(path)], capsys)
    assert code == 2 and out.startswith(f"error: {path}: ") and "Traceback" not in out
