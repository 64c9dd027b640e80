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


# Test modules run twice, once on the native step core (the C extensions built by the install)
# and once on its pure-Python fallback (MEMORY_BROKER_NATIVE=0, in this process and in the
# brokers it starts): the adapter wing and the tier policies. (The step fuzz and churn tests
# get the same from ``wire_codec`` below: its ``python`` run turns every native core off.)
NATIVE_AND_FALLBACK = ("test_adapter", "test_policy")


def _native_and_fallback(metafunc):
    # (A module that runs both paths its own way, e.g. with the store's ``both_cores``, is left to it.)
    names = metafunc.fixturenames
    if (
        "native_core" in names
        and "both_cores" not in names
        and metafunc.module.__name__.startswith(NATIVE_AND_FALLBACK)
    ):
        metafunc.parametrize("native_core", ["native", "fallback"], indirect=True)


@pytest.fixture(autouse=True)
def native_core(request, monkeypatch):
    """The path a test runs: the native core (the default), or its fallback (the core turned off)."""
    mode = getattr(request, "param", "native")
    if mode == "fallback":
        from memory_broker.proto.wire import native

        monkeypatch.setenv(native.ENV, "0")
        monkeypatch.setattr(native, "_loaded", {})
    return mode


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


# The step wire's codec runs native (``proto/wire/_stepcore.c``) or as its pure-Python
# fallback: these modules' tests run under both, in this process (``step._core``) and in the
# brokers and clients they start (``MEMORY_BROKER_NATIVE``, inherited).
CODEC_MODULES = {
    "test_step_wire",
    "test_step_channel",
    "test_step_client",
    "test_step_keys",
    "test_step_batch",
    "test_step_posted",
    "test_fuzz",
    "test_churn",
}
# Tests of the Python codec's own internals (its struct caches): they run against it alone.
PYTHON_CODEC_TESTS = {
    "test_keys_of_one_length_are_read_in_one_struct_call_as_key_by_key",
    "test_the_key_struct_cache_is_bounded",
}


# Each test's time (setup + call + teardown, as pytest-timeout counts it) beside its bound: the
# summary names every test that used more than half of it. A test at 97% of its bound on one
# machine fails on a slower one (test_vllm_lora_baseline's setup did, in CI).
_SPENT: dict[str, float] = {}
_BOUND: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    _SPENT[item.nodeid] = _SPENT.get(item.nodeid, 0.0) + call.duration
    if item.nodeid not in _BOUND:
        marker = item.get_closest_marker("timeout")
        bound = (marker.args[0] if marker.args else marker.kwargs.get("timeout")) if marker else None
        if bound is None:
            try:
                bound = item.config.getini("timeout")  # pytest-timeout's ini value
            except ValueError:  # pytest-timeout not installed
                bound = None
        if bound:
            _BOUND[item.nodeid] = float(bound)


def pytest_terminal_summary(terminalreporter):
    near = sorted(((_SPENT[n] / b, n) for n, b in _BOUND.items() if b > 0 and _SPENT.get(n, 0.0) > b / 2), reverse=True)
    if near:
        terminalreporter.write_sep("=", "tests past half of their timeout (a slower machine fails them)")
        for frac, nodeid in near:
            terminalreporter.write_line(f"{_SPENT[nodeid]:7.1f}s of {_BOUND[nodeid]:.0f}s ({frac:.0%})  {nodeid}")


def pytest_generate_tests(metafunc):
    # One hook for both parametrizations (a second ``pytest_generate_tests`` in this module
    # would replace the first, and ``native_core``'s would silently never run).
    _native_and_fallback(metafunc)
    if metafunc.module.__name__.rpartition(".")[2] in CODEC_MODULES:
        both = metafunc.function.__name__ not in PYTHON_CODEC_TESTS
        metafunc.parametrize("wire_codec", ["native", "python"] if both else ["python"], indirect=True)


@pytest.fixture(autouse=True)
def wire_codec(request, monkeypatch):
    """``native`` (the default) or ``python``: which step wire codec this test runs."""
    from memory_broker.proto.wire import step

    mode = getattr(request, "param", "native")
    if mode == "python":
        monkeypatch.setattr(step, "_core", None)
        monkeypatch.setenv("MEMORY_BROKER_NATIVE", "0")
    return mode


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


# ------------------------------------------------------------ the store's native core and its fallback

STORE_CORE = "memory_broker.broker.store._storecore"


@pytest.fixture(params=["native", "python"])
def both_cores(request, monkeypatch):
    """Run a test twice: with the store's native core (``broker/store/_storecore.c``) and with
    its pure-Python fallback (``MEMORY_BROKER_NATIVE=0``, which brokers started by the test
    inherit). Stores made during the test take that path; the store test modules use it
    (``pytestmark = pytest.mark.usefixtures("both_cores")``)."""
    from memory_broker.proto.wire import native

    monkeypatch.setattr(native, "_loaded", {})
    if request.param == "python":
        monkeypatch.setenv(native.ENV, "0")
        assert native.load(STORE_CORE) is None
    else:
        monkeypatch.delenv(native.ENV, raising=False)
        assert native.load(STORE_CORE) is not None, "the store's native core was not built by pip install -e ."
    return request.param
