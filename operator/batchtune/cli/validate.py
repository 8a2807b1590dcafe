"""`batchtune validate -f FILE [-f FILE ...] [--values VALUES]`: check BatchTuning files offline as the operator would.

Prints "FILE: <namespace/>name: valid" per object, or one line per field error
"FILE: spec.x.y: message (got VALUE)"; exits 0 when every object is valid, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from batchtune.terminal import safe

if TYPE_CHECKING:

    from batchtune.api import BatchTuning, FieldError
    from batchtune.core.install import Install

DESCRIPTION = """\
Check BatchTuning YAML files (multi-document allowed; '-' reads stdin) offline, without a cluster.

Checked as the API server checks them: the CRD's schema and rules, unknown fields (the API server's
strict field validation), metadata (name, namespace, labels, annotations).

Checked beyond the CRD:
  - YAML read as kubectl reads it, refusing what YAML readers disagree on: yes/no/on/off (booleans
    to kubectl, strings to YAML 1.2), 010 (octal 8 to kubectl), 1_000, 0o10, 0b10, .inf/.nan,
    repeated keys; quote a value meant as a string. 1:30 and dates stay strings; 8.0 is 8.
  - explicit nulls in spec (`mode:` with nothing after it): the API server would drop them and
    use the default, so an empty value would silently mean Auto.
  - files over 1 MiB, nesting deeper than 100, aliases adding more than 10000 nodes, non-UTF-8.
  - image references (spec.load.image), label names Prometheus reserves (__*, and le and quantile,
    which histogram and summary queries group by), Secret and ConfigMap keys Kubernetes refuses
    ('.', '..', a leading '..'): the CRD's rules, in the operator's own words.
  - spec.searchSpace.extraArgs as the operator's engine check reads them: only allowed flags, spelled
    in full, each value of its type (a switch takes none: --enforce-eager=false is refused; numbers
    are whole numbers in range), no control characters, no $(VAR), no tuned knob.
  - spec.prometheus.url by the operator's address rules (any spelling of a loopback, link-local,
    multicast or cloud-metadata host, percent-encoding, credentials, a query or fragment); what a
    name resolves to is the operator's to check.
  - a search space vLLM would refuse entirely (e.g. every maxNumBatchedTokens below every
    maxNumSeqs candidate, or below --max-model-len with --no-enable-chunked-prefill in extraArgs):
    the operator would fail it at planning with EmptySearchSpace. A partly refused one is valid,
    with a note (`batchtune plan` lists what is pruned).

The install's bounds, as the operator applies them: the chart's default values, or those of
--values FILE (the Helm values file you install with, read the way the chart reads it):
  - extra flags beyond the default list (searchSpace.allowedExtraFlags), load images
    (load.allowedImages), Prometheus and Git URLs (prometheus.allowedUrls, git.allowedUrls: no
    PullRequest mode without one), the GPU-minute ceiling (maxGpuMinutesPerTuning; a higher
    spec.strategy.maxGpuMinutes is valid, with a note: the operator holds it to the ceiling).
  - a note where Auto will not apply an extra flag that changes what production outputs (e.g.
    --kv-cache-dtype) without spec.apply.allowNumericsChange.

Not checked (the operator checks them on the cluster): the target Deployment and its vLLM
flags (and so its image, which VllmBench may run), GPU memory fit, permissions, a forge API
URL derived from the repository's.
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "validate",
        help="check BatchTuning files offline (exit 1 with field-level errors)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-f", "--filename", dest="files", action="append", required=True, metavar="FILE",
                        help="a YAML file with one or more BatchTunings ('-' reads stdin); repeatable")
    parser.add_argument("--values", metavar="VALUES", help="the Helm values file of the install (its bounds: allowed "
                        "extra flags, images, URLs, GPU budget); default: the chart's own defaults")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        install = read_install(args.values)
    except (OSError, ValueError) as exc:
        print(f"{safe(args.values)}: cannot use as Helm values: {safe(getattr(exc, 'strerror', None) or exc)}",
              file=sys.stderr)
        return 1
    ok = True
    for name in args.files:
        try:
            ok = check_file(name, install) and ok
        except Exception as exc:  # never a traceback for a file, whatever is in it
            print(f"{safe(name)}: cannot check: {type(exc).__name__}: {safe(exc)}", file=sys.stderr)
            ok = False
    return 0 if ok else 1


def read_install(values: str | None) -> Install:
    """The install's bounds from a Helm values file (None: the chart's defaults); ValueError names what is wrong."""
    import yaml

    from batchtune import __version__
    from batchtune.admission import install_flag_problems
    from batchtune.core.install import install_from_values
    from batchtune.engines import VLLM

    if values is None:
        return install_from_values({}, __version__)
    with open(values, encoding="utf-8") as f:
        text = f.read(1 << 20)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {exc}") from None
    install = install_from_values(data, __version__)
    problems = install_flag_problems(VLLM, list(install.extra_flags))
    if problems:
        raise ValueError("searchSpace.allowedExtraFlags: " + "; ".join(problems))
    return install


def check_file(name: str, install: Install | None = None) -> bool:
    """Print one line per object (valid) or per error; True when every object in the file is valid."""
    from batchtune.api import InvalidBatchTuning, parse_batchtuning, read_documents

    shown = safe(name)
    try:
        documents = read_documents("/dev/stdin" if name == "-" else name)
    except OSError as exc:
        print(f"{shown}: cannot read: {safe(exc.strerror or exc)}", file=sys.stderr)
        return False
    except InvalidBatchTuning as exc:
        for error in exc.errors:
            print(f"{shown}: {error}")
        return False
    if not documents:
        print(f"{shown}: no BatchTuning found")
        return False
    ok = True
    for doc in documents:
        # Name the document only when the file holds several, so single-object output stays short.
        where = shown if len(documents) == 1 else f"{shown}[{doc.index}]"
        errors = doc.errors
        note = None
        if not errors:
            try:
                bt = parse_batchtuning(doc.value)
            except InvalidBatchTuning as exc:
                errors = exc.errors
            else:
                errors, note = offline_checks(bt, install or read_install(None))
        if errors:
            for error in errors:
                print(f"{where}: {error}")
            ok = False
            continue
        ns = f"{bt.metadata.namespace}/" if bt.metadata.namespace else ""
        line = f"{where}: {safe(ns)}{safe(bt.metadata.name or bt.metadata.generate_name)}: valid"
        print(line + (f" (note: {note})" if note else ""))
    return ok


def offline_checks(bt: BatchTuning, install: Install) -> tuple[list[FieldError], str | None]:
    """What the operator would refuse at planning that the CRD cannot see: (errors, a note or None).

    The engine is vLLM (the one engine there is); its limits are read from extraArgs alone, as
    production's own flags are not known offline.
    """
    from batchtune.admission import review, url_problems
    from batchtune.core import plan_candidates
    from batchtune.engines import VLLM

    space_spec = bt.spec.search_space
    verdict = review(VLLM, bt.spec, install, None)
    errors = [_field_error(m) for m in verdict.invalid + verdict.not_allowed + url_problems(bt.spec, install)]
    notes = list(verdict.notes)
    if errors:
        return errors, "; ".join(notes) or None
    extra = list(space_spec.extra_args or [])
    limits = VLLM.limits({}, extra)
    space = space_spec.core()
    plan = plan_candidates(space, lambda s: VLLM.invariant_violation(s, limits), limits=limits)
    total = len(plan.candidates) + len(plan.pruned)
    if not plan.candidates:
        from batchtune.api import FieldError

        reasons = sorted({p.message for p in plan.pruned})
        message = (f"leaves no setting to try: vLLM would refuse all {total} candidate settings, so the operator "
                   f"would fail the tuning with EmptySearchSpace; e.g. {reasons[0] if reasons else 'none'}")
        return [FieldError("spec.searchSpace.maxNumBatchedTokens", space_spec.max_num_batched_tokens, message)], None
    if plan.pruned:
        notes.append(f"{len(plan.pruned)} of {total} candidate settings would be refused by vLLM and are "
                     "pruned; batchtune plan lists them")
    return [], "; ".join(notes) or None


def _field_error(message: str) -> FieldError:
    """An admission message ("spec.x.y VALUE: why") as a field error on that path."""
    from batchtune.api import MISSING, FieldError

    path, _, rest = message.partition(" ")
    if not path.startswith("spec.") or not rest:
        return FieldError("spec", MISSING, message)
    return FieldError(path.rstrip(":"), MISSING, rest)
