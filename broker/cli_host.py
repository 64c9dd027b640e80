"""The host-level commands of ``memory-broker``: every broker of a multi-GPU host at once.

* ``memory-broker gpus`` lists the host's GPUs (index, UUID, name) and whether a broker serves
  each; ``--enable`` enables one ``memory-broker@<uuid>`` unit per GPU (``--dry-run`` prints
  the commands).
* ``memory-broker status --all`` asks every broker under the run directory (the per-GPU
  layout, ``/run/memory-broker/<uuid>/broker.sock``) for its figures and prints one table;
  a broker that does not answer is a row saying so.

Only sessionless calls are made (GetArena, GetStats), which the socket's mode gates.
``adapters register --all`` talks only to sockets in directories that no one but root, the
caller or the broker's service account (``memory-broker``, the unit's ``User=``) could have
made or changed (``untrusted_directory``).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys

from memory_broker.proto.wire.gpus import DEFAULT_RUN_DIR, gpu_sockets, host_gpus


def add_run_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--run-dir",
        default=DEFAULT_RUN_DIR,
        metavar="DIR",
        help=f"where the per-GPU brokers keep their sockets (default {DEFAULT_RUN_DIR})",
    )


def gpus_parser(sub) -> None:
    p = sub.add_parser(
        "gpus",
        help="list the host's GPUs and their brokers; enable one unit per GPU",
        description="List the host's GPUs (nvidia-smi, or $MEMORY_BROKER_DEVICE_TABLE) and the broker serving "
        "each; --enable runs 'systemctl enable --now memory-broker@<uuid>' for each.",
    )
    add_run_dir(p)
    p.add_argument("--enable", action="store_true", help="enable and start one memory-broker@<uuid> unit per GPU")
    p.add_argument("--dry-run", action="store_true", help="with --enable: print the commands, run nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _ask(socket: str, timeout: float) -> dict:
    """One broker's figures, or {"state": "down", "error": ...}."""
    import grpc

    from memory_broker.proto.wire.v1 import broker_pb2 as pb
    from memory_broker.proto.wire.v1 import broker_pb2_grpc

    with grpc.insecure_channel(f"unix:{socket}") as ch:
        stub = broker_pb2_grpc.MemoryBrokerStub(ch)
        try:
            arena = stub.GetArena(pb.GetArenaRequest(), timeout=timeout)
            st = stub.GetStats(pb.GetStatsRequest(), timeout=timeout)
        except grpc.RpcError as e:
            return {"state": "down", "error": f"{e.code().name}: {e.details()}"}
    kv = sum(c.objects for c in st.by_content if c.content_type == pb.CONTENT_TYPE_KV_CACHE)
    return {
        "state": "serving",
        "device": arena.device,
        "backend": arena.backend,
        "used_pages": st.used_pages,
        "max_pages": st.max_pages,
        "utilization": st.utilization,
        "hot_adapters": st.adapters.hot if st.HasField("adapters") else 0,
        "kv_objects": kv,
        "sessions": st.sessions,
    }


def cmd_status_all(a: argparse.Namespace) -> int:
    brokers = gpu_sockets(a.run_dir)
    rows = []
    for uuid, socket in brokers.items():
        found = _ask(socket, a.timeout) if os.path.exists(socket) else {"state": "down", "error": "no socket"}
        row = {"gpu_uuid": uuid, "socket": socket, **found}
        if row["state"] == "serving" and row["device"] != uuid:
            row["state"] = f"serving GPU {row['device'] or '(host arena)'}: misplaced"
        rows.append(row)
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0 if rows and all(r["state"] == "serving" for r in rows) else 1
    if not rows:
        print(f"no per-GPU brokers under {a.run_dir} (memory-broker gpus --enable starts one per GPU)")
        return 1
    print(f"{'GPU':<41} {'state':<8} {'arena':<6} {'pool used':>15} {'util':>6} {'hot':>5} {'KV':>8} {'sessions':>8}")
    for r in rows:
        if r["state"] != "serving":
            print(f"{r['gpu_uuid']:<41} {r['state']:<8} {r.get('error', '')}")
            continue
        used = f"{r['used_pages']}/{r['max_pages']}"
        print(
            f"{r['gpu_uuid']:<41} {'serving':<8} {r['backend']:<6} {used:>15} {r['utilization']:>6.1%} "
            f"{r['hot_adapters']:>5} {r['kv_objects']:>8} {r['sessions']:>8}"
        )
    return 0 if all(r["state"] == "serving" for r in rows) else 1


def cmd_gpus(a: argparse.Namespace) -> int:
    gpus = host_gpus()
    brokers = gpu_sockets(a.run_dir)
    if a.json and not a.enable:
        live = {u: p for u, p in brokers.items() if os.path.exists(p)}
        rows = [{"index": g.index, "uuid": g.uuid, "name": g.name, "socket": live.get(g.uuid)} for g in gpus]
        print(json.dumps(rows, indent=2))
        return 0
    if not gpus:
        print("no GPUs found (nvidia-smi absent or lists none); the host arena needs no per-GPU units")
        return 1
    if not a.enable:
        for g in gpus:
            where = brokers.get(g.uuid, "")
            where = where if where and os.path.exists(where) else "no broker"
            print(f"{g.index:>3}  {g.uuid}  {g.name:<24} {where}")
        return 0
    commands = [["systemctl", "enable", "--now", f"memory-broker@{g.uuid}.service"] for g in gpus]
    if a.dry_run:
        for c in commands:
            print(" ".join(c))
        return 0
    if shutil.which("systemctl") is None:
        print("systemctl is not on PATH: run these yourself (or use --dry-run):", file=sys.stderr)
        for c in commands:
            print(" ".join(c), file=sys.stderr)
        return 1
    failed = 0
    for c in commands:
        r = subprocess.run(c, check=False)
        print(f"{' '.join(c)}: {'ok' if r.returncode == 0 else f'failed ({r.returncode})'}")
        failed += r.returncode != 0
    return 1 if failed else 0


# The user the systemd unit runs each broker as (ops/systemd/memory-broker@.service, User=).
SERVICE_USER = "memory-broker"


def trusted_owners() -> dict[int, str]:
    """The uids whose directories ``register --all`` trusts: root, the caller, the service user."""
    owners = {0: "root", os.getuid(): "you"}
    try:
        owners.setdefault(pwd.getpwnam(SERVICE_USER).pw_uid, SERVICE_USER)
    except KeyError:
        pass
    return owners


def untrusted_directory(path: str) -> str:
    """Why a socket in directory ``path`` could be anyone's ("" if not): the directory (or a
    link to it) is owned by someone other than root, the caller or the service user, or its
    group or everyone may write to it (and so put any socket there)."""
    owners = trusted_owners()
    named = ", ".join(sorted(set(owners.values())))
    try:
        link, st = os.lstat(path), os.stat(path)
    except OSError as e:
        return f"cannot be checked ({e.strerror})"
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in owners:
        return f"is a link owned by uid {link.st_uid}, not by {named}"
    if st.st_uid not in owners:
        return f"is owned by uid {st.st_uid}, not by {named}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "everyone" if st.st_mode & stat.S_IWOTH else f"group {st.st_gid}"
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def register_all(a: argparse.Namespace, register, cli_error: type[Exception]) -> int:
    """``adapters register --all``: ``register`` (the one-broker command) on every broker under
    the run directory, each one's result reported; a broker that is down, or whose directory
    anyone else could have written, is named. Exit 1 unless every broker registered it."""
    brokers = gpu_sockets(a.run_dir)
    if not brokers:
        raise cli_error(f"no per-GPU brokers under {a.run_dir}; without --all, --socket names one broker")
    failed = 0
    for uuid, socket in brokers.items():
        print(f"{uuid}: ", end="", flush=True)
        why = untrusted_directory(os.path.dirname(socket))
        if why:
            print(f"REFUSED: not talking to {socket}: its directory {os.path.dirname(socket)} {why}")
            failed += 1
            continue
        if not os.path.exists(socket):
            print(f"DOWN (no socket at {socket}; systemctl start memory-broker@{uuid})")
            failed += 1
            continue
        one = argparse.Namespace(**{**vars(a), "socket": socket, "all": False})
        try:
            failed += register(one) != 0
        except cli_error as e:
            print(f"FAILED: {e}")
            failed += 1
    return 1 if failed else 0
