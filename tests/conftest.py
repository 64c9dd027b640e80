"""Shared fixtures: a real broker daemon in a subprocess, and helpers to run client processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Every test gets one tier (tests/tiers.py).
pytest_plugins = ("tiers",)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small geometry so tests can fill the pool: 512 KiB pages, 4 pages per slab, 64 pages max.
SMALL = ["--page-size", "512KiB", "--slab-size", "2MiB", "--pool-size", "32MiB"]


@dataclass
class Broker:
    socket: str
    proc: subprocess.Popen
    log_path: str
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def log_events(self) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def stop(self, sig=signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


# The native cores (the C extensions the install builds: the step wire's codec, the store's and
# the adapter wing's cores) each have a pure-Python fallback. A module, class or test marked
# ``both_cores`` runs twice, in the style of CPython's PEP 399 tests: once on the native cores and
# once on the fallback (``MEMORY_BROKER_NATIVE=0`` in this process and in the brokers and clients
# it starts). ``fallback_only`` runs only the second (tests of the Python path's own internals),
# ``native_only`` only the first (what only the native cores do, e.g. reuse a reply's records).
# The fallback runs carry the ``fallback`` marker: ``make test-all`` runs them, ``make test`` not.


@pytest.fixture(autouse=True)
def native_core(request, monkeypatch):
    """``native`` (the default) or ``fallback``: which path this test runs (see above)."""
    mode = getattr(request, "param", "native")
    from memory_broker.proto.wire import native, step

    if mode == "fallback":
        monkeypatch.setenv(native.ENV, "0")
        monkeypatch.setattr(native, "_loaded", {})
        monkeypatch.setattr(step, "_core", None)
    elif request.node.get_closest_marker("both_cores"):
        monkeypatch.delenv(native.ENV, raising=False)
        monkeypatch.setattr(native, "_loaded", {})
        assert native.load(STORE_CORE) is not None, "the store's native core was not built by pip install -e ."
    return mode


def pytest_generate_tests(metafunc):
    # One hook, one parametrization: a second ``pytest_generate_tests`` in this module would
    # replace this one (test_structure checks the fallback runs are collected).
    if metafunc.definition.get_closest_marker("fallback_only"):
        modes = ["fallback"]
    elif metafunc.definition.get_closest_marker("native_only"):
        modes = ["native"]
    elif metafunc.definition.get_closest_marker("both_cores"):
        modes = ["native", "fallback"]
    else:
        return
    params = [pytest.param(m, marks=[pytest.mark.fallback] if m == "fallback" else []) for m in modes]
    metafunc.parametrize("native_core", params, indirect=True)


STORE_CORE = "memory_broker._native._storecore"  # native.STORECORE (imported late, as the fixture does)


def short_tmpdir() -> str:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    return tempfile.mkdtemp(prefix="mb-", dir="/tmp")


def wait_serving(socket: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited with {proc.returncode} before serving")
        if os.path.exists(socket):
            try:
                with grpc.insecure_channel(f"unix:{socket}") as ch:
                    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError:
                pass
        time.sleep(0.05)
    raise RuntimeError("broker did not start serving in time")


def start_broker(*extra: str, socket: str | None = None, wait: bool = True) -> Broker:
    d = short_tmpdir()
    socket = socket or os.path.join(d, "b.sock")
    log_path = os.path.join(d, "broker.log")
    args = [
        sys.executable,
        "-m",
        "memory_broker.broker.cli",
        "serve",
        "--socket",
        socket,
        "--arena",
        "host",
        "--state-dir",
        os.path.join(d, "state"),
        *SMALL,
        *extra,
    ]
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT)
    b = Broker(socket, proc, log_path, args)
    if wait:
        try:
            wait_serving(socket, proc)
        except Exception:
            b.stop(signal.SIGKILL)
            raise RuntimeError(f"broker failed to start; log:\n{b.log()}") from None
    return b


# Each test's time (setup + call + teardown, as pytest-timeout counts it) beside its bound: the
# summary names every test that used more than half of it. A test at 97% of its bound on one
# machine fails on a slower one (test_vllm_lora_baseline's setup did, in CI).
# (Under pytest-xdist the workers run the tests: the bound travels in each report's user_properties.)
_SPENT: dict[str, float] = {}
_BOUND: dict[str, float] = {}


def _timeout_bound(item) -> float | None:
    marker = item.get_closest_marker("timeout")
    bound = (marker.args[0] if marker.args else marker.kwargs.get("timeout")) if marker else None
    if bound is None:
        try:
            bound = item.config.getini("timeout")  # pytest-timeout's ini value
        except ValueError:  # pytest-timeout not installed
            bound = None
    return float(bound) if bound else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    bound = _timeout_bound(item)
    if bound and not any(k == "timeout_bound" for k, _ in item.user_properties):
        item.user_properties.append(("timeout_bound", bound))


def pytest_runtest_logreport(report):
    _SPENT[report.nodeid] = _SPENT.get(report.nodeid, 0.0) + report.duration
    for k, v in report.user_properties:
        if k == "timeout_bound":
            _BOUND[report.nodeid] = v


def pytest_terminal_summary(terminalreporter):
    near = sorted(((_SPENT[n] / b, n) for n, b in _BOUND.items() if b > 0 and _SPENT.get(n, 0.0) > b / 2), reverse=True)
    if near:
        terminalreporter.write_sep("=", "tests past half of their timeout (a slower machine fails them)")
        for frac, nodeid in near:
            terminalreporter.write_line(f"{_SPENT[nodeid]:7.1f}s of {_BOUND[nodeid]:.0f}s ({frac:.0%})  {nodeid}")


@pytest.fixture
def broker():
    b = start_broker()
    yield b
    b.stop()


@pytest.fixture
def step_rig():
    """A broker with 4 tiny registered adapters and 6 keyed KV blocks (owned by ``setup``):
    the step-path tests' broker."""
    from rigs import write_adapter

    from memory_broker.clients import BrokerClient, Spec

    b = start_broker()
    d = os.path.dirname(b.socket)
    setup = BrokerClient.connect(b.socket, client_name="setup")
    for i in range(4):
        setup.register_adapter(f"a{i}", write_adapter(os.path.join(d, "adapters", f"a{i}"), i))
    setup.allocate([Spec(1, content_type="kv_cache", key=b"k%d" % i) for i in range(6)])
    try:
        yield b, setup
    finally:
        setup.close()
        b.stop()


def step_frames(c) -> int:
    """Frames the client's step path has sent (how tests count round trips)."""
    return c._step_path().frames


@pytest.fixture
def broker_factory():
    started: list[Broker] = []

    def make(*extra: str, **kw) -> Broker:
        b = start_broker(*extra, **kw)
        started.append(b)
        return b

    yield make
    for b in started:
        b.stop(signal.SIGKILL if b.proc.poll() is None else signal.SIGTERM)


CHILD_PRELUDE = """
import json, os, sys, time
from memory_broker.clients import BrokerClient, Spec, BrokerError
SOCKET = {socket!r}
def out(**kw):
    print(json.dumps(kw), flush=True)
"""


def child_code(socket: str, body: str) -> str:
    return CHILD_PRELUDE.format(root=ROOT, socket=socket) + textwrap.dedent(body)


def run_child(socket: str, body: str, timeout: float = 60.0) -> list[dict]:
    """Run ``body`` in a fresh Python process (with ``SOCKET`` and ``out(**kw)``); returns
    the JSON lines it printed."""
    r = subprocess.run(
        [sys.executable, "-c", child_code(socket, body)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if r.returncode != 0:
        raise AssertionError(f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def spawn_child(socket: str, body: str) -> subprocess.Popen:
    """Start ``body`` in a child process that keeps running; read its lines from stdout."""
    return subprocess.Popen(
        [sys.executable, "-c", child_code(socket, body)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_side_by_side(jobs: list[tuple[str, list[str], dict]], timeout: float) -> list[str]:
    """Each (label, command, environment) in a process of its own, all at once (CI's machine has
    two cores); each one's stdout, in order. One that fails fails the test with its label and
    its output's tail; none outlives the call."""
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _, cmd, env in jobs
    ]
    try:
        outs = []
        for (label, _, _), p in zip(jobs, procs):
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"{label} failed:\n" + out[-2000:] + err[-4000:]
            outs.append(out)
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def read_line(proc: subprocess.Popen, timeout: float = 30.0) -> dict:
    import select

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.1)
        if r:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                return json.loads(line)
        elif proc.poll() is not None:
            break
    raise AssertionError(f"child gave no line; stderr:\n{proc.stderr.read() if proc.poll() is not None else ''}")


class VllmShared:
    """What the vLLM modules share in one session: the tiny model with adapters l1..l4 (built
    once, in the vLLM environment) and plain vLLM reference engines (no connector, no plugin;
    l1..l4 from their files and one slot spare, so base rows stay base), one per dtype, started
    on first use and reused by every module (an engine start is most of a vLLM test's time).
    A reference only gives tokens: what another module did with it changes none of them."""

    ADAPTERS = ("l1", "l2", "l3", "l4")

    def __init__(self):
        self.tmp = short_tmpdir()
        self.model = os.path.join(self.tmp, "model")
        self.dirs = {n: os.path.join(self.tmp, n) for n in self.ADAPTERS}
        self._built = False
        self._refs: dict = {}

    def build(self) -> VllmShared:
        if not self._built:
            from test_vllm_kv import VLLM_PY

            code = (
                "import sys; from memory_broker.clients.vllm import tiny_model as t; t.build(sys.argv[1]); "
                "[t.build_lora(p, i + 1) for i, p in enumerate(sys.argv[2:])]"
            )
            args = [VLLM_PY, "-c", code, self.model, *self.dirs.values()]
            subprocess.run(args, check=True, capture_output=True, timeout=600)
            self._built = True
        return self

    def reference(self, dtype: str = "float32"):
        """The reference engine for ``dtype`` (started now if none is running; it answers once
        ready). Stopping it (``stop()``) frees its memory; the next caller gets a new one."""
        from test_vllm_lora import LoraEngine

        e = self._refs.get(dtype)
        if e is None or e.proc.poll() is not None:
            self.build()
            files = [a for n in self.ADAPTERS for a in ("--lora", f"{n}={self.dirs[n]}")]
            max_loras = str(len(self.ADAPTERS) + 1)
            e = self._refs[dtype] = LoraEngine(
                f"ref-{dtype}", self.tmp, self.model, "--dtype", dtype, *files, "--max-loras", max_loras
            )
        return e

    def close(self) -> None:
        for e in self._refs.values():
            e.stop()


@pytest.fixture(scope="session")
def vllm_shared():
    shared = VllmShared()
    yield shared
    shared.close()
