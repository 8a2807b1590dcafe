"""vLLM argument reading and rewriting in container specs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchtune.core import ArgsError, Setting, find_vllm_container, read_vllm_settings, rewrite_vllm_args, vllm_port

NEW = Setting(128, 85, 4096)


@pytest.mark.parametrize("container, model, seqs, gmu, mbt", [
    pytest.param({"name": "v", "command": ["vllm", "serve", "m/x", "--max-num-seqs", "8"]}, "m/x", 8, None, None, id="serve-space"),
    pytest.param({"name": "v", "command": ["vllm", "serve"], "args": ["m", "--max-num-seqs=8", "--gpu-memory-utilization=0.9"]}, "m", 8, 90, None, id="serve-equals-split-command-args"),
    pytest.param({"name": "v", "command": ["/usr/local/bin/vllm", "serve", "m", "--max_num_seqs", "16", "--max_num_batched_tokens=2048"]}, "m", 16, None, 2048, id="underscores"),
    pytest.param({"name": "v", "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"], "args": ["--model", "m", "--gpu-memory-utilization", "0.95"]}, "m", None, 95, None, id="api-server"),
    pytest.param({"name": "v", "image": "vllm/vllm-openai:v0.10.1", "args": ["m", "--enforce-eager", "--max-num-seqs", "4"]}, "m", 4, None, None, id="image-entrypoint"),
    pytest.param({"name": "v", "command": ["sh", "-c", "exec vllm serve $MODEL --max-num-seqs 8 --gpu-memory-utilization=0.9"]}, "$MODEL", 8, 90, None, id="shell-simple"),
    pytest.param({"name": "v", "command": ["/bin/bash", "-lc"], "args": ["vllm serve 'my model' --max-num-seqs \"32\""]}, "my model", 32, None, None, id="shell-in-args-quoted"),
    pytest.param({"name": "v", "command": ["vllm", "serve", "m", "--max-num-seqs", "8", "--max-num-seqs", "64"]}, "m", 64, None, None, id="last-occurrence-wins"),
])
def test_read_vllm_settings(container, model, seqs, gmu, mbt):
    inv = read_vllm_settings(container)
    assert (inv.model, inv.max_num_seqs, inv.gpu_memory_utilization_percent, inv.max_num_batched_tokens) == (model, seqs, gmu, mbt)


@pytest.mark.parametrize("container, expected", [
    pytest.param({"name": "v", "command": ["vllm", "serve", "m", "--max-num-seqs", "8", "--port", "8001"]},
                 {"command": ["vllm", "serve", "m", "--max-num-seqs", "128", "--port", "8001"],
                  "args": ["--gpu-memory-utilization", "0.85", "--max-num-batched-tokens", "4096"]}, id="replace-in-command-append-to-args"),
    pytest.param({"name": "v", "command": ["vllm", "serve"], "args": ["m", "--max_num_seqs=8", "--gpu-memory-utilization", "0.9"]},
                 {"command": ["vllm", "serve"], "args": ["m", "--max_num_seqs=128", "--gpu-memory-utilization", "0.85", "--max-num-batched-tokens", "4096"]},
                 id="keeps-spelling-and-equals"),
    pytest.param({"name": "v", "command": ["sh", "-c", "vllm serve \"$MODEL\" --max-num-seqs 8  --served-model-name 'a b'"]},
                 {"command": ["sh", "-c", "vllm serve \"$MODEL\" --max-num-seqs 128  --served-model-name 'a b' --gpu-memory-utilization 0.85 --max-num-batched-tokens 4096"]},
                 id="shell-splices-only-changed-words"),
])
def test_rewrite_exact(container, expected):
    out = rewrite_vllm_args(container, NEW)
    for key, value in expected.items():
        assert out[key] == value
    assert out["name"] == "v"


@pytest.mark.parametrize("script, why", [
    pytest.param("vllm serve m && sleep 1", "'&' or '&&'", id="and"),
    pytest.param("vllm serve m | tee log", "pipe", id="pipe"),
    pytest.param("vllm serve m; echo done", "';'", id="semicolon"),
    pytest.param("vllm serve $(cat /model) --max-num-seqs 8", "command substitution", id="subst"),
    pytest.param("vllm serve m > /tmp/log", "redirect", id="redirect"),
    pytest.param("set -e\nvllm serve m", "several lines", id="multiline"),
    pytest.param("vllm serve `cat m`", "backtick", id="backtick"),
    pytest.param("vllm serve m --max-num-seqs \"$(echo 8)\"", "command substitution", id="subst-in-quotes"),
    pytest.param("echo hello", "does not run", id="not-vllm"),
])
def test_shell_refused_with_container_and_reason(script, why):
    with pytest.raises(ArgsError) as exc:
        rewrite_vllm_args({"name": "engine", "command": ["sh", "-c", script]}, NEW)
    assert "engine" in str(exc.value) and why in str(exc.value)


def test_extra_args_replace_existing_and_append_new():
    c = {"name": "v", "command": ["vllm", "serve", "m", "--max-model-len", "8192"]}
    out = rewrite_vllm_args(c, NEW, ["--max-model-len=4096", "--enforce-eager"])
    inv = read_vllm_settings(out)
    assert inv.flags["max-model-len"] == "4096" and "enforce-eager" in inv.flags
    assert out["command"][:3] == ["vllm", "serve", "m"]


def test_input_container_not_mutated():
    c = {"name": "v", "command": ["vllm", "serve", "m", "--max-num-seqs", "8"]}
    rewrite_vllm_args(c, NEW)
    assert c["command"][-1] == "8" and "args" not in c


def test_find_vllm_container():
    pod = {"containers": [{"name": "proxy", "image": "envoy", "command": ["envoy"]},
                          {"name": "engine", "command": ["vllm", "serve", "m"]}]}
    assert find_vllm_container(pod)["name"] == "engine"
    assert find_vllm_container(pod, "engine")["name"] == "engine"
    with pytest.raises(ArgsError, match="no such container"):
        find_vllm_container(pod, "nope")
    with pytest.raises(ArgsError, match="does not run vLLM"):
        find_vllm_container(pod, "proxy")
    two = {"containers": [{"name": "a", "command": ["vllm", "serve", "m"]}, {"name": "b", "command": ["vllm", "serve", "n"]}]}
    with pytest.raises(ArgsError, match="containerName"):
        find_vllm_container(two)


def test_vllm_port():
    assert vllm_port({"name": "v", "command": ["vllm", "serve", "m", "--port", "9000"]}) == 9000
    assert vllm_port({"name": "v", "command": ["vllm", "serve", "m"], "ports": [{"name": "http", "containerPort": 8080}]}) == 8080
    assert vllm_port({"name": "v", "command": ["vllm", "serve", "m"]}) == 8000


# Round trip: rewrite then read gives the new values; every other word is unchanged and in order.
_word = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/._", min_size=1, max_size=8)
_other = st.lists(st.tuples(st.sampled_from(["port", "max-model-len", "dtype", "tensor-parallel-size", "served-model-name"]), _word),
                  max_size=4, unique_by=lambda t: t[0])
_knob_spellings = st.sampled_from(["--max-num-seqs", "--max_num_seqs"])
_settings = st.builds(Setting, st.integers(1, 4096), st.integers(10, 99), st.one_of(st.none(), st.integers(1, 65536)))


@st.composite
def _containers(draw):
    others = draw(_other)
    flags: list[str] = []
    for name, value in others:
        flags += [f"--{name}", value]
    if draw(st.booleans()):
        spelled, joined = draw(_knob_spellings), draw(st.booleans())
        knob = [f"{spelled}={draw(st.integers(1, 999))}"] if joined else [spelled, str(draw(st.integers(1, 999)))]
        flags[draw(st.integers(0, len(others))) * 2:0] = knob
    form = draw(st.sampled_from(["serve", "serve-split", "api", "entrypoint", "shell"]))
    if form == "serve":
        return {"name": "v", "command": ["vllm", "serve", "model"] + flags}, flags
    if form == "serve-split":
        return {"name": "v", "command": ["vllm", "serve"], "args": ["model"] + flags}, flags
    if form == "api":
        return {"name": "v", "command": ["python", "-m", "vllm.entrypoints.openai.api_server"], "args": ["--model", "model"] + flags}, flags
    if form == "entrypoint":
        return {"name": "v", "image": "vllm/vllm-openai", "args": ["model"] + flags}, flags
    return {"name": "v", "command": ["sh", "-c", " ".join(["vllm", "serve", "model"] + flags)]}, flags


@settings(max_examples=150, deadline=None)
@given(_containers(), _settings)
def test_round_trip(pair, setting):
    container, flags = pair
    before = read_vllm_settings(container)
    out = rewrite_vllm_args(container, setting)
    after = read_vllm_settings(out)
    assert after.max_num_seqs == setting.max_num_seqs
    assert after.gpu_memory_utilization_percent == setting.gpu_memory_utilization_percent
    expected_mbt = setting.max_num_batched_tokens if setting.max_num_batched_tokens is not None else before.max_num_batched_tokens
    assert after.max_num_batched_tokens == expected_mbt
    assert after.model == before.model
    knobs = {"max-num-seqs", "gpu-memory-utilization", "max-num-batched-tokens"}
    untouched = lambda inv: [(k, v) for k, v in inv.flags.items() if k not in knobs]  # noqa: E731
    assert untouched(after) == untouched(before)
    # Words that are not knob values keep their relative order.
    def skeleton(inv):
        words, skip = [], False
        for w in inv.args:
            if skip:
                skip = False
                continue
            name = w.lstrip("-").partition("=")[0].replace("_", "-")
            if w.startswith("--") and name in knobs:
                skip = "=" not in w
                continue
            words.append(w)
        return words
    assert skeleton(after) == skeleton(before)
    # Rewriting again with the same setting changes nothing.
    assert rewrite_vllm_args(out, setting) == out
