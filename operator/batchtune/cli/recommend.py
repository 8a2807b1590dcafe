"""`batchtune recommend NAME -o patch|kustomize|helm-values|args|hpa|keda`: the chosen setting as a ready change.

-o hpa / -o keda write an autoscaler for the target whose per-replica target is the chosen setting's
measured SLO capacity (`core.autoscale`).

stdout holds only the patch, so it pipes into `kubectl patch --type json -p "$(...)"`, a kustomization
or a values file; the setting and the reason go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

import yaml

from batchtune.cli.status import add_common_arguments
from batchtune.terminal import clean, safe

# -o value -> (status.recommendation field, what it is)
FORMATS = {
    "patch": ("jsonPatch", "RFC 6902 JSON patch for the target Deployment"),
    "kustomize": ("kustomizePatch", "Kustomize strategic-merge patch"),
    "helm-values": ("helmValues", "Helm values snippet"),
    "args": ("args", "vLLM container args, one per line"),
}
AUTOSCALERS = {"hpa": "HorizontalPodAutoscaler (autoscaling/v2) on vllm_requests_per_second",
               "keda": "KEDA ScaledObject with a Prometheus trigger"}


class NoRecommendation(Exception):
    pass


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("recommend", help="print a BatchTuning's recommendation as a patch",
                       description="Print the recommended setting as a JSON patch (-o patch), a Kustomize "
                                   "patch (-o kustomize), a Helm values snippet (-o helm-values) or the "
                                   "container args (-o args). The reason goes to stderr.")
    add_common_arguments(p)
    p.add_argument("-o", "--output", choices=sorted([*FORMATS, *AUTOSCALERS]), default="patch",
                   help="format (default patch); hpa and keda write an autoscaler targeting the measured capacity")
    p.add_argument("--min-replicas", type=int, default=None, help="hpa/keda: least replicas (default 1)")
    p.add_argument("--max-replicas", type=int, default=None,
                   help="hpa/keda: most replicas (default twice the replica hint, at least 2)")
    p.add_argument("--scale-down-seconds", type=int, default=300,
                   help="hpa: scale-down stabilization window (default %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batchtune.api import InvalidBatchTuning
    from batchtune.cli.view import status_error
    from batchtune.client import CliError, connect

    try:
        kube = connect(args.kubeconfig, args.context)
        bt = kube.get_batchtuning(kube.namespace(args.namespace), args.name)
        if args.output in AUTOSCALERS:
            text, note = autoscaler_text(bt, args.output, args.min_replicas, args.max_replicas,
                                         args.scale_down_seconds)
        else:
            text, note = recommendation_text(bt, args.output)
    except InvalidBatchTuning as exc:
        print(status_error(bt, exc), file=sys.stderr)
        return 1
    except (CliError, NoRecommendation, ValueError) as exc:
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 1
    print(note, file=sys.stderr)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def recommendation_text(bt: Mapping[str, Any], output: str) -> tuple[str, str]:
    """(the patch for stdout, a one-line note for stderr), or NoRecommendation saying why not.

    Both are safe to print: control characters from the object are escaped (a patch keeps its newlines,
    each arg of -o args and the note stay on their line).
    """
    from batchtune.cli.status import phase_of, setting_label
    from batchtune.cli.view import shown

    view = shown(bt)  # InvalidBatchTuning naming the field of a forged status
    status = view.status
    where = f"{view.namespace}/{view.name}"
    rec = status.recommendation
    phase = phase_of(view)
    if rec is None:
        if phase == "Failed":
            failed = status.condition("Failed")
            raise NoRecommendation(f"BatchTuning {where} failed without a recommendation: "
                                   f"{failed.reason if failed else ''}: {failed.message if failed else ''}")
        raise NoRecommendation(f"BatchTuning {where} has no recommendation yet (phase {phase}, "
                               f"{status.trials_completed}/{status.trials_planned} trials done); "
                               f"follow it with `batchtune status {view.name or 'NAME'} --watch`")
    field, what = FORMATS[output]
    wire = rec.model_dump(by_alias=True)  # FORMATS names the status fields by their camelCase names
    value = wire.get(field)
    if not value:
        available = [name for name, (f, _) in FORMATS.items() if wire.get(f)]
        raise NoRecommendation(f"BatchTuning {where} has no {what} (status.recommendation.{field} is empty)"
                               + (f"; available: -o {', -o '.join(available)}" if available else ""))
    text = "\n".join(safe(a) for a in value) if isinstance(value, list) else safe(value, multiline=True)
    note = f"# {setting_label(rec.setting)}: {safe(rec.reason)}"
    if phase == "RolledBack":
        note += "\n# warning: this setting was applied and rolled back on production (see `batchtune status`)"
    return text, note


def autoscaler_text(bt: Mapping[str, Any], output: str, min_replicas: int | None = None,
                    max_replicas: int | None = None, scale_down_seconds: int = 300) -> tuple[str, str]:
    """(the HPA or ScaledObject YAML, a note for stderr); NoRecommendation when nothing was measured to scale on."""
    from batchtune.api import InvalidBatchTuning, parse_spec
    from batchtune.cli.view import shown
    from batchtune.core import autoscale
    from batchtune.core.vocabulary import M, TrialState

    view = shown(bt)  # InvalidBatchTuning naming the field of a forged status
    status, where = view.status, f"{view.namespace}/{view.name}"
    try:
        spec = parse_spec(dict(clean(bt).get("spec") or {}))
    except InvalidBatchTuning as exc:
        raise NoRecommendation(f"BatchTuning {where}: {exc}") from None
    rec = status.recommendation
    trials = [autoscale.Measured(t.setting.core(), t.state is TrialState.DONE, (t.metrics or {}).get(M.SLO_CAPACITY))
              for t in status.trials]
    try:
        cap = autoscale.capacity(where, view.namespace, spec.target_ref.name,
                                 rec.setting.core() if rec else None, trials, spec.slo.headroom_percent,
                                 rec.replicas_hint if rec else None)
    except autoscale.NoCapacity as exc:
        raise NoRecommendation(str(exc)) from None
    prom = spec.prometheus
    counter = prom.metric_names.request_success or "vllm:request_success_total"
    ns_label, pod_label = prom.labels.namespace, prom.labels.pod
    if output == "hpa":
        manifest = autoscale.hpa(cap, min_replicas, max_replicas, scale_down_seconds)
        rule = yaml.safe_dump({"rules": [autoscale.adapter_rule(counter, ns_label, pod_label)]}, sort_keys=False)
        header = ("HorizontalPodAutoscaler from batchtune: target = the measured SLO capacity per replica.\n"
                  "It needs a custom-metrics adapter serving vllm_requests_per_second; prometheus-adapter's rule:\n"
                  + rule)
    else:
        manifest = autoscale.keda(cap, prom.url, min_replicas, max_replicas, counter, ns_label, pod_label)
        header = "KEDA ScaledObject from batchtune: threshold = the measured SLO capacity per replica."
    note = f"# {cap.namespace}/{cap.deployment}: {cap.requests_per_second:.3g} req/s per replica at {cap.setting}"
    return autoscale.render(manifest, header), note
