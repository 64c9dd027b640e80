"""vLLM's Triton LoRA kernels as the kernel benchmark's baseline, checked without a GPU.

ops/gpu/extract_vllm_lora_ops.py copies the kernels out of the vLLM environment
(``$MEMORY_BROKER_VLLM_PYTHON``, else .venv-vllm; ``make test`` builds it) into a temporary
folder; then, in a subprocess of this project's Python with TRITON_INTERPRET=1, the copied
package imports through its shims, vLLM's lora_shrink + lora_expand run on CPU tensors at tiny
shapes with the metadata tests/vllm_lora_baseline.py builds (the benchmark's own code, which it
imports from tests/) and must equal the fp32 reference, and the benchmark itself runs end to end
at tiny shapes (``bench_lora_kernels.py --cpu-dry-run``: timings stubbed, there is no GPU to time). fp16 only: Triton's interpreter computes bf16 dots wrongly
(FIELD-NOTES.md), vLLM's kernels included; bf16 is checked by the benchmark on the GPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, run_side_by_side

VLLM_PY = os.environ.get("MEMORY_BROKER_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
EXTRACTOR = os.path.join(ROOT, "ops", "gpu", "extract_vllm_lora_ops.py")
COPIED = ("lora_shrink_op.py", "lora_expand_op.py", "kernel_utils.py", "utils.py", "lora_kernel_metadata.py")
OPS = "vllm/lora/ops/triton_ops"

if not os.path.exists(VLLM_PY):
    if os.environ.get("MEMORY_BROKER_REQUIRE_VLLM"):
        raise RuntimeError(f"the vLLM environment's python {VLLM_PY} is missing: run `make vllm-venv`")
    pytest.skip(
        f"no vLLM environment at {VLLM_PY} (`make vllm-venv` builds it; `make test` does)", allow_module_level=True
    )


# The probe fixture below runs Triton's interpreter for about a minute on each core; its setup
# counts toward the first test's bound (pytest's default 120 s was reached in CI).
pytestmark = pytest.mark.timeout(600)


def run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def vllm_package() -> Path:
    """The vllm package folder the vLLM environment's python finds (without importing vLLM)."""
    code = "import importlib.util as u; print(list(u.find_spec('vllm').submodule_search_locations)[0])"
    r = subprocess.run([VLLM_PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, vllm_package) -> Path:
    out = tmp_path_factory.mktemp("vllm_ops") / "vllm_lora_ops"
    r = run(EXTRACTOR, "--python", VLLM_PY, "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"-> {out}" in r.stdout
    return out


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_the_extractor_copies_vllms_files_unmodified_and_records_them(extracted, vllm_package):
    manifest = json.loads((extracted / "MANIFEST.json").read_text())
    version_py = (vllm_package / "_version.py").read_text()
    assert f"'{manifest['vllm_version']}'" in version_py
    assert sorted(manifest["copied"]) == sorted(f"{OPS}/{f}" for f in COPIED)
    for f in COPIED:
        copy, original = extracted / OPS / f, vllm_package / "lora" / "ops" / "triton_ops" / f
        assert copy.read_bytes() == original.read_bytes(), f
        assert manifest["copied"][f"{OPS}/{f}"] == sha(original)
    # Nothing else of vLLM's came along: every other file is a shim the manifest names.
    others = {str(p.relative_to(extracted)) for p in extracted.rglob("*.py")} - set(manifest["copied"])
    assert others == set(manifest["shims"])
    for rel in others:
        assert "Shim written by memory-broker" in (extracted / rel).read_text(), rel
    size = sum(p.stat().st_size for p in extracted.rglob("*") if p.is_file())
    assert size < 1 << 20, f"{size} bytes: too big to carry"


def test_a_wheel_gives_the_same_files(tmp_path, extracted, vllm_package):
    wheel = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in COPIED:
            z.write(vllm_package / "lora" / "ops" / "triton_ops" / f, f"{OPS}/{f}")
        z.writestr("vllm/_version.py", "__version__ = version = '9.8.7'\n")
    out = tmp_path / "from_wheel"
    r = run(EXTRACTOR, "--wheel", str(wheel), "--out", str(out))
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["vllm_version"] == "9.8.7"
    assert manifest["source"].startswith(f"wheel {wheel.name}")
    assert manifest["copied"] == json.loads((extracted / "MANIFEST.json").read_text())["copied"]


def test_a_vllm_import_without_a_shim_is_refused_and_changes_nothing(tmp_path, vllm_package):
    site = tmp_path / "site"
    shutil.copytree(
        vllm_package / "lora" / "ops" / "triton_ops",
        site / "vllm" / "lora" / "ops" / "triton_ops",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    utils = site / "vllm" / "lora" / "ops" / "triton_ops" / "utils.py"
    utils.write_text(utils.read_text() + "\nfrom vllm.model_executor import something_new\n")
    out = tmp_path / "out"
    r = run(EXTRACTOR, "--from-site", str(site), "--out", str(out))
    assert r.returncode == 1
    assert "utils.py: 'from vllm.model_executor import something_new' has no shim" in r.stderr
    assert not out.exists()
    # An env variable the envs shim does not define is refused the same way.
    utils.write_text(
        utils.read_text().replace("\nfrom vllm.model_executor import something_new\n", "\nX = envs.VLLM_NEW\n")
    )
    r = run(EXTRACTOR, "--from-site", str(site), "--out", str(out))
    assert r.returncode == 1 and "envs.VLLM_NEW" in r.stderr
    # A folder that is not an earlier extraction is never replaced.
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = run(EXTRACTOR, "--python", VLLM_PY, "--out", str(out))
    assert r.returncode == 1 and "not an earlier extraction" in r.stderr
    assert (out / "keep.txt").read_text() == "mine"


PROBE = textwrap.dedent(
    r"""
    import json, os, sys
    folder, root = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.join(root, "tests"))
    import torch
    import vllm_lora_baseline as vb
    from memory_broker.kernels import LoraStep, reference
    from memory_broker.kernels.testing import pack_adapters, random_adapter

    result = {}
    ops = vb.load(folder)
    import vllm, vllm.envs, vllm.platforms
    from vllm.lora.ops.triton_ops import utils as vutils
    result["vllm_file"] = vllm.__file__
    result["shrink_is_custom_op"] = ops.lora_shrink is torch.ops.vllm.lora_shrink
    result["expand_is_custom_op"] = ops.lora_expand is torch.ops.vllm.lora_expand
    result["pdl"] = vutils.supports_pdl(None)
    result["dual_stream"] = vllm.envs.VLLM_LORA_ENABLE_DUAL_STREAM
    result["is_cuda"] = vllm.platforms.current_platform.is_cuda()

    # Tiny shapes: 5 tokens (one without LoRA), 3 adapters of ranks 4, 2, 4, hidden 32, 2 slices.
    g = torch.Generator().manual_seed(int(os.environ.get("LORA_TEST_SEED", "17")))
    adapters = [random_adapter(r, 32, (32, 32), g) for r in (4, 2, 4)]
    packed = pack_adapters(adapters, dtype=torch.float16, generator=g)
    slots = torch.tensor([2, 0, -1, 1, 2], dtype=torch.int32)
    x = torch.randn(5, 32, generator=g).half()
    base = torch.randn(5, 64, generator=g).half()
    p = packed
    expected = reference.lora_apply(x, base.clone(), p.arena, p.tables, LoraStep(slots), p.slice_offsets,
                                    p.slice_sizes)
    w = vb.stack_weights(adapters, torch.float16, "cpu")
    meta = vb.make_metadata(ops, slots, 3, "cpu")
    out = base.clone()
    vb.lora_apply(ops, x, out, w, meta)
    result["max_err"] = (out.float() - expected.float()).abs().max().item()
    result["max_ref"] = expected.float().abs().max().item()
    result["no_lora_row_untouched"] = bool(torch.equal(out[2], base[2]))
    result["lora_changed_rows"] = bool((out[[0, 1, 3, 4]] != base[[0, 1, 3, 4]]).any(dim=1).all())
    print("RESULT " + json.dumps(result))
    """
)


# The benchmark end to end at tiny shapes (its CPU dry run: timings stubbed, every check real),
# with vLLM's rows, without the vLLM folder, and with vLLM given a wrong token -> slot map.
# Small grids: the interpreter runs each of vLLM's split-K shrink programs (64 per tile) in Python.
BENCH = [os.path.join(ROOT, "ops", "bench", "bench_lora_kernels.py"), "--cpu-dry-run", "--tokens", "decode=3,prefill=8"]
BENCH += "--reps 1 --warmup 0 --dtypes float16 --stacked-rank 8 --layers 1 --modules 2".split()


@pytest.fixture(scope="module")
def probe(extracted) -> dict:
    """The probe and the benchmark's three runs, side by side (about 2 minutes of Triton's
    interpreter in one process): the probe checks the kernels against the reference; the
    benchmark runs with vLLM's rows, without them, and with a wrong token -> slot map."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    runs = {
        "bench": ["--vllm-ops", str(extracted)],
        "bench_without_vllm": ["--vllm-ops", f"{extracted}.absent"],
        "bench_wrong_metadata": ["--cases", "decode", "--vllm-ops", str(extracted), "--vllm-wrong-map"],
    }
    jobs = [("probe", [sys.executable, "-c", PROBE, str(extracted), ROOT], env)]
    jobs += [(key, [sys.executable, *BENCH, *args], env) for key, args in runs.items()]
    probe_out, *bench_outs = run_side_by_side(jobs, 400)
    line = next(ln for ln in probe_out.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    # run_side_by_side fails the test on a non-zero exit: each run's status is 0 here.
    result.update({key: {"rc": 0, "out": out} for key, out in zip(runs, bench_outs)})
    return result


def test_the_extracted_package_imports_through_its_shims_as_vllm_would_on_this_machine(probe, extracted):
    assert Path(probe["vllm_file"]).resolve() == (extracted / "vllm" / "__init__.py").resolve()
    # Registered as torch ops, as vLLM registers them (the same dispatcher cost on a GPU).
    assert probe["shrink_is_custom_op"] and probe["expand_is_custom_op"]
    # vLLM's own rule decides PDL: no CUDA here, and dual-stream off by default.
    assert probe["is_cuda"] is False and probe["pdl"] is False and probe["dual_stream"] is False


def test_vllms_kernels_with_the_benchmarks_metadata_equal_the_reference(probe):
    # Triton's interpreter runs vLLM's kernels, pointer-array loads (one weight tensor per
    # slice) included; fp16 tolerance as in test_kernels.py.
    assert probe["max_err"] <= 1e-2 * max(1.0, probe["max_ref"]), probe
    assert probe["no_lora_row_untouched"] and probe["lora_changed_rows"]


def test_the_benchmark_adds_vllms_rows_and_the_ratio_per_case_and_dtype(probe):
    bench = probe["bench"]
    assert bench["rc"] == 0, bench["out"]
    out = bench["out"]
    assert "vLLM rows: vLLM " in out
    for case in ("decode", "prefill"):
        assert f"{case} float16: vLLM Triton lora_shrink+lora_expand: max |out - fp32 reference|" in out
        assert "MISMATCH" not in out and "FAILED" not in out, out
        table = [ln for ln in out.splitlines() if ln.startswith(f"{case:8} float16") and "vLLM Triton" in ln]
        assert len(table) == 1, out
        assert f"  {case} float16: kernels best (" in out and "/ vLLM 500.0 us = 1.00" in out
    # The whole decode step, driven the same way for both (CUDA graphs only on a GPU).
    assert "decode   float16   model step 1x2: vLLM eager, prepare_tensors + 2 pairs" in out, out
    assert "decode   float16   model step 1x2: kernels eager, plan + 2 pairs (token)" in out, out


def test_the_benchmark_without_the_vllm_folder_says_so_once_and_runs(probe):
    bench = probe["bench_without_vllm"]
    assert bench["rc"] == 0, bench["out"]
    lines = bench["out"].splitlines()
    assert len([ln for ln in lines if ln.startswith("vLLM rows: skipped: no extracted vLLM LoRA ops")]) == 1
    assert not any("vLLM Triton" in ln for ln in lines)
    assert "  decode float16: kernels best (" in bench["out"] and "no vLLM row" in bench["out"]


def test_the_benchmark_leaves_out_a_vllm_row_whose_output_is_off_the_reference(probe):
    bench = probe["bench_wrong_metadata"]
    out = bench["out"]
    assert bench["rc"] == 0, out  # vLLM's row is optional; the project's rows stand
    assert "decode float16: vLLM Triton lora_shrink+lora_expand: max |out - fp32 reference|" in out
    assert "MISMATCH" in out and "decode float16: vLLM CHECK FAILED" in out
    assert not any("vLLM Triton" in ln and ln.startswith(f"{'decode':8} float16") for ln in out.splitlines()), out
    assert "decode float16: kernels best (" in out and "no vLLM row" in out
