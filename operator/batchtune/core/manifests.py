"""Trial Deployments and load-generator Jobs, built from the target as plain dicts (deterministic)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shlex
from urllib.parse import urlsplit
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from batchtune.core.args import find_vllm_container, rewrite_vllm_args
from batchtune.core.settings import Setting

API_VERSION = "batchtune.io/v1alpha1"
KIND = "BatchTuning"
LABEL_TUNING = "batchtune.io/tuning"
LABEL_TRIAL = "batchtune.io/trial"
LABEL_COMPONENT = "batchtune.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "batchtune"
ANNOTATION_SETTING = "batchtune.io/setting"
ANNOTATION_ARGS = "batchtune.io/args"
TERMINATION_LOG = "/dev/termination-log"
MAX_NAME = 63

# Metadata the API server owns: a clone must not carry it.
_SERVER_FIELDS = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields",
                  "selfLink", "deletionTimestamp", "deletionGracePeriodSeconds", "ownerReferences")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _short_hash(text: str, n: int = 5) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def child_name(bt_name: str, suffix: str) -> str:
    """`<bt>-<suffix>` within 63 characters; a long BatchTuning name is cut and given a hash."""
    name = f"{bt_name}-{suffix}"
    if len(name) <= MAX_NAME:
        return name
    keep = MAX_NAME - len(suffix) - 7  # "-" + 5 hash chars + "-"
    return f"{bt_name[:keep].rstrip('-.')}-{_short_hash(bt_name)}-{suffix}"


def trial_name(bt_name: str, trial_index: int) -> str:
    return child_name(bt_name, f"trial-{trial_index}")


def load_job_name(bt_name: str, trial_index: int, repeat: int = 0) -> str:
    return child_name(bt_name, f"load-{trial_index}" + (f"-r{repeat}" if repeat else ""))


def label_value(text: str) -> str:
    """A valid label value naming `text` (cut with a hash when too long or oddly spelled)."""
    if len(text) <= MAX_NAME and _LABEL_VALUE.match(text):
        return text
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[: MAX_NAME - 6].strip("-_.")
    return f"{cleaned}-{_short_hash(text)}"


def owner_reference(bt_name: str, bt_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION, "kind": KIND, "name": bt_name, "uid": bt_uid,
        "controller": True, "blockOwnerDeletion": True,
    }


def trial_labels(bt_name: str, trial_index: int, component: str) -> dict[str, str]:
    return {
        LABEL_TUNING: label_value(bt_name),
        LABEL_TRIAL: str(trial_index),
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def _matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def build_trial_deployment(
    target: Mapping[str, Any],
    bt_name: str,
    bt_uid: str,
    namespace: str,
    trial_index: int,
    setting: Setting,
    extra_args: Sequence[str] = (),
    container_name: str | None = None,
    service_selectors: Sequence[Mapping[str, str]] = (),
) -> dict[str, Any]:
    """One-replica Deployment running the target's pod template with the setting's vLLM flags.

    Production Services must never send traffic to a trial: the target's selector labels are
    dropped from the pod labels, and so is every label of any `service_selectors` entry (the
    namespace's Service selectors, when the caller knows them) that would still match.
    """
    spec = target.get("spec") or {}
    template = copy.deepcopy(spec.get("template") or {})
    pod_meta = template.setdefault("metadata", {})
    for key in _SERVER_FIELDS + ("name", "namespace"):
        pod_meta.pop(key, None)
    labels = dict(pod_meta.get("labels") or {})
    for key in (spec.get("selector") or {}).get("matchLabels") or {}:
        labels.pop(key, None)
    for sel in service_selectors:
        if _matches(sel, labels):
            for key in sel:
                labels.pop(key, None)
    own = trial_labels(bt_name, trial_index, "trial")
    labels.update(own)
    pod_meta["labels"] = labels
    annotations = dict(pod_meta.get("annotations") or {})
    annotations[ANNOTATION_SETTING] = setting.label()
    pod_meta["annotations"] = annotations

    pod_spec = template.setdefault("spec", {})
    chosen = find_vllm_container(pod_spec, container_name)
    rewritten = rewrite_vllm_args(chosen, setting, extra_args)
    pod_spec["containers"] = [rewritten if c.get("name") == chosen.get("name") else c for c in pod_spec.get("containers", [])]

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
                ANNOTATION_ARGS: json.dumps(setting.as_args() + list(extra_args)),
                "batchtune.io/target": str(target_meta.get("name", "")),
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
    """What load to drive at one trial (from spec.load and spec.trial)."""

    input_tokens: int = 512
    output_tokens: int = 128
    concurrency: int | None = None
    """Closed loop; None with no rate: the caller passes the trial's max-num-seqs."""
    requests_per_minute: int | None = None
    """Open loop (Poisson arrivals)."""
    duration_seconds: int | None = 60
    num_prompts: int | None = None
    warmup_seconds: int = 30
    percentile: int = 95

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.requests_per_minute is None):
            raise ValueError(
                f"exactly one of concurrency ({self.concurrency!r}) and requests_per_minute "
                f"({self.requests_per_minute!r}) must be set"
            )
        if self.duration_seconds is None and self.num_prompts is None:
            raise ValueError("one of duration_seconds and num_prompts must be set")

    def bound_seconds(self) -> int:
        """How long the Job may run: warm-up + measurement, doubled, plus two minutes to start."""
        measure = self.duration_seconds or 600
        return 2 * (self.warmup_seconds + measure) + 120


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
        "--termination-message-path", TERMINATION_LOG,
        "--quiet",
    ]
    if profile.concurrency is not None:
        args += ["--concurrency", str(profile.concurrency)]
    else:
        args += ["--request-rate", f"{profile.requests_per_minute / 60:.6g}"]
    host = urlsplit(base_url).hostname or ""
    if not host.startswith("127."):
        args.append("--allow-non-loopback")  # real clusters: pod IPs are not loopback
    return args


def _vllm_bench_script(base_url: str, model: str, profile: LoadProfile) -> str:
    if profile.num_prompts is not None:
        prompts = profile.num_prompts
    elif profile.requests_per_minute is not None:
        prompts = max(1, profile.requests_per_minute * (profile.duration_seconds or 60) // 60)
    else:  # closed loop bounded by time: enough prompts, cut by `timeout`
        prompts = max(10 * (profile.concurrency or 1), 100)
    argv = [
        "vllm", "bench", "serve", "--backend", "openai", "--base-url", base_url, "--model", model,
        "--dataset-name", "random", "--random-input-len", str(profile.input_tokens),
        "--random-output-len", str(profile.output_tokens), "--ignore-eos",
        "--num-prompts", str(prompts),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,95,99",
        "--save-result", "--result-dir", "/tmp", "--result-filename", "result.json",
    ]
    if profile.concurrency is not None:
        argv += ["--max-concurrency", str(profile.concurrency)]
    else:
        argv += ["--request-rate", f"{profile.requests_per_minute / 60:.6g}"]
    run = shlex.join(argv)
    if profile.duration_seconds is not None and profile.num_prompts is None:
        run = f"timeout {profile.warmup_seconds + profile.duration_seconds + 60} {run}"
    # The result JSON (without per-request arrays) fits the 4 KiB termination message.
    return f"{run} && cp /tmp/result.json {TERMINATION_LOG}"


def build_load_job(
    bt_name: str,
    bt_uid: str,
    namespace: str,
    trial_index: int,
    *,
    generator: str,
    image: str,
    base_url: str,
    model: str,
    profile: LoadProfile,
    repeat: int = 0,
) -> dict[str, Any]:
    """The load-generator Job for one trial (repeat): bounded by count and time, never retried.

    `Builtin`: `image` is the operator image, running `batchtune loadgen ...`, which writes its
    summary JSON to the termination message. `VllmBench`: `image` is the target's image, running
    `vllm bench serve`, whose result JSON is copied to the termination message.
    """
    labels = trial_labels(bt_name, trial_index, "load")
    if generator == "Builtin":
        container = {"name": "loadgen", "image": image, "command": ["batchtune"],
                     "args": _builtin_args(base_url, model, profile)}
    elif generator == "VllmBench":
        container = {"name": "loadgen", "image": image, "command": ["sh", "-c"],
                     "args": [_vllm_bench_script(base_url, model, profile)]}
    else:
        raise ValueError(f"load.generator {generator!r} is not Builtin or VllmBench")
    container.update({
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
    })
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": load_job_name(bt_name, trial_index, repeat),
            "namespace": namespace,
            "labels": dict(labels),
            "annotations": {"batchtune.io/repeat": str(repeat)},
            "ownerReferences": [owner_reference(bt_name, bt_uid)],
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": profile.bound_seconds(),
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {"restartPolicy": "Never", "containers": [container]},
            },
        },
    }


def load_profile_from_spec(spec: Any, max_num_seqs: int) -> LoadProfile:
    """From the api model's spec (load, trial, slo); closed-loop concurrency defaults to max-num-seqs."""
    load, trial = spec.load, spec.trial
    percentile = getattr(spec.slo.percentile, "value", spec.slo.percentile)
    concurrency = load.concurrency
    if concurrency is None and load.requests_per_minute is None:
        concurrency = max_num_seqs
    duration = load.duration_seconds
    if duration is None and load.num_prompts is None:
        duration = trial.measure_seconds
    return LoadProfile(
        input_tokens=load.input_tokens, output_tokens=load.output_tokens, concurrency=concurrency,
        requests_per_minute=load.requests_per_minute, duration_seconds=duration, num_prompts=load.num_prompts,
        warmup_seconds=trial.warmup_seconds, percentile=int(str(percentile).lstrip("Pp")),
    )
