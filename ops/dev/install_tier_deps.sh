#!/usr/bin/env bash
# Installs the Debian packages the tier's backends need (docs/tier.md): Mooncake Store's CPU
# wheel loads libibverbs.so.1 at import even over TCP. Does nothing when it is there already;
# otherwise installs it without a prompt (root, as in CI), or says the command to run.
set -euo pipefail
PACKAGES=(libibverbs1)
missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "the tier needs Debian packages: ${missing[*]}; run: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
echo "installing ${missing[*]} (the tier's backends need them at import)"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q "${missing[@]}" >/dev/null
}
