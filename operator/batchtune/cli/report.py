"""`batchtune report NAME [--out DIR] [--html]`: the trial table and decision in the terminal, the
three-curve image and the CSV/JSON as files, and with `--html` one self-contained page (report.html:
decision, curves, trials, predicted against measured, workload) to open in any browser, offline.

The files come from the operator's report ConfigMap `<name>-report` when the BatchTuning controls it (its
ownerReference); report.html is always rendered here from status, and what the ConfigMap lacks (the tuning is
still running, an older operator wrote it, or someone else did) is drawn from the BatchTuning's status instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchtune.cli.status import add_common_arguments
from batchtune.terminal import safe, text

if TYPE_CHECKING:
    from batchtune.api.models import BatchTuningStatus
    from batchtune.client import StoredReport
    from batchtune.report import Tuning

REPORT_FILES = ("curves.png", "trials.csv", "trials.json")
HTML_FILE = "report.html"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="print a BatchTuning's trial table and write its curves and CSV",
                       description="Print the trial table and the decision, and write curves.png (GPU "
                                   "utilization, throughput and latency against max-num-seqs at one common "
                                   "load, and SLO capacity), trials.csv and trials.json into a folder; with "
                                   "--html also report.html, one self-contained page.")
    add_common_arguments(p)
    p.add_argument("-o", "--out", type=Path, default=None,
                   help="folder for the files (default ./NAME-report; created if missing)")
    p.add_argument("--html", action="store_true",
                   help="also write report.html: the decision, curves, trial table, predicted against measured "
                        "and the workload in one page with no script and no external resource")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    from batchtune.api import InvalidBatchTuning
    from batchtune.cli import status as st
    from batchtune.client import CliError, connect

    try:
        kube = connect(args.kubeconfig, args.context)
        namespace = kube.namespace(args.namespace)
        raw = kube.get_batchtuning(namespace, args.name)
        bt = st.typed(raw)  # the status parsed once: a forged one ends here, naming the field
        stored = kube.get_report(namespace, args.name)
        files, source = report_files(bt, stored, html=args.html)
    except CliError as exc:
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 1
    except InvalidBatchTuning as exc:
        print(st.status_error(raw, exc), file=sys.stderr)
        return 1
    out_dir = args.out or Path(f"{args.name}-report")
    try:
        paths = write_files(out_dir, files)
    except OSError as exc:
        print(f"error: cannot write the report into {safe(out_dir)}: {safe(exc)}", file=sys.stderr)
        return 1
    console = st.console()
    now = datetime.now(UTC)
    console.print(st.header(bt, now))
    console.print()
    console.print(st.trials_table(bt))
    notes = st.trial_notes(bt)
    if notes.plain:
        console.print(notes)
    twin = st.twin_table(bt)  # TwinGuided: predicted against measured
    if twin is not None:
        console.print()
        console.print(twin)
    made = st.decision(bt)
    if made.plain:
        console.print()
        console.print(made)
    console.print()
    console.print(text(f"Report ({source}):"))
    for path in paths:
        console.print(text(f"  {path}"), soft_wrap=True)  # a path folded over two lines cannot be copied
    return 0


def report_files(bt: Mapping[str, Any], stored: StoredReport | None,
                 html: bool = False) -> tuple[dict[str, bytes], str]:
    """The report's files and where they came from. The ConfigMap's are used only when this BatchTuning
    controls it (ownerReference to its uid, controller: true: the operator wrote it, as anyone who may write
    ConfigMaps in the namespace can write one by that name); report.html is always rendered here from status,
    never copied; what is not taken from the ConfigMap is drawn from status."""
    from batchtune import KIND
    from batchtune.cli.view import reported, shown

    view = shown(bt)
    tuning = reported(bt, view)
    wanted = (*REPORT_FILES, HTML_FILE) if html else REPORT_FILES
    configmap = f"ConfigMap {tuning.name}-report"
    uid = view.uid
    owned = stored is not None and stored.owned_by(KIND, uid)
    files = {name: stored.files[name] for name in REPORT_FILES if name in stored.files} if stored and owned else {}
    files = {name: data for name, data in files.items() if name in wanted}
    if len(files) == len(wanted):
        return files, f"from {configmap}"
    drawn = from_status(tuning, missing=[n for n in wanted if n not in files], png=files.get("curves.png"))
    files.update(drawn)
    if stored is None:
        source = "drawn from the BatchTuning's status; the operator has not written its report ConfigMap yet"
    elif not owned:
        source = (f"drawn from the BatchTuning's status; {configmap} was not used: this BatchTuning does not control "
                  f"it (no ownerReference to uid {uid} with controller: true), so anyone may have written it")
    else:
        source = f"from {configmap}, {', '.join(sorted(drawn))} drawn from status"
    return files, safe(source)


def from_status(tuning: Tuning, missing: list[str], png: bytes | None = None) -> dict[str, bytes]:
    from datetime import UTC, datetime

    from batchtune import report
    from batchtune.report_html import html_report

    status = tuning.status
    out: dict[str, bytes] = {}
    if "trials.csv" in missing:
        out["trials.csv"] = report.trials_csv(status.trials).encode()
    if "trials.json" in missing:
        out["trials.json"] = report.trials_json(status.trials, _summary(status)).encode()
    if "curves.png" in missing:
        out["curves.png"] = report.curves_png(
            tuning, title=safe(f"{tuning.namespace}/{tuning.name}: target {tuning.spec.target_ref.name}"))
    if HTML_FILE in missing:
        generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        out[HTML_FILE] = html_report(tuning, out.get("curves.png", png), generated).encode()
    return out


def _summary(status: BatchTuningStatus) -> dict[str, Any]:
    """trials.json's summary: the decision's fields as status holds them, those set."""
    wire = {"phase": status.phase, "bestTrial": status.best_trial, "bestSetting": status.best_setting,
            "knee": status.knee.to_wire() if status.knee else None,
            "recommendation": status.recommendation.to_wire() if status.recommendation else None}
    return {k: v for k, v in wire.items() if v is not None}


def write_files(out_dir: Path, files: Mapping[str, bytes]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in (*REPORT_FILES, HTML_FILE):
        if name in files:
            path = out_dir / name
            path.write_bytes(files[name])
            paths.append(path.resolve())
    return paths
