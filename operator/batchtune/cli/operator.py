"""`batchtune operator`: run the kopf operator (also `kopf run -m batchtune.controller.handlers`)."""

from __future__ import annotations

import argparse
import os


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the BatchTuning operator")
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable); default: all namespaces")
    p.add_argument("--liveness-address", default=os.environ.get("BATCHTUNE_LIVENESS", "127.0.0.1:8080"),
                   help="host:port of the /healthz endpoint (default %(default)s)")
    p.add_argument("--metrics-address", default=os.environ.get("BATCHTUNE_METRICS", "127.0.0.1:8081"),
                   help="host:port of the operator's own /metrics (default %(default)s; empty disables)")
    p.add_argument("--tick-seconds", type=float, default=float(os.environ.get("BATCHTUNE_TICK_SECONDS", "2")),
                   help="how often each BatchTuning is reconciled (default %(default)s)")
    p.add_argument("--operator-image", default=os.environ.get("BATCHTUNE_IMAGE", "ghcr.io/batchtune/batchtune:0.1.0"),
                   help="image used for the builtin load generator Jobs (default %(default)s)")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf

    # The handlers module reads these at import (kopf fixes timer intervals at decoration time).
    os.environ["BATCHTUNE_TICK_SECONDS"] = str(args.tick_seconds)
    os.environ["BATCHTUNE_IMAGE"] = args.operator_image
    from batchtune.controller import handlers, metrics  # noqa: F401  (registers the handlers)

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # kopf logs every timer run; a tick every few seconds per BatchTuning drowns the transitions.
        logging.getLogger("kopf.objects").addFilter(
            lambda record: not record.getMessage().startswith("Timer 'reconcile' succeeded"))
    if args.metrics_address:
        host, _, port = args.metrics_address.rpartition(":")
        metrics.serve(int(port), host or "127.0.0.1")
    namespaces = args.namespace
    asyncio.run(kopf.operator(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=f"http://{args.liveness_address}/healthz",
    ))
    return 0
