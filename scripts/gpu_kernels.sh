#!/usr/bin/env bash
# The aggregation kernels' GPU session (issue 17): GPU tests, then benchmarks; logs and results under $OUT.
#   scripts/gpu_kernels.sh check   correctness of every kernel + a timing sweep of every candidate (model fitting)
#   scripts/gpu_kernels.sh profile  GPU tests + host/kernel profile + the parts not yet run (fused, layers, reorder)
#   scripts/gpu_kernels.sh final   GPU tests + the full B3 (benchmarks/aggregate.py) + benchmarks/full_graph.py
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kernels-out}
mkdir -p "$OUT/results"
export DATAPATH_RESULTS=$OUT/results
MODE=${1:-check}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 | tail -n 1
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
if [[ $MODE == check ]]; then
  step tests
  timeout 200 python -m pytest -q -rf -p no:cacheprovider tests/ops tests/nn tests/graph > "$OUT/tests.log" 2>&1
  echo "pytest rc=$?"; tail -n 25 "$OUT/tests.log"
  step aggregate
  timeout 170 python benchmarks/aggregate.py --candidates --parts fixed,spmm,fused --repeat 3 \
    --graphs citeseer,ppi,amazon0505,soc-BlogCatalog --dtypes float32,bfloat16 > "$OUT/bench.log" 2>&1
  echo "aggregate rc=$?"
  step full_graph
  timeout 50 python benchmarks/full_graph.py --graphs citeseer,ppi,amazon0505 --epochs 5 > "$OUT/full.log" 2>&1
  echo "full_graph rc=$?"; tail -n 12 "$OUT/full.log"
  tail -n 60 "$OUT/bench.log"
elif [[ $MODE == profile ]]; then
  step tests
  timeout 150 python -m pytest -q -rf -p no:cacheprovider tests/ops tests/nn tests/graph > "$OUT/tests.log" 2>&1
  echo "pytest rc=$?"; grep -E "FAILED|passed|failed" "$OUT/tests.log" | tail -n 15
  step profile
  timeout 120 python scripts/profile_aggregate.py --out /tmp > "$OUT/profile.log" 2>&1
  cp /tmp/profile.json "$OUT/" 2>/dev/null
  echo "profile rc=$?"
  step aggregate
  timeout 120 python benchmarks/aggregate.py --parts fixed,fused,layers,reorder --repeat 3 \
    --graphs citeseer,soc-BlogCatalog,artist,amazon0505 --dtypes float32 > "$OUT/bench.log" 2>&1
  echo "aggregate rc=$?"
  step full_graph
  timeout 40 python benchmarks/full_graph.py --graphs citeseer,cora,pubmed --epochs 5 > "$OUT/full.log" 2>&1
  echo "full_graph rc=$?"; tail -n 12 "$OUT/full.log"
  mv "$OUT/results/"*.png /tmp/ 2>/dev/null
  grep -E "^host:|^  [a-zA-Z]" "$OUT/profile.log" | head -n 40
  grep -E "fused_|/|layer|reorder|fixed" "$OUT/bench.log" | tail -n 40
else
  step tests
  timeout 150 python -m pytest -q -rf -p no:cacheprovider tests/ops tests/nn tests/graph > "$OUT/tests.log" 2>&1
  echo "pytest rc=$?"; grep -E "FAILED|passed|failed" "$OUT/tests.log" | tail -n 12
  step aggregate
  timeout 260 python benchmarks/aggregate.py --repeat 5 > "$OUT/bench.log" 2>&1
  echo "aggregate rc=$?"
  step full_graph
  timeout 120 python benchmarks/full_graph.py > "$OUT/full.log" 2>&1
  echo "full_graph rc=$?"; tail -n 30 "$OUT/full.log"; tail -n 60 "$OUT/bench.log"
fi
step done
