"""`batchtune recommend NAME -o patch|kustomize|helm-values`: the chosen setting as a ready change.

stdout holds only the patch, so it pipes into `kubectl patch --type json -p "$(...)"`, a kustomization
or a values file; the setting and the reason go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from batchtune.cli.status import add_common_arguments
from batchtune.terminal import clean, safe

# -o value -> (status.recommendation field, what it is)
FORMATS = {
    "patch": ("jsonPatch", "RFC 6902 JSON patch for the target Deployment"),
    "kustomize": ("kustomizePatch", "Kustomize strategic-merge patch"),
    "helm-values": ("helmValues", "Helm values snippet"),
    "args": ("args", "vLLM container args, one per line"),
}


class NoRecommendation(Exception):
    pass


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("recommend", help="print a BatchTuning's recommendation as a patch",
                       description="Print the recommended setting as a JSON patch (-o patch), a Kustomize "
                                   "patch (-o kustomize), a Helm values snippet (-o helm-values) or the "
                                   "container args (-o args). The reason goes to stderr.")
    add_common_arguments(p)
    p.add_argument("-o", "--output", choices=sorted(FORMATS), default="patch", help="format (default patch)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batchtune.client import CliError, connect

    try:
        kube = connect(args.kubeconfig, args.context)
        bt = kube.get_batchtuning(kube.namespace(args.namespace), args.name)
        text, note = recommendation_text(bt, args.output)
    except (CliError, NoRecommendation) as exc:
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

    bt = clean(bt)
    meta = bt.get("metadata") or {}
    where = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    status = bt.get("status") or {}
    rec = status.get("recommendation") or {}
    phase = phase_of(bt)
    if not rec:
        if phase == "Failed":
            failed: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Failed"), {})
            raise NoRecommendation(f"BatchTuning {where} failed without a recommendation: "
                                   f"{failed.get('reason', '')}: {failed.get('message', '')}")
        raise NoRecommendation(f"BatchTuning {where} has no recommendation yet (phase {phase}, "
                               f"{status.get('trialsCompleted', 0)}/{status.get('trialsPlanned', 0)} trials done); "
                               f"follow it with `batchtune status {meta.get('name', 'NAME')} --watch`")
    field, what = FORMATS[output]
    value = rec.get(field)
    if not value:
        available = [name for name, (f, _) in FORMATS.items() if rec.get(f)]
        raise NoRecommendation(f"BatchTuning {where} has no {what} (status.recommendation.{field} is empty)"
                               + (f"; available: -o {', -o '.join(available)}" if available else ""))
    text = "\n".join(safe(a) for a in value) if isinstance(value, list) else safe(value, multiline=True)
    note = f"# {setting_label(rec.get('setting'))}: {safe(rec.get('reason', ''))}"
    if phase == "RolledBack":
        note += "\n# warning: this setting was applied and rolled back on production (see `batchtune status`)"
    return text, note
