"""The vLLM engine: reading and rewriting its command line in container specs, flags, extra args, ports."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchtune.core import Setting
from batchtune.engines import VLLM, ArgsError, UnsafeShell, find_engine_container

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
    pytest.param({"name": "v", "command": ["vllm", "serve", "m", "--max-num-seq", "12", "--gpu-memory-util=0.8"]}, "m", 12, 80, None, id="unambiguous-prefixes"),
])
def test_read(container, model, seqs, gmu, mbt):
    inv = VLLM.read(container)
    assert (inv.model, inv.max_num_seqs, inv.gpu_memory_utilization_percent, inv.max_num_batched_tokens) == (model, seqs, gmu, mbt)
    assert inv.engine == "vllm" and inv.container == "v"


@pytest.mark.parametrize("container, form, served, argv", [
    pytest.param({"name": "v", "command": ["vllm", "serve", "m", "--served-model-name", "a", "b", "--port", "1"]},
                 "serve", "a", ("m", "--served-model-name", "a", "b", "--port", "1"), id="served-name-first-of-several"),
    pytest.param({"name": "v", "command": ["python", "-m", "vllm.entrypoints.openai.api_server"], "args": ["--model", "m"]},
                 "api_server", "m", ("--model", "m"), id="api-server-served-is-model"),
    pytest.param({"name": "v", "command": ["sh", "-c", "vllm serve m --enforce-eager"]},
                 "shell+serve", "m", ("m", "--enforce-eager"), id="shell"),
    pytest.param({"name": "v", "image": "vllm/vllm-openai", "args": ["m"]}, "entrypoint", "m", ("m",), id="entrypoint"),
])
def test_read_form_served_model_and_argv(container, form, served, argv):
    inv = VLLM.read(container)
    assert (inv.form, inv.served_model, inv.argv) == (form, served, argv)


@pytest.mark.parametrize("container, why", [
    pytest.param({"name": "v", "command": ["vllm", "serve", "m", "--max-num-seqs", "many"]}, "not an integer", id="seqs-not-int"),
    pytest.param({"name": "v", "command": ["vllm", "serve", "m", "--gpu-memory-utilization", "1.5"]}, r"outside \(0, 1\]", id="gmu-out-of-range"),
    pytest.param({"name": "v", "command": ["vllm", "serve", "m", "--gpu-memory-utilization", "x"]}, "not a number", id="gmu-not-number"),
])
def test_read_refuses_bad_knob_values(container, why):
    with pytest.raises(ArgsError, match=why):
        VLLM.read(container)


def test_read_keeps_switches_and_values():
    inv = VLLM.read({"name": "v", "command": ["vllm", "serve", "m", "--enforce-eager", "--max-model-len", "4096"]})
    assert inv.flags == {"enforce-eager": None, "max-model-len": "4096"}


@pytest.mark.parametrize("container, expected", [
    pytest.param({"name": "v", "command": ["vllm", "serve", "m", "--max-num-seqs", "8", "--port", "8001"]},
                 {"command": ["vllm", "serve", "m", "--max-num-seqs", "128", "--port", "8001"],
                  "args": ["--gpu-memory-utilization", "0.85", "--max-num-batched-tokens", "4096"]}, id="replace-in-command-append-to-args"),
    pytest.param({"name": "v", "command": ["vllm", "serve"], "args": ["m", "--max_num_seqs=8", "--gpu-memory-utilization", "0.9"]},
                 {"command": ["vllm", "serve"], "args": ["m", "--max_num_seqs=128", "--gpu-memory-utilization", "0.85", "--max-num-batched-tokens", "4096"]},
                 id="keeps-spelling-and-equals"),
    pytest.param({"name": "v", "command": ["vllm", "serve", "m", "--max-num-seq", "8"]},
                 {"command": ["vllm", "serve", "m", "--max-num-seq", "128"],
                  "args": ["--gpu-memory-utilization", "0.85", "--max-num-batched-tokens", "4096"]},
                 id="prefix-spelling-is-the-knob-and-is-replaced"),
    pytest.param({"name": "v", "command": ["sh", "-c", "vllm serve \"$MODEL\" --max-num-seqs 8  --served-model-name 'a b'"]},
                 {"command": ["sh", "-c", "vllm serve \"$MODEL\" --max-num-seqs 128  --served-model-name 'a b' --gpu-memory-utilization 0.85 --max-num-batched-tokens 4096"]},
                 id="shell-splices-only-changed-words"),
])
def test_rewrite_exact(container, expected):
    out = VLLM.rewrite(container, NEW)
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
        VLLM.rewrite({"name": "engine", "command": ["sh", "-c", script]}, NEW)
    assert "engine" in str(exc.value) and why in str(exc.value)


def test_extra_args_replace_existing_and_append_new():
    c = {"name": "v", "command": ["vllm", "serve", "m", "--max-model-len", "8192"]}
    out = VLLM.rewrite(c, NEW, ["--max-model-len=4096", "--enforce-eager"])
    inv = VLLM.read(out)
    assert inv.flags["max-model-len"] == "4096" and "enforce-eager" in inv.flags
    assert out["command"][:3] == ["vllm", "serve", "m"]


def test_input_container_not_mutated():
    c = {"name": "v", "command": ["vllm", "serve", "m", "--max-num-seqs", "8"]}
    VLLM.rewrite(c, NEW)
    assert c["command"][-1] == "8" and "args" not in c


def test_find_engine_container():
    pod = {"containers": [{"name": "proxy", "image": "envoy", "command": ["envoy"]},
                          {"name": "engine", "command": ["vllm", "serve", "m"]}]}
    engine, container = find_engine_container(pod)
    assert engine is VLLM and container["name"] == "engine"
    assert find_engine_container(pod, "engine")[1]["name"] == "engine"
    with pytest.raises(ArgsError, match="no such container"):
        find_engine_container(pod, "nope")
    with pytest.raises(ArgsError, match="does not run vLLM"):
        find_engine_container(pod, "proxy")
    two = {"containers": [{"name": "a", "command": ["vllm", "serve", "m"]}, {"name": "b", "command": ["vllm", "serve", "n"]}]}
    with pytest.raises(ArgsError, match="containerName"):
        find_engine_container(two)
    with pytest.raises(ArgsError, match="no container runs vLLM"):
        find_engine_container({"containers": [{"name": "proxy", "image": "envoy", "command": ["envoy"]}]})


def test_find_engine_container_says_why_the_only_engine_cannot_be_tuned():
    pod = {"containers": [{"name": "proxy", "image": "envoy", "command": ["envoy"]},
                          {"name": "engine", "command": ["sh", "-c", "vllm serve m | tee /log"]}]}
    with pytest.raises(UnsafeShell, match="pipe"):
        find_engine_container(pod)
    with pytest.raises(UnsafeShell, match="pipe"):
        find_engine_container(pod, "engine")


@pytest.mark.parametrize("container, port", [
    pytest.param({"name": "v", "command": ["vllm", "serve", "m", "--port", "9000"]}, 9000, id="flag"),
    pytest.param({"name": "v", "command": ["vllm", "serve", "m"], "ports": [{"name": "http", "containerPort": 8080}]}, 8080, id="named-http-port"),
    pytest.param({"name": "v", "command": ["vllm", "serve", "m"], "ports": [{"name": "metrics", "containerPort": 9100}]}, 9100, id="first-port"),
    pytest.param({"name": "v", "command": ["vllm", "serve", "m"]}, 8000, id="default"),
])
def test_serving_port(container, port):
    assert VLLM.serving_port(container) == port


@pytest.mark.parametrize("setting, args", [
    pytest.param(Setting(64, 90, 8192), ["--max-num-seqs", "64", "--gpu-memory-utilization", "0.90", "--max-num-batched-tokens", "8192"], id="all-three"),
    pytest.param(Setting(8, 5), ["--max-num-seqs", "8", "--gpu-memory-utilization", "0.05"], id="no-mbt-exact-fraction"),
    pytest.param(Setting(1, 100), ["--max-num-seqs", "1", "--gpu-memory-utilization", "1.00"], id="hundred-percent"),
])
def test_setting_args_and_flags(setting, args):
    assert VLLM.setting_args(setting) == args
    assert {f"--{k}": v for k, v in VLLM.setting_flags(setting).items()} == dict(zip(args[::2], args[1::2], strict=True))


def test_parse_flags():
    assert VLLM.parse_flags(["--max-model-len", "4096", "--enforce-eager", "--max_num_seqs=8", "--max-num-seq", "4"]) == [
        ("max-model-len", "--max-model-len", "4096"),
        ("enforce-eager", "--enforce-eager", None),
        ("max-num-seqs", "--max_num_seqs", "8"),
        ("max-num-seqs", "--max-num-seq", "4"),
    ]
    with pytest.raises(ValueError, match="'foo' at position 2 is not a flag"):
        VLLM.parse_flags(["--seed", "1", "foo"])


@pytest.mark.parametrize("token, canonical", [
    pytest.param("--max-num-seqs", "max-num-seqs", id="exact"),
    pytest.param("--max_num_seqs=8", "max-num-seqs", id="underscores-and-equals"),
    pytest.param("--max-num-seq", "max-num-seqs", id="prefix"),
    pytest.param("--max_num_seq=8", "max-num-seqs", id="prefix-underscores-equals"),
    pytest.param("--gpu-memory-util", "gpu-memory-utilization", id="prefix-gmu"),
    pytest.param("--max-num-b", "max-num-batched-tokens", id="prefix-mbt"),
    pytest.param("--max-num", "max-num", id="ambiguous-prefix-stays"),
    pytest.param("-tp", "tensor-parallel-size", id="short-alias"),
    pytest.param("--not-a-vllm-flag", "not-a-vllm-flag", id="unknown-stays"),
])
def test_canonical_resolves_like_vllms_argparse(token, canonical):
    assert VLLM.canonical(token) == canonical


@pytest.mark.parametrize("args", [
    pytest.param(["--enforce-eager"], id="enforce-eager"),
    pytest.param(["--enable-prefix-caching"], id="prefix-caching"),
    pytest.param(["--max-model-len", "4096"], id="max-model-len"),
    pytest.param(["--max-model-len=4096", "--enforce-eager", "--enable-prefix-caching"], id="several"),
    pytest.param([], id="none"),
])
def test_check_extra_args_allows(args):
    assert VLLM.check_extra_args(args) == []


@pytest.mark.parametrize("args, fragment", [
    pytest.param(["--trust-remote-code"], "--trust-remote-code", id="trust-remote-code"),
    pytest.param(["--tokenizer", "x"], "--tokenizer", id="tokenizer"),
    pytest.param(["--model", "x"], "--model", id="model"),
    pytest.param(["--served-model-name", "x"], "--served-model-name", id="served-model-name"),
    pytest.param(["--host", "0.0.0.0"], "--host", id="host"),
    pytest.param(["--port", "1"], "--port", id="port"),
    pytest.param(["--max-num-seq", "8"], "sets a knob batchtune tunes", id="knob-prefix"),
    pytest.param(["--max_num_seqs=8"], "sets a knob batchtune tunes", id="knob-underscores-equals"),
    pytest.param(["--gpu-memory-util", "0.5"], "sets a knob batchtune tunes", id="gmu-prefix"),
    pytest.param(["--max-num-batched-tokens", "512"], "sets a knob batchtune tunes", id="mbt"),
    pytest.param(["$(HOME)"], "$(VAR)", id="expansion-alone"),
    pytest.param(["--max-model-len", "$(HOME)"], "$(VAR)", id="expansion-as-value"),
    pytest.param(["--seed=$(HOME)"], "$(VAR)", id="expansion-joined"),
    pytest.param(["--max-model-len", "4096\n"], "control characters", id="control-character"),
    pytest.param(["foo"], "'foo' at position 0 is not a flag", id="positional"),
    pytest.param(["--enforce-eager", "foo"], "'foo' at position 1 is not a flag", id="positional-after-switch"),
])
def test_check_extra_args_refuses(args, fragment):
    problems = VLLM.check_extra_args(args)
    assert problems and any(fragment in p for p in problems), problems


def test_check_extra_args_reports_every_problem():
    problems = VLLM.check_extra_args(["--enforce-eager", "--port", "1", "--max-num-seq", "8"])
    assert len(problems) == 2 and "--port" in problems[0] and "knob" in problems[1]


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
    before = VLLM.read(container)
    out = VLLM.rewrite(container, setting)
    after = VLLM.read(out)
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
        for w in inv.argv:
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
    assert VLLM.rewrite(out, setting) == out
