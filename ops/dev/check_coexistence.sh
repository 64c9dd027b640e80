#!/usr/bin/env bash
# Installs Hugging Face's `kernels` and this project into fresh virtual environments, in both
# orders, and checks that both stay importable and correct, and that removing either one
# leaves the other whole. This project installs one top-level import package,
# `memory_broker`; before it had its own import root, its `kernels` package and Hugging
# Face's overwrote each other in site-packages.
#
# Usage: ops/dev/check_coexistence.sh [PYTHON]
#   PYTHON: an interpreter whose site-packages has this project's dependencies (default
#   .venv/bin/python). The fresh environments see those dependencies through a .pth file, so
#   nothing but the two packages under test is installed into them. Hugging Face's wheel
#   comes from the package index ($HF_KERNELS_SPEC, default kernels==0.17.2) or, with
#   HF_KERNELS_WHEEL=path, from a file.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-.venv/bin/python}
SPEC=${HF_KERNELS_SPEC:-kernels==0.17.2}
work=$(mktemp -d)
# A wheel build from the checkout leaves memory_broker.egg-info in it; a stale one there (its
# entry points from an older pyproject.toml) shadows the installed metadata for any
# `python -m` run from the checkout. Remove it unless it was there before.
egg_existed=$([ -e memory_broker.egg-info ] && echo 1 || true)
build_existed=$([ -e build ] && echo 1 || true)
trap 'rm -rf "$work"; [ -n "$egg_existed" ] || rm -rf memory_broker.egg-info; [ -n "$build_existed" ] || rm -rf build' EXIT

# Every site-packages directory the interpreter sees (one venv may reach another's by a .pth).
deps=$("$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("site-packages")))')
echo "building this project's wheel"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheels" . >/dev/null
if [ -n "${HF_KERNELS_WHEEL:-}" ]; then
    cp "$HF_KERNELS_WHEEL" "$work/wheels/"
else
    echo "downloading Hugging Face's $SPEC"
    "$PY" -m pip download -q --no-deps -d "$work/wheels" "$SPEC" 2>&1 | grep -v "^WARNING: Location" || true
fi
ours=$(ls "$work"/wheels/memory_broker-*.whl)
theirs=$(ls "$work"/wheels/kernels-*.whl)

echo "the wheel's top-level entries:"
top=$("$PY" -c 'import sys, zipfile; print(" ".join(sorted({n.split("/")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()})))' "$ours")
echo "  $top"
for name in $top; do
    case "$name" in memory_broker|memory_broker-*.dist-info) ;; *) echo "FAIL: the wheel installs $name"; exit 1 ;; esac
done

check() {  # $1: venv; asserts both packages are importable and are what they claim to be
    # (run outside the checkout, whose kernels/ folder would otherwise be found first)
    (cd "$work" && "$1/bin/python" - <<'PY'
import kernels  # Hugging Face's
assert callable(getattr(kernels, "get_kernel", None)), f"`kernels` is not Hugging Face's: {kernels.__file__}"
from memory_broker.kernels import plan_batch
from memory_broker.kernels.reference import lora_apply
from memory_broker.clients import BrokerClient, Spec
assert "memory_broker" not in kernels.__file__
print("  both importable:", kernels.__file__.split("site-packages/")[-1], "and memory_broker.kernels")
PY
    )
}

for order in "ours theirs" "theirs ours"; do
    env="$work/venv-${order// /-}"
    "$PY" -m venv "$env"  # the interpreter that built our wheel (its tag names that Python)
    echo "$deps" > "$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dev-deps.pth"
    echo "fresh environment, installing $order:"
    for which in $order; do
        if [ "$which" = ours ]; then w=$ours; else w=$theirs; fi
        "$env/bin/python" -m pip install -q --no-deps --no-index "$w" 2>&1 | grep -v "^WARNING: Location" || true
    done
    check "$env"
    # Removing one must not take the other's files with it.
    last=${order##* }
    if [ "$last" = ours ]; then "$env/bin/python" -m pip uninstall -q -y memory-broker; else "$env/bin/python" -m pip uninstall -q -y kernels; fi
    cd "$work"
    if [ "$last" = ours ]; then
        "$env/bin/python" -c 'import kernels; assert callable(kernels.get_kernel); print("  after removing memory-broker, kernels is whole")'
    else
        "$env/bin/python" -c 'from memory_broker.kernels import plan_batch; print("  after removing kernels, memory_broker.kernels is whole")'
    fi
    cd - >/dev/null
done
echo "coexistence: OK"
