"""The native step core: optional C extensions for the step path's per-item passes, and their fallback.

Each per-item pass of the step channel (decoding a frame's ids and keys, the store's pin books,
the client's reply records) has a pure-Python definition, and may also have a C one in one of
the native cores, the package ``memory_broker._native`` (``native/_*.c``, built when the project
is installed: ``[tool.setuptools] ext-modules`` in ``pyproject.toml``; the build is optional, so
an install without a compiler still works). ``load`` returns the C module, or ``None``; a caller then takes its Python path.
The two are the same protocol and the same results: the tests run both.

``MEMORY_BROKER_NATIVE=0`` (or ``off``/``false``/``no``) turns every native module off, so the
Python path runs; a native module that was not built is said once, in the log, per process.
``MEMORY_BROKER_NATIVE_DIR=DIR`` loads each module from ``DIR/<last name>.so`` instead of the
installed build: ``make test-sanitize`` builds them there with AddressSanitizer and
UndefinedBehaviorSanitizer and runs the native-against-fallback tests on them.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from types import ModuleType

# The cores, by the names ``load`` takes.
STEPCORE = "memory_broker._native._stepcore"
STORECORE = "memory_broker._native._storecore"
HOTCORE = "memory_broker._native._hotcore"

ENV = "MEMORY_BROKER_NATIVE"
DIR_ENV = "MEMORY_BROKER_NATIVE_DIR"
_OFF = {"0", "off", "false", "no"}
log = logging.getLogger("memory_broker.native")
_loaded: dict[str, ModuleType | None] = {}
# Why each module asked for and not in use is not ("off by MEMORY_BROKER_NATIVE=0", "not built: ...").
_why_off: dict[str, str] = {}


def enabled() -> bool:
    """False when ``MEMORY_BROKER_NATIVE`` turns the native core off."""
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


def load(name: str) -> ModuleType | None:
    """The native module ``name`` (a full import name), or ``None`` if it is off or was not built.

    Read once per process and name; a module that was not built is logged once, at warning
    level, with what that costs and how to build it.
    """
    if name in _loaded:
        return _loaded[name]
    module: ModuleType | None = None
    if not enabled():
        _why_off[name] = f"off by {ENV}={os.environ.get(ENV, '')}"
    else:
        try:
            module = _import(name)
        except ImportError as e:
            _why_off[name] = f"not built: {e}"
            log.warning(
                "native step core %s is not built (%s): the pure-Python path runs, correct but slower "
                "per item; reinstall with a C compiler and Python's headers (pip install -e .) to build it",
                name,
                e,
            )
    _loaded[name] = module
    return module


def _import(name: str) -> ModuleType:
    """The installed module ``name``, or with ``MEMORY_BROKER_NATIVE_DIR`` its build there."""
    where = os.environ.get(DIR_ENV, "")
    if not where or name in sys.modules:
        return importlib.import_module(name)
    path = os.path.join(where, name.rpartition(".")[2] + ".so")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not os.path.exists(path):
        raise ImportError(f"no {path} ({DIR_ENV}={where})")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def status() -> dict[str, bool]:
    """Each native module asked for so far, and whether it is in use."""
    return {name: module is not None for name, module in _loaded.items()}


def cores() -> dict[str, str]:
    """Each native module asked for so far, by its last name: "native", or why the Python path
    runs in its place (for the broker's ``serving`` line)."""
    return {
        name.rpartition(".")[2]: "native" if m is not None else _why_off.get(name, "off") for name, m in _loaded.items()
    }
