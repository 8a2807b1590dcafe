"""`batchtune operator`: run the kopf operator (also `kopf run -m batchtune.controller.handlers`). The CLI registers
it by module name (cli/__init__.py), so cli/ imports nothing of the controller's."""

from __future__ import annotations

import argparse
import os
from typing import Any

from batchtune import __version__


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("operator", help="run the BatchTuning operator")
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable); default: all namespaces")
    p.add_argument("--liveness-address", default=os.environ.get("BATCHTUNE_LIVENESS", "127.0.0.1:8080"),
                   help="host:port of the /healthz endpoint (default %(default)s)")
    p.add_argument("--metrics-address", default=os.environ.get("BATCHTUNE_METRICS", "127.0.0.1:8081"),
                   help="host:port of the operator's own /metrics (default %(default)s; empty disables)")
    p.add_argument("--tick-seconds", type=float, default=float(os.environ.get("BATCHTUNE_TICK_SECONDS", "2")),
                   help="how often each BatchTuning is reconciled (default %(default)s)")
    p.add_argument("--operator-image", default=os.environ.get("BATCHTUNE_IMAGE", f"batchtune:{__version__}"),
                   help="image used for the builtin load generator Jobs (default %(default)s)")
    p.add_argument("--allowed-load-image", action="append", default=[],
                   help="an image spec.load.image may name besides the operator's own (repeatable)")
    p.add_argument("--allowed-prometheus-url", action="append", default=[],
                   help="a URL prefix spec.prometheus.url must start with (repeatable; none: any non-link-local URL)")
    p.add_argument("--allowed-git-url", action="append", default=[],
                   help="a URL prefix spec.apply.git.url and forge.apiUrl must start with (repeatable; none: no "
                        "PullRequest mode)")
    p.add_argument("--allowed-extra-flag", action="append", default=[], metavar="FLAG",
                   help="an engine flag spec.searchSpace.extraArgs may add besides the engine's default list "
                        "(batching, scheduling, memory); repeatable")
    p.add_argument("--argocd-instance-label", action="append", default=[],
                   help="a label Argo CD's label tracking uses here (repeatable; default app.kubernetes.io/instance "
                        "and argocd.argoproj.io/instance)")
    p.add_argument("--max-gpu-minutes", type=int, default=int(os.environ.get("BATCHTUNE_MAX_GPU_MINUTES", "2880")),
                   help="ceiling on one BatchTuning's GPU-minutes (default %(default)s)")
    p.add_argument("--leader-elect", action="store_true",
                   default=os.environ.get("BATCHTUNE_LEADER_ELECT", "false") == "true",
                   help="run only while holding the leader Lease (for more than one replica); a standby waits "
                        "without watching anything")
    p.add_argument("--leader-elect-namespace", default=os.environ.get("POD_NAMESPACE", ""),
                   help="namespace of the leader Lease (default: $POD_NAMESPACE)")
    p.add_argument("--leader-elect-name", default="batchtune-operator", help="name of the leader Lease "
                   "(default %(default)s; one Lease per install)")
    p.add_argument("--leader-elect-lease-duration", type=float, default=15, metavar="SECONDS",
                   help="a leader that stopped renewing is presumed gone after this long (default %(default)s)")
    p.add_argument("--leader-elect-renew-deadline", type=float, default=10, metavar="SECONDS",
                   help="the leader stops when it could not renew for this long (default %(default)s)")
    p.add_argument("--leader-elect-retry-period", type=float, default=2, metavar="SECONDS",
                   help="how often the leader renews and a standby looks (default %(default)s)")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=run)


def elector(args: argparse.Namespace) -> Any:
    """The leader elector for `--leader-elect`; SystemExit naming the flag when the flags cannot work."""
    from batchtune.controller import leader
    from batchtune.core.lease import LeaseTimes

    times = LeaseTimes(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                       args.leader_elect_retry_period)
    problem = times.problem()
    if problem:
        raise SystemExit(f"batchtune operator: {problem}")
    if not args.leader_elect_namespace:
        raise SystemExit("batchtune operator: --leader-elect needs --leader-elect-namespace (or $POD_NAMESPACE): "
                         "the namespace the Lease lives in")
    from batchtune.controller import kube

    kube.load_config()
    where = f"{args.leader_elect_namespace}/{args.leader_elect_name}"
    return leader.Elector(leader.KubeLease(args.leader_elect_namespace, args.leader_elect_name, kube.api()),
                          leader.identity(), times, where=where)


def allowed_extra_flags(flags: list[str]) -> list[str]:
    """The install's extra engine flags, canonical; SystemExit naming each one the engine does not take."""
    from batchtune.admission import install_flag_problems
    from batchtune.engines import VLLM

    names = [f.removeprefix("--") for f in flags]
    problems = install_flag_problems(VLLM, names)
    if problems:
        raise SystemExit("batchtune operator: " + "; ".join(problems))
    return names


def environment(args: argparse.Namespace) -> dict[str, str]:
    """The environment the handlers module reads (`core.install.install_from_environment`) for these flags."""
    env = {
        "BATCHTUNE_TICK_SECONDS": str(args.tick_seconds),
        "BATCHTUNE_IMAGE": args.operator_image,
        "BATCHTUNE_CLUSTERWIDE": "false" if args.namespace else "true",
        "BATCHTUNE_WATCHED_NAMESPACES": str(len(args.namespace)),
        "BATCHTUNE_MAX_GPU_MINUTES": str(args.max_gpu_minutes),
    }
    listed = {"BATCHTUNE_ALLOWED_LOAD_IMAGES": args.allowed_load_image,
              "BATCHTUNE_ALLOWED_GIT_URLS": args.allowed_git_url,
              "BATCHTUNE_ARGOCD_INSTANCE_LABELS": args.argocd_instance_label,
              "BATCHTUNE_ALLOWED_PROMETHEUS_URLS": args.allowed_prometheus_url,
              "BATCHTUNE_ALLOWED_EXTRA_FLAGS": allowed_extra_flags(args.allowed_extra_flag)}
    env.update({name: ",".join(values) for name, values in listed.items() if values})
    return env


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf

    # The handlers module reads these at import (kopf fixes timer intervals at decoration time).
    os.environ.update(environment(args))
    from batchtune.controller import handlers, telemetry  # noqa: F401  # importing registers the handlers

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # kopf logs every timer run; a tick every few seconds per BatchTuning drowns the transitions.
        logging.getLogger("kopf.objects").addFilter(
            lambda record: not record.getMessage().startswith("Timer 'reconcile' succeeded"))
    if args.leader_elect:
        telemetry.LEADER.set(0)  # a standby from its first scrape on, not only once it asks for the Lease
    if args.metrics_address:
        host, _, port = args.metrics_address.rpartition(":")
        telemetry.serve(int(port), host or "127.0.0.1")
    election = None
    if args.leader_elect:
        import signal

        from batchtune.controller import leader

        election = elector(args)
        logging.getLogger(__name__).info("Standing by until this replica (%s) holds the Lease %s",
                                         election.me, election.where)
        # A standby holds nothing: SIGTERM ends it at once (as PID 1 a process ignores SIGTERM without a handler).
        previous = signal.signal(signal.SIGTERM, lambda *_: election.stop())
        with leader.standby_health(args.liveness_address):
            handlers.warm_up()
            election.acquire()
        signal.signal(signal.SIGTERM, previous)
        # Lost the Lease: stop at once, as a SIGKILL would; the replica that takes over resumes from status.
        election.keep(on_lost=lambda: os._exit(1))
    namespaces = args.namespace
    try:
        asyncio.run(kopf.operator(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=f"http://{args.liveness_address}/healthz",
        ))
    finally:
        if election is not None:
            election.release()  # every handler has returned: the standby may take over at once
    return 0
