"""`python -m batchtune_local.nodeagent`: run the node agent until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from batchtune_local.nodeagent.products import PRODUCTS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m batchtune_local.nodeagent",
        description=(
            "Register GPU nodes with a Kubernetes API server and run the pods scheduled on them as "
            "local processes, each on its own loopback IP, with dcgm-exporter-style GPU metrics. "
            "Stops every process it started on SIGTERM/SIGINT."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--kubeconfig", help="kubeconfig of an identity that may write nodes, leases, pods/status "
                        "and delete pods (default: $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context to use")
    parser.add_argument("--state-dir", required=True, type=Path,
                        help="directory for state.json (IP/GPU allocations, PIDs), pod working dirs and logs; "
                        "reuse it across restarts so running processes are re-adopted")
    parser.add_argument("--nodes", type=int, default=2, help="number of nodes to register")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="nvidia.com/gpu capacity of each node")
    parser.add_argument("--gpu-product", default="NVIDIA-H100-80GB-HBM3",
                        help=f"nvidia.com/gpu.product label; known: {', '.join(sorted(PRODUCTS))}")
    parser.add_argument("--node-prefix", default="gpu-node-", help="node names are PREFIX0, PREFIX1, ...")
    parser.add_argument("--metrics-address", default="127.0.0.1:9400",
                        help="HOST:PORT for the GPU metrics (/metrics); port 0 picks a free one")
    parser.add_argument("--image-map", help="YAML file of image -> local command rules tried before the built-ins "
                        "(*vllm* -> batchtune twin vllm, *batchtune* -> batchtune CLI)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="passed to processes as BATCHTUNE_TIME_SCALE; also divides restart back-off and "
                        "probe delays/periods")
    parser.add_argument("--pod-network", default="127.1.0.0/16", help="loopback CIDR pod IPs are taken from")
    parser.add_argument("--cpu", default="192", help="cpu capacity per node")
    parser.add_argument("--memory", default="2Ti", help="memory capacity per node")
    parser.add_argument("--max-pods", type=int, default=110, help="pods capacity per node")
    parser.add_argument("--node-label", action="append", default=[], metavar="KEY=VALUE",
                        help="extra label on every node (repeatable)")
    parser.add_argument("--node-taint", action="append", default=[], metavar="KEY=VALUE:EFFECT",
                        help="taint on every node, e.g. batchtune.io/test=pool1:NoSchedule (repeatable)")
    parser.add_argument("--kubelet-address", default="127.0.0.1:0",
                        help="HOST:PORT of the TLS endpoint the API server dials for `kubectl logs` "
                        "(port 0 picks one; empty turns it off)")
    parser.add_argument("--idle-pods", action="store_true",
                        help="run every pod's processes at the lowest CPU priority (SCHED_IDLE, niceness 19, their "
                        "session's autogroup at niceness 19): a GPU node's pods do not share the control plane's "
                        "CPUs, so on one machine they yield to it")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.time_scale <= 0:
        print(f"--time-scale must be > 0, got {args.time_scale}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    from batchtune_local.nodeagent.agent import AgentConfig, NodeAgent

    try:
        labels = dict(_key_value(text, "--node-label") for text in args.node_label)
        taints = tuple(_taint(text) for text in args.node_taint)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2

    config = AgentConfig(
        kubeconfig=args.kubeconfig, context=args.context, state_dir=args.state_dir.resolve(), nodes=args.nodes,
        gpus_per_node=args.gpus_per_node, gpu_product=args.gpu_product, metrics_address=args.metrics_address,
        image_map=args.image_map, time_scale=args.time_scale, node_prefix=args.node_prefix,
        pod_network=args.pod_network, cpu=args.cpu, memory=args.memory, max_pods=args.max_pods,
        extra_labels=labels, taints=taints, kubelet_address=args.kubelet_address, idle_pods=args.idle_pods,
    )
    return NodeAgent(config).run()


def _key_value(text: str, flag: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"{flag}: expected KEY=VALUE, got {text!r}")
    return key, value


def _taint(text: str) -> dict[str, str]:
    head, sep, effect = text.rpartition(":")
    if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise ValueError(f"--node-taint: expected KEY=VALUE:NoSchedule|PreferNoSchedule|NoExecute, got {text!r}")
    key, _, value = head.partition("=")
    return {"key": key, "value": value, "effect": effect} if value else {"key": key, "effect": effect}


if __name__ == "__main__":
    sys.exit(main())
