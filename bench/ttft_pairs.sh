#!/usr/bin/env bash
# TTFT added by disaggregation on two trees, run alternately so both see the same load:
#
#   bash bench/ttft_pairs.sh BEFORE_TREE AFTER_TREE ISL REQUESTS PAIRS [OUT_DIR]
#
# Each run is `pdtool bench +recipe=tiny-local --launch --compare aggregated --concurrency 1
# --osl 1` from that tree (its own checkout and built binding, on PYTHONPATH), and prints the
# median per-prompt difference (`ttft_added_ms` of results.json) with the time and the load.
set -euo pipefail
before=$(realpath "$1"); after=$(realpath "$2"); isl=$3; n=$4; pairs=$5
out=${6:-$(mktemp -d /tmp/ttft-pairs.XXXXXX)}
mkdir -p "$out"
for i in $(seq 1 "$pairs"); do
  for tree in "$before" "$after"; do
    run="$out/$(basename "$tree")-$isl-$i"
    load0=$(cut -d' ' -f1 /proc/loadavg); t0=$(date -u +%H:%M:%S)
    (cd "$tree" && PYTHONPATH="$tree" timeout 1800 python3 -c \
      'import sys; from pdtool.cli import main; sys.exit(main())' bench +recipe=tiny-local \
      --launch --compare aggregated --concurrency 1 --requests "$n" --isl "$isl" --osl 1 \
      --rounds "$n" --out "$run" > "$run.log" 2>&1) || echo "run failed: $run.log"
    load1=$(cut -d' ' -f1 /proc/loadavg)
    python3 - "$run" "$tree" "$isl" "$t0" "$load0" "$load1" <<'PY'
import glob, json, sys
run, tree, isl, t0, l0, l1 = sys.argv[1:]
found = glob.glob(run + "/**/results.json", recursive=True)
if not found:
    sys.exit(print(f"{tree} isl {isl}: no results.json"))
r = json.load(open(found[0]))
stack, added = [r], None
while stack and added is None:
    d = stack.pop()
    if isinstance(d, dict):
        added = d.get("ttft_added_ms")
        stack += list(d.values())
    elif isinstance(d, list):
        stack += d
if not added:
    sys.exit(print(f"{tree} isl {isl}: no ttft_added_ms"))
print(f"{tree} isl {isl} {t0} UTC load {l0}-{l1}: added p50 {added['p50']:+.2f} ms "
      f"({added['relative_p50'] * 100:+.1f} % of aggregated p50 "
      f"{added['baseline_ttft_p50_ms']:.1f} ms), {added['pairs']} pairs")
PY
  done
done
