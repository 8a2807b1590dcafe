"""What the operator refuses in a spec beyond the CRD (`batchtune.admission`), and `batchtune validate` saying the same:
the extra-flag allow-list and its types, the install's bounds read from a Helm values file, image references,
reserved label names and the keys Kubernetes refuses."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchtune import __version__
from batchtune.admission import install_flag_problems, numerics_unconfirmed, review, url_problems
from batchtune.api import InvalidBatchTuning, parse_spec
from batchtune.cli import main
from batchtune.core.install import DEFAULT_PROMETHEUS_URLS, Install, InvalidValues, install_from_values
from batchtune.engines import VLLM
from batchtune.engines.vllm import EXTRA_FLAG_VALUES, NUMERICS_FLAGS, SAFE_EXTRA_FLAGS

REPO = Path(__file__).resolve().parents[2]
MINIMAL = yaml.safe_load((REPO / "manifests" / "samples" / "batchtuning-minimal.yaml").read_text())
DEFAULT = install_from_values({}, __version__)


def spec_with(**edits: Any) -> Any:
    raw = copy.deepcopy(MINIMAL["spec"])
    for path, value in edits.items():
        node = raw
        *parents, last = path.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return parse_spec(raw)


def extra(*args: str, install: Install = DEFAULT) -> list[str]:
    return review(VLLM, spec_with(searchSpace__extraArgs=list(args)), install, None).invalid


# ---- the default list: batching, scheduling and memory ------------------------------------------------

DENIED = ["--dtype=half", "--seed=7", "--enable-log-requests", "--uvicorn-log-level=debug", "--max-logprobs=100",
          "--disable-uvicorn-access-log", "--disable-cascade-attn", "--trust-remote-code", "--quantization=fp8",
          "--kv-cache-memory-bytes=1000", "--disable-log-stats", "--served-model-name=x", "--api-key=k"]


@pytest.mark.parametrize("arg", DENIED)
def test_flags_that_change_or_log_what_production_serves_are_refused_by_default(arg):
    (problem,) = extra(arg)
    name = arg.partition("=")[0]
    assert problem.startswith(f"spec.searchSpace.extraArgs[0] '{name}' ({name}) is not a flag this install lets")
    assert "searchSpace.allowedExtraFlags" in problem


@pytest.mark.parametrize("arg", ["--dtype=half", "--seed=7", "--enable-log-requests", "--uvicorn-log-level=debug"])
def test_an_install_value_allows_more(arg):
    name = arg.partition("=")[0].removeprefix("--")
    assert extra(arg, install=Install("op:1", extra_flags=(name,))) == []


def test_the_default_list_holds_vllm_flags_only_and_types_name_default_flags():
    assert frozenset(VLLM.catalog) >= SAFE_EXTRA_FLAGS and frozenset(VLLM.catalog) >= NUMERICS_FLAGS
    assert set(EXTRA_FLAG_VALUES) <= SAFE_EXTRA_FLAGS
    assert not SAFE_EXTRA_FLAGS & {"dtype", "seed", "enable-log-requests", "uvicorn-log-level"}
    valued = {f for f in SAFE_EXTRA_FLAGS if VLLM.arity(f) != 0}
    assert valued == set(EXTRA_FLAG_VALUES), "every default flag with a value has a declared type"


# ---- values by type ----------------------------------------------------------------------------------

@pytest.mark.parametrize("arg, words", [
    pytest.param("--enforce-eager=false", "--enforce-eager is a switch and takes no value (got 'false')", id="switch-false"),
    pytest.param("--enable-prefix-caching=1", "is a switch and takes no value", id="switch-one"),
    pytest.param("--no-enforce-eager=true", "is a switch and takes no value", id="negated-switch-value"),
    pytest.param("--max-model-len=abc", "--max-model-len takes a whole number (got 'abc')", id="not-a-number"),
    pytest.param("--max-model-len=-1", "from 1 to 16777216 (got -1)", id="negative"),
    pytest.param("--max-model-len=0", "from 1 to 16777216 (got 0)", id="zero"),
    pytest.param("--max-model-len=4096.5", "takes a whole number", id="fraction"),
    pytest.param("--max-model-len=1e3", "takes a whole number", id="exponent"),
    pytest.param("--max-model-len=99999999999999", "takes a whole number", id="huge"),
    pytest.param("--max-model-len", "needs a value", id="valued-without-value"),
    pytest.param("--block-size=0", "from 1 to 1024", id="block-size-zero"),
    pytest.param("--stream-interval=0x10", "takes a whole number", id="hex"),
    pytest.param("--long-prefill-token-threshold=-5", "from 0 to", id="threshold-negative"),
    pytest.param("--scheduling-policy=lifo", "takes one of fcfs, priority (got 'lifo')", id="choice"),
    pytest.param("--kv-cache-dtype=fp8;rm", "takes a word", id="word-metachar"),
    pytest.param("--enforce-eage", "spell the flag in full, --enforce-eager", id="abbreviated"),
    pytest.param("--max-model-le=8", "spell the flag in full, --max-model-len", id="abbreviated-valued"),
])
def test_each_value_is_checked_by_its_type(arg, words):
    (problem,) = extra(arg)
    assert problem.startswith(f"spec.searchSpace.extraArgs[0] '{arg}'" if "=" in arg else
                              f"spec.searchSpace.extraArgs[0] '{arg}'") and words in problem, problem


@pytest.mark.parametrize("args", [["--enforce-eager"], ["--max-model-len=4096"], ["--block-size=16"],
                                  ["--scheduling-policy=priority"], ["--kv-cache-dtype=fp8_e4m3"],
                                  ["--no-enable-chunked-prefill", "--long-prefill-token-threshold=0"]])
def test_well_typed_default_flags_pass(args):
    assert extra(*args) == []


def test_an_install_flag_is_checked_by_its_arity():
    install = Install("op:1", extra_flags=("enable-log-requests", "dtype"))
    assert "is a switch" in extra("--enable-log-requests=no", install=install)[0]
    assert "needs a value" in extra("--dtype", install=install)[0]


@pytest.mark.parametrize("flags, words", [
    pytest.param(["max-num-seqs"], "is a knob batchtune tunes", id="knob"),
    pytest.param(["enforce-eage"], "is not a vLLM flag", id="prefix"),
    pytest.param(["no-such-flag"], "is not a vLLM flag", id="unknown"),
])
def test_the_install_can_allow_only_vllm_flags_that_are_not_knobs(flags, words):
    (problem,) = install_flag_problems(VLLM, flags)
    assert words in problem and f"--{flags[0]}" in problem


def test_the_operator_refuses_to_start_with_a_flag_vllm_does_not_have():
    import argparse

    from batchtune.controller import main as operator

    parser = argparse.ArgumentParser()
    operator.add_parser(parser.add_subparsers())
    args = parser.parse_args(["operator", "--allowed-extra-flag=--dtype", "--allowed-extra-flag", "seed"])
    assert operator.environment(args)["BATCHTUNE_ALLOWED_EXTRA_FLAGS"] == "dtype,seed"
    with pytest.raises(SystemExit, match="--bogus is not a vLLM flag"):
        operator.environment(parser.parse_args(["operator", "--allowed-extra-flag=bogus"]))


# ---- numerics: applied in Auto only when the spec says so ----------------------------------------------

def test_a_numerics_flag_needs_the_spec_s_explicit_word():
    assert numerics_unconfirmed(VLLM, spec_with(searchSpace__extraArgs=["--kv-cache-dtype=fp8"])) == ["--kv-cache-dtype"]
    assert numerics_unconfirmed(VLLM, spec_with(searchSpace__extraArgs=["--kv-cache-dtype=fp8"],
                                                apply__allowNumericsChange=True)) == []
    assert numerics_unconfirmed(VLLM, spec_with(searchSpace__extraArgs=["--enforce-eager"])) == []


# ---- install-independent rules, in the models (the operator's parse_spec and validate alike) ---------------

BAD_IMAGES = ["UPPER/case:1", "with space:1", "x;rm -rf:1", "a//b:1", ":tag", "name:", "-lead:1", "x:1\n",
              "reg.example.com/x@sha256:abc", "x:" + "t" * 129, "$(IMAGE)", "reg.example.com:port/x:1"]
BAD_LABELS = ["__name__", "__meta_kubernetes_pod_name", "__", "le", "quantile"]
BAD_KEYS = [".", "..", "..data", "...x"]


@pytest.mark.parametrize("image", BAD_IMAGES)
def test_an_image_that_is_not_an_image_reference_is_refused(image):
    with pytest.raises(InvalidBatchTuning) as refused:
        spec_with(load__image=image)
    (error,) = refused.value.errors
    assert error.path == "spec.load.image" and error.message == "is not an image reference" and error.value == image


@pytest.mark.parametrize("image", ["vllm/vllm-openai:v0.10.1", "localhost:5000/team/lg:1", "lg",
                                   "registry.example.com/a/b_c__d-e:1.2-rc1", "r.example/x@sha256:" + "a" * 64,
                                   "r.example/x:1@sha256:" + "a" * 64])
def test_image_references_pass(image):
    assert spec_with(load__image=image).load.image == image


@pytest.mark.parametrize("field", ["prometheus__labels__pod", "prometheus__labels__namespace", "prometheus__labels__model",
                                   "prometheus__gpuLabels__pod", "prometheus__gpuLabels__namespace"])
@pytest.mark.parametrize("name", BAD_LABELS)
def test_label_names_prometheus_reserves_are_refused(field, name):
    with pytest.raises(InvalidBatchTuning) as refused:
        spec_with(**{field: name})
    (error,) = refused.value.errors
    assert error.path == "spec." + ".".join(field.split("__")) and error.value == name
    assert "label name Prometheus reserves" in error.message


@pytest.mark.parametrize("key", BAD_KEYS)
@pytest.mark.parametrize("field", ["prometheus__authSecretRef", "load__traceConfigMapRef"])
def test_keys_kubernetes_refuses_are_refused(field, key):
    with pytest.raises(InvalidBatchTuning) as refused:
        spec_with(**{field: {"name": "x", "key": key}})
    assert [(e.path.rsplit(".", 1)[1], e.value) for e in refused.value.errors if e.path.endswith(".key")] == [("key", key)]
    assert any("is not a Secret or ConfigMap key Kubernetes allows" in e.message for e in refused.value.errors)


@pytest.mark.parametrize("key", [".hidden", "a..b", "token", "trace.jsonl"])
def test_keys_kubernetes_allows_pass(key):
    assert spec_with(prometheus__authSecretRef={"name": "s", "key": key}).prometheus.auth_secret_ref.key == key


# ---- the install's bounds, from a Helm values file -------------------------------------------------------

def test_the_chart_s_own_values_are_the_default_install():
    values = yaml.safe_load((REPO / "charts" / "batchtune" / "values.yaml").read_text())
    assert install_from_values(values, __version__) == DEFAULT == Install(f"batchtune:{__version__}",
                                                                          prometheus_urls=DEFAULT_PROMETHEUS_URLS)


def test_values_are_read_as_the_chart_reads_them():
    install = install_from_values({
        "image": {"repository": "reg.example.com/batchtune", "digest": "sha256:" + "c" * 64},
        "load": {"allowedImages": ["reg.example.com/lg:1"]}, "prometheus": {"allowedUrls": ["http://prom:9090/"]},
        "git": {"allowedUrls": ["https://github.com/acme/"]}, "maxGpuMinutesPerTuning": 60,
        "searchSpace": {"allowedExtraFlags": ["--dtype", "seed"]}}, __version__)
    assert install == Install("reg.example.com/batchtune@sha256:" + "c" * 64, ("reg.example.com/lg:1",),
                              ("http://prom:9090/",), 60, git_urls=("https://github.com/acme/",),
                              extra_flags=("dtype", "seed"))
    assert install_from_values({"operator": {"loadGeneratorImage": "lg:2"}}, "9").operator_image == "lg:2"
    assert install_from_values({"image": {"tag": "1.2"}}, "9").operator_image == "batchtune:1.2"


@pytest.mark.parametrize("values, words", [
    pytest.param([], "a mapping at the top", id="list"),
    pytest.param({"load": "x"}, "load must be a mapping", id="section"),
    pytest.param({"load": {"allowedImages": "x"}}, "load.allowedImages must be a list", id="not-a-list"),
    pytest.param({"searchSpace": {"allowedExtraFlags": [1]}}, "searchSpace.allowedExtraFlags must be a list", id="item"),
    pytest.param({"maxGpuMinutesPerTuning": "60"}, "maxGpuMinutesPerTuning must be a whole number", id="budget-text"),
    pytest.param({"maxGpuMinutesPerTuning": 0}, "(got 0)", id="budget-zero"),
    pytest.param({"maxGpuMinutesPerTuning": True}, "(got True)", id="budget-bool"),
    pytest.param({"image": {"tag": 3}}, "image.tag must be a string", id="tag"),
])
def test_a_values_file_the_chart_would_refuse_is_named(values, words):
    with pytest.raises(InvalidValues, match=words.replace("(", r"\(").replace(")", r"\)")):
        install_from_values(values, __version__)


def test_urls_are_bounded_by_the_install():
    spec = spec_with(prometheus__url="http://other:9090/")
    assert url_problems(spec, Install("op:1")) == []  # no prefix listed: the address rules alone
    assert url_problems(spec, DEFAULT)  # the chart's default names one in-cluster Prometheus
    (problem,) = url_problems(spec, Install("op:1", prometheus_urls=("http://prom:9090/",)))
    assert problem.startswith("spec.prometheus.url 'http://other:9090/' is not under a Prometheus URL this install")


# ---- batchtune validate, with and without --values ---------------------------------------------------------

def write(tmp_path: Path, name: str, obj: Any) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(obj))
    return str(path)


def doc(**edits: Any) -> dict[str, Any]:
    obj = copy.deepcopy(MINIMAL)
    for path, value in edits.items():
        node = obj["spec"]
        *parents, last = path.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return obj


@pytest.mark.parametrize("edits, line", [
    pytest.param({"load__image": "Evil Image"}, 'spec.load.image: is not an image reference (got "Evil Image")', id="image"),
    pytest.param({"prometheus__labels__pod": "__name__"}, "spec.prometheus.labels.pod: is a label name Prometheus "
                 "reserves (__*) or batchtune's queries use (le, quantile) (got \"__name__\")", id="label"),
    pytest.param({"prometheus__authSecretRef": {"name": "s", "key": ".."}}, "spec.prometheus.authSecretRef.key: is not "
                 "a Secret or ConfigMap key Kubernetes allows (not '.', and not starting with '..') (got \"..\")", id="key"),
    pytest.param({"searchSpace__extraArgs": ["--enforce-eager=false"]}, "spec.searchSpace.extraArgs[0]: "
                 "'--enforce-eager=false': --enforce-eager is a switch and takes no value (got 'false')", id="switch"),
    pytest.param({"searchSpace__extraArgs": ["--max-num-seqs=-1"]}, "spec.searchSpace.extraArgs[0]: '--max-num-seqs' "
                 "sets a knob batchtune tunes (vLLM --max-num-seqs); list its candidates under searchSpace instead",
                 id="knob"),
    pytest.param({"load__image": "reg.example.com/lg:1"}, "spec.load.image: 'reg.example.com/lg:1' is not an image "
                 f"this install allows (batchtune:{__version__}; Helm value load.allowedImages)", id="install-image"),
    pytest.param({"apply": {"mode": "PullRequest", "git": {"url": "https://github.com/acme/x", "path": "deploy",
                                                          "layout": "Kustomize"}}},
                 "spec.apply.git.url: 'https://github.com/acme/x': this install allows no Git repository (Helm value "
                 "git.allowedUrls); use spec.apply.mode Recommend", id="install-git"),
])
def test_validate_refuses_what_the_operator_refuses(tmp_path, capsys, edits, line):
    path = write(tmp_path, "bt.yaml", doc(**edits))
    assert main(["validate", "-f", path]) == 1
    assert capsys.readouterr().out.splitlines() == [f"{path}: {line}"]


def test_validate_applies_the_install_s_bounds_from_values(tmp_path, capsys):
    values = write(tmp_path, "values.yaml", {
        "load": {"allowedImages": ["reg.example.com/lg:1"]}, "prometheus": {"allowedUrls": ["http://prom:9090/"]},
        "maxGpuMinutesPerTuning": 60, "searchSpace": {"allowedExtraFlags": ["--dtype"]}})
    ok = write(tmp_path, "ok.yaml", doc(load__image="reg.example.com/lg:1", prometheus__url="http://prom:9090/api",
                                        searchSpace__extraArgs=["--dtype=half"], strategy={"maxGpuMinutes": 600}))
    assert main(["validate", "-f", ok]) == 1  # the chart's defaults allow none of it
    out = capsys.readouterr().out
    assert "spec.searchSpace.extraArgs[0]: '--dtype'" in out and "spec.load.image: 'reg.example.com/lg:1'" in out
    assert main(["validate", "-f", ok, "--values", values]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{ok}: llama-8b: valid (note: ")
    assert "spec.strategy.maxGpuMinutes 600 is above this install's ceiling (60" in out
    assert "--dtype change(s) what production outputs" in out and "spec.apply.allowNumericsChange" in out
    elsewhere = write(tmp_path, "far.yaml", doc(prometheus__url="http://elsewhere:9090/"))
    assert main(["validate", "-f", elsewhere, "--values", values]) == 1
    assert "spec.prometheus.url: 'http://elsewhere:9090/' is not under a Prometheus URL" in capsys.readouterr().out


@pytest.mark.parametrize("content, words", [
    pytest.param("searchSpace:\n  allowedExtraFlags: [--max-num-seqs]\n", "is a knob batchtune tunes", id="knob"),
    pytest.param("searchSpace:\n  allowedExtraFlags: [--bogus]\n", "--bogus is not a vLLM flag", id="unknown"),
    pytest.param("a: [b\n", "not valid YAML", id="yaml"),
    pytest.param("- 1\n", "a mapping at the top", id="list"),
])
def test_validate_names_what_is_wrong_with_a_values_file(tmp_path, capsys, content, words):
    values = tmp_path / "values.yaml"
    values.write_text(content)
    bt = write(tmp_path, "bt.yaml", doc())
    assert main(["validate", "-f", bt, "--values", str(values)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{values}: cannot use as Helm values: ") and words in err, err


def test_the_crd_holds_the_models_rules_in_the_same_words():
    """One definition: the CRD's CEL rules on images, labels and keys carry the models' regex and messages."""
    from batchtune.api.models import KEY_MESSAGE, RESERVED_LABEL_MESSAGE
    from batchtune.core.policy import IMAGE_REFERENCE, IMAGE_REFERENCE_MESSAGE

    crd = yaml.safe_load((REPO / "crds" / "batchtune.io_batchtunings.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    (image,) = spec["load"]["properties"]["image"]["x-kubernetes-validations"]
    assert image == {"rule": f"self.matches('{IMAGE_REFERENCE}')".replace("\\", "\\\\"), "message": IMAGE_REFERENCE_MESSAGE}
    prom = spec["prometheus"]["properties"]
    for labels in ("labels", "gpuLabels"):
        for name, node in prom[labels]["properties"].items():
            assert [r["message"] for r in node["x-kubernetes-validations"]] == [RESERVED_LABEL_MESSAGE], name
    for ref in (prom["authSecretRef"], spec["load"]["properties"]["traceConfigMapRef"]):
        assert [r["message"] for r in ref["properties"]["key"]["x-kubernetes-validations"]] == [KEY_MESSAGE]
