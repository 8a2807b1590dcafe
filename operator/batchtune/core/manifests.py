"""Trial Deployments and load-generator Jobs, built from the target as plain dicts (deterministic).

Names stay within Kubernetes' 63-character limit for any valid BatchTuning name. A trial pod never
matches production: the labels production's Deployment selects on (matchLabels and the keys of
matchExpressions) and every label by which a Service in the namespace would select it are removed. A
trial runs on the GPU product production runs on. Load Jobs run under the `restricted` Pod Security
profile with no ServiceAccount token: they only send HTTP to one trial pod.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from batchtune import API_GROUP, API_VERSION, KIND
from batchtune.core.gpus import GPU_PRODUCT_LABEL
from batchtune.core.protocol import CurveLoad
from batchtune.core.settings import Setting
from batchtune.core.trial_loop import Run
from batchtune.core.tuning import View, goodput_targets
from batchtune.core.vocabulary import StepPurpose
from batchtune.core.warmup import steady_warmup
from batchtune.core.workload import bucket_text

if TYPE_CHECKING:
    from batchtune.engines import Engine

LABEL_TUNING = "batchtune.io/tuning"
LABEL_TRIAL = "batchtune.io/trial"
LABEL_COMPONENT = "batchtune.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "batchtune"
ANNOTATION_SETTING = "batchtune.io/setting"
ANNOTATION_ARGS = "batchtune.io/args"
ANNOTATION_TARGET = "batchtune.io/target"
TERMINATION_LOG = "/dev/termination-log"
MAX_NAME = 63
COMPONENT_TRIAL = "trial"
COMPONENT_LOAD = "load"

# Metadata the API server owns: a clone must not carry it.
_SERVER_FIELDS = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields",
                  "selfLink", "deletionTimestamp", "deletionGracePeriodSeconds", "ownerReferences")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
TRACE_MOUNT = "/trace"
TRACE_FILE = "trace.jsonl"
# The uid/gid of the load generator: any non-root id works under the restricted profile.
LOADGEN_UID = 65532


def _short_hash(text: str, n: int = 5) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def child_name(bt_name: str, suffix: str) -> str:
    """`<bt>-<suffix>` within 63 characters; a long BatchTuning name is cut and given a hash."""
    name = f"{bt_name}-{suffix}"
    if len(name) <= MAX_NAME:
        return name
    keep = MAX_NAME - len(suffix) - 7  # "-" + 5 hash chars + "-"
    if keep < 1:
        raise ValueError(f"child suffix {suffix!r} leaves no room for the BatchTuning name")
    return f"{bt_name[:keep].rstrip('-.')}-{_short_hash(bt_name)}-{suffix}"


def trial_name(bt_name: str, trial_index: int) -> str:
    return child_name(bt_name, f"trial-{trial_index}")


def load_job_name(bt_name: str, trial_index: int, step: int, repeat: int, attempt: int) -> str:
    """One Job per (trial, step, repeat, attempt): a retried run is a new object, never a reused one."""
    return child_name(bt_name, f"trial-{trial_index}-s{step}r{repeat}a{attempt}")


def report_name(bt_name: str) -> str:
    return child_name(bt_name, "report")


def label_value(text: str) -> str:
    """A valid label value naming `text` (cut with a hash when too long or oddly spelled)."""
    if len(text) <= MAX_NAME and _LABEL_VALUE.match(text):
        return text
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[: MAX_NAME - 6].strip("-_.")
    return f"{cleaned}-{_short_hash(text)}"


def owner_reference(bt_name: str, bt_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": bt_name, "uid": bt_uid,
        "controller": True, "blockOwnerDeletion": True,
    }


def trial_labels(bt_name: str, trial_index: int, component: str) -> dict[str, str]:
    return {
        LABEL_TUNING: label_value(bt_name),
        LABEL_TRIAL: str(trial_index),
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def trial_pod_selector(bt_name: str, trial_index: int) -> dict[str, str]:
    return {LABEL_TUNING: label_value(bt_name), LABEL_TRIAL: str(trial_index), LABEL_COMPONENT: COMPONENT_TRIAL}


def _selector_keys(selector: Mapping[str, Any]) -> set[str]:
    keys = set((selector.get("matchLabels") or {}).keys())
    keys |= {str(e.get("key")) for e in selector.get("matchExpressions") or [] if e.get("key")}
    return keys


def _matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def isolated_labels(pod_labels: Mapping[str, str], deployment_selector: Mapping[str, Any],
                    service_selectors: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The pod labels less every label production's Deployment or any Service could select the pod by."""
    labels = {k: v for k, v in pod_labels.items() if k not in _selector_keys(deployment_selector)}
    changed = True
    while changed:  # removing one Service's keys never makes another match, but be exact anyway
        changed = False
        for sel in service_selectors:
            if _matches(sel, labels):
                for key in sel:
                    labels.pop(key, None)
                changed = True
    return labels


def build_trial_deployment(
    engine: Engine,
    target: Mapping[str, Any],
    container: Mapping[str, Any],
    bt_name: str,
    bt_uid: str,
    namespace: str,
    trial_index: int,
    setting: Setting,
    extra_args: Sequence[str] = (),
    service_selectors: Sequence[Mapping[str, str]] = (),
    gpu_product: str | None = None,
    as_is: bool = False,
) -> dict[str, Any]:
    """One-replica Deployment running the target's pod template with the setting's engine flags.

    `as_is`: production's engine container unchanged (a retune round's trial 0, which measures the
    setting production runs); `setting` then only names it.
    """
    spec = target.get("spec") or {}
    template = copy.deepcopy(spec.get("template") or {})
    pod_meta = template.setdefault("metadata", {})
    for key in _SERVER_FIELDS + ("name", "namespace"):
        pod_meta.pop(key, None)
    labels = isolated_labels(pod_meta.get("labels") or {}, spec.get("selector") or {}, service_selectors)
    own = trial_labels(bt_name, trial_index, COMPONENT_TRIAL)
    labels.update(own)
    pod_meta["labels"] = labels
    annotations = dict(pod_meta.get("annotations") or {})
    annotations[ANNOTATION_SETTING] = setting.label()
    pod_meta["annotations"] = annotations

    pod_spec = template.setdefault("spec", {})
    if not as_is:
        rewritten = engine.rewrite(container, setting, extra_args)
        pod_spec["containers"] = [rewritten if c.get("name") == container.get("name") else c
                                  for c in pod_spec.get("containers", [])]
    if gpu_product:
        pod_spec["nodeSelector"] = {**(pod_spec.get("nodeSelector") or {}), GPU_PRODUCT_LABEL: gpu_product}

    selector = {LABEL_TUNING: own[LABEL_TUNING], LABEL_TRIAL: own[LABEL_TRIAL]}
    target_meta = target.get("metadata") or {}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": trial_name(bt_name, trial_index),
            "namespace": namespace,
            "labels": dict(own),
            "annotations": {
                ANNOTATION_SETTING: setting.label(),
                ANNOTATION_ARGS: json.dumps(list(container.get("args") or []) if as_is
                                            else engine.setting_args(setting) + list(extra_args)),
                ANNOTATION_TARGET: str(target_meta.get("name", "")),
            },
            "ownerReferences": [owner_reference(bt_name, bt_uid)],
        },
        "spec": {
            "replicas": 1,
            "revisionHistoryLimit": 0,
            "strategy": {"type": "Recreate"},  # never two trial pods on one GPU budget
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }


@dataclass(frozen=True)
class LoadProfile:
    """What load to drive at one trial step (from spec.load, spec.trial and production's workload)."""

    input_tokens: int = 512
    output_tokens: int = 128
    concurrency: int | None = None
    """Closed loop: requests in flight."""
    requests_per_minute: int | None = None
    """Open loop: mean arrival rate."""
    duration_seconds: int | None = 60
    """Measurement window after the warm-up."""
    num_prompts: int | None = None
    warmup_seconds: int = 30
    steady_warmup: bool = False
    """End the warm-up once the load has settled, at most at warmup_seconds (Builtin generator only:
    core/warmup.py)."""
    percentile: int = 95
    burstiness: float = 1.0
    """Gamma shape of inter-arrival times (1: Poisson; below 1: burstier)."""
    seed: int = 0
    prompt_lengths: str | None = None
    """Production's prompt-length histogram (`le:count,...`) to sample from; None: input_tokens each."""
    output_lengths: str | None = None
    """Production's output-length histogram to sample from; None: output_tokens each."""
    max_model_len: int | None = None
    """The engine's context length: sampled prompt plus output lengths stay within it."""
    trace_speed_percent: int | None = None
    """Replay the trace at this percent of its own speed (100: as is)."""
    trace_config_map: str | None = None
    """The ConfigMap (in the BatchTuning's namespace) the load Job mounts the trace from."""
    trace_key: str = "trace.jsonl"
    """The trace's key in that ConfigMap."""
    goodput_ms: tuple[tuple[str, int], ...] = ()
    """Per-request SLO targets (`ttft`, `tpot`, `e2el` in ms) the load generator's goodput counts against."""

    def __post_init__(self) -> None:
        loops = (self.concurrency, self.requests_per_minute, self.trace_speed_percent)
        if sum(v is not None for v in loops) != 1:
            raise ValueError(
                f"exactly one of concurrency ({self.concurrency!r}), requests_per_minute "
                f"({self.requests_per_minute!r}) and trace_speed_percent ({self.trace_speed_percent!r}) must be set"
            )
        if (self.trace_speed_percent is None) != (self.trace_config_map is None):
            raise ValueError("a trace needs both trace_speed_percent and trace_config_map")
        if self.duration_seconds is None and self.num_prompts is None:
            raise ValueError("one of duration_seconds and num_prompts must be set")

    def bound_seconds(self) -> int:
        """How long the Job may run: warm-up + measurement, doubled, plus two minutes to start."""
        measure = self.duration_seconds or 600
        return 2 * (self.warmup_seconds + measure) + 120


def load_profile(view: View, run: Run, seed: int, curve: CurveLoad | None = None,
                 max_model_len: int | None = None) -> LoadProfile:
    """The load of one run of the trial loop (`core.trial_loop.Run`) as the load generator drives it: spec.load and
    spec.trial through the tick's view, production's lengths and burstiness when it drives production's workload.

    The curve step runs the common load (`curve`: a concurrency or a rate), never a trace's speed."""
    spec = view.spec
    curve = curve if run.purpose is StepPurpose.CURVE else None
    open_loop = curve.open_loop if curve is not None else view.protocol.open_loop
    trace = view.protocol.trace and curve is None
    measured = view.workload
    ref = spec.load.trace
    return LoadProfile(
        input_tokens=view.input_tokens, output_tokens=view.output_tokens,
        concurrency=None if open_loop else run.load,
        requests_per_minute=run.load if open_loop and not trace else None,
        trace_speed_percent=run.load if trace else None,
        trace_config_map=ref.config_map if trace and ref is not None else None,
        trace_key=ref.key if ref is not None else "trace.jsonl",
        duration_seconds=run.seconds, num_prompts=spec.load.num_prompts, warmup_seconds=spec.trial.warmup_seconds,
        steady_warmup=steady_warmup(spec.trial.warmup, spec.load.builtin_generator, run.runs_before, trace),
        percentile=view.slo.percentile, seed=seed,
        burstiness=measured.burstiness if measured is not None else 1.0,
        prompt_lengths=bucket_text(measured.prompt) if measured is not None else None,
        output_lengths=bucket_text(measured.output) if measured is not None else None,
        max_model_len=max_model_len, goodput_ms=goodput_targets(view.slo))


def _builtin_args(base_url: str, model: str, profile: LoadProfile) -> list[str]:
    """Arguments of `batchtune loadgen` (cli/loadgen.py): both a prompt count and a time cap."""
    duration = profile.duration_seconds or profile.bound_seconds()
    args = [
        "loadgen", "--base-url", base_url, "--model", model,
        "--input-len", str(profile.input_tokens), "--output-len", str(profile.output_tokens),
        "--num-prompts", str(profile.num_prompts or 1_000_000),
        "--duration", str(profile.warmup_seconds + duration),
        "--warmup-seconds", str(profile.warmup_seconds),
        "--metric-percentiles", "50,90,95,99",
        "--seed", str(profile.seed),
        "--termination-message-path", TERMINATION_LOG,
        "--quiet",
    ]
    if profile.concurrency is not None:
        args += ["--concurrency", str(profile.concurrency)]
    elif profile.trace_speed_percent is not None:
        args += ["--trace", f"{TRACE_MOUNT}/{TRACE_FILE}", "--trace-speed-percent", str(profile.trace_speed_percent)]
    else:
        assert profile.requests_per_minute is not None
        args += ["--request-rate", f"{profile.requests_per_minute / 60:.6g}", "--burstiness", f"{profile.burstiness:g}"]
    if profile.prompt_lengths:
        args += ["--prompt-buckets", profile.prompt_lengths]
    if profile.output_lengths:
        args += ["--output-buckets", profile.output_lengths]
    if profile.max_model_len:
        args += ["--max-model-len", str(profile.max_model_len)]
    if profile.goodput_ms:
        args += ["--goodput", *(f"{key}:{ms}" for key, ms in profile.goodput_ms)]
    if profile.steady_warmup:
        args.append("--steady-warmup")
    host = urlsplit(base_url).hostname or ""
    if not host.startswith("127."):
        args.append("--allow-non-loopback")  # real clusters: pod IPs are not loopback
    return args


def restricted_security_context() -> dict[str, Any]:
    """A container security context the `restricted` Pod Security profile admits."""
    return {
        "runAsNonRoot": True, "runAsUser": LOADGEN_UID, "runAsGroup": LOADGEN_UID,
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
    }


def _job(bt_name: str, bt_uid: str, namespace: str, trial_index: int, name: str, profile: LoadProfile,
         containers: list[dict[str, Any]], init_containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    labels = trial_labels(bt_name, trial_index, COMPONENT_LOAD)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": containers,
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}],
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                     "ownerReferences": [owner_reference(bt_name, bt_uid)]},
        "spec": {"backoffLimit": 0, "activeDeadlineSeconds": profile.bound_seconds(),
                 "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec}},
    }


def _container(name: str, image: str, command: list[str], args: list[str]) -> dict[str, Any]:
    return {
        "name": name, "image": image, "command": command, "args": args,
        "env": [{"name": "HOME", "value": "/tmp"}],
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": restricted_security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }


def build_bench_job(
    engine: Engine,
    bt_name: str,
    bt_uid: str,
    namespace: str,
    trial_index: int,
    name: str,
    *,
    image: str,
    operator_image: str,
    base_url: str,
    model: str,
    tokenizer: str | None,
    profile: LoadProfile,
) -> dict[str, Any]:
    """The engine's own benchmark (VllmBench: `vllm bench serve` from the target's image) for one load run.

    The benchmark runs as an init container and saves its result JSON in /tmp; the operator's image
    then summarises it into the termination message (`batchtune loadgen --summarize-result`). No shell
    is involved. A bench run is bounded by its request count (`load.numPrompts`, else ten per
    concurrent request, at least 100) and by the Job's deadline.
    """
    prompts = profile.num_prompts
    if prompts is None:
        if profile.requests_per_minute is not None:
            prompts = max(100, profile.requests_per_minute * (profile.duration_seconds or 60) // 60)
        else:
            prompts = max(100, 10 * (profile.concurrency or 1))
    warmups = profile.concurrency or 1
    argv = engine.bench_argv(base_url, model, tokenizer, profile.input_tokens, profile.output_tokens,
                             profile.concurrency, profile.requests_per_minute, prompts, warmups, profile.seed,
                             "/tmp", "result.json", burstiness=profile.burstiness, goodput_ms=profile.goodput_ms)
    if argv is None:
        raise ValueError(f"{engine.display} has no benchmark client of its own; use spec.load.generator: Builtin")
    bench = _container("bench", image, argv[:1], argv[1:])
    summary = _container("summary", operator_image, ["batchtune"],
                         ["loadgen", "--summarize-result", "/tmp/result.json",
                          "--termination-message-path", TERMINATION_LOG])
    return _job(bt_name, bt_uid, namespace, trial_index, name, profile, [summary], [bench])


def build_load_job(
    bt_name: str,
    bt_uid: str,
    namespace: str,
    trial_index: int,
    name: str,
    *,
    image: str,
    base_url: str,
    model: str,
    profile: LoadProfile,
) -> dict[str, Any]:
    """The builtin load generator's Job for one load run: bounded by count and time, never retried.

    `image` is the operator's own image, running `batchtune loadgen ...`, which writes its summary
    JSON (with its own measurement window) to the termination message. A trace is mounted read-only
    from its ConfigMap (the kubelet reads it for the pod; the operator never does).
    """
    container = _container("loadgen", image, ["batchtune"], _builtin_args(base_url, model, profile))
    job = _job(bt_name, bt_uid, namespace, trial_index, name, profile, [container])
    if profile.trace_config_map is not None:
        pod = job["spec"]["template"]["spec"]
        pod["volumes"].append({"name": "trace", "configMap": {
            "name": profile.trace_config_map, "items": [{"key": profile.trace_key, "path": TRACE_FILE}]}})
        container["volumeMounts"].append({"name": "trace", "mountPath": TRACE_MOUNT, "readOnly": True})
    return job
