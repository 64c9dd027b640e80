"""Several brokers on one host, one per GPU, named by UUID; engines find theirs.

Two host-arena brokers stand in for two GPUs: each is given a GPU UUID from a stand-in device
table (``MEMORY_BROKER_DEVICE_TABLE``, the one device lookup both sides use), and processes with
different ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs, as CUDA reads them) each reach their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from conftest import ROOT, Broker, short_tmpdir, wait_serving

from memory_broker.broker.server.config import ConfigError, build_options
from memory_broker.proto.wire.gpus import DEVICE_TABLE_ENV, current_gpu_uuid, gpu_sockets, host_gpus

A = "GPU-11111111-1111-1111-1111-111111111111"
B = "GPU-22222222-2222-2222-2222-222222222222"
SMALL = ["--page-size", "512KiB", "--slab-size", "2MiB", "--pool-size", "8MiB"]


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps([{"index": 0, "uuid": A, "name": "Fake A"}, {"index": 1, "uuid": B.upper()}]))
    monkeypatch.setenv(DEVICE_TABLE_ENV, str(path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("MEMORY_BROKER_SOCKET", raising=False)
    return str(path)


def start_gpu_broker(run_dir: str, device: str, instance: str, *extra: str) -> Broker:
    d = short_tmpdir()
    log_path = os.path.join(d, "broker.log")
    args = [
        sys.executable,
        "-m",
        "memory_broker.broker.cli",
        "serve",
        "--arena",
        "host",
        "--device",
        device,
        "--instance",
        instance,
        "--run-dir",
        run_dir,
        "--state-root",
        os.path.join(d, "state"),
        *SMALL,
        *extra,
    ]
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT)
    uuid = {"0": A, "1": B}.get(device, device)
    b = Broker(os.path.join(run_dir, uuid, "broker.sock"), proc, log_path, args)
    try:
        wait_serving(b.socket, proc)
    except RuntimeError:
        b.stop(signal.SIGKILL)
        raise RuntimeError(f"broker failed to start; log:\n{b.log()}") from None
    return b


@pytest.fixture
def two_gpus(table):
    run_dir = short_tmpdir()
    brokers = [start_gpu_broker(run_dir, "0", "0"), start_gpu_broker(run_dir, B, B)]
    yield run_dir, brokers
    for b in brokers:
        b.stop()


def test_the_device_table_and_cuda_visible_devices_name_the_gpu(table, monkeypatch):
    assert [(g.index, g.uuid) for g in host_gpus()] == [(0, A), (1, B)]  # UUIDs normalized
    assert current_gpu_uuid() == A  # no CUDA_VISIBLE_DEVICES: device 0
    for visible, want in (("1", B), ("1,0", B), (B, B), (A.lower().upper(), A), ("", None), ("-1", None)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert current_gpu_uuid() == want, visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # an index the host lacks: CUDA sees no device
    assert current_gpu_uuid() is None


def child(run_dir: str, visible: str, table: str) -> dict:
    code = (
        "import json; from memory_broker.clients import BrokerClient, Spec\n"
        f"c = BrokerClient.connect({run_dir!r})\n"
        "objs = c.allocate([Spec(1, content_type='kv_cache', key=b'k-' + c.arena.device.encode())])\n"
        "print(json.dumps({'socket': c.socket_path, 'device': c.arena.device}))\n"
        "c.close()\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible, **{DEVICE_TABLE_ENV: table})
    env.pop("MEMORY_BROKER_SOCKET", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_processes_with_different_devices_each_reach_their_own_broker(two_gpus, table):
    run_dir, (ba, bb) = two_gpus
    assert set(gpu_sockets(run_dir)) == {A, B}
    assert all(os.stat(os.path.join(run_dir, u)).st_mode & 0o777 == 0o755 for u in (A, B))  # engines may enter
    # Broker A was started by index (instance "0"): the old per-instance path links to it.
    assert os.path.realpath(os.path.join(run_dir, "0.sock")) == os.path.realpath(ba.socket)
    assert os.path.realpath(os.path.join(run_dir, "0.sock.fds")) == os.path.realpath(ba.socket + ".fds")
    assert not os.path.exists(os.path.join(run_dir, f"{B}.sock"))  # an instance named by UUID needs no link
    got_a = child(run_dir, "0", table)
    got_b = child(run_dir, "1", table)
    got_b_by_uuid = child(run_dir, f"{B},0", table)
    assert got_a == {"socket": ba.socket, "device": A}
    assert got_b == {"socket": bb.socket, "device": B} == got_b_by_uuid
    # Each allocation landed in its own broker: the keyed object is there, not in the other.
    from memory_broker.clients import BrokerClient

    for b, mine, other in ((ba, A, B), (bb, B, A)):
        with BrokerClient.connect(b.socket) as c:
            assert len(c.lookup([b"k-" + mine.encode()])) == 1
            assert c.lookup([b"k-" + other.encode()]) == []


def test_a_missing_broker_for_the_device_is_an_error_naming_the_uuid_and_the_unit(two_gpus, table, monkeypatch):
    from memory_broker.clients import BrokerClient, BrokerError
    from memory_broker.clients.discovery import find_socket

    run_dir, (ba, bb) = two_gpus
    bb.stop()
    assert not os.path.exists(bb.socket)  # a stopped broker keeps its directory, not its socket
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(BrokerError) as e:
        BrokerClient.connect(run_dir, wait_s=0.2)
    assert e.value.code.name == "UNAVAILABLE"
    assert B in e.value.message and f"systemctl start memory-broker@{B}" in e.value.message
    # MEMORY_BROKER_SOCKET may name the directory too; a socket path is taken as given.
    monkeypatch.setenv("MEMORY_BROKER_SOCKET", run_dir)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert find_socket() == (ba.socket, A)
    monkeypatch.setenv("MEMORY_BROKER_SOCKET", ba.socket)
    assert find_socket() == (ba.socket, None)


def test_a_broker_serving_another_gpu_than_its_directory_says_is_refused(table, monkeypatch):
    from memory_broker.clients import BrokerClient, BrokerError

    run_dir = short_tmpdir()
    b = start_gpu_broker(run_dir, "0", "0")
    try:
        os.makedirs(os.path.join(run_dir, B))
        os.symlink(b.socket, os.path.join(run_dir, B, "broker.sock"))  # B's path, A's broker
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        with pytest.raises(BrokerError) as e:
            BrokerClient.connect(run_dir)
        assert e.value.code.name == "FAILED_PRECONDITION" and f"serves GPU {A}" in e.value.message
    finally:
        b.stop()


def test_each_broker_has_its_state_metrics_port_and_gpu_label(table):
    run_dir = short_tmpdir()
    port = 20000 + os.getpid() % 20000
    brokers = [
        start_gpu_broker(run_dir, dev, dev, "--metrics-port", str(port), "--metrics-port-per-gpu") for dev in ("0", "1")
    ]
    try:
        for i, (b, uuid) in enumerate(zip(brokers, (A, B))):
            state_root = b.args[b.args.index("--state-root") + 1]
            assert os.path.isdir(os.path.join(state_root, uuid))
            text = urllib.request.urlopen(f"http://127.0.0.1:{port + i}/metrics", timeout=10).read().decode()
            line = next(ln for ln in text.splitlines() if ln.startswith("memory_broker_pool_max_pages{"))
            assert f'gpu_uuid="{uuid}"' in line
            serving = next(e for e in b.log_events() if e.get("event") == "serving")
            assert serving["gpu_uuid"] == uuid
    finally:
        for b in brokers:
            b.stop()


def test_status_all_shows_every_broker_and_a_down_one(two_gpus, table):
    run_dir, (ba, bb) = two_gpus
    cli = [sys.executable, "-m", "memory_broker.broker.cli"]
    r = subprocess.run([*cli, "status", "--all", "--run-dir", run_dir], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()[1:]]
    assert [(x[0], x[1], x[2]) for x in rows] == [(A, "serving", "host"), (B, "serving", "host")]
    bb.stop()
    r = subprocess.run(
        [*cli, "status", "--all", "--json", "--run-dir", run_dir, "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    states = {row["gpu_uuid"]: row["state"] for row in json.loads(r.stdout)}
    assert states == {A: "serving", B: "down"}


def test_gpus_lists_the_host_and_enables_one_unit_per_gpu(table):
    cli = [sys.executable, "-m", "memory_broker.broker.cli", "gpus"]
    r = subprocess.run([*cli, "--enable", "--dry-run"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"systemctl enable --now memory-broker@{u}.service" for u in (A, B)]
    r = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60)
    assert [(g["index"], g["uuid"], g["socket"]) for g in json.loads(r.stdout)] == [(0, A, None), (1, B, None)]


def test_an_instance_file_is_read_over_the_shared_config(tmp_path, table):
    (tmp_path / "broker.yaml").write_text("memory_pool:\n  pool_size: 256MiB\nlisteners:\n  metrics_port: 9400\n")
    (tmp_path / f"{B}.yaml").write_text("memory_pool:\n  pool_size: 128MiB\n")
    run = short_tmpdir()
    flags = {"instance": B, "device": B, "run_dir": run, "metrics_port_per_gpu": True}
    opts = build_options(str(tmp_path / "broker.yaml"), flags)
    assert opts.pool_size == 128 << 20
    assert opts.socket == os.path.join(run, B, "broker.sock") and opts.metrics_port == 9401
    other = build_options(str(tmp_path / "broker.yaml"), dict(flags, instance=A, device=A))
    assert other.pool_size == 256 << 20 and other.metrics_port == 9400


def test_a_device_index_the_host_lacks_is_refused_naming_its_gpus(tmp_path, table):
    with pytest.raises(ConfigError) as e:
        build_options(None, {"device": "5", "run_dir": str(tmp_path)})
    assert "'5' names no GPU of this host" in str(e.value) and A in str(e.value)


def test_a_run_dir_too_long_for_a_socket_is_refused_naming_it(tmp_path, table):
    with pytest.raises(ConfigError) as e:
        build_options(None, {"device": "0", "run_dir": str(tmp_path / ("x" * 60))})
    assert "run_dir" in str(e.value) and "107 bytes" in str(e.value)


def test_adapters_register_all_registers_on_every_broker_and_names_one_down(two_gpus, table, tmp_path):
    from rigs import write_adapter

    from memory_broker.clients import BrokerClient

    run_dir, (ba, bb) = two_gpus
    path = write_adapter(str(tmp_path / "ad"), 0)
    cli = [sys.executable, "-m", "memory_broker.broker.cli", "adapters", "register", "ad", path, "--all"]
    r = subprocess.run([*cli, "--run-dir", run_dir], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [ln.split(":")[0] for ln in r.stdout.splitlines() if ln.startswith("GPU-")] == [A, B]
    for b in (ba, bb):
        with BrokerClient.connect(b.socket) as c:
            assert [x.adapter_id for x in c.list_adapters().adapters] == ["ad"]
    bb.stop()
    r = subprocess.run([*cli, "--run-dir", run_dir], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert f"{B}: DOWN" in r.stdout and f"systemctl start memory-broker@{B}" in r.stdout


def register_all_in(run_dir: str, capsys) -> tuple[int, str]:
    """``adapters register ad <dir> --all --run-dir run_dir`` in this process: (exit code, stdout)."""
    from memory_broker.broker.cli import main

    rc = main(["adapters", "register", "ad", run_dir, "--all", "--run-dir", run_dir, "--timeout", "2"])
    return rc, capsys.readouterr().out


@pytest.mark.parametrize(
    ("mode", "why"), [(0o777, "is writable by everyone (mode 0777)"), (0o775, "is writable by group 0 (mode 0775)")]
)
def test_register_all_refuses_a_broker_directory_others_may_write_naming_it(tmp_path, capsys, mode, why):
    gpu_dir = tmp_path / A
    gpu_dir.mkdir()
    os.chown(gpu_dir, os.getuid(), 0)
    gpu_dir.chmod(mode)
    rc, out = register_all_in(str(tmp_path), capsys)
    assert rc == 1
    assert out.strip() == f"{A}: REFUSED: not talking to {gpu_dir}/broker.sock: its directory {gpu_dir} {why}"


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another uid needs root")
def test_register_all_refuses_a_broker_directory_owned_by_another_user(tmp_path, capsys):
    gpu_dir = tmp_path / A
    gpu_dir.mkdir(mode=0o755)
    os.chown(gpu_dir, 54321, 54321)
    rc, out = register_all_in(str(tmp_path), capsys)
    assert rc == 1 and f"its directory {gpu_dir} is owned by uid 54321, not by " in out
    assert "root" in out and "DOWN" not in out


def test_register_all_refuses_a_link_to_a_broker_directory_owned_by_another_user(tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    (tmp_path / A).symlink_to(real)
    if os.getuid() == 0:
        os.lchown(tmp_path / A, 54321, 54321)
    else:
        pytest.skip("giving a link to another uid needs root")
    rc, out = register_all_in(str(tmp_path), capsys)
    assert rc == 1 and "is a link owned by uid 54321" in out


def test_the_dashboard_has_a_gpu_variable_that_every_panel_filters_on():
    dash = json.load(open(os.path.join(ROOT, "ops", "grafana", "memory-broker.json")))
    var = next(v for v in dash["templating"]["list"] if v["name"] == "gpu_uuid")
    assert "gpu_uuid" in var["query"] and var["allValue"] == ".*"  # brokers without a GPU label still show
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all('gpu_uuid=~"$gpu_uuid"' in e for e in exprs)
