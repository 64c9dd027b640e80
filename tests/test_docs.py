"""Every code block of README.md, the guides in docs/ and ops/grpcurl.md, run as written against a real broker.

The docs promise what a newcomer can paste; this module keeps the promise by extracting each
fenced block and running it, twice in a row, so the examples cannot drift from the code.

The rules (a block's Markdown shows which one applies to it):

* ```python blocks run in a fresh interpreter, ```sh blocks in bash (``set -e -o pipefail``),
  from the repository root. The sh blocks of one file are one shell session, as in a terminal:
  a variable a block sets is seen by the blocks after it (so a block that uses one stays in
  the file that sets it). Every ``docs/*.md`` is run: a new guide needs no entry here.
* The default socket ``/tmp/memory-broker.sock`` in a block is replaced by the socket of the
  test's broker (one broker shared by every block, default geometry), and the environment
  carries ``MEMORY_BROKER_SOCKET`` (that socket), ``MEMORY_BROKER_STATE_DIR`` and ``TMPDIR``
  (the test's own directories) and this environment's ``bin`` first on ``PATH``, but not what the
  suite sets for itself (``TRITON_INTERPRET``); ``.venv/bin/`` is read as this environment's
  ``bin``. Nothing else in a block is changed.
* A line that starts the daemon (``memory-broker serve ...``) runs in the background on a
  socket and state directory of its own; the block's other lines run once it serves, and it
  must then stop cleanly on SIGTERM.
* Each file's blocks run in order, and the whole sequence runs twice against the same broker:
  an example must be self-contained and runnable again (ids, registrations, keys).
* A marker in an HTML comment right before a block says how to treat it, ``;``-separated
  (it may share the comment with other tags, e.g. ``<!-- recipe: x | docs-test: ... -->``):
  ``docs-test: static: REASON`` the block is checked, not run (it needs root or systemd,
  installs packages, runs for minutes, or is what CI itself runs): it must parse, the repository
  files it names must exist, ``make`` targets must exist, scripts must compile, a systemd unit it
  installs must run the program it links and a config it installs must load;
  ``docs-test: background`` the block keeps running (another terminal) until the file is done;
  ``docs-test: NAME=a.0.b`` after the block, the shell variable NAME is set from that field of
  the first JSON object the block printed (what the prose tells a person to copy);
  ``docs-test: fails`` the block must exit non-zero, printing on stderr the untagged block that
  follows it, if one does.
* A block that would need root or systemd, install packages, or run ``make`` and has no
  ``static`` marker is an error, as is a language the runner does not know: nothing is
  skipped silently. Untagged blocks are output or listings and are not run.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import pytest
from conftest import ROOT, short_tmpdir, start_broker, wait_serving

DOCS = (
    "README.md",
    *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
    os.path.join("ops", "grpcurl.md"),
)
DEFAULT_SOCKET = "/tmp/memory-broker.sock"
BIN = os.path.dirname(sys.executable)
SHELL_LANGS = {"sh", "bash", "shell"}
RUN_LANGS = SHELL_LANGS | {"python"}
TEXT_LANGS = {"", "text", "console-output", "yaml", "json", "ini"}
# What a docs example must not do on a developer's machine or in CI (only checked statically):
# root or systemd; installing or downloading packages; make (CI runs it); a GPU or minutes of
# benchmarks (ops/gpu, ops/bench); vLLM, which lives in its own environment.
NEEDS_MARKER = re.compile(
    r"^\s*(sudo|systemctl|journalctl|useradd|groupadd)\b|\bpip3? (install|download)\b|^\s*make\b|\s/etc/"
    r"|\bops/(gpu|bench)/|^\s*(from|import)\s+vllm\b|-m vllm\b",
    re.M,
)
BLOCK_TIMEOUT = 180.0
SUITE_ONLY_ENV = {"TRITON_INTERPRET"}


@dataclass
class Block:
    doc: str  # path relative to the repository root
    line: int  # line of the opening fence
    lang: str
    body: str
    section: str  # the closest "## " heading above it
    markers: list[str] = field(default_factory=list)
    output: str | None = None  # an untagged block right after it (what it prints)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def marker(self, name: str) -> str | None:
        for m in self.markers:
            key, _, rest = m.partition(":")
            if key.strip() == name:
                return rest.strip()
        return None

    @property
    def captures(self) -> dict[str, str]:
        return dict(m.split("=", 1) for m in self.markers if re.fullmatch(r"[A-Z_][A-Z0-9_]*=[\w.]+", m))


def parse(doc: str, text: str | None = None) -> list[Block]:
    """The fenced blocks of ``doc`` with the docs-test markers of the comments right above them."""
    if text is None:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
    lines = text.splitlines()
    blocks: list[Block] = []
    section, pending, i = "", [], 0
    gap_since_block = None  # blank lines since the last block closed (None: prose came between)
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^```\s*([\w-]*)\s*$", line)
        if fence:
            start, body = i, []
            i += 1
            while i < len(lines) and lines[i].rstrip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"{doc}:{start + 1}: unclosed code fence")
            b = Block(doc, start + 1, fence.group(1).lower(), "\n".join(body) + "\n", section, pending)
            if b.lang == "" and blocks and gap_since_block is not None and not pending:
                blocks[-1].output = b.body.strip()
            blocks.append(b)
            pending, gap_since_block = [], 0
        elif line.startswith("## "):
            section, pending, gap_since_block = line[3:].strip(), [], None
        elif "<!--" in line:
            comment = line
            while "-->" not in comment and i + 1 < len(lines):
                i += 1
                comment += " " + lines[i]
            for part in re.split(r"[|]", comment.split("<!--", 1)[1].split("-->", 1)[0]):
                part = part.strip()
                if part.startswith("docs-test:"):
                    items = part[len("docs-test:") :].split(";")
                    while items:  # a static reason is the rest of the comment, ';' and all
                        item = items.pop(0).strip()
                        if item.startswith("static:"):
                            item, items = ";".join([item, *items]), []
                        if item:
                            pending.append(item)
            gap_since_block = None
        elif line.strip():
            pending, gap_since_block = [], None
        i += 1
    return blocks


def problems(blocks: list[Block]) -> list[str]:
    """Why any block would be neither run nor checked (empty when every block is accounted for)."""
    out = []
    known = re.compile(r"^(static:.*|background|fails|[A-Z_][A-Z0-9_]*=[\w.]+)$")
    for b in blocks:
        for m in b.markers:
            if not known.match(m):
                out.append(f"{b.where}: unknown docs-test marker {m!r}")
        if b.lang not in RUN_LANGS | TEXT_LANGS:
            out.append(f"{b.where}: ```{b.lang} blocks are neither run nor known as text; add a runner for them")
        elif b.lang in RUN_LANGS and b.marker("static") is None:
            hit = NEEDS_MARKER.search(b.body)
            if hit:
                out.append(
                    f"{b.where}: the block runs {hit.group(0).strip()!r} (root, systemd, packages, make, a GPU,"
                    " benchmarks or vLLM); mark it <!-- docs-test: static: REASON --> and let the static"
                    " checks cover it"
                )
        elif b.marker("static") == "":
            out.append(f"{b.where}: a static marker needs its reason: <!-- docs-test: static: REASON -->")
        if b.markers and b.lang in TEXT_LANGS:
            out.append(f"{b.where}: docs-test markers on a block that is not run")
        if b.lang == "python" and (b.marker("background") is not None or b.captures):
            out.append(f"{b.where}: `background` and NAME=... apply to sh blocks only")
    return out


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in parse(doc)]


def runnable(doc: str) -> list[Block]:
    """The blocks of ``doc`` that run (a guide of static blocks only is checked, not run)."""
    return [b for b in parse(doc) if b.lang in RUN_LANGS and b.marker("static") is None]


# ---------------------------------------------------------------- running


class Session:
    """One file's blocks as a person runs them: one shell session, background commands kept
    running until the file is done."""

    def __init__(self, socket: str, workdir: str):
        self.socket = socket
        self.workdir = workdir
        # A user's environment: not what other test modules set in this process (test_lora_e2e
        # sets TRITON_INTERPRET, which would hide whether the example works without it).
        self.env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY_ENV and not k.startswith("PYTEST_")}
        self.env.update(
            MEMORY_BROKER_SOCKET=socket,
            MEMORY_BROKER_STATE_DIR=os.path.join(workdir, "state"),
            TMPDIR=os.path.join(workdir, "tmp"),
            PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        os.makedirs(self.env["TMPDIR"], exist_ok=True)
        self.background: list[subprocess.Popen] = []

    def text(self, b: Block, socket: str | None = None) -> str:
        body = b.body
        body = body.replace(DEFAULT_SOCKET, socket or self.socket)
        if os.path.realpath(os.path.join(ROOT, ".venv", "bin")) != os.path.realpath(BIN):
            body = body.replace(".venv/bin/", BIN + "/")
        return body

    def fail(self, b: Block, what: str, r) -> None:
        out = r.stdout if isinstance(r.stdout, str) else ""
        err = r.stderr if isinstance(r.stderr, str) else ""
        pytest.fail(
            f"{b.where} ({b.section}): {what}\n--- block ---\n{b.body}--- stdout ---\n{out[-3000:]}"
            f"\n--- stderr ---\n{err[-5000:]}",
            pytrace=False,
        )

    def run(self, b: Block) -> None:
        env = dict(self.env)
        if b.lang == "python":
            r = self._python(b, env)
        elif b.marker("background") is not None:
            return self._background(b, env)
        elif re.search(r"^\s*\S*memory-broker serve\b", b.body, re.M):
            r = self._with_daemon(b, env)
        else:
            r = self._shell(self.text(b), env)
        if b.marker("fails") is not None:
            if r.returncode == 0:
                self.fail(b, "the block is marked `fails` but succeeded", r)
            if b.output is not None and r.stderr.strip() != b.output:
                self.fail(b, f"it printed something else than the documented output:\n{b.output}", r)
        elif r.returncode != 0:
            self.fail(b, f"exit status {r.returncode}", r)
        self._capture(b, r.stdout)

    def _python(self, b: Block, env: dict) -> subprocess.CompletedProcess:
        path = os.path.join(self.workdir, f"block_{os.path.basename(b.doc)}_{b.line}.py")
        with open(path, "w") as f:
            f.write(self.text(b))
        return subprocess.run(
            [sys.executable, path], cwd=ROOT, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT
        )

    def _shell(self, script: str, env: dict) -> subprocess.CompletedProcess:
        env_out = os.path.join(self.workdir, "session.env")
        wrapped = f"set -a -e -o pipefail\n{script}\nenv -0 > {shlex.quote(env_out)}\n"
        r = subprocess.run(
            ["bash", "-c", wrapped], cwd=ROOT, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT
        )
        if r.returncode == 0:
            with open(env_out) as f:
                carried = dict(kv.split("=", 1) for kv in f.read().split("\0") if "=" in kv)
            for key in set(carried) - set(env) - {"_", "SHLVL", "PWD", "OLDPWD"}:
                self.env[key] = carried[key]
        return r

    def _with_daemon(self, b: Block, env: dict) -> subprocess.CompletedProcess:
        own = os.path.join(short_tmpdir(), "b.sock")
        env = dict(env, MEMORY_BROKER_STATE_DIR=os.path.join(os.path.dirname(own), "state"))
        lines = self.text(b, own).replace("\\\n", " ").splitlines()
        serve = [ln for ln in lines if re.match(r"^\s*\S*memory-broker serve\b", ln)]
        rest = "\n".join(ln for ln in lines if ln not in serve)
        assert len(serve) == 1, f"{b.where}: one daemon per block"
        log = open(os.path.join(os.path.dirname(own), "serve.log"), "w+")
        daemon = subprocess.Popen(["bash", "-c", f"exec {serve[0]}"], cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            try:
                wait_serving(own, daemon)
            except RuntimeError as e:
                log.seek(0)
                self.fail(b, f"the daemon line did not serve: {e}", subprocess.CompletedProcess([], 1, "", log.read()))
            r = self._shell(rest, env)
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                code = daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                code = daemon.wait()
            log.seek(0)
            logged = log.read()
            log.close()
            shutil.rmtree(os.path.dirname(own), ignore_errors=True)
        if code != 0 and r.returncode == 0:
            return subprocess.CompletedProcess(r.args, code, r.stdout, f"the daemon exited {code} on SIGTERM\n{logged}")
        return r

    def _background(self, b: Block, env: dict) -> None:
        out = os.path.join(self.workdir, f"background_{b.line}.out")
        f = open(out, "w")
        proc = subprocess.Popen(["bash", "-c", self.text(b)], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        f.close()
        self.background.append(proc)
        if not b.captures:
            return
        deadline = time.monotonic() + 30
        while True:
            with open(out) as f:
                printed = f.read()
            try:
                return self._capture(b, printed, quiet=True)
            except (ValueError, KeyError, IndexError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.fail(
                        b,
                        "the background block printed nothing to take",
                        subprocess.CompletedProcess([], 1, printed, ""),
                    )
                time.sleep(0.05)

    def _capture(self, b: Block, stdout: str, quiet: bool = False) -> None:
        for name, path in b.captures.items():
            try:
                value = json.JSONDecoder().raw_decode(stdout.lstrip())[0]
                for part in path.split("."):
                    value = value[int(part)] if isinstance(value, list) else value[part]
            except (ValueError, KeyError, IndexError, TypeError):
                if quiet:
                    raise ValueError(path) from None
                pytest.fail(f"{b.where}: no {path} in the block's output for {name}:\n{stdout[-2000:]}", pytrace=False)
            self.env[name] = str(value)

    def close(self) -> None:
        for proc in self.background:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.background.clear()


# ---------------------------------------------------------------- static checks

REPO_PATH = re.compile(r"(?<![\w/.-])(?:\$PWD/)?((?:\.venv|ops|tests|broker|clients|kernels|proto)/[\w.@/-]*\w)")


def static_problems(b: Block) -> list[str]:
    """What is wrong with a block that is checked rather than run."""
    out = []
    if b.lang == "python":
        try:
            compile(b.body, b.where, "exec")
        except SyntaxError as e:
            return [f"{b.where}: does not parse: {e}"]
    else:
        r = subprocess.run(["bash", "-n"], input=b.body, capture_output=True, text=True)
        if r.returncode != 0:
            return [f"{b.where}: does not parse: {r.stderr.strip()}"]
    named = b.body if b.lang == "python" else re.sub(r"(^|\s)#.*$", "", b.body, flags=re.M)  # not comments
    for rel in REPO_PATH.findall(named):
        path = os.path.join(BIN, rel[len(".venv/bin/") :]) if rel.startswith(".venv/bin/") else os.path.join(ROOT, rel)
        if not os.path.exists(path):
            out.append(f"{b.where}: names {rel}, which does not exist")
        elif path.endswith(".py"):
            try:
                with open(path) as f:
                    compile(f.read(), path, "exec")
            except SyntaxError as e:
                out.append(f"{b.where}: {rel} does not compile: {e}")
    for target in re.findall(r"^\s*make\s+([\w-]+)", b.body, re.M):
        r = subprocess.run(["make", "-n", "-C", ROOT, target], capture_output=True, text=True)
        if r.returncode != 0:
            out.append(f"{b.where}: `make {target}`: {r.stderr.strip()}")
    links = {dst: src for src, dst in re.findall(r"\bln -s\S*\s+(\S+)\s+(\S+)", b.body)}
    for unit in re.findall(r"\binstall\b[^\n]*?\s(ops/\S+\.service)\s", b.body):
        if not os.path.exists(os.path.join(ROOT, unit)):
            continue  # named above
        with open(os.path.join(ROOT, unit)) as f:
            execs = re.findall(r"^ExecStart=(\S+)", f.read(), re.M)
        if not execs:
            out.append(f"{b.where}: {unit} has no ExecStart")
        elif execs[0] not in links:
            out.append(f"{b.where}: {unit} runs {execs[0]}, which the block does not provide (links: {sorted(links)})")
    for config in re.findall(r"\binstall\b[^\n]*?\s(ops/\S+\.ya?ml)\s", b.body):
        if not os.path.exists(os.path.join(ROOT, config)):
            continue
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from memory_broker.broker.server.config import build_options;"
                " build_options(sys.argv[1], {})",
                os.path.join(ROOT, config),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if r.returncode != 0:
            out.append(f"{b.where}: the daemon refuses {config}: {r.stderr.strip().splitlines()[-1:]}")
    return out


# ---------------------------------------------------------------- tests


def test_every_code_block_is_run_or_marked():
    blocks = all_blocks()
    assert sum(b.lang in RUN_LANGS for b in blocks) >= 15, "the docs lost their examples (or the parser broke)"
    assert problems(blocks) == []


def test_an_unmarked_block_that_needs_root_or_an_unknown_language_is_an_error():
    text = (
        "## Setup\n\n```sh\nsudo systemctl restart memory-broker@0\n```\n\n"
        "<!-- docs-test: static: needs root -->\n```sh\nsudo useradd x\n```\n\n"
        "```ruby\nputs 1\n```\n\n<!-- docs-test: static: -->\n```sh\nls\n```\n\n"
        "<!-- docs-test: sometimes -->\n```python\nprint(1)\n```\n"
        "```python\nfrom vllm import LLM\n```\n```sh\nops/gpu/run_gpu_checks.sh\n```\n"
    )
    found = problems(parse("x.md", text))
    assert len(found) == 6, found
    assert "x.md:3: the block runs 'sudo'" in found[0]
    assert "x.md:12: ```ruby" in found[1]
    assert "x.md:17: a static marker needs its reason" in found[2]
    assert "unknown docs-test marker 'sometimes'" in found[3]
    assert "runs 'from vllm'" in found[4] and "runs 'ops/gpu/'" in found[5]


def test_markers_and_documented_output_attach_to_their_blocks():
    text = (
        "## S\n<!-- recipe: a | docs-test: background; TOKEN=opened.token -->\n```sh\nx\n```\n\n"
        "prose\n\n```sh\ny\n```\n\n```\nERROR: z\n```\n"
    )
    a, b, out = parse("x.md", text)
    assert a.marker("background") == "" and a.captures == {"TOKEN": "opened.token"} and a.section == "S"
    assert b.markers == [] and b.output == "ERROR: z" and out.lang == "" and a.output is None


def test_static_blocks_check_out():
    static = [b for b in all_blocks() if b.marker("static") is not None]
    assert static, "no static blocks: the systemd and make examples should be marked"
    assert [p for b in static for p in static_problems(b)] == []


def test_static_checks_catch_a_missing_file_and_a_unit_that_runs_something_else(tmp_path):
    b = Block("x.md", 1, "sh", "sudo install -m 0644 ops/systemd/nope.service /etc/systemd/system/\n", "S")
    assert static_problems(b) == ["x.md:1: names ops/systemd/nope.service, which does not exist"]
    b.body = (
        'sudo ln -s "$PWD/.venv/bin/memory-broker" /usr/bin/mb\n'
        "sudo install -m 0644 ops/systemd/memory-broker@.service /etc/systemd/system/\n"
    )
    assert "runs /usr/local/bin/memory-broker, which the block does not provide" in " ".join(static_problems(b))
    b.body = "make no-such-target\n"
    assert "make no-such-target" in " ".join(static_problems(b))


def test_every_file_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        named = re.findall(r"`([^`\s]*/[^`\s]*\.(?:md|py|ya?ml|json|sh|service|toml|proto))`", text)
        links = {t for t in re.findall(r"\]\(([^)#\s]+)\)", text) if "://" not in t}
        named += sorted(links)
        for rel in named:
            if rel.startswith("/") or re.match(r"[A-Z_]+/", rel):
                continue  # a path on the user's machine, or a placeholder (STATE_DIR/...)
            # A link is relative to its file, as Markdown reads it; a `path` in prose is from the root.
            base = os.path.dirname(os.path.join(ROOT, doc)) if rel.startswith(".") or rel in links else ROOT
            if not os.path.exists(os.path.normpath(os.path.join(base, rel))):
                missing.append(f"{doc}: {rel}")
    assert missing == [], "the docs name files the repository does not have"


@pytest.fixture(scope="module")
def docs_broker():
    # The default geometry (1 GiB of 2 MiB pages): ops/grpcurl.md shows its numbers.
    b = start_broker("--pool-size", "1GiB", "--page-size", "2MiB", "--slab-size", "64MiB")
    yield b
    assert b.stop() == 0


# Tens of seconds of CPU for a file on an idle 2-core machine; a loaded one stretches the wall time.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("doc", [doc for doc in DOCS if runnable(doc)])
def test_every_example_runs_twice_against_a_live_broker(doc, docs_broker):
    blocks = runnable(doc)
    workdir = tempfile.mkdtemp(prefix="docs-", dir=os.path.dirname(docs_broker.socket))
    for _ in range(2):
        session = Session(docs_broker.socket, workdir)
        try:
            for b in blocks:
                session.run(b)
        finally:
            session.close()
    assert docs_broker.proc.poll() is None, "the broker died under the examples:\n" + docs_broker.log()[-3000:]
