"""Deprecated: ``memory_broker.wire`` is now ``memory_broker.proto.wire`` (removed next release).

Importing ``memory_broker.wire`` or any ``memory_broker.wire.X`` warns once (DeprecationWarning)
and gives the very module object of ``memory_broker.proto.wire.X``, so classes and errors stay
one and the same under both names (``memory_broker.wire.arena`` is now ``...wire.mapping``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_OLD = __name__  # "memory_broker.wire"
_NEW = "memory_broker.proto.wire"
_RENAMED = {"arena": "mapping"}

warnings.warn(
    f"{_OLD} is deprecated: import {_NEW} instead (the old name goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)


def _target(fullname: str) -> str:
    rest = fullname[len(_OLD) + 1 :].split(".")
    rest[0] = _RENAMED.get(rest[0], rest[0])
    return ".".join([_NEW, *rest])


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002 (finder protocol)
        if not fullname.startswith(_OLD + "."):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(_target(spec.name))

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())

_real = importlib.import_module(_NEW)
globals().update({k: v for k, v in vars(_real).items() if not k.startswith("__")})
