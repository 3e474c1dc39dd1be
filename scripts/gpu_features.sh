#!/usr/bin/env bash
# GPU calls of the feature-store work (issue 16).  Logs and results go under $OUT (logs packed in logs.tgz).
#
#   scripts/gpu_features.sh call1   # GPU tests of memory/unified_tensor/features/loaders/examples (+ nn/ops/
#                                   # sampling/apps), B1, products B2 with the store ways, a scaled papers probe
#   scripts/gpu_features.sh call2   # the papers shape: resident vs unified vs GPU cache vs host+disk
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; L="$OUT/logs"; mkdir -p "$L"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD" DATAPATH_RESULTS="$OUT"
stage="${1:-call1}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  df -h . /tmp /dev/shm; free -g; nproc; uname -r
  python3 -c "import torch, cupy, numpy; print('torch', torch.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
  python3 -c "from datapath.features import native_aio_available as a; print('native aio:', a() or 'ok')"
} > "$L/machine.txt" 2>&1
cat "$L/machine.txt"
T0=$SECONDS
run_bench() {  # timeout name args...
  local t=$1 name=$2; shift 2
  echo "== $name $* (t=$((SECONDS - T0)) s)"
  timeout "$t" python3 "benchmarks/$name.py" "$@" > "$L/bench_${name}_$#.log" 2>&1
  echo "$name rc=$?"; tail -"${TAIL:-22}" "$L/bench_${name}_$#.log"
}
if [ "$stage" = call1 ]; then
  timeout "${T_TESTS:-170}" python3 -m pytest -q -p no:cacheprovider --maxfail=15 -m gpu tests/memory tests/features \
    tests/unified_tensor tests/loaders tests/examples > "$L/gpu_tests.log" 2>&1
  echo "gpu tests (mine) rc=$? (t=$((SECONDS - T0)) s)"; tail -2 "$L/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests.log" | head -20
  timeout "${T_OTHER:-70}" python3 -m pytest -q -p no:cacheprovider --maxfail=10 -m gpu tests/nn tests/ops tests/sampling \
    tests/apps/test_train_gnn_cli.py > "$L/gpu_tests_other.log" 2>&1
  echo "gpu tests (nn/ops/sampling/apps) rc=$? (t=$((SECONDS - T0)) s)"; tail -2 "$L/gpu_tests_other.log"
  grep -E "^(FAILED|ERROR)" "$L/gpu_tests_other.log" | head -10
  run_bench 190 gather
  run_bench 150 gnn_epoch --datasets products --models sage --ways datapath,datapath_cache,gpu_resident,datapath_disk \
    --name gnn_epoch --disk-dir "$PWD/bench-disk"
  run_bench 120 gnn_epoch --datasets papers --papers-feature-gb 6 --models sage \
    --ways datapath,datapath_cache,gpu_resident,datapath_disk --rounds 1 --batches 20 --warmup 3 --eval-nodes 1024 \
    --profile-batches 2 --disk-batches 10 --verify-batches 3 --name gnn_epoch_papers_probe --disk-dir "$PWD/bench-disk"
  mv "$OUT"/gnn_epoch_papers_probe.* "$L"/ 2>/dev/null
fi
if [ "$stage" = call2 ]; then
  timeout "${T_TESTS:-60}" python3 -m pytest -q -p no:cacheprovider --maxfail=10 -m gpu tests/memory tests/features \
    > "$L/gpu_tests.log" 2>&1
  echo "gpu tests (memory, features) rc=$? (t=$((SECONDS - T0)) s)"; tail -2 "$L/gpu_tests.log"
  grep -E "^(FAILED|ERROR)" "$L/gpu_tests.log" | head -20
  run_bench "${T_GATHER:-150}" gather
  run_bench "${T_PAPERS:-400}" gnn_epoch --datasets papers --models sage \
    --ways datapath,datapath_cache,gpu_resident,datapath_disk --rounds 3 --batches 100 --warmup 3 --eval-nodes 1024 \
    --profile-batches 2 --disk-batches "${DISK_BATCHES:-15}" --verify-batches 3 --name gnn_epoch_papers \
    --disk-dir "$PWD/bench-disk"
fi
rm -rf "$PWD/bench-disk"
echo "total $((SECONDS - T0)) s"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
