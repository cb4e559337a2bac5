#!/usr/bin/env bash
# GPU check of the transfer layer on one GPU node without network (e.g. one H200):
#   - builds the libfabric binding there from Debian's libfabric 1.17 (.deb files carried along),
#   - moves KV pages in CUDA memory between two processes over shm on the staged path,
#     byte-exact and counted, with GB/s next to device->device and device->host->device copies,
#   - confirms transfer.gpu_memory=direct is refused with its clear message (no CUDA in
#     Debian's libfabric),
#   - the reference engine's GPU path (gpu/check_reference.py): FlashInfer's paged decode
#     (kv_layout=HND) on pages transferred over shm against the torch reference, the progress
#     word written by the GPU stream under CUDA-graph replay (layer 0's writes issued before the
#     last layer ends), and a one-GPU disaggregated deployment of a tiny checkpoint token for
#     token against transformers.
# Meant to finish under 8 minutes on one H200: the staged check moves about 1 GiB per run (3
# runs); FlashInfer compiles its decode kernel once with the node's nvcc (a minute or two, then
# cached in ~/.cache/flashinfer). Nothing of it has run on a GPU yet.
#
# Prepare once, on a Debian 12 (bookworm) machine with network, from the repository root:
#   mkdir -p gpu/debs && (cd gpu/debs && apt-get download libfabric1 libfabric-dev \
#       ibverbs-providers libibverbs1 librdmacm1 libpsm-infinipath1 libpsm2-2 libnuma1 \
#       libnl-3-200 libnl-route-3-200 libatomic1)
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d gpu/wheels \
#       cffi pycparser setuptools numpy
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d gpu/wheels/reference \
#       transformers tokenizers safetensors huggingface-hub regex pyyaml tqdm filelock \
#       packaging requests
# (gpu/debs and gpu/wheels are git-ignored; carry them to the node with the checkout.) The
# wheels are installed (into a scratch directory, never the node's Python) only where the
# node's python3 lacks cffi/setuptools/numpy, or (gpu/wheels/reference) transformers,
# tokenizers and safetensors. FlashInfer must already be importable on the node (with its
# dependencies and nvcc): flashinfer-python 0.7.4's wheel alone is 101 MB, over the 64 MiB that
# travels with a checkout, so it is not carried; without it the FlashInfer and deployment
# steps fail naming it.
#
# Usage: gpu/check.sh [--cpu] [staged_check.py options]
#   --cpu  the same build and drivers on CPU tensors (checks everything but the GPU parts:
#          the staged copies, FlashInfer, the graph, the mapped word).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pdtool-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
step() { printf '[%4ds] %s\n' $((SECONDS - START)) "$*"; }

shopt -s nullglob
debs=(gpu/debs/*.deb)
if ((${#debs[@]})); then
    step "unpacking ${#debs[@]} .deb files (dpkg -x)"
    mkdir -p "$WORK/root"
    for deb in "${debs[@]}"; do
        if command -v dpkg >/dev/null; then
            dpkg -x "$deb" "$WORK/root"
        else  # not a Debian-family node: a .deb is an ar archive around data.tar.*
            member=$(ar t "$deb" | grep '^data\.tar')
            ar p "$deb" "$member" | tar -x -C "$WORK/root" \
                "$(case $member in *.xz) echo -J;; *.zst) echo --zstd;; *.gz) echo -z;; esac)"
        fi
    done
    lib=$WORK/root/usr/lib/x86_64-linux-gnu
    # libpsm_infinipath.so.1 is an update-alternatives link, which dpkg -x does not create
    psm=$(ls "$WORK"/root/usr/lib/libpsm1/libpsm_infinipath.so.1.* 2>/dev/null | head -1 || true)
    [[ -n $psm ]] && ln -sf "$psm" "$lib/libpsm_infinipath.so.1"
    export PDTOOL_FABRIC_INCLUDE=$WORK/root/usr/include
    export LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$lib:$WORK/root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
elif [[ ! -f /usr/include/rdma/fabric.h ]]; then
    echo "gpu/check.sh: no gpu/debs/*.deb and no system libfabric headers; see the top of" \
         "this script for the apt-get download line" >&2
    exit 2
else
    step "no gpu/debs: using the system libfabric"
fi

if ! "$PY" -c 'import cffi, setuptools, numpy' 2>/dev/null; then
    wheels=(gpu/wheels/*.whl)
    ((${#wheels[@]})) || { echo "gpu/check.sh: $PY lacks cffi/setuptools/numpy and" \
                               "gpu/wheels/ is empty" >&2; exit 2; }
    step "installing ${#wheels[@]} wheels into a scratch dir"
    "$PY" -m pip install -q --no-index --no-deps --target "$WORK/py" "${wheels[@]}"
    export PYTHONPATH=$WORK/py${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

step "building the libfabric binding (warnings are errors)"
PDTOOL_FABRIC_WERROR=1 "$PY" transfer/_fabric_build.py
so=$(ls transfer/_fabric*.so)
step "built $so; it loads $(ldd "$so" | awk '/libfabric/ {print $3}')"
"$PY" - <<'PY'
from transfer.fabric import available_providers
print("providers:", available_providers())
PY

cpu=()
for a in "$@"; do [[ $a == --cpu ]] && cpu=(--cpu); done
if ! "$PY" -c 'import transformers, tokenizers, safetensors' 2>/dev/null; then
    ref_wheels=(gpu/wheels/reference/*.whl)
    if ((${#ref_wheels[@]})); then
        step "installing ${#ref_wheels[@]} reference-check wheels into a scratch dir"
        "$PY" -m pip install -q --no-index --no-deps --target "$WORK/pyref" "${ref_wheels[@]}"
        export PYTHONPATH=$PYTHONPATH:$WORK/pyref
    fi
fi

step "staged transfer check"
rc=0
"$PY" gpu/staged_check.py --json "$WORK/summary.json" "$@" || rc=$?
step "staged transfer check done (exit $rc)"

step "reference engine GPU check"
ref=0
"$PY" gpu/check_reference.py --json "$WORK/reference.json" "${cpu[@]}" || ref=$?
step "reference engine GPU check done (exit $ref)"
((rc == 0)) && rc=$ref
step "done (exit $rc)"
exit $rc
