"""Drives the demo on a running local cluster (hack/demo/run starts it): install, deploy, tune, report."""

from __future__ import annotations

import argparse
import os
import string
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "hack" / "demo"
NAMESPACE = "demo"
RELEASE_NAMESPACE = "batchtune-system"
BATCHTUNE = [sys.executable, "-m", "batchtune"]


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run(*argv: str, input: str | None = None, check: bool = True, quiet: bool = False) -> str:
    done = subprocess.run(argv, input=input, text=True, capture_output=True)
    if check and done.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    if not quiet and done.stdout.strip():
        print(done.stdout.rstrip())
    return done.stdout


def kubectl(*args: str, **kw) -> str:
    return run("kubectl", *args, **kw)


def render(name: str, **values: str) -> str:
    return string.Template((DEMO / name).read_text()).safe_substitute(values)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--started", type=float, default=time.time())
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "demo")
    args = parser.parse_args()
    prometheus = os.environ["PROMETHEUS_URL"]

    step("Installing the batchtune chart (operator, CRD, least-privilege RBAC)")
    run("helm", "upgrade", "--install", "batchtune", str(ROOT / "charts" / "batchtune"), "--namespace",
        RELEASE_NAMESPACE, "--create-namespace", "--wait", "--timeout", "3m", "--set", "operator.tickSeconds=2",
        # The local cluster's Prometheus scrapes every 2 s (a real one: 15-30 s, and longer windows).
        "--set", "prometheus.scrapeIntervalSeconds=2")

    step("Deploying production: Llama-3.1-70B fp8 on one H100 at --max-num-seqs 8")
    kubectl("create", "namespace", NAMESPACE, check=False, quiet=True)
    kubectl("-n", NAMESPACE, "apply", "-f", str(DEMO / "production.yaml"))
    kubectl("-n", NAMESPACE, "rollout", "status", "deployment/llama-70b", "--timeout=180s")
    pod_ip = kubectl("-n", NAMESPACE, "get", "pods", "-l", "app.kubernetes.io/name=llama-70b", "-o",
                     "jsonpath={.items[0].status.podIP}", quiet=True).strip()

    step(f"Sending steady production traffic to {pod_ip}")
    kubectl("-n", NAMESPACE, "apply", "-f", "-", input=render("traffic.yaml", PRODUCTION_URL=f"http://{pod_ip}:8000"))

    step("Applying the BatchTuning")
    # A second run of the demo starts a fresh tuning rather than finding the last one finished.
    kubectl("-n", NAMESPACE, "delete", "batchtuning", "llama-70b", "--ignore-not-found", "--wait=true",
            "--timeout=60s", quiet=True)
    kubectl("-n", NAMESPACE, "apply", "-f", "-", input=render("batchtuning.yaml", PROMETHEUS_URL=prometheus))
    print("    watch it yourself with:  kubectl -n demo get bt -w   or   batchtune status llama-70b -n demo -w")

    step("Tuning (live progress)")
    watch = subprocess.run([*BATCHTUNE, "status", "llama-70b", "-n", NAMESPACE, "--watch", "--interval", "3"])
    step("Report")
    run(*BATCHTUNE, "report", "llama-70b", "-n", NAMESPACE, "--out", str(args.out))
    step("Decision")
    run(*BATCHTUNE, "recommend", "llama-70b", "-n", NAMESPACE, "-o", "patch")
    elapsed = time.time() - args.started
    print(f"\nThe three curves: {args.out / 'curves.png'}\nThe trial table: {args.out / 'trials.csv'}")
    print(f"Demo finished in {elapsed / 60:.1f} minutes. Stop the cluster with: "
          f"BATCHTUNE_CLUSTER_DIR={os.environ.get('BATCHTUNE_CLUSTER_DIR')} hack/localcluster/down")
    return watch.returncode


if __name__ == "__main__":
    sys.exit(main())
