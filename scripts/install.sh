#!/usr/bin/env bash
# Installs what pdtool needs on a fresh Debian machine (run as root): system packages
# (libfabric, gcc, Slurm + munge, shellcheck, numactl), then pdtool itself with pip.
#   scripts/install.sh          runtime: pdtool + the reference CPU engine + `pdtool bench`
#   scripts/install.sh --test   also the test tools
set -euo pipefail
cd "$(dirname "$0")/.."

extras="engine,load"
[[ "${1:-}" == "--test" ]] && extras="engine,load,test,sglang-cpu"

apt_pkgs=(gcc libfabric-dev libfabric-bin slurm-wlm munge shellcheck numactl procps)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check -e ".[${extras}]"

# tests parse rendered launch lines with SGLang's own parsers: pinned, without their CUDA deps
if [[ "${1:-}" == "--test" ]]; then
  python3 -m pip install -q --disable-pip-version-check --no-deps sglang==0.5.23 sglang-router==0.3.2
fi
