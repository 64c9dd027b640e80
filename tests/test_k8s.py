"""The Kubernetes manifests (ops/k8s/): valid against a pinned Kubernetes release's schemas, offline,
and holding the properties the operator's guide promises, each check run on the manifests and on a
copy planted with the fault it looks for; the broker pod's entrypoint run against stand-in GPUs.

The broker's pod: a DaemonSet whose container starts one broker per GPU (run-brokers.sh, in the
ConfigMap) with the sockets on a hostPath that engine pods mount too; hostPID on this pod only, no
hostIPC anywhere; every GPU visible, none claimed; the sockets' group in the engines'
supplementalGroups; metrics on 9400 + the GPU's index, as the ConfigMap's broker.yaml says through
the broker's own config loader.
"""

from __future__ import annotations

import copy
import glob
import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from conftest import ROOT, short_tmpdir
from kubernetes_validate import utils as kubernetes_validate

from memory_broker.broker.cli import build_parser
from memory_broker.broker.server.config import SCHEMA, ConfigError, build_options
from memory_broker.proto.wire.gpus import DEVICE_TABLE_ENV

K8S = os.path.join(ROOT, "ops", "k8s")
# The oldest Kubernetes release the manifests are checked against; kubernetes-validate (pinned in
# pyproject.toml) ships its schemas, so nothing is fetched.
KUBERNETES = "1.30.0"
GPUS = [{"index": i, "uuid": f"GPU-{i:08x}-0000-0000-0000-{i:012x}", "name": "stand-in"} for i in range(8)]
BIN = os.path.dirname(sys.executable)


def manifests() -> list[dict]:
    """Every object of every file in ops/k8s/, each with the file it came from."""
    objs = []
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    objs.append(dict(doc, _file=os.path.basename(path)))
    return objs


def one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name} in ops/k8s/"
    return found[0]


def pod_spec(obj: dict) -> dict | None:
    """The pod template's spec of a workload, a Pod's own spec, None for anything else."""
    if obj["kind"] == "Pod":
        return obj["spec"]
    return obj.get("spec", {}).get("template", {}).get("spec")


def broker_spec(objs: list[dict]) -> dict:
    return pod_spec(one(objs, "DaemonSet", "memory-broker"))


def engine_spec(objs: list[dict]) -> dict:
    return pod_spec(one(objs, "Pod", "vllm-engine"))


def container(spec: dict, name: str) -> dict:
    return next(c for c in spec["containers"] if c["name"] == name)


def config_map(objs: list[dict]) -> dict:
    return one(objs, "ConfigMap", "memory-broker")["data"]


def without_file(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k != "_file"}


# ---------------------------------------------------------------- the checks


def schema_problems(objs: list[dict]) -> list[str]:
    """Objects the pinned release's schemas refuse (strict: an unknown field is refused too)."""
    out = []
    for o in objs:
        try:
            kubernetes_validate.validate(without_file(o), KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            out.append(
                f"{o['_file']}: {o['kind']} {o['metadata'].get('name')}: {'.'.join(map(str, e.path))}: {e.message}"
            )
    return out


def host_namespace_problems(objs: list[dict]) -> list[str]:
    """hostPID on the broker's pod and no other; hostIPC on none."""
    out = []
    if not broker_spec(objs).get("hostPID"):
        out.append("the broker's pod lacks hostPID: engines' pids would read 0, their liveness lost")
    for o in objs:
        spec = pod_spec(o)
        if spec is None:
            continue
        if spec.get("hostPID") and not (o["kind"] == "DaemonSet" and o["metadata"]["name"] == "memory-broker"):
            out.append(f"{o['_file']}: {o['metadata']['name']} has hostPID")
        if spec.get("hostIPC"):
            out.append(f"{o['_file']}: {o['metadata']['name']} has hostIPC")
    return out


def gpu_problems(objs: list[dict]) -> list[str]:
    """The broker sees every GPU and claims none; the engine claims its one."""
    out = []
    for c in broker_spec(objs).get("initContainers", []) + broker_spec(objs)["containers"]:
        for part in ("requests", "limits"):
            if "nvidia.com/gpu" in c.get("resources", {}).get(part, {}):
                out.append(f"the broker's container {c['name']} claims GPUs ({part})")
    env = {e["name"]: e.get("value") for e in container(broker_spec(objs), "broker").get("env", [])}
    if env.get("NVIDIA_VISIBLE_DEVICES") != "all":
        out.append(f"the broker sees NVIDIA_VISIBLE_DEVICES={env.get('NVIDIA_VISIBLE_DEVICES')!r}, not all")
    if container(engine_spec(objs), "vllm")["resources"]["limits"].get("nvidia.com/gpu") != 1:
        out.append("the engine does not claim one GPU")
    return out


def _run_mount(spec: dict, name: str) -> tuple[str | None, str | None]:
    """(the host path, where container ``name`` mounts it) of the pod's hostPath volume named
    /run/memory-broker on the host."""
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in spec.get("volumes", [])}
    for m in container(spec, name).get("volumeMounts", []):
        if volumes.get(m["name"]) == "/run/memory-broker":
            return volumes[m["name"]], m["mountPath"]
    return None, None


def run_dir_problems(objs: list[dict]) -> list[str]:
    """Broker and engine share the run directory's hostPath at one path, which is where the
    entrypoint puts the sockets, the probes look and the engine's client looks."""
    out = []
    host_b, at_b = _run_mount(broker_spec(objs), "broker")
    host_e, at_e = _run_mount(engine_spec(objs), "vllm")
    if host_b is None or host_e is None:
        return [f"the run directory's hostPath: broker mounts {host_b}, engine {host_e}"]
    if at_b != at_e:
        out.append(f"the broker mounts the run directory at {at_b}, the engine at {at_e}")
    script = config_map(objs)["run-brokers.sh"]
    if f"RUN_DIR=${{MEMORY_BROKER_RUN_DIR:-{at_b}}}" not in script:
        out.append(f"run-brokers.sh does not put the sockets in {at_b}")
    env = {e["name"]: e.get("value") for e in container(engine_spec(objs), "vllm").get("env", [])}
    if env.get("MEMORY_BROKER_SOCKET") != at_e:
        out.append(f"the engine's MEMORY_BROKER_SOCKET is {env.get('MEMORY_BROKER_SOCKET')!r}, not {at_e}")
    for kind, probe in probes(objs).items():
        if probe is not None and probe.run_dir != at_b:
            out.append(f"the {kind} probe looks in {probe.run_dir}, not {at_b}")
    return out


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def probes(objs: list[dict]) -> dict:
    """Each probe of the broker's container, parsed by the memory-broker command's own parser
    (None for one it refuses)."""
    c = container(broker_spec(objs), "broker")
    found = {}
    for kind in PROBES:
        argv = c[kind]["exec"]["command"]
        try:
            found[kind] = build_parser().parse_args(argv[1:]) if argv[0] == "memory-broker" else None
        except SystemExit:
            found[kind] = None
    return found


def probe_problems(objs: list[dict]) -> list[str]:
    """Every probe asks every broker of the node (``memory-broker status --all``) and gives up
    before the kubelet does."""
    c = container(broker_spec(objs), "broker")
    out = []
    for kind, a in probes(objs).items():
        if a is None:
            out.append(f"{kind}: {shlex.join(c[kind]['exec']['command'])} is not a memory-broker command")
        elif a.command != "status" or not a.all:
            out.append(f"{kind}: not memory-broker status --all")
        elif a.timeout >= c[kind]["timeoutSeconds"]:
            out.append(f"{kind}: waits {a.timeout:g} s for a broker, the kubelet {c[kind]['timeoutSeconds']} s")
    return out


def broker_options(objs: list[dict], gpu: dict, tmp: str, monkeypatch):
    """The options GPU ``gpu``'s broker runs with: the ConfigMap's broker.yaml through the broker's
    own loader, with the flags run-brokers.sh gives it, on a node of the 8 stand-in GPUs."""
    table = os.path.join(tmp, "gpus.json")
    with open(table, "w") as f:
        json.dump(GPUS, f)
    monkeypatch.setenv(DEVICE_TABLE_ENV, table)
    config = os.path.join(tmp, "broker.yaml")
    with open(config, "w") as f:
        f.write(config_map(objs)["broker.yaml"])
    flags = {"instance": gpu["uuid"], "device": gpu["uuid"], "run_dir": os.path.join(tmp, "run")}
    return build_options(config, dict(flags, state_root=os.path.join(tmp, "state")))


def socket_problems(objs: list[dict], opts) -> list[str]:
    """The engine reaches the sockets (its groups hold theirs, 0660) and may use a session."""
    out = []
    group = broker_spec(objs)["securityContext"]["runAsGroup"]
    engine = engine_spec(objs)["securityContext"]
    if opts.socket_group is not None:
        out.append(f"listeners.socket_group {opts.socket_group!r}: a name the image's /etc/group must hold")
    if opts.socket_mode is None or opts.socket_mode & 0o060 != 0o060 or opts.socket_mode & 0o007:
        out.append(f"socket mode {opts.socket_mode and oct(opts.socket_mode)}: not read-write to the group alone")
    if group not in engine.get("supplementalGroups", []):
        out.append(
            f"the engine's supplementalGroups {engine.get('supplementalGroups')} lack the sockets' group {group}"
        )
    if engine["runAsUser"] not in opts.allowed_uids:
        out.append(f"the engine's uid {engine['runAsUser']} is not in security.allowed_uids {opts.allowed_uids}")
    return out


def metrics_problems(objs: list[dict], tmp: str, monkeypatch) -> list[str]:
    """GPU i's broker serves metrics on the container port named metrics-gpuI, on an address the
    Service reaches, and the node-local Service points at those ports."""
    out = []
    ports = {p["name"]: p["containerPort"] for p in container(broker_spec(objs), "broker")["ports"]}
    for gpu in GPUS:
        opts = broker_options(objs, gpu, tmp, monkeypatch)
        name = f"metrics-gpu{gpu['index']}"
        if ports.get(name) != opts.metrics_port:
            out.append(
                f"GPU {gpu['index']}'s broker serves metrics on {opts.metrics_port}, the pod says {ports.get(name)}"
            )
        if opts.metrics_address.startswith("127.") or opts.metrics_address == "localhost":
            out.append(f"metrics on {opts.metrics_address}: the pod's loopback, which no Service reaches")
    service = one(objs, "Service", "memory-broker-metrics")["spec"]
    if service.get("internalTrafficPolicy") != "Local":
        out.append(f"the metrics Service's internalTrafficPolicy is {service.get('internalTrafficPolicy')}")
    for p in service["ports"]:
        if p["targetPort"] not in ports:
            out.append(f"the metrics Service targets {p['targetPort']}, which the pod does not name")
    return out


@pytest.fixture
def short_dir():
    """A directory whose path leaves a socket inside room under the 107-byte limit."""
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- the manifests


def test_every_manifest_is_valid_for_the_pinned_kubernetes_release_offline():
    objs = manifests()
    kinds = sorted({(o["kind"], o["metadata"]["name"]) for o in objs})
    for wanted in (("DaemonSet", "memory-broker"), ("Pod", "vllm-engine"), ("Deployment", "valkey")):
        assert wanted in kinds, kinds
    assert ("Deployment", "mooncake-master") in kinds and ("Service", "mooncake-master") in kinds
    assert schema_problems(objs) == []
    # A misspelled field and a wrong type are refused.
    bad = copy.deepcopy(objs)
    broker_spec(bad)["hostPIDs"] = True
    one(bad, "Service", "valkey")["spec"]["ports"][0]["port"] = "six"
    found = schema_problems(bad)
    assert len(found) == 2 and "hostPIDs" in found[0] and "six" in found[1], found


def test_host_pid_is_on_the_broker_pod_only_and_host_ipc_nowhere():
    objs = manifests()
    assert host_namespace_problems(objs) == []
    bad = copy.deepcopy(objs)
    engine_spec(bad)["hostPID"] = True
    pod_spec(one(bad, "Deployment", "valkey"))["hostIPC"] = True
    assert host_namespace_problems(bad) == [
        "engine-vllm-pod.yaml: vllm-engine has hostPID",
        "valkey.yaml: valkey has hostIPC",
    ]
    bad = copy.deepcopy(objs)
    del broker_spec(bad)["hostPID"]
    assert "lacks hostPID" in host_namespace_problems(bad)[0]


def test_the_broker_sees_every_gpu_and_claims_none():
    objs = manifests()
    assert gpu_problems(objs) == []
    bad = copy.deepcopy(objs)
    c = container(broker_spec(bad), "broker")
    c["resources"]["limits"]["nvidia.com/gpu"] = 1
    c["env"] = [e for e in c["env"] if e["name"] != "NVIDIA_VISIBLE_DEVICES"]
    found = gpu_problems(bad)
    assert len(found) == 2 and "claims GPUs (limits)" in found[0] and "None, not all" in found[1], found


def test_broker_and_engine_share_the_run_directory_where_sockets_probes_and_client_look():
    objs = manifests()
    assert run_dir_problems(objs) == []
    bad = copy.deepcopy(objs)
    next(m for m in container(engine_spec(bad), "vllm")["volumeMounts"] if m["name"] == "memory-broker")[
        "mountPath"
    ] = "/run/broker"
    assert (
        run_dir_problems(bad)[0]
        == "the broker mounts the run directory at /run/memory-broker, the engine at /run/broker"
    )
    bad = copy.deepcopy(objs)
    next(v for v in engine_spec(bad)["volumes"] if v["name"] == "memory-broker")["hostPath"]["path"] = "/run/other"
    assert "engine None" in run_dir_problems(bad)[0]
    bad = copy.deepcopy(objs)
    container(broker_spec(bad), "broker")["livenessProbe"]["exec"]["command"][4] = "/tmp/memory-broker"
    assert run_dir_problems(bad) == ["the livenessProbe probe looks in /tmp/memory-broker, not /run/memory-broker"]


def test_the_probes_ask_every_broker_of_the_node_within_the_kubelets_timeout():
    objs = manifests()
    assert probe_problems(objs) == []
    bad = copy.deepcopy(objs)
    c = container(broker_spec(bad), "broker")
    c["startupProbe"]["exec"]["command"][2] = "--every"
    c["readinessProbe"]["exec"]["command"].remove("--all")
    c["livenessProbe"]["timeoutSeconds"] = 5
    assert probe_problems(bad) == [
        "startupProbe: memory-broker status --every --run-dir /run/memory-broker --timeout 3 is not a memory-broker command",
        "readinessProbe: not memory-broker status --all",
        "livenessProbe: waits 5 s for a broker, the kubelet 5 s",
    ]


def test_the_configmap_loads_and_the_engine_reaches_the_sockets_and_may_use_a_session(short_dir, monkeypatch):
    objs = manifests()
    opts = broker_options(objs, GPUS[1], short_dir, monkeypatch)
    assert opts.arena == "cuda" and opts.socket == os.path.join(short_dir, "run", GPUS[1]["uuid"], "broker.sock")
    assert socket_problems(objs, opts) == []
    bad = copy.deepcopy(objs)
    engine_spec(bad)["securityContext"]["supplementalGroups"] = [1001]
    engine_spec(bad)["securityContext"]["runAsUser"] = 1002
    found = socket_problems(bad, opts)
    assert len(found) == 2 and "lack the sockets' group 2000" in found[0] and "uid 1002" in found[1], found
    bad = copy.deepcopy(objs)
    config_map(bad)["broker.yaml"] = config_map(bad)["broker.yaml"].replace(
        'socket_mode: "0660"', 'socket_mode: "0666"'
    )
    assert "0o666" in socket_problems(bad, broker_options(bad, GPUS[1], short_dir, monkeypatch))[0]
    # The broker's own loader refuses what it does not know.
    config_map(bad)["broker.yaml"] += "memory_pool:\n  pool_sise: 1GiB\n"
    with pytest.raises(ConfigError, match="pool_sise"):
        broker_options(bad, GPUS[1], short_dir, monkeypatch)


def test_each_gpus_metrics_port_is_the_one_the_pod_and_the_node_local_service_name(short_dir, monkeypatch):
    objs = manifests()
    assert metrics_problems(objs, short_dir, monkeypatch) == []
    bad = copy.deepcopy(objs)
    config_map(bad)["broker.yaml"] = (
        config_map(bad)["broker.yaml"]
        .replace("metrics_port: 9400", "metrics_port: 9500")
        .replace("0.0.0.0", "127.0.0.1")
    )
    one(bad, "Service", "memory-broker-metrics")["spec"]["internalTrafficPolicy"] = "Cluster"
    found = metrics_problems(bad, short_dir, monkeypatch)
    assert found[:2] == [
        "GPU 0's broker serves metrics on 9500, the pod says 9400",
        "metrics on 127.0.0.1: the pod's loopback, which no Service reaches",
    ]
    assert len(found) == 17 and "internalTrafficPolicy is Cluster" in found[-1], found


def test_the_commented_tier_block_loads_once_the_broker_has_the_tier(short_dir, monkeypatch):
    objs = manifests()
    lines = config_map(objs)["broker.yaml"].splitlines()
    start = lines.index("# tier:")
    block = [lines[start], *itertools.takewhile(lambda ln: ln.startswith("#   "), lines[start + 1 :])]
    assert [ln.split(":")[0].strip("# ") for ln in block] == [
        "tier",
        *("backend", "valkey_url", "deadline", "queue_depth", "write", "key_prefix"),
    ]
    config_map(objs)["broker.yaml"] += "\n".join(ln[2:] for ln in block) + "\n"
    if "tier.backend" in SCHEMA:
        opts = broker_options(objs, GPUS[0], short_dir, monkeypatch)
        assert getattr(opts, SCHEMA["tier.backend"].name) == "valkey"
    else:
        # This broker has no tier: the block must stay a comment, as the ConfigMap says.
        with pytest.raises(ConfigError, match="tier: unknown key"):
            broker_options(objs, GPUS[0], short_dir, monkeypatch)


# ---------------------------------------------------------------- the entrypoint


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free on loopback now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


class Node:
    """run-brokers.sh from the ConfigMap as the DaemonSet runs it, on a host arena (flags the
    script passes on), with ``gpus`` standing in for the node's GPUs."""

    def __init__(self, gpus: list[dict], *flags: str, data: dict[str, str] | None = None):
        objs = manifests()
        self.dir = short_tmpdir()
        self.run_dir = os.path.join(self.dir, "run")
        # The ConfigMap's keys, as files in one directory (/etc/memory-broker in the pod).
        for name, text in {**config_map(objs), **(data or {})}.items():
            with open(os.path.join(self.dir, name), "w") as f:
                f.write(text)
        with open(os.path.join(self.dir, "gpus.json"), "w") as f:
            json.dump(gpus, f)
        self.probe = container(broker_spec(objs), "broker")["readinessProbe"]["exec"]["command"]
        self.probe = [os.path.join(BIN, "memory-broker")] + [
            self.run_dir if a == "/run/memory-broker" else a for a in self.probe[1:]
        ]
        self.env = dict(
            os.environ,
            PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            MEMORY_BROKER_CONFIG=os.path.join(self.dir, "broker.yaml"),
            MEMORY_BROKER_RUN_DIR=self.run_dir,
            MEMORY_BROKER_STATE_ROOT=os.path.join(self.dir, "state"),
            **{DEVICE_TABLE_ENV: os.path.join(self.dir, "gpus.json")},
        )
        self.log = open(os.path.join(self.dir, "node.log"), "w+")
        argv = ["bash", os.path.join(self.dir, "run-brokers.sh"), "--arena", "host", "--pool-size", "128MiB", *flags]
        self.proc = subprocess.Popen(argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def ready(self, timeout: float = 60.0) -> None:
        """Wait until the DaemonSet's readiness probe passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"run-brokers.sh exited {self.proc.returncode}:\n{self.output()}"
            if subprocess.run(self.probe, env=self.env, capture_output=True).returncode == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"the readiness probe never passed ({shlex.join(self.probe)}):\n{self.output()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            pids = children(self.proc.pid)
            self.proc.kill()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def engine_on(node: Node, gpu: dict) -> str:
    """The GPU whose broker an engine pod given ``gpu`` reaches with the example pod's environment
    (its nvidia-smi lists that GPU alone, as device 0): the broker's ``ArenaInfo.device``."""
    table = os.path.join(node.dir, "engine-gpus.json")
    with open(table, "w") as f:
        json.dump([dict(gpu, index=0)], f)
    pod_env = {e["name"]: e["value"] for e in container(engine_spec(manifests()), "vllm")["env"]}
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(MEMORY_BROKER_SOCKET=pod_env["MEMORY_BROKER_SOCKET"].replace("/run/memory-broker", node.run_dir))
    env[DEVICE_TABLE_ENV] = table
    code = (
        "from memory_broker.clients import BrokerClient, Spec\n"
        "with BrokerClient.connect() as c:\n"
        "    c.allocate([Spec(1, content_type='kv_cache', key=b'k')])\n"
        "    print(c.arena.device)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.timeout(180)
def test_the_entrypoint_runs_a_broker_per_gpu_that_probe_metrics_and_engine_find_and_drains_on_sigterm():
    base = free_ports(2)
    # A ConfigMap key named after a GPU is that GPU's own settings, over broker.yaml.
    own = {f"{GPUS[1]['uuid']}.yaml": "memory_pool:\n  page_size: 1MiB\n"}
    node = Node(GPUS[:2], "--metrics-port", str(base), "--metrics-address", "127.0.0.1", data=own)
    try:
        node.ready()
        brokers = children(node.proc.pid)
        assert len(brokers) == 2
        r = subprocess.run([*node.probe, "--json"], env=node.env, capture_output=True, text=True, check=True)
        assert [(b["gpu_uuid"], b["max_pages"]) for b in json.loads(r.stdout)] == [
            (GPUS[0]["uuid"], 64),
            (GPUS[1]["uuid"], 128),
        ]
        for gpu in GPUS[:2]:
            assert os.path.exists(os.path.join(node.run_dir, gpu["uuid"], "broker.sock"))
            with urllib.request.urlopen(f"http://127.0.0.1:{base + gpu['index']}/metrics", timeout=10) as r:
                assert f'gpu_uuid="{gpu["uuid"]}"' in r.read().decode()
        assert engine_on(node, GPUS[1]) == GPUS[1]["uuid"]
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(40) == 0, node.output()
        assert all(gone(pid) for pid in brokers)
        assert subprocess.run(node.probe, env=node.env, capture_output=True).returncode != 0
    finally:
        node.close()


@pytest.mark.timeout(180)
def test_a_broker_that_dies_stops_the_others_and_fails_the_container():
    node = Node(GPUS[:2], "--metrics-port", "0")
    try:
        node.ready()
        first, second = children(node.proc.pid)
        os.kill(first, signal.SIGKILL)
        assert node.proc.wait(40) == 128 + signal.SIGKILL, node.output()
        assert gone(second) and "a broker exited (137); stopping the others" in node.output()
    finally:
        node.close()


def test_the_entrypoint_refuses_a_node_without_gpus():
    node = Node([])
    try:
        assert node.proc.wait(60) == 1
        assert "no GPU visible" in node.output() and not os.path.exists(node.run_dir)
    finally:
        node.close()
