#!/usr/bin/env bash
# The features helper's GPU call for issue 16's disk bar: the superbatch GPU tests, then the papers-shape disk
# epoch (whole epoch, every batch's rows checked) beside a whole GPU-resident epoch.
#
#   scripts/gpu_features_superbatch.sh dev     # papers shape at 10 GiB of features (1/4): checks the path (~2 min)
#   scripts/gpu_features_superbatch.sh final   # papers shape, 40 GiB: gnn_epoch_papers.json (gpu_resident and
#                                              # datapath_disk; ~7 min)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD" DATAPATH_RESULTS="$OUT"
T0=$SECONDS
mode="${1:-dev}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h "$PWD" | tail -n 1; free -g | head -n 2
if [ "$mode" = dev ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/features/test_superbatch_gpu.py \
    tests/features/test_feature_store_gpu.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? ($((SECONDS - T0)) s)"; tail -n 3 "$OUT/gpu_tests.log"
  args=(--datasets papers --papers-feature-gb 10 --models sage --ways gpu_resident,datapath_disk --rounds 1
        --batches 30 --warmup 2 --eval-nodes 1024 --profile-batches 1 --verify-batches 1 --disk-full-epoch
        --name gnn_epoch_papers_dev)
  limit=300
else
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/features/test_superbatch_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? ($((SECONDS - T0)) s)"; tail -n 3 "$OUT/gpu_tests.log"
  args=(--datasets papers --models sage --ways gpu_resident,datapath_disk --rounds 1 --batches 100 --warmup 3
        --eval-nodes 1024 --profile-batches 1 --verify-batches 1 --disk-full-epoch --name gnn_epoch_papers)
  limit="${FINAL_LIMIT:-540}"
fi
echo "== gnn_epoch ${args[*]} ($((SECONDS - T0)) s)"
timeout "$limit" python3 benchmarks/gnn_epoch.py "${args[@]}" --disk-dir "$PWD/bench-disk" > "$OUT/bench.log" 2>&1
echo "gnn_epoch rc=$? ($((SECONDS - T0)) s)"
rm -rf "$PWD/bench-disk"
grep -vE "^INFO datapath.features.superbatch" "$OUT/bench.log" | tail -n 30
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/gnn_epoch_papers*.json"):
    d = json.load(open(f))
    for r in d.get("records", []):
        keep = {k: r.get(k) for k in ("features_on", "epoch_s", "resident_epoch_s", "batches_timed", "batches_per_epoch",
                                      "hit_rate", "rows_match", "rows_checked", "disk_read_GBps", "disk_useful_GBps",
                                      "disk_probe_GBps", "host_memory_gb", "staging_gb", "superbatch_modes")}
        print(json.dumps(keep))
    for r in d.get("results", []):
        for s in r.get("superbatches", [])[:30]:
            print("  sb", json.dumps(s))
PY
echo "total $((SECONDS - T0)) s"
