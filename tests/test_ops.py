"""Operating the broker: systemd unit and notify protocol, configuration, metrics, lifecycle."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import yaml
from conftest import ROOT, short_tmpdir, start_broker

from memory_broker.broker.server.config import SCHEMA, ConfigError, build_options, load_config
from memory_broker.clients import BrokerClient, Spec
from memory_broker.proto.wire.errors import BrokerError, Code

UNIT = os.path.join(ROOT, "ops", "systemd", "memory-broker@.service")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------- systemd unit


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_unit_without_any_warning(tmp_path):
    # verify insists that ExecStart's binary exists: point it at this checkout's install,
    # changing nothing else in the unit.
    exe = shutil.which("memory-broker", path=os.path.dirname(sys.executable))
    assert exe, "the memory-broker command is not installed in this environment"
    text = open(UNIT).read()
    assert text.count("/usr/local/bin/memory-broker") == 1
    unit = tmp_path / "memory-broker@0.service"
    unit.write_text(text.replace("/usr/local/bin/memory-broker", exe))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", f"warnings:\n{r.stdout}{r.stderr}"


def test_unit_is_a_notify_service_with_watchdog_restart_user_and_runtime_dir():
    text = open(UNIT).read()
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "User=memory-broker",
        "RuntimeDirectory=memory-broker",
        "ExecReload=",
        "--instance %i --device %i --run-dir /run/memory-broker --state-root /var/lib/memory-broker",
        "RuntimeDirectoryPreserve=yes",
        "RuntimeDirectoryMode=0755",  # engines of another group must reach the sockets inside  # instances share /run/memory-broker: one stopping keeps the others'
    ):
        assert line in text, line
    # The socket permissions the unit promises are what the example config documents.
    assert "socket_mode" in open(os.path.join(ROOT, "ops", "broker.example.yaml")).read()


def test_unit_keeps_the_oom_killer_off_the_broker_and_says_how_to_bound_it():
    text = open(UNIT).read()
    adjust = [line for line in text.splitlines() if line.startswith("OOMScoreAdjust=")]
    assert len(adjust) == 1 and int(adjust[0].partition("=")[2]) <= -500
    assert "MemoryMax=" in text and not any(line.startswith("MemoryHigh=") for line in text.splitlines())
    guide = open(os.path.join(ROOT, "docs", "operating.md")).read()
    for words in ("OOMScoreAdjust=-900", "MemoryMax=", "memory.max", "MemAvailable", "RESOURCE_EXHAUSTED"):
        assert words in guide, words


# ----------------------------------------------------------------- notify protocol


def test_daemon_speaks_the_notify_protocol_ready_status_watchdog_stopping():
    d = short_tmpdir()
    notify_path = os.path.join(d, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    sock.settimeout(0.2)
    env = dict(os.environ, NOTIFY_SOCKET=notify_path, WATCHDOG_USEC="600000")
    sock_path = os.path.join(d, "b.sock")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memory_broker.broker.cli",
            "serve",
            "--socket",
            sock_path,
            "--arena",
            "host",
            "--pool-size",
            "32MiB",
            "--slab-size",
            "2MiB",
            "--page-size",
            "512KiB",
            "--state-dir",
            os.path.join(d, "s"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    got: list[tuple[float, str]] = []

    def collect(until: float) -> None:
        while time.monotonic() < until:
            try:
                got.append((time.monotonic(), sock.recv(4096).decode()))
            except TimeoutError:
                pass

    try:
        # Start-up time depends on the machine's load; the pings are timed after READY.
        deadline = time.monotonic() + 30.0
        while not any("READY=1" in m for _, m in got) and time.monotonic() < deadline:
            collect(time.monotonic() + 0.2)
        got = [(t, m) for t, m in got if "READY=1" in m]
        collect(time.monotonic() + 3.0)
        ready = [m for _, m in got if "READY=1" in m]
        assert ready, got
        assert "STATUS=" in ready[0] and "pages used" in ready[0]
        assert f"MAINPID={proc.pid}" in ready[0]
        pings = [t for t, m in got if m == "WATCHDOG=1"]
        assert len(pings) >= 4, f"expected a ping every 0.3 s (half of WATCHDOG_USEC), got {len(pings)} in 3 s"
        gaps = sorted(b - a for a, b in zip(pings, pings[1:]))
        assert 0.2 <= gaps[len(gaps) // 2] <= 0.45, gaps  # median, robust to a loaded machine
        # STATUS follows the pool: allocate and see a new line.
        with BrokerClient.connect(sock_path) as c:
            c.allocate([Spec(3, pin=True)])
            collect(time.monotonic() + 1.5)
        assert any(m.startswith("STATUS=3/64 pages used") for _, m in got), [m for _, m in got if "STATUS" in m]
        proc.send_signal(signal.SIGTERM)
        collect(time.monotonic() + 2.0)
        assert any(m.startswith("STOPPING=1") for _, m in got)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        sock.close()


# ----------------------------------------------------------------- configuration


def test_example_config_documents_every_key_and_loads():
    text = open(os.path.join(ROOT, "ops", "broker.example.yaml")).read()
    for key in SCHEMA:
        leaf = key.rsplit(".", 1)[-1]
        assert re.search(rf"^\s*#?\s*{leaf}:", text, re.M), f"{key} is not documented in broker.example.yaml"
    opts = build_options(os.path.join(ROOT, "ops", "broker.example.yaml"), {})
    assert opts.page_size == 2 << 20 and opts.high_watermark == 0.90


@pytest.mark.parametrize(
    "doc,words",
    [
        ("memory_pool:\n  eviction:\n    high_watermrk: 0.9\n", "memory_pool.eviction.high_watermrk: unknown key"),
        ("memory_pool:\n  eviction:\n    high_watermark: 1.5\n", "memory_pool.eviction.high_watermark"),
        ("memory_pool:\n  page_size: 3MiB\n", "memory_pool.page_size"),
        ("memory_pool:\n  page_size: lots\n", "memory_pool.page_size"),
        ("memory_pool:\n  allocation_strategy: worst_fit\n", "memory_pool.allocation_strategy"),
        ("listeners:\n  tcp_port: web\n", "listeners.tcp_port: expected an integer"),
        ("shutdown:\n  grace: soon\n", "shutdown.grace"),
        ("security:\n  allowed_uids: root\n", "security.allowed_uids"),
        ("memory_pool: [1, 2]\n", "memory_pool: expected a mapping"),
        ("memory_pool:\n  pool_size: 1GiB\n  total_pages: 10\n", "not both"),
        ("memory_pool: {page_size: 2MiB\n", "not valid YAML"),
        # A misspelled section is refused even when its value is empty, with the intended key.
        ("memory_pool:\n  evicton: {}\n", "memory_pool.evicton: unknown key"),
        ("memory_pool:\n  evicton: {}\n", "did you mean memory_pool.eviction?"),
        ("adaptors: {}\n", "adaptors: unknown key"),
        ("memory_pool:\n  eviction:\n    policies: {}\n", "did you mean memory_pool.eviction.policy?"),
        ("logging:\n  fromat: json\n", "did you mean logging.format?"),
        ("wibble: {}\n", "known keys at the top level: adapters, arena"),
        ("logging:\n  format: fancy\n", "logging.format: 'fancy' is not one of auto, console, json"),
        ("memory_pool:\n  pool_size: 4GB\n", "memory_pool.pool_size: '4GB': decimal units"),
        (
            "listeners:\n  socket: /nonexistent-dir/b.sock\n",
            "listeners.socket (socket: the directory /nonexistent-dir does not exist",
        ),
    ],
)
def test_bad_config_is_refused_with_a_message_naming_the_key(tmp_path, doc, words):
    p = tmp_path / "broker.yaml"
    p.write_text(doc)
    with pytest.raises(ConfigError) as e:
        build_options(str(p), {})
    assert words in str(e.value)


def test_log_format_comes_from_the_file_and_a_flag_overrides_it(tmp_path):
    from memory_broker.broker.cli import build_parser
    from memory_broker.broker.server.flags import flag_overrides

    p = tmp_path / "broker.yaml"
    p.write_text("logging:\n  format: console\n")
    assert build_options(None, {}).log_format == "auto"
    assert build_options(str(p), {}).log_format == "console"
    over = flag_overrides(build_parser().parse_args(["serve", "--log-format", "json"]))
    assert build_options(str(p), over).log_format == "json"
    assert flag_overrides(build_parser().parse_args(["serve", "--json"]))["log_format"] == "json"


def test_adapter_image_settings_come_from_the_file_and_the_flags(tmp_path):
    from memory_broker.broker.cli import build_parser
    from memory_broker.broker.server.flags import flag_overrides

    p = tmp_path / "broker.yaml"
    p.write_text("adapters:\n  image_budget: 2GiB\n  convert_ahead: false\n")
    opts = build_options(str(p), {})
    assert opts.adapter_image_budget == 2 << 30 and opts.adapter_convert_ahead is False
    assert build_options(None, {}).adapter_image_budget == 64 << 30 and build_options(None, {}).adapter_convert_ahead
    a = build_parser().parse_args(["serve", "--adapter-image-budget", "512MiB", "--no-adapter-convert-ahead"])
    over = flag_overrides(a)
    assert over["adapter_image_budget"] == 512 << 20 and over["adapter_convert_ahead"] is False
    p.write_text("adapters:\n  image_budget: -1GiB\n")
    with pytest.raises(ConfigError, match="adapters.image_budget"):
        build_options(str(p), {})


def test_daemon_refuses_a_bad_config_file_at_start_naming_the_key(tmp_path):
    p = tmp_path / "broker.yaml"
    p.write_text("memory_pool:\n  eviction:\n    low_watermark: 0.95\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "memory_broker.broker.cli",
            "serve",
            "--config",
            str(p),
            "--socket",
            str(tmp_path / "x.sock"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "memory_pool.eviction.low_watermark" in r.stderr
    assert not os.path.exists(tmp_path / "x.sock")


def test_flags_override_the_config_file(tmp_path):
    p = tmp_path / "broker.yaml"
    p.write_text("memory_pool:\n  page_size: 1MiB\n  eviction:\n    high_watermark: 0.7\n    low_watermark: 0.5\n")
    opts = build_options(str(p), {"high_watermark": 0.95})
    assert opts.page_size == 1 << 20 and opts.high_watermark == 0.95 and opts.low_watermark == 0.5
    assert load_config(str(p))["high_watermark"] == 0.7


def test_sighup_reloads_runtime_settings_and_reports_what_needs_a_restart(tmp_path):
    cfg = tmp_path / "broker.yaml"
    cfg.write_text("memory_pool:\n  eviction:\n    high_watermark: 0.9\n    low_watermark: 0.8\n")
    b = start_broker("--config", str(cfg))
    try:
        with BrokerClient.connect(b.socket) as c:
            assert c.stats().high_watermark == pytest.approx(0.9)
            cfg.write_text(
                "memory_pool:\n  page_size: 1MiB\n  window_factor: 8\n  pinning:\n    max_pins_per_session: 2\n"
                "  eviction:\n    high_watermark: 0.6\n    low_watermark: 0.5\n"
            )
            b.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 5
            while c.stats().high_watermark != pytest.approx(0.6) and time.monotonic() < deadline:
                time.sleep(0.05)
            st = c.stats()
            assert st.high_watermark == pytest.approx(0.6) and st.low_watermark == pytest.approx(0.5)
            assert st.page_size == 512 << 10  # given as a flag: flags win over the file, on reload too
            with pytest.raises(BrokerError) as e:
                c.allocate([Spec(1, pin=True) for _ in range(3)])
            assert e.value.code == Code.RESOURCE_EXHAUSTED and "max_pins_per_session" in e.value.message
        reload = [e for e in b.log_events() if e.get("event") == "reloaded"]
        assert reload and reload[0]["needs_restart"] == ["window_factor"]
        assert reload[0]["applied"]["high_watermark"] == 0.6
    finally:
        assert b.stop() == 0


# ----------------------------------------------------------------- metrics


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample (labels must match exactly the given subset)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == str(v) for k, v in labels.items()):
            return float(m.group(3))
    raise AssertionError(f"no sample {name}{labels} in:\n" + "\n".join(ln for ln in text.splitlines() if name in ln))


def test_prometheus_endpoint_serves_metrics_that_move_with_the_pool(broker_factory):
    port = free_port()
    b = broker_factory("--metrics-port", str(port))
    with BrokerClient.connect(b.socket) as c:
        time.sleep(1.2)
        before = scrape(port)
        assert metric(before, "memory_broker_pool_utilization") == 0
        assert metric(before, "memory_broker_sessions_active") == 1
        # Fill to 56 of 64 pages, share a pinned object between two sessions, then cross
        # the high watermark (57.6) so the oldest temp buffers are evicted.
        c.allocate([Spec(8, content_type="temp_buffer") for _ in range(6)])
        keyed = c.allocate([Spec(8, content_type="kv_cache", key=b"m")])[0]
        with BrokerClient.connect(b.socket) as other:
            c.pin([keyed])
            other.pin([keyed])  # a second session pins it: contention
            c.allocate([Spec(8, content_type="temp_buffer")])
            time.sleep(1.3)
            after = scrape(port)
            assert metric(after, "memory_broker_sessions_active") == 2
        assert metric(after, "memory_broker_pool_utilization") > 0.5
        assert metric(after, "memory_broker_pool_pages", state="pinned") == 8
        assert metric(after, "memory_broker_evicted_pages_total") > 0
        assert metric(after, "memory_broker_eviction_runs_total") >= 1
        assert metric(after, "memory_broker_pin_contention_total") == 1
        assert metric(after, "memory_broker_allocations_total") == 8
        assert metric(after, "memory_broker_allocation_latency_seconds_count") == 3
        # Microsecond buckets are exported (how many allocations land below 1 ms depends on the
        # machine's load: timings are the benchmarks' business, not a test's).
        assert metric(after, "memory_broker_allocation_latency_seconds_bucket", le="1e-06") >= 0
        assert metric(after, "memory_broker_allocation_latency_seconds_bucket", le="+Inf") == 3
        assert metric(after, "memory_broker_rpc_latency_seconds_count", method="Allocate", code="OK") == 3
        assert metric(after, "memory_broker_rpc_latency_seconds_count", method="Pin", code="OK") == 2
        assert metric(after, "memory_broker_objects", content_type="kv_cache") == 1


def test_dashboard_and_alert_rules_use_only_exported_metric_names(broker_factory):
    port = free_port()
    b = broker_factory("--metrics-port", str(port))
    with BrokerClient.connect(b.socket) as c:
        c.allocate([Spec(1)])
        time.sleep(1.2)
        exported = set(re.findall(r"^(memory_broker_[a-z_]+)", scrape(port), re.M))
    # Adapter series appear once adapters are in use; their names are declared in metrics.py.
    declared = set(re.findall(r'f"\{PREFIX\}_([a-z_]+)"', open(os.path.join(ROOT, "broker/server/metrics.py")).read()))
    known = exported | {f"memory_broker_{n}" for n in declared}
    known |= {f"{n}_bucket" for n in known} | {f"{n}_count" for n in known} | {f"{n}_sum" for n in known}
    rules = yaml.safe_load(open(os.path.join(ROOT, "ops", "prometheus", "memory-broker.rules.yaml")))
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dash = json.load(open(os.path.join(ROOT, "ops", "grafana", "memory-broker.json")))
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"memory_broker_[a-z_]+", e)}
    assert used, "no memory_broker metrics referenced"
    assert used <= known, f"referenced but not exported: {sorted(used - known)}"
    assert {"memory_broker_pool_utilization", "memory_broker_allocation_latency_seconds_bucket"} <= used


# ----------------------------------------------------------------- lifecycle


def test_sigterm_under_load_finishes_in_flight_calls_and_exits_zero_within_grace(broker_factory):
    b = broker_factory("--grace", "5")
    clients = [BrokerClient.connect(b.socket) for _ in range(4)]
    outcomes: list[str] = []
    stop = threading.Event()

    def hammer(c: BrokerClient) -> None:
        while not stop.is_set():
            try:
                objs = c.allocate([Spec(1) for _ in range(4)])
                c.free(objs)
                outcomes.append("ok")
            except BrokerError as e:
                outcomes.append(e.code.value)
                if e.code in (Code.UNAVAILABLE,):
                    return

    threads = [threading.Thread(target=hammer, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    b.proc.send_signal(signal.SIGTERM)
    rc = b.proc.wait(10)
    elapsed = time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join(10)
    for c in clients:
        c.close()
    assert rc == 0
    assert elapsed < 5.0
    assert outcomes.count("ok") > 10
    # Calls either completed or were refused cleanly; a call cut off mid-flight would show
    # as INTERNAL or an unexpected code.
    assert set(outcomes) <= {"ok", "UNAVAILABLE"}, set(outcomes)
    names = [e.get("event") for e in b.log_events()]
    assert names.index("draining") < names.index("stopped")


def test_socket_mode_and_group_are_applied(broker_factory):
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    b = broker_factory("--socket-mode", "0660", "--socket-group", group)
    for path in (b.socket, b.socket + ".fds"):
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o660 and st.st_gid == os.getgid()


def test_tcp_listener_on_loopback_serves_the_same_broker(broker_factory):
    import grpc

    from memory_broker.proto.wire.v1 import broker_pb2 as pb
    from memory_broker.proto.wire.v1 import broker_pb2_grpc

    port = free_port()
    broker_factory("--tcp-port", str(port))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        st = broker_pb2_grpc.MemoryBrokerStub(ch).GetStats(pb.GetStatsRequest(), timeout=5)
    assert st.max_pages == 64


# Makes the native cores unimportable in a broker's process, as on an install without a compiler.
UNBUILT_CORES = """
import sys

class Unbuilt:
    def find_spec(self, name, path=None, target=None):
        if name.rpartition(".")[2] in ("_stepcore", "_storecore", "_hotcore"):
            raise ImportError(f"{name} was not built on this install")
        return None

sys.meta_path.insert(0, Unbuilt())
"""


def json_lines_only(b) -> list[dict]:
    """Every line of a broker's output (stdout and stderr), each a JSON event; fails on any other."""
    lines = b.log().splitlines()
    assert lines
    for line in lines:
        assert line.startswith("{"), f"not a JSON line in a --log-format json stream: {line!r}"
    return [json.loads(line) for line in lines]


def test_the_serving_line_names_the_native_cores_that_run(broker):
    serving = next(e for e in broker.log_events() if e["event"] == "serving")
    assert serving["native_cores"] == {"_stepcore": "native", "_storecore": "native", "_hotcore": "native"}


def test_a_broker_with_the_native_cores_off_says_so_and_logs_json_only(monkeypatch):
    monkeypatch.setenv("MEMORY_BROKER_NATIVE", "0")
    b = start_broker("--log-format", "json")
    b.stop()
    serving = next(e for e in json_lines_only(b) if e["event"] == "serving")
    assert set(serving["native_cores"].values()) == {"off by MEMORY_BROKER_NATIVE=0"}
    assert "_stepcore" in serving["native_cores"]


def test_native_cores_not_built_are_json_warnings_in_a_json_log(monkeypatch, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(UNBUILT_CORES)
    monkeypatch.delenv("MEMORY_BROKER_NATIVE", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    b = start_broker("--log-format", "json")
    b.stop()
    events = json_lines_only(b)
    said = [e for e in events if e.get("logger") == "memory_broker.native"]
    assert said and all(e["level"] == "warning" and "is not built" in e["event"] for e in said)
    serving = next(e for e in events if e["event"] == "serving")
    assert serving["native_cores"]["_stepcore"].startswith("not built: ")


def test_python_logging_records_are_rendered_into_the_structured_stream():
    import io
    import logging

    from memory_broker.broker.server.logs import configure

    out = io.StringIO()
    try:
        configure("info", "json", out)
        logging.getLogger("memory_broker.somewhere").warning("a plain %s", "warning")
    finally:
        configure("info", "json", sys.stdout)
    event = json.loads(out.getvalue().strip())
    assert event["event"] == "a plain warning" and event["level"] == "warning"
    assert event["logger"] == "memory_broker.somewhere" and "timestamp" in event


def test_logs_are_json_lines_carrying_the_session_and_rpc(broker):
    with BrokerClient.connect(broker.socket) as c:
        with pytest.raises(BrokerError):
            c.free([12345])
        sid = c.session_id
    time.sleep(0.2)
    events = broker.log_events()
    assert events and all("event" in e and "timestamp" in e and "level" in e for e in events)
    refused = [e for e in events if e["event"] == "rpc_refused"]
    assert refused and refused[0]["rpc"] == "Free" and refused[0]["session"] == sid
    assert refused[0]["code"] == "NOT_FOUND"
    opened = [e for e in events if e["event"] == "session_opened"]
    assert opened and opened[0]["session"] == sid
