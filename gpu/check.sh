#!/usr/bin/env bash
# The GPU check: one GPU node without network (a lent H100 or H200 with PyTorch and nvcc, no
# libfabric, no SGLang). Builds the libfabric binding there from Debian's libfabric 1.17 (the
# .deb files `gpu/bundle.sh` downloads here, carried with the checkout), then runs the steps of
# gpu/check.py, each in its own process under its own timeout (their sum, 7.5 minutes, plus the
# build keeps the run under 8), writing OUT/summary.json after every step: a timeout or a
# machine taken back mid-run still leaves the results so far.
#
#   gpu/check.sh [--cpu] [--out DIR] [check.py options]
#
#   --cpu   every step that runs without a GPU (CI runs this: tests/test_gpu_check.py); the
#           GPU-only steps are listed as not run
#   --out   where summary.json, each step's JSON and build.log go (default: $OUT when set,
#           else gpu/out); never deleted by this script
#
# Prepare once, on a machine with network (Debian/Ubuntu with apt, and pip): gpu/bundle.sh
# writes gpu/debs/ and gpu/wheels/ (git-ignored, about 5 MB: carry them with the checkout).
# Nothing is installed into the node's Python: the wheels go to a scratch directory, and only
# where the node's python3 lacks cffi, pycparser or setuptools. A binding already built and
# importable (CI, after scripts/install.sh) is used as it is, never rebuilt under a running
# test.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUTDIR=${OUT:-$ROOT/gpu/out}
pass=()
while (($#)); do
    case $1 in
        --out) OUTDIR=$2; shift 2 ;;
        --out=*) OUTDIR=${1#--out=}; shift ;;
        *) pass+=("$1"); shift ;;
    esac
done
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pdtool-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT  # the scratch only: the summary lives in $OUTDIR
START=$SECONDS
step() { printf '[%4ds] %s\n' $((SECONDS - START)) "$*" | tee -a "$OUTDIR/build.log"; }
: > "$OUTDIR/build.log"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

if "$PY" -c 'import transfer.fabric as f; f.available_providers()' 2>/dev/null; then
    step "the libfabric binding is built and loads: using it"
else
    shopt -s nullglob
    debs=(gpu/debs/*.deb)
    if ((${#debs[@]})); then
        step "unpacking ${#debs[@]} .deb files"
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
        step "no gpu/debs/*.deb and no system libfabric headers: run gpu/bundle.sh where there" \
             "is network and carry gpu/debs and gpu/wheels"
        exit 2
    fi
    if ! "$PY" -c 'import cffi, pycparser, setuptools' 2>/dev/null; then
        step "installing cffi, pycparser and setuptools from gpu/wheels into a scratch dir"
        "$PY" -m pip install -q --no-index --find-links gpu/wheels --target "$WORK/py" \
            cffi pycparser setuptools >>"$OUTDIR/build.log" 2>&1 || {
            step "no wheels in gpu/wheels for $("$PY" -V): run gpu/bundle.sh"; exit 2; }
        export PYTHONPATH=$PYTHONPATH:$WORK/py
    fi
    step "building the libfabric binding"
    "$PY" transfer/_fabric_build.py >>"$OUTDIR/build.log" 2>&1 || {
        step "the build failed: see $OUTDIR/build.log"; exit 2; }
fi
"$PY" -c 'from transfer.fabric import available_providers as a; print("providers:", a())' \
    | tee -a "$OUTDIR/build.log"
step "running the steps (gpu/check.py ${pass[*]})"
rc=0
"$PY" gpu/check.py --out "$OUTDIR" "${pass[@]}" || rc=$?
step "done (exit $rc): $OUTDIR/summary.json"
exit $rc
