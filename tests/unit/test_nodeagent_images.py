"""Image mapping: container image + command/args -> local argv."""

from __future__ import annotations

import pytest

from batchtune_local.nodeagent.images import ImageMap, ImageNotMapped, ImageRule, load_image_map

PY = "/venv/bin/python"


@pytest.mark.parametrize(
    "container, expected",
    [
        pytest.param(
            {"image": "vllm/vllm-openai:v0.11.0", "args": ["meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "64"]},
            [PY, "-m", "batchtune", "twin", "vllm", "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
             "--max-num-seqs", "64"],
            id="vllm-args-only-uses-entrypoint",
        ),
        pytest.param(
            {"image": "vllm/vllm-openai:latest", "command": ["vllm", "bench", "serve"], "args": ["--num-prompts", "10"]},
            [PY, "-m", "batchtune", "twin", "vllm", "vllm", "bench", "serve", "--num-prompts", "10"],
            id="vllm-command-replaces-entrypoint",
        ),
        pytest.param(
            {"image": "ghcr.io/batchtune/batchtune:0.1.0", "command": ["batchtune", "loadgen"], "args": ["--x", "1"]},
            [PY, "-m", "batchtune", "loadgen", "--x", "1"],
            id="batchtune-drops-leading-batchtune",
        ),
        pytest.param(
            {"image": "ghcr.io/batchtune/batchtune:0.1.0", "args": ["operator"]},
            [PY, "-m", "batchtune", "operator"],
            id="batchtune-args-only",
        ),
        pytest.param(
            {"image": "ghcr.io/batchtune/batchtune:0.1.0", "command": ["python", "-m", "batchtune", "twin"]},
            [PY, "-m", "batchtune", "twin"],
            id="batchtune-drops-python-m-batchtune",
        ),
    ],
)
def test_builtin_argv(container, expected):
    assert ImageMap().argv_for(container, python=PY) == expected


def test_unmapped_image_names_image_and_mapping(tmp_path):
    with pytest.raises(ImageNotMapped) as err:
        ImageMap().argv_for({"image": "nginx:1.27"})
    assert "nginx:1.27" in str(err.value) and "--image-map" in str(err.value)
    path = tmp_path / "map.yaml"
    path.write_text("images: []\n")
    with pytest.raises(ImageNotMapped, match=str(path)):
        load_image_map(path).argv_for({"image": "nginx:1.27"})


def test_file_rules_come_first_and_run_commands_as_is(tmp_path):
    path = tmp_path / "map.yaml"
    path.write_text('images:\n  - match: "batchtune.test/*"\n    run: []\n')
    image_map = load_image_map(path)
    argv = image_map.argv_for({"image": "batchtune.test/python", "command": ["python3", "-c", "print(1)"]}, python=PY)
    assert argv == [PY, "-c", "print(1)"]
    # Built-ins still apply after the file's rules.
    assert image_map.argv_for({"image": "vllm/vllm-openai", "args": ["m"]}, python=PY)[:5] == [
        PY, "-m", "batchtune", "twin", "vllm"]


def test_replace_defaults_drops_builtins(tmp_path):
    path = tmp_path / "map.yaml"
    path.write_text('replaceDefaults: true\nimages:\n  - {match: "x/*", run: [echo]}\n')
    with pytest.raises(ImageNotMapped):
        load_image_map(path).argv_for({"image": "vllm/vllm-openai"})


@pytest.mark.parametrize(
    "text, message",
    [
        pytest.param("images: {a: 1}\n", "list 'images'", id="not-a-list"),
        pytest.param("images:\n  - run: []\n", r"images\[0\]: needs a string 'match'", id="no-match"),
        pytest.param('images:\n  - {match: "*", runn: []}\n', "unknown keys", id="typo"),
        pytest.param('images:\n  - {match: "*", run: echo}\n', r"images\[0\].run: expected a list", id="run-not-list"),
    ],
)
def test_bad_mapping_files_name_the_field(tmp_path, text, message):
    path = tmp_path / "map.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_image_map(path)


def test_empty_command_is_an_error():
    with pytest.raises(ValueError, match="image 'x' maps to an empty command"):
        ImageMap((ImageRule("*", ()),)).argv_for({"name": "c", "image": "x"})
