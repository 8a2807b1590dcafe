"""`python -m batchtune_local up|down|status|kubeconfig`: what hack/localcluster/* run."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import batchtune_local as lc


def _up(args: argparse.Namespace) -> int:
    config = lc.ClusterConfig(
        state_dir=args.state_dir, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        gpu_product=args.gpu_product or (lc.cluster.REAL_VLLM_GPU_PRODUCT if args.engine == "vllm"
                                         else lc.cluster.DEFAULT_GPU_PRODUCT),
        time_scale=args.time_scale, scrape_interval_s=args.scrape_interval,
        node_agent=not args.no_node_agent, keep_data=args.keep_data, timeout_s=args.timeout,
        pod_network=args.pod_network, engine=args.engine, idle_pods=args.idle_pods,
        **({"image_map": args.image_map.resolve()} if args.image_map else {}),
    )
    began = time.monotonic()
    try:
        info, started = lc.up(config)
    except (lc.MissingBinaries, lc.ClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if started:
        print(f"Local cluster started in {time.monotonic() - began:.1f}s (state in {info.state_dir}).")
    else:
        print(f"Local cluster already up and healthy (state in {info.state_dir}).")
    if not info.config.get("node_agent"):
        print("Note: no node agent (batchtune_local.nodeagent missing or --no-node-agent): no nodes, pods stay Pending.")
    print(f"""
  . {info.env_file}            # sets KUBECONFIG (admin), PROMETHEUS_URL, PATH (kubectl, helm)
  kubectl get nodes
  kubectl --kubeconfig {info.operator_kubeconfig} auth whoami   # the non-admin operator identity
  Prometheus: {info.prometheus_url}
  hack/localcluster/status ; hack/localcluster/down""")
    return 0


def _down(args: argparse.Namespace) -> int:
    try:
        still = lc.down(args.state_dir, log=lambda line: print(f"Stopped {line}"), force=args.force)
    except lc.ClusterInUse as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if still:
        print(f"error: ports still listening after stop: {still}", file=sys.stderr)
        return 1
    return 0


def _status(args: argparse.Namespace) -> int:
    info = lc.load(args.state_dir)
    if info is None:
        print(f"No cluster recorded in {args.state_dir}")
        return 3
    report = lc.check(info)
    print(f"{'component':<25} {'pid':>8}  {'ports':<14} state")
    for c in report:
        print(f"{c.name:<25} {c.pid:>8}  {','.join(map(str, c.ports)):<14} {c.detail}")
    print(f"\nKUBECONFIG={info.admin_kubeconfig}\nPROMETHEUS_URL={info.prometheus_url}")
    return 0 if all(c.healthy for c in report) else 1


def _kubeconfig(args: argparse.Namespace) -> int:
    info = lc.load(args.state_dir)
    if info is None:
        print(f"error: no cluster recorded in {args.state_dir}", file=sys.stderr)
        return 1
    path = lc.make_kubeconfig(info, args.user, tuple(args.group), args.output)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m batchtune_local",
                                     description="The local Kubernetes cluster (loopback only).")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", type=Path, default=lc.default_state_dir(),
                        help="state directory (default $BATCHTUNE_CLUSTER_DIR or ~/.cache/batchtune/cluster)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", parents=[common], help="start the cluster (or report the healthy one already running)")
    up.add_argument("--nodes", type=int, default=2, help="GPU nodes the node agent registers (default 2)")
    up.add_argument("--gpus-per-node", type=int, default=8, help="nvidia.com/gpu per node (default 8)")
    up.add_argument("--gpu-product", default=None,
                    help=f"nvidia.com/gpu.product label (default {lc.cluster.DEFAULT_GPU_PRODUCT}; "
                    f"{lc.cluster.REAL_VLLM_GPU_PRODUCT} with --engine vllm)")
    up.add_argument("--engine", choices=lc.cluster.ENGINES, default="twin",
                    help="what *vllm* images run: the twin (default) or real vLLM on CPU (needs hack/real-vllm/build)")
    up.add_argument("--time-scale", type=float, default=1.0, help="divide simulated durations by this")
    up.add_argument("--scrape-interval", type=float, default=2.0, help="Prometheus scrape interval, seconds")
    up.add_argument("--pod-network", help="loopback CIDR for pod IPs (node agent default 127.1.0.0/16)")
    up.add_argument("--image-map", type=Path, help="node agent image -> command rules (default hack/localcluster/batchtune_local/images.yaml)")
    up.add_argument("--idle-pods", action="store_true",
                    help="the node agent runs every pod's processes at the lowest CPU priority (docs/node-agent.md)")
    up.add_argument("--no-node-agent", action="store_true", help="control plane and Prometheus only")
    up.add_argument("--keep-data", action="store_true", help="keep etcd/Prometheus data of the last run")
    up.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for each component")
    up.set_defaults(func=_up)

    down = sub.add_parser("down", parents=[common], help="stop exactly the processes `up` started")
    down.add_argument("--force", action="store_true", help="stop even while test sessions use the cluster")
    down.set_defaults(func=_down)
    sub.add_parser("status", parents=[common], help="each component's PID, ports and health").set_defaults(func=_status)

    kc = sub.add_parser("kubeconfig", parents=[common], help="write a kubeconfig for any identity (client certificate)")
    kc.add_argument("user")
    kc.add_argument("--group", action="append", default=[], help="group of the identity (repeatable)")
    kc.add_argument("--output", type=Path, help="where to write it (default in the state dir)")
    kc.set_defaults(func=_kubeconfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
