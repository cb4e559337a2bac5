#!/usr/bin/env bash
# Installs what pdtool needs on a fresh Debian machine (run as root): system packages, then
# pdtool itself with pip.
#   scripts/install.sh          runtime: pdtool, the reference CPU engine, SGLang 0.5.23 with
#                               sglang-router (its CPU engine serves here), `pdtool bench`
#   scripts/install.sh --test   also the test tools, Slurm + munge (the tests start an emulated
#                               cluster), shellcheck, and SGLang's own mooncake and nixl backends
# Slurm and munge are installed only with --test: a login node keeps its site's Slurm.
set -euo pipefail
cd "$(dirname "$0")/.."

test_mode=0
[[ "${1:-}" == "--test" ]] && test_mode=1

extras="engine,load,sglang-cpu"
apt_pkgs=(gcc libfabric-dev libfabric-bin numactl procps)
if ((test_mode)); then
  extras="$extras,test"
  apt_pkgs+=(slurm-wlm munge shellcheck)
fi

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

pip=(python3 -m pip install -q --disable-pip-version-check)
"${pip[@]}" -e ".[${extras}]"
# SGLang and its router pinned, without their CUDA dependency sets (the sglang-cpu extra holds
# what their CPU path imports: docs/sglang.md)
"${pip[@]}" --no-deps sglang==0.5.23 sglang-router==0.3.2
