"""One pod's life on the node agent with real local processes and a recording stand-in for the API."""

from __future__ import annotations

import dataclasses
import os
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from batchtune_local.nodeagent.images import ImageMap, ImageRule
from batchtune_local.nodeagent.pod import NodeSettings, PodWorker, backoff_s
from batchtune_local.nodeagent.state import StateStore

TEST_IMAGES = ImageMap((ImageRule("batchtune.test/*", ()),), ("test-map.yaml",))


class RecordingApi:
    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.events: list[tuple[str, str, str]] = []

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append(status)

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        self.deleted.append(uid)

    def config_map(self, namespace: str, name: str):
        return {"GREETING": "hello"} if name == "cfg" else None

    def secret(self, namespace: str, name: str):
        return None

    def event(self, pod, container, kind, reason, message):
        self.events.append((kind, reason, message))

    @property
    def last(self) -> dict[str, Any]:
        return self.statuses[-1]


def make_pod(command: list[str], *, restart: str = "Always", gpus: int = 0, image: str = "batchtune.test/python",
             **container: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "main", "image": image, "command": command, **container}
    if gpus:
        spec["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    return {
        "metadata": {"name": "p-" + uuid.uuid4().hex[:6], "namespace": "t", "uid": str(uuid.uuid4())},
        "spec": {"nodeName": "gpu-node-0", "restartPolicy": restart, "terminationGracePeriodSeconds": 5,
                 "containers": [spec]},
        "status": {"phase": "Pending"},
    }


@pytest.fixture
def node(tmp_path):
    settings = NodeSettings(node="gpu-node-0", gpu_product="NVIDIA-L4", gpus_per_node=4, image_map=TEST_IMAGES,
                            state_dir=tmp_path, time_scale=50.0, base_env={"PATH": os.environ["PATH"]})
    store = StateStore(tmp_path, "127.42.0.0/16")
    workers: list[PodWorker] = []

    def run(pod):
        api = RecordingApi()
        worker = PodWorker(pod, settings, store, api)
        workers.append(worker)
        return worker, api

    yield settings, store, run
    for worker in workers:
        worker.shutdown()
        worker.tick()


def drive(worker: PodWorker, until, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker.tick()
        if until():
            return
        time.sleep(0.05)
    raise AssertionError(f"condition not reached in {timeout}s; last status: {worker.last_sent}")


def container_status(api: RecordingApi) -> dict[str, Any]:
    return api.last["containerStatuses"][0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


SERVER = (
    "import http.server, os\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(os.environ['NVIDIA_VISIBLE_DEVICES'].encode())\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer((os.environ['BATCHTUNE_POD_IP'], 8080), H).serve_forever()\n"
)


def test_server_pod_gets_ready_answers_on_its_ip_and_is_deleted(node):
    _, store, run = node
    pod = make_pod(["python3", "-c", SERVER], gpus=2,
                   readinessProbe={"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1})
    worker, api = run(pod)
    drive(worker, lambda: api.statuses and api.last["conditions"][2]["status"] == "True")
    status = api.last
    assert status["phase"] == "Running"
    assert status["podIP"].startswith("127.42.") and container_status(api)["ready"]
    assert urllib.request.urlopen(f"http://{status['podIP']}:8080/", timeout=5).read() == b"0,1"
    pid = store.pod(worker.uid)["processes"]["main"]["pid"]

    pod = dict(pod, metadata=dict(pod["metadata"], deletionTimestamp="2030-01-01T00:00:00Z",
                                  deletionGracePeriodSeconds=5))
    worker.update(pod)
    drive(worker, lambda: worker.done)
    assert api.deleted == [worker.uid]
    assert not alive(pid)
    assert store.pod(worker.uid) is None and store.gpu_holders("gpu-node-0") == {}


def test_exit_137_is_oomkilled_and_never_pod_fails(node):
    worker, api = node[2](make_pod(["python3", "-c", "raise SystemExit(137)"], restart="Never"))
    drive(worker, lambda: api.statuses and api.last["phase"] == "Failed")
    term = container_status(api)["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (137, "OOMKilled")


def test_crashing_container_backs_off_with_crashloopbackoff(node):
    worker, api = node[2](make_pod(["python3", "-c", "raise SystemExit(3)"]))
    drive(worker, lambda: api.statuses and container_status(api)["state"].get("waiting", {}).get("reason")
          == "CrashLoopBackOff")
    cs = container_status(api)
    assert cs["restartCount"] >= 1
    assert cs["lastState"]["terminated"]["exitCode"] == 3 and cs["lastState"]["terminated"]["reason"] == "Error"
    assert "back-off" in cs["state"]["waiting"]["message"]
    assert api.last["phase"] == "Running"
    drive(worker, lambda: container_status(api)["restartCount"] >= 3)
    reasons = [reason for _, reason, _ in api.events]
    assert reasons[0] == "Started" and "BackOff" in reasons


def test_backoff_doubles_to_a_cap():
    assert [backoff_s(n, 1.0) for n in (1, 2, 3, 4, 7, 20)] == [0, 10, 20, 40, 300, 300]
    assert backoff_s(3, 10.0) == 2.0


def test_job_pod_succeeds_with_termination_message_and_env(node):
    script = ("import os\n"
              "open(os.environ['BATCHTUNE_TERMINATION_MESSAGE_PATH'], 'w').write("
              "'|'.join([os.environ['MY_IP'], os.environ['MY_NAME'], os.environ['GREETING'], "
              "os.environ['NVIDIA_VISIBLE_DEVICES'], os.environ['BATCHTUNE_GPU_COUNT'], os.environ['BATCHTUNE_GPU_PRODUCT'], "
              "os.environ['BATCHTUNE_TIME_SCALE'], os.getcwd()]))\n")
    pod = make_pod(["python3", "-c", script], restart="Never", gpus=1, env=[
        {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "GREETING"}}},
    ])
    _, store, run = node
    worker, api = run(pod)
    drive(worker, lambda: api.statuses and api.last["phase"] == "Succeeded")
    term = container_status(api)["state"]["terminated"]
    ip, name, greeting, gpus, count, product, scale, cwd = term["message"].split("|")
    assert (ip, name, greeting, gpus, count, product, scale) == (
        api.last["podIP"], pod["metadata"]["name"], "hello", "0", "1", "NVIDIA-L4", "50.0")
    assert cwd == str(worker.pod_dir)
    assert term["reason"] == "Completed" and term["exitCode"] == 0
    assert store.gpu_holders("gpu-node-0") == {}  # a finished pod frees its GPUs


def test_fallback_to_logs_on_error(node):
    pod = make_pod(["python3", "-c", "print('first'); print('boom'); raise SystemExit(2)"], restart="Never",
                   terminationMessagePolicy="FallbackToLogsOnError")
    worker, api = node[2](pod)
    drive(worker, lambda: api.statuses and api.last["phase"] == "Failed")
    assert container_status(api)["state"]["terminated"]["message"] == "first\nboom\n"


def test_unmapped_image_waits_with_errimagepull(node):
    worker, api = node[2](make_pod(["x"], image="nginx:1.27"))
    drive(worker, lambda: api.statuses)
    waiting = container_status(api)["state"]["waiting"]
    assert waiting["reason"] == "ErrImagePull"
    assert "nginx:1.27" in waiting["message"] and "test-map.yaml" in waiting["message"]
    assert api.last["phase"] == "Pending"


def test_liveness_failure_restarts_the_container(node):
    pod = make_pod(["python3", "-c", "import time; time.sleep(60)"],
                   livenessProbe={"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2},
                   terminationGracePeriodSeconds=1)
    worker, api = node[2](pod)
    drive(worker, lambda: api.statuses and container_status(api)["restartCount"] >= 1)
    assert container_status(api)["lastState"]["terminated"]["exitCode"] == 143  # SIGTERM from the agent
    assert ("Warning", "Unhealthy", "Liveness probe failed: ") in api.events
    assert any(reason == "Killing" and "failed liveness probe" in message for _, reason, message in api.events)


def test_restarted_agent_adopts_running_process_then_kills_it_on_delete(node):
    settings, store, run = node
    pod = make_pod(["python3", "-c", "import time; time.sleep(60)"])
    first, api = run(pod)
    drive(first, lambda: api.statuses and api.last["phase"] == "Running")
    pid = store.pod(first.uid)["processes"]["main"]["pid"]
    ip = api.last["podIP"]
    first.containers[0].process = None  # the old agent "crashed" without stopping anything

    pod = dict(pod, status=api.last)
    second, api2 = run(pod)
    assert second.containers[0].process is not None and second.containers[0].process.pid == pid
    drive(second, lambda: api2.statuses)
    assert api2.last["podIP"] == ip and container_status(api2)["restartCount"] == 0
    second.update(dict(pod, metadata=dict(pod["metadata"], deletionTimestamp="2030-01-01T00:00:00Z")))
    drive(second, lambda: second.done)
    assert not alive(pid)


def test_shutdown_stops_processes(node):
    worker, api = node[2](make_pod(["python3", "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"],
                                   terminationGracePeriodSeconds=1))
    drive(worker, lambda: api.statuses and api.last["phase"] == "Running")
    pid = worker.containers[0].process.pid
    worker.shutdown()
    worker.tick()
    assert worker.done and not alive(pid)
    assert api.deleted == []  # shutdown leaves the API alone


def test_init_container_runs_first(node):
    pod = make_pod(["python3", "-c", "import os; open(os.environ['BATCHTUNE_TERMINATION_MESSAGE_PATH'],'w').write(open('ready').read())"],
                   restart="Never")
    pod["spec"]["initContainers"] = [{"name": "init", "image": "batchtune.test/sh",
                                      "command": ["sh", "-c", "echo from-init > ready"]}]
    worker, api = node[2](pod)
    drive(worker, lambda: api.statuses and api.last["phase"] == "Succeeded")
    assert api.last["initContainerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
    assert container_status(api)["state"]["terminated"]["message"] == "from-init\n"


PRIORITY = (  # the container's scheduling policy, niceness and autogroup line, then a child's it starts
    "import os, subprocess, sys, time\n"
    "time.sleep(0.2)\n"  # past the agent's start-up of the process
    "me = lambda: f'{os.sched_getscheduler(0)} {os.getpriority(os.PRIO_PROCESS, 0)} ' + "
    "open('/proc/self/autogroup').read().split()[-1]\n"
    "child = subprocess.run([sys.executable, '-c', 'import sys; ' + sys.argv[1]], capture_output=True, text=True)\n"
    "open(os.environ['BATCHTUNE_TERMINATION_MESSAGE_PATH'], 'w').write(me() + '|' + child.stdout.strip())\n"
)


@pytest.mark.parametrize("idle", [False, True], ids=["normal", "idle"])
def test_idle_pods_run_every_process_at_the_lowest_cpu_priority(node, idle):
    settings, store, _ = node
    settings = dataclasses.replace(settings, idle_pods=idle)
    printer = ("import os; print(f'{os.sched_getscheduler(0)} {os.getpriority(os.PRIO_PROCESS, 0)} ' + "
               "open('/proc/self/autogroup').read().split()[-1])")
    worker = PodWorker(make_pod(["python3", "-c", PRIORITY, printer], restart="Never"), settings, store,
                       api := RecordingApi())
    try:
        drive(worker, lambda: api.statuses and api.last["phase"] == "Succeeded")
    finally:
        worker.shutdown()
        worker.tick()
    container, child = container_status(api)["state"]["terminated"]["message"].split("|")
    own_niceness = os.getpriority(os.PRIO_PROCESS, 0)  # the tests may run niced: a pod inherits it
    # (policy, niceness, the autogroup's niceness): a new session is a new autogroup at niceness 0
    expected = f"{os.SCHED_IDLE} 19 19" if idle else f"{os.SCHED_OTHER} {own_niceness} 0"
    assert container == expected and child == expected
