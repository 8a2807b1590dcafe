"""Drives the demo on a running local cluster (hack/demo/run starts it): install, deploy, tune, report (HTML)."""

from __future__ import annotations

import argparse
import json
import os
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "hack" / "demo"
NAMESPACE = "demo"
RELEASE_NAMESPACE = "batchtune-system"
BATCHTUNE = [sys.executable, "-m", "batchtune"]
TERMINAL = ("Succeeded", "Recommended", "RolledBack", "Failed")


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


def production_args() -> list[str]:
    out = kubectl("-n", NAMESPACE, "get", "deployment", "llama-70b", "-o",
                  "jsonpath={.spec.template.spec.containers[0].args}", quiet=True)
    return json.loads(out or "[]")


def phase() -> str:
    return kubectl("-n", NAMESPACE, "get", "batchtuning", "llama-70b", "-o", "jsonpath={.status.phase}",
                   check=False, quiet=True).strip()


def flood_during_verify(url: str, stop: threading.Event) -> None:
    """The rollback act: once production is being verified, a traffic spike it cannot serve within the SLO."""
    while not stop.is_set():
        if phase() == "Verifying":
            step("Rollback act: a traffic spike hits production while batchtune verifies the change")
            kubectl("-n", NAMESPACE, "apply", "-f", "-", input=render(
                "traffic.yaml", NAME="llama-70b-flood", PRODUCTION_URL=url, RATE="60", CONCURRENCY="96"))
            return
        if phase() in TERMINAL:
            return
        stop.wait(2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--started", type=float, default=time.time())
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "demo")
    parser.add_argument("--rollback", action="store_true",
                        help="degrade production during verify and show batchtune roll it back")
    args = parser.parse_args()
    prometheus = os.environ["PROMETHEUS_URL"]

    step("Installing the batchtune chart (operator, CRD, least-privilege RBAC)")
    run("helm", "upgrade", "--install", "batchtune", str(ROOT / "charts" / "batchtune"), "--namespace",
        RELEASE_NAMESPACE, "--create-namespace", "--wait", "--timeout", "3m", "--set", "operator.tickSeconds=2",
        # The local cluster's Prometheus scrapes every 2 s (a real one: 15-30 s, and longer windows).
        "--set", "prometheus.scrapeIntervalSeconds=2",
        # It is on loopback, which the chart allows only where allowedUrls names it.
        "--set", f"prometheus.allowedUrls={{{prometheus.rstrip('/')}/}}")

    step("Deploying production: Llama-3.1-70B fp8 on one H100 at --max-num-seqs 8, behind a Service")
    kubectl("create", "namespace", NAMESPACE, check=False, quiet=True)
    # A second run starts from the timid production again, not from the setting the last run applied.
    for kind, name in (("batchtuning", "llama-70b"), ("deployment", "llama-70b-flood"), ("deployment", "llama-70b")):
        kubectl("-n", NAMESPACE, "delete", kind, name, "--ignore-not-found", "--wait=true", "--timeout=60s",
                quiet=True)
    kubectl("-n", NAMESPACE, "apply", "-f", str(DEMO / "production.yaml"))
    kubectl("-n", NAMESPACE, "rollout", "status", "deployment/llama-70b", "--timeout=180s")
    address = wait(lambda: kubectl("-n", NAMESPACE, "get", "service", "llama-70b", "-o",
                                   "jsonpath={.status.loadBalancer.ingress[0].ip}", quiet=True).strip(),
                   "the Service's load balancer address")
    url = f"http://{address}:8000"
    before = production_args()

    step(f"Sending steady production traffic to the Service at {url}")
    kubectl("-n", NAMESPACE, "apply", "-f", "-", input=render(
        "traffic.yaml", NAME="llama-70b-traffic", PRODUCTION_URL=url, RATE="2", CONCURRENCY="16"))

    step("Applying the BatchTuning (mode Auto: patch, verify, roll back on regression)")
    kubectl("-n", NAMESPACE, "apply", "-f", "-", input=render("batchtuning.yaml", PROMETHEUS_URL=prometheus))
    print("    watch it yourself with:  kubectl -n demo get bt -w   or   batchtune status llama-70b -n demo -w")
    stop = threading.Event()
    if args.rollback:
        threading.Thread(target=flood_during_verify, args=(url, stop), daemon=True).start()

    step("Tuning (live progress)")
    watch = subprocess.run([*BATCHTUNE, "status", "llama-70b", "-n", NAMESPACE, "--watch", "--interval", "3"])
    stop.set()
    kubectl("-n", NAMESPACE, "delete", "deployment", "llama-70b-flood", "--ignore-not-found", quiet=True)

    step("Production's args, before and after")
    after = production_args()
    print(f"    before: {' '.join(before)}\n    after:  {' '.join(after)}")
    final = phase()
    if final == "RolledBack":
        print("    rolled back: production runs exactly its previous args again" if after == before else
              "    ROLLED BACK BUT THE ARGS DIFFER: this is a bug")
    mark = kubectl("-n", NAMESPACE, "get", "deployment", "llama-70b", "-o",
                   "jsonpath={.metadata.annotations.batchtune\\.io/applied}", quiet=True)
    if mark:
        print(f"    recorded on the Deployment (batchtune.io/applied): {mark}")

    step("Report")
    run(*BATCHTUNE, "report", "llama-70b", "-n", NAMESPACE, "--out", str(args.out), "--html")
    elapsed = time.time() - args.started
    print(f"\nThe report, one page to open in a browser: {args.out / 'report.html'}"
          f"\nThe three curves at one common load, and SLO capacity: {args.out / 'curves.png'}"
          f"\nThe trial table: {args.out / 'trials.csv'}")
    print(f"Demo finished ({final}) in {elapsed / 60:.1f} minutes. Stop the cluster with: "
          f"BATCHTUNE_CLUSTER_DIR={os.environ.get('BATCHTUNE_CLUSTER_DIR')} hack/localcluster/down")
    expected = "RolledBack" if args.rollback else "Succeeded"
    return 0 if final == expected and (final != "RolledBack" or after == before) and watch.returncode in (0, 1) else 1


def wait(probe, what: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(1)
    sys.exit(f"timed out waiting for {what}")


if __name__ == "__main__":
    sys.exit(main())
