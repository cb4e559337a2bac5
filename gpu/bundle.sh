#!/usr/bin/env bash
# What gpu/check.sh needs on a GPU node without network, downloaded here (apt and pip
# reachable): Debian bookworm's libfabric 1.17 with the libraries it loads (gpu/debs/), and
# cffi, pycparser and setuptools wheels for every CPython the node may run (gpu/wheels/). The
# versions are pinned, so two runs give the same files; both folders are git-ignored and
# travel with the checkout (about 5 MB of the 64 MiB a device run carries).
#
#   gpu/bundle.sh            # then: the device run carries gpu/debs and gpu/wheels
set -euo pipefail
cd "$(dirname "$0")"
DEBS=(libfabric1=1.17.0-3 libfabric-dev=1.17.0-3 ibverbs-providers libibverbs1 librdmacm1
      libpsm-infinipath1 libpsm2-2 libnuma1 libnl-3-200 libnl-route-3-200 libatomic1)
WHEELS=(cffi==2.1.1 pycparser==2.23 setuptools==80.9.0)
PYTHONS=(3.10 3.11 3.12 3.13)

rm -rf debs wheels
mkdir -p debs wheels
(cd debs && apt-get download "${DEBS[@]}")
for v in "${PYTHONS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$v" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d wheels "${WHEELS[@]}"
done
du -sh debs wheels
