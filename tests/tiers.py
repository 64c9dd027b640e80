"""Test tiers: every test belongs to exactly one, chosen here from what the test uses.

A tier is a pytest marker (``pytest -m unit``), applied at collection from what a test's code
reaches: its own body, the fixtures it requests and the module's and conftest's helpers those
call, followed transitively (names and string constants, read from the source). First rule that
matches wins:

* ``engine``: vLLM's own environment (``vllm_shared``, ``VLLM_PY``: engines, model builds);
* ``tools``: the repository's tools: the docs' examples, benchmark and ops scripts, packaging,
  linters, the coexistence check;
* ``interp``: Triton kernels, under the interpreter on a CPU (``TRITON_INTERPRET``) or its
  compiler;
* ``broker``: a broker daemon or any other child process;
* ``unit``: the rest, in one process.

What a test does is then checked as it runs: a ``unit`` test that starts a process, or a test
outside ``engine`` that runs vLLM's python, or a test outside ``interp``/``tools``/``engine``
that launches a kernel in Triton's interpreter, fails with the rule it escaped. A hand-placed
tier marker that disagrees with the rules is an error at collection. The run ends with the
count of tests per tier (tests/test_structure.py checks the partition on the whole suite).

``make test`` runs ``unit`` and ``broker`` on the native cores; ``make test-all`` every tier and
the fallback runs (the ``fallback`` marker, see conftest's ``native_core``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest

TIERS = {
    "unit": "in one process: no broker, no child process",
    "broker": "starts a broker daemon or other child processes",
    "interp": "runs Triton kernels (the interpreter on a CPU, or its compiler)",
    "engine": "runs vLLM's environment (engines, model builds)",
    "tools": "the repository's tools: docs examples, benchmark and ops scripts, packaging, lint, coexistence",
}

# What each tier is recognised by, among the names and strings a test's code reaches.
ENGINE_NAMES = {"vllm_shared", "VLLM_PY", "VllmShared", "LoraEngine"}
TOOL_NAMES = {"DOCS", "run_bench", "check_coexistence"}
# (A whole string constant: a command's word or a path, not a message that names one.)
TOOL_STRINGS = re.compile(
    r"ruff|pip|wheel|grpcurl|make|ops/(bench|gpu|dev)/.*|.*\.md|.*bench_\w+\.py|check_coexistence\.sh"
)
INTERP_NAMES = {"triton", "compile_all"}
INTERP_STRINGS = re.compile(r"TRITON_INTERPRET")
PROCESS_NAMES = {
    "start_broker",
    "broker",
    "broker_factory",
    "step_rig",
    "run_child",
    "spawn_child",
    "run_side_by_side",
    "subprocess",
    "Popen",
    "multiprocessing",
    "fork",
    "posix_spawn",
}


# Processes a library starts on its own to find a shared library (ctypes.util.find_library runs
# ldconfig, or gcc, ld and objdump), the first time some test in a worker asks: not a test's doing.
LIBRARY_PROBES = {"ldconfig", "gcc", "cc", "ld", "objdump"}


class Uses:
    """The names and string constants a test's code reaches."""

    def __init__(self):
        self.names: set[str] = set()
        self.strings: set[str] = set()

    def has_string(self, pattern: re.Pattern) -> bool:
        return any(pattern.fullmatch(s) for s in self.strings)

    def has_ops_path(self) -> bool:
        # os.path.join(ROOT, "ops", "bench", ...): a script of the repository's ops/ tools.
        return "ops" in self.strings and bool(self.strings & {"bench", "gpu", "dev"})


def tier_of(uses: Uses, module_text: str) -> str:
    if uses.names & ENGINE_NAMES:
        return "engine"
    if uses.names & TOOL_NAMES or uses.has_string(TOOL_STRINGS) or uses.has_ops_path():
        return "tools"
    if uses.names & INTERP_NAMES or uses.has_string(INTERP_STRINGS) or _sets_interpreter(module_text):
        return "interp"
    if uses.names & PROCESS_NAMES:
        return "broker"
    return "unit"


def _sets_interpreter(module_text: str) -> bool:
    # The kernel modules turn the interpreter on at import: every test in them runs under it.
    return 'setdefault("TRITON_INTERPRET", "1")' in module_text


# ---------------------------------------------------------------- reading what a test reaches


class _Index:
    """One module's top-level functions and classes: name -> (names, strings) each refers to."""

    def __init__(self, path: str):
        with open(path) as f:
            self.text = f.read()
        tree = ast.parse(self.text, path)
        self.defs: dict[str, tuple[set[str], set[str]]] = {}
        # Names imported from the suite's other modules (helpers, fixtures): name -> (path, name there).
        self.imports: dict[str, tuple[str, str]] = {}
        here = os.path.dirname(path)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                other = os.path.join(here, node.module + ".py")
                if os.path.exists(other):
                    for a in node.names:
                        self.imports[a.asname or a.name] = (other, a.name)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.defs[node.name] = _refs(node)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        self.defs[t.id] = _refs(node)


def _refs(node: ast.AST) -> tuple[set[str], set[str]]:
    names: set[str] = set()
    strings: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).partition(".")[0])  # import subprocess, in a function
        elif isinstance(n, ast.arg):
            names.add(n.arg)  # fixtures a helper or fixture asks for
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            strings.add(n.value)
    return names, strings


CONFTEST = os.path.join(os.path.dirname(__file__), "conftest.py")
# Fixtures every test gets, which say nothing of what a test uses.
NEUTRAL_FIXTURES = {"tier_watch", "native_core"}


@functools.cache
def _index(path: str) -> _Index:
    return _Index(path)


@functools.cache
def _node_refs(obj) -> tuple[set[str], set[str]]:
    try:
        src = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return set(), set()
    return _refs(ast.parse(src))


def uses_of(item: pytest.Function) -> tuple[Uses, str]:
    """What ``item`` reaches, and its module's text."""
    indexes = [_index(str(item.path)), _index(CONFTEST)]
    todo: list[tuple[set[str], set[str]]] = [_node_refs(item.obj)]
    if item.cls is not None:
        todo.append(_node_refs(item.cls))
    for name, defs in item._fixtureinfo.name2fixturedefs.items():
        if defs and name not in NEUTRAL_FIXTURES:
            todo.append(_node_refs(defs[-1].func))
    uses = _reach(todo, indexes)
    uses.names |= set(item.fixturenames) - NEUTRAL_FIXTURES
    return uses, indexes[0].text


def _reach(todo: list[tuple[set[str], set[str]]], indexes: list[_Index]) -> Uses:
    """Everything ``todo``'s names and strings reach through ``indexes``' definitions."""
    uses = Uses()
    seen: set[tuple[int, str]] = set()
    while todo:
        names, strings = todo.pop()
        uses.names |= names
        uses.strings |= strings
        for n in names:
            for ix in indexes:
                _follow(ix, n, todo, seen)
    return uses


def _follow(ix: _Index, name: str, todo: list, seen: set, depth: int = 0) -> None:
    key = (id(ix), name)
    if key in seen or depth > 4:
        return
    seen.add(key)
    if name in ix.defs:
        todo.append(ix.defs[name])
    elif name in ix.imports:
        path, there = ix.imports[name]
        other = _index(path)
        # What the helper reaches in its own module is followed there.
        if there in other.defs:
            names, strings = other.defs[there]
            todo.append((names, strings))
            for n in names:
                _follow(other, n, todo, seen, depth + 1)
        else:
            _follow(other, there, todo, seen, depth + 1)


# ---------------------------------------------------------------- the hooks


def pytest_configure(config):
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: tier: {what}")
    config.addinivalue_line(
        "markers", "fallback: the pure-Python fallback run of the native cores (make test-all only)"
    )
    config.addinivalue_line(
        "markers", "both_cores: run on the native cores and on their fallback (conftest.native_core)"
    )
    config.addinivalue_line("markers", "fallback_only: run on the fallback alone (the Python path's own internals)")
    config.addinivalue_line("markers", "native_only: run on the native cores alone (what only they do)")


def pytest_itemcollected(item):
    # Each test's tier, as it is collected: before any hook deselects some (-m).
    if not isinstance(item, pytest.Function):
        return
    hand = [m.name for m in item.iter_markers() if m.name in TIERS]
    uses, text = uses_of(item)
    tier = tier_of(uses, text)
    if hand and set(hand) != {tier}:
        raise pytest.UsageError(
            f"{item.nodeid}: marked {hand} by hand, but what it uses makes it {tier!r} "
            "(tests/tiers.py chooses a test's tier; change what it uses or the rules there)"
        )
    item.add_marker(getattr(pytest.mark, tier))
    item.stash[_TIER] = tier
    tiers = [m.name for m in item.iter_markers() if m.name in TIERS]
    COLLECTED[item.nodeid] = (tiers, item.get_closest_marker("fallback") is not None)


# ---------------------------------------------------------------- under pytest-xdist


def engine_module(path: str) -> bool:
    """Whether any test of the module at ``path`` reaches the engine tier's names."""
    ix = _index(path)
    indexes = [ix, _index(CONFTEST)]
    tests = (refs for name, refs in ix.defs.items() if name.startswith("test"))
    return any(_reach([refs], indexes).names & ENGINE_NAMES for refs in tests)


def pytest_xdist_make_scheduler(config, log):
    """``-n N`` (pytest-xdist's ``load``) with one exception: the modules with engine-tier tests
    are one unit of work, run in order on one worker (their tests share the session's reference
    engines, a few GB each, and a module's later tests use what its earlier ones started); the
    largest unit goes first, so one worker starts on the engines while the others take the rest.
    (xdist's own ``loadgroup`` does not group under this pytest.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    rootdir = str(config.rootpath)

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            path = os.path.join(rootdir, module)
            return "engine" if module.endswith(".py") and os.path.exists(path) and engine_module(path) else nodeid

    return TierScheduling(config, log)


_TIER = pytest.StashKey[str]()
_COUNTS: dict[str, int] = {}
# Every test this process collected, before any -m or -k deselects some: nodeid -> (its tiers,
# whether it is a fallback run); test_tiers checks the partition on it when the run collected
# the whole suite.
COLLECTED: dict[str, tuple[list[str], bool]] = {}


def pytest_runtest_logreport(report):
    # Every test that ran has a setup report (with its markers among its keywords), in this
    # process or, under pytest-xdist, sent here by the worker that ran it.
    if report.when == "setup":
        for t in TIERS:
            if t in report.keywords:
                _COUNTS[t] = _COUNTS.get(t, 0) + 1


def pytest_terminal_summary(terminalreporter):
    if _COUNTS:
        line = ", ".join(f"{t} {_COUNTS.get(t, 0)}" for t in TIERS)
        terminalreporter.write_sep("=", f"tests by tier: {line}")


class _Watch:
    """What one test did that its tier must allow: processes, vLLM's python, the interpreter."""

    def __init__(self):
        self.argv: list[str] = []
        self.interpreted = 0


def _vllm_python() -> str | None:
    p = os.environ.get("MEMORY_BROKER_VLLM_PYTHON")
    return os.path.realpath(p) if p else None


@pytest.fixture(autouse=True)
def tier_watch(request, monkeypatch):
    """Fails a test whose run leaves its tier (a ``unit`` test that starts a process, ...)."""
    tier = request.node.stash.get(_TIER, None)
    if tier is None:
        yield
        return
    watch = _Watch()
    execute = subprocess.Popen._execute_child

    def execute_child(self, args, executable, *rest, **kw):
        argv = [args] if isinstance(args, str | bytes) else list(args)
        if os.path.basename(str(argv[0]).split(" ")[0]) not in LIBRARY_PROBES:
            watch.argv.append(" ".join(map(str, argv))[:200])
        return execute(self, args, executable, *rest, **kw)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", execute_child)
    real_fork = os.fork

    def fork():
        watch.argv.append("os.fork()")
        return real_fork()

    monkeypatch.setattr(os, "fork", fork)
    interp = sys.modules.get("triton.runtime.interpreter")
    if interp is not None:
        run = interp.InterpretedFunction.run

        def interpreted(self, *a, **kw):
            watch.interpreted += 1
            return run(self, *a, **kw)

        monkeypatch.setattr(interp.InterpretedFunction, "run", interpreted)
    yield
    monkeypatch.undo()
    problems = []
    if tier == "unit" and watch.argv:
        problems.append(f"started a process ({watch.argv[0]}): tier 'broker'")
    vllm = _vllm_python()
    if tier != "engine" and vllm and any(a.startswith(vllm) or vllm in a.split(" ")[0] for a in watch.argv):
        problems.append("ran vLLM's python: tier 'engine'")
    if tier not in ("interp", "tools", "engine") and watch.interpreted:
        problems.append(f"launched {watch.interpreted} kernels in Triton's interpreter: tier 'interp'")
    if problems:
        pytest.fail(
            f"{request.node.nodeid} is in tier {tier!r} by tests/tiers.py's rules, but it "
            + "; ".join(problems)
            + ". Make what it uses visible to the rules (a fixture or helper they know), or extend them.",
            pytrace=False,
        )
