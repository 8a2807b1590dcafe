"""`batchtune validate -f FILE [-f FILE ...]`: check BatchTuning files offline against the typed models.

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
  - spec.prometheus.url by the operator's address rules (any spelling of a loopback, link-local,
    multicast or cloud-metadata host, percent-encoding, credentials, a query or fragment); the
    install's allowed prefixes and what a name resolves to are the operator's to check.
  - spec.searchSpace.extraArgs as the operator's engine check reads them (no control characters,
    no $(VAR), no tuned knob).
  - a search space vLLM would refuse entirely (e.g. every maxNumBatchedTokens below every
    maxNumSeqs candidate, or below --max-model-len with --no-enable-chunked-prefill in extraArgs):
    the operator would fail it at planning with EmptySearchSpace. A partly refused one is valid,
    with a note (`batchtune plan` lists what is pruned).

Not checked (the operator checks them on the cluster): the target Deployment and its vLLM
flags, the install's allowed load images, GPU memory fit, permissions.
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
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    ok = True
    for name in args.files:
        try:
            ok = check_file(name) and ok
        except Exception as exc:  # never a traceback for a file, whatever is in it
            print(f"{safe(name)}: cannot check: {type(exc).__name__}: {safe(exc)}", file=sys.stderr)
            ok = False
    return 0 if ok else 1


def check_file(name: str) -> bool:
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
                errors, note = offline_checks(bt)
        if errors:
            for error in errors:
                print(f"{where}: {error}")
            ok = False
            continue
        ns = f"{bt.metadata.namespace}/" if bt.metadata.namespace else ""
        line = f"{where}: {safe(ns)}{safe(bt.metadata.name or bt.metadata.generate_name)}: valid"
        print(line + (f" (note: {note})" if note else ""))
    return ok


def offline_checks(bt: BatchTuning) -> tuple[list[FieldError], str | None]:
    """What the operator would refuse at planning that the CRD cannot see: (errors, a note or None).

    The engine is vLLM (the one engine there is); its limits are read from extraArgs alone, as
    production's own flags are not known offline.
    """
    from batchtune.api import MISSING, FieldError
    from batchtune.core import plan_candidates
    from batchtune.core.policy import prometheus_url_problem
    from batchtune.engines import VLLM

    field = "spec.prometheus.url"
    url_problem = prometheus_url_problem(bt.spec.prometheus.url, ())  # the install-independent rules
    if url_problem:
        return [FieldError(field, MISSING, url_problem.removeprefix(f"{field} "))], None
    space_spec = bt.spec.search_space
    extra = list(space_spec.extra_args or [])
    problems = VLLM.check_extra_args(extra)
    if problems:
        return [FieldError("spec.searchSpace.extraArgs", MISSING, problem) for problem in problems], None
    limits = VLLM.limits({}, extra)
    space = space_spec.core()
    plan = plan_candidates(space, lambda s: VLLM.invariant_violation(s, limits), limits=limits)
    total = len(plan.candidates) + len(plan.pruned)
    if not plan.candidates:
        reasons = sorted({p.message for p in plan.pruned})
        message = (f"leaves no setting to try: vLLM would refuse all {total} candidate settings, so the operator "
                   f"would fail the tuning with EmptySearchSpace; e.g. {reasons[0] if reasons else 'none'}")
        return [FieldError("spec.searchSpace.maxNumBatchedTokens", space_spec.max_num_batched_tokens, message)], None
    if plan.pruned:
        return [], (f"{len(plan.pruned)} of {total} candidate settings would be refused by vLLM and are "
                    "pruned; batchtune plan lists them")
    return [], None


