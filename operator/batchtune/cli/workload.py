"""`batchtune workload capture DEPLOYMENT`: production's workload profile (or a trace of its shape) from Prometheus.

The same measurement the operator makes for `spec.load.fromProduction` (`core.workload`, the engine's
metric names, `controller.prometheus`), run from a laptop: it reads the Deployment and its pods with
the caller's kubeconfig and queries Prometheus directly. Output:

- `-o summary` (default): the profile in words;
- `-o profile`: the profile as JSON, the shape of `status.workload`;
- `-o trace`: a JSONL trace with the profile's shape (gamma arrivals at the mean rate with the
  measured burstiness, lengths sampled from the histograms), for `spec.load.traceConfigMapRef`:
  `kubectl create configmap NAME --from-file=trace.jsonl=FILE`.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import Any

from batchtune.terminal import safe


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("workload", help="capture production's workload profile or a trace of its shape",
                            description="Production's traffic as batchtune measures it.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    capture = actions.add_parser(
        "capture", help="measure a vLLM Deployment's workload from Prometheus",
        description="Measure a Deployment's prompt/output length distributions, request rate, peak and burstiness "
                    "and prefix-cache hit rate over a lookback, from the engine's own series in Prometheus.")
    capture.add_argument("deployment", metavar="DEPLOYMENT", help="the production vLLM Deployment")
    capture.add_argument("-n", "--namespace", help="its namespace (default: the kubeconfig context's)")
    capture.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")
    capture.add_argument("--context", help="kubeconfig context (default: the current one)")
    capture.add_argument("--container", default=None, help="the engine container (default: the one running it)")
    capture.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL")
    capture.add_argument("--token-file", default=None, help="a file holding a bearer token for Prometheus")
    capture.add_argument("--lookback", type=int, default=3600, help="seconds of traffic to measure (default 3600)")
    capture.add_argument("--min-requests", type=int, default=100,
                         help="requests the lookback must hold (default 100)")
    capture.add_argument("--scrape-interval", type=float, default=15.0,
                         help="Prometheus' scrape interval in seconds: rate windows span four (default 15)")
    capture.add_argument("--metric-name", action="append", default=[], metavar="ROLE=NAME",
                         help="override a metric name, as spec.prometheus.metricNames (e.g. "
                              "requestPromptTokens=vllm:request_prompt_tokens); repeatable")
    capture.add_argument("--pod-label", default="pod", help="label holding the pod name (default pod)")
    capture.add_argument("--namespace-label", default="namespace", help="label holding the namespace")
    capture.add_argument("-o", "--output", choices=["summary", "profile", "trace"], default="summary")
    capture.add_argument("--requests", type=int, default=1000, help="requests in a -o trace (default 1000)")
    capture.add_argument("--seed", type=int, default=0, help="seed of a -o trace")
    capture.set_defaults(func=run)

    def usage(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=usage)


def overrides(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        role, sep, name = pair.partition("=")
        if not sep or not role or not name:
            raise ValueError(f"--metric-name {pair!r}: expected ROLE=NAME")
        out[role] = name
    return out


def run(args: argparse.Namespace) -> int:
    from batchtune.client import CliError, connect
    from batchtune.prometheus import PrometheusUnavailable

    try:
        kube = connect(args.kubeconfig, args.context)
        namespace = kube.namespace(args.namespace)
        profile = capture(kube, namespace, args)
        if isinstance(profile, str):
            print(f"error: {safe(profile)}", file=sys.stderr)
            return 1
        text = render(profile, args)
    except (CliError, ValueError, OSError, PrometheusUnavailable) as exc:
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 1
    print(text)
    if args.output == "trace":
        print(f"# put it where a BatchTuning's load Job can read it: kubectl -n {namespace} create configmap "
              f"{args.deployment}-trace --from-file=trace.jsonl=FILE", file=sys.stderr)
    return 0


def capture(kube: Any, namespace: str, args: argparse.Namespace) -> Any:
    """The profile of the Deployment's traffic, or why there is none (a string)."""
    from batchtune.core.manifests import LABEL_TUNING
    from batchtune.core.promql import LabelNames, MetricNames, QueryContext, rate_window_seconds
    from batchtune.core.workload import build_profile
    from batchtune.engines import ENGINES, ArgsError, find_engine_container
    from batchtune.prometheus import Production, PrometheusReader

    if args.lookback < 600:
        raise ValueError(f"--lookback {args.lookback}: at least 600 seconds")
    deployment = kube.get_deployment(namespace, args.deployment)
    spec = deployment.get("spec") or {}
    pod_spec = (spec.get("template") or {}).get("spec") or {}
    try:
        engine, _ = find_engine_container(pod_spec, args.container, ENGINES)
    except ArgsError as exc:
        raise ValueError(f"Deployment {namespace}/{args.deployment}: {exc}") from None
    match = (spec.get("selector") or {}).get("matchLabels") or {}
    pods = tuple(sorted(str(p["metadata"]["name"]) for p in kube.pods(namespace, match)
                        if LABEL_TUNING not in (p["metadata"].get("labels") or {})))
    token = None
    if args.token_file:
        from batchtune.files import read_text

        token = read_text(args.token_file, 64 * 1024).strip()  # InputFileError (a ValueError) naming the file
    ctx = QueryContext(MetricNames.build(engine.metrics, overrides(args.metric_name)),
                       LabelNames(args.pod_label, args.namespace_label, None), LabelNames(model=None))
    # The CLI's user picks their own Prometheus, often a port-forward to localhost; metadata stays refused.
    reader = PrometheusReader(args.prometheus, ctx, token=token, loopback_allowed=True)
    window = min(rate_window_seconds(args.scrape_interval), args.lookback)
    observation = reader.production_workload(Production(namespace, pods), args.lookback, window)
    if observation is None:
        return f"Deployment {namespace}/{args.deployment} has no pods to measure"
    result = build_profile(observation, args.min_requests)
    return result.profile if result.profile is not None else result.problem


def render(profile: Any, args: argparse.Namespace, now: datetime | None = None) -> str:
    """The captured profile in the asked form."""
    from batchtune.api import WorkloadRecord
    from batchtune.loadgen.workload import LengthSampler, synthesize_trace, trace_lines

    if args.output == "profile":
        record = WorkloadRecord.of(profile, now or datetime.now(UTC))
        return json.dumps(record.to_wire(), indent=2)
    if args.output == "trace":
        if args.requests < 1:
            raise ValueError(f"--requests {args.requests}: at least 1")
        rate = profile.arrivals.mean_per_second if profile.arrivals else 0.0
        if rate <= 0:
            raise ValueError("production's rate is not known: no trace can be made")
        sampler = LengthSampler(1, 1, prompts=profile.prompt, outputs=profile.output)
        return trace_lines(synthesize_trace(args.requests, rate, profile.burstiness, sampler, args.seed)).rstrip("\n")
    lines = [profile.summary()]
    lines += [f"note: {note}" for note in profile.notes]
    return "\n".join(lines)
