"""`batchtune validate -f FILE [-f FILE ...]`: check BatchTuning files offline against the typed models.

Prints "FILE: <namespace/>name: valid" per object, or one line per field error
"FILE: spec.x.y: message (got VALUE)"; exits 0 when every object is valid, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "validate",
        help="check BatchTuning files offline (exit 1 with field-level errors)",
        description="Check BatchTuning YAML files (multi-document allowed) against the v1alpha1 API.",
    )
    parser.add_argument("-f", "--filename", dest="files", action="append", required=True, metavar="FILE",
                        help="a YAML file with one or more BatchTunings ('-' reads stdin); repeatable")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batchtune.api import InvalidBatchTuning, iter_documents, parse_batchtuning

    ok = True
    for name in args.files:
        path = "/dev/stdin" if name == "-" else name
        try:
            documents = list(iter_documents(path))
        except OSError as exc:
            print(f"{name}: cannot read: {exc.strerror or exc}", file=sys.stderr)
            ok = False
            continue
        except InvalidBatchTuning as exc:
            for error in exc.errors:
                print(f"{name}: {error}")
            ok = False
            continue
        if not documents:
            print(f"{name}: no BatchTuning found")
            ok = False
        for index, doc in documents:
            # Name the document only when the file holds several, so single-object output stays short.
            where = name if len(documents) == 1 else f"{name}[{index}]"
            try:
                bt = parse_batchtuning(doc)
            except InvalidBatchTuning as exc:
                for error in exc.errors:
                    print(f"{where}: {error}")
                ok = False
                continue
            ns = f"{bt.metadata.namespace}/" if bt.metadata.namespace else ""
            print(f"{where}: {ns}{bt.metadata.name or bt.metadata.generate_name}: valid")
    return 0 if ok else 1
