#!/usr/bin/env bash
# GPU calls of the sharded feature store (issue 18), for a machine with 2 GPUs (nvidia-h200-x2).
# Logs and results go under $OUT (logs packed in logs.tgz); the JSON/PNG results are written there too
# (copy multi_node.json/png into benchmarks/results/ when they are the run of record).
#
#   scripts/gpu_multi_node.sh call1   # machine facts (GPU link), GPU tests (sharded store, two torchrun nodes with
#                                     # NCCL, the feature store/loader/DDP GPU tests beside them), products benchmark
#   scripts/gpu_multi_node.sh call2   # the papers-shaped graph (PAPERS_GB of host memory, default 6)
#
# Then, here: PYTHONPATH=src:. python benchmarks/multi_node.py --merge OUT1/multi_node_products.json \
#   OUT2/multi_node_papers.json   # -> benchmarks/results/multi_node.json and .png (the records of both calls)
#
# Run from the repository root (or .gpu/<name>), e.g.
#   cd .gpu/dist && export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 && scripts/gpu_multi_node.sh call1
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; L="$OUT/logs"; mkdir -p "$L"
# NVLink multicast stays off on the shared multi-GPU hosts (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD" DATAPATH_RESULTS="$OUT"
DATA="${DATA:-$PWD/bench-multi-node}"
stage="${1:-call1}"
{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  nvidia-smi topo -m
  df -h . /tmp /dev/shm; free -g; nproc; uname -r
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} > "$L/machine.txt" 2>&1
cat "$L/machine.txt"
T0=$SECONDS
bench() {  # timeout args...
  local t=$1; shift
  echo "== multi_node $* (t=$((SECONDS - T0)) s)"
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT timeout "$t" python3 benchmarks/multi_node.py --data-dir "$DATA" "$@" \
    > "$L/bench_$stage.log" 2>&1
  echo "multi_node rc=$?"; grep -v "NCCL INFO" "$L/bench_$stage.log" | tail -"${TAIL:-24}"
}
if [ "$stage" = call1 ]; then
  timeout "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider --maxfail=10 -m gpu \
    tests/features/test_sharded_gpu.py tests/apps/test_multi_node.py > "$L/gpu_tests_sharded.log" 2>&1
  echo "gpu tests (sharded) rc=$? (t=$((SECONDS - T0)) s)"; tail -2 "$L/gpu_tests_sharded.log"
  grep -E "^(FAILED|ERROR)" "$L/gpu_tests_sharded.log" | head -10
  timeout "${T_OTHER:-120}" python3 -m pytest -q -p no:cacheprovider --maxfail=10 -m gpu tests/features \
    tests/loaders tests/apps/test_distributed.py --ignore=tests/features/test_sharded_gpu.py \
    > "$L/gpu_tests_other.log" 2>&1
  echo "gpu tests (store, loaders, DDP) rc=$? (t=$((SECONDS - T0)) s)"; tail -2 "$L/gpu_tests_other.log"
  grep -E "^(FAILED|ERROR)" "$L/gpu_tests_other.log" | head -10
  bench "${T_PRODUCTS:-300}" --datasets products --caches "none,own:50%" --name multi_node_products
fi
if [ "$stage" = call2 ]; then
  bench "${T_PAPERS:-560}" --datasets papers --papers-gb "${PAPERS_GB:-6}" --caches "none,own:25%" \
    --name multi_node_papers
fi
rm -rf "$DATA"
echo "total $((SECONDS - T0)) s"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
