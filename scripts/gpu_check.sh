#!/usr/bin/env bash
# The one GPU-machine script: installs what the machine lacks (wheels in ./.whl), runs GPU tests and benchmark
# suites, and writes every log and result under $OUT (logs packed into $OUT/logs.tgz: the device tool returns at
# most 8 files).  Each suite is what one device call should do; run several in one call when time allows.
#
#   scripts/gpu_check.sh [--tests "PATHS"] [--no-tests] [--suite NAME]... [--bench "NAME ARGS"]...
#
# Suites (the commands behind the committed results in benchmarks/results/):
#   b1        B1 gather                          benchmarks/gather.py                        (~3 min)
#   b2        B2 products epoch, store ways      benchmarks/gnn_epoch.py --datasets products (~2.5 min)
#   b2-papers B2 papers shape, cache and disk    benchmarks/gnn_epoch.py --datasets papers   (~7 min, 40 GiB data)
#   b2-disk   B2 papers shape, a WHOLE disk-tier epoch (superbatches; every batch's rows checked) beside a whole
#             GPU-resident epoch, after the superbatch GPU tests       (9 min: the committed run took 540 s)
#   b2-disk-quarter  the same at a quarter of the papers feature bytes (10 GiB)            (~2.5 min)
#   b3        B3 aggregation + full-graph models benchmarks/aggregate.py, full_graph.py      (~6.5 min)
#   b4        B4 offloading on real models       benchmarks/offload.py          (~11 min for all three models)
#             (B4_ARGS / B4_TIMEOUT override; the committed runs, two calls merged with `offload.py --merge`:
#             B4_TIMEOUT=575 B4_ARGS="--models llama,gpt2 --steps 7 --warmup 2 --time-budget 265" (390 s) and
#             B4_TIMEOUT=420 B4_ARGS="--models gpt-h8192 --steps 5 --warmup 2 --time-budget 330 --datapath-compile both"
#             (250 s): eager and compiled datapath, the faster counts)
#   b6-lora88k B6 LoRA on the Llama-3-8B shape at 88K (checkpointing's longest on an 80 GB H100): checkpointing
#             against memory_budget 82.9 GB with compile=True     benchmarks/offload_scale.py (~7 min; one call)
#   b6-fsdp2  B6 FSDP2 (2 GPUs): the 8B shape at 8K, every peer that runs there (keep, checkpointing eager,
#             selective and with compiled layers, compile's activation_memory_budget 0.5/0.25/0.1) and memory_budget
#             at checkpointing's peak with compile=True (30 warm-up steps: its trials run 2 steps a plan where the
#             ranks agree, compiled blocks partitioned among them)  benchmarks/offload_scale.py --mode fsdp2 (~5 min)
#   rok       ROK curve                          benchmarks/rok.py                           (~2.5 min)
#   fuzz      differential kernel fuzz           benchmarks/kernel_fuzz.py: 10,000 cases, then 520 under
#             compute-sanitizer memcheck and 48 under racecheck (~4.5 min; FUZZ_ARGS / T_FUZZ override); then
#             120 cases of the offload fuzz on the GPU (python -m datapath.testing.fuzz_offload; T_OFFLOAD_FUZZ)
#   two-gpu   the tests that need 2 GPUs (offload FSDP2/DDP/Megatron TP2, data-parallel loaders, sharded store,
#             two torchrun nodes)                                     (nvidia-h200-x2 only; ~4 min with tests/features)
#   b5        B5 features sharded over 2 nodes: its GPU tests, then products 1 GPU vs 2 torchrun nodes
#             benchmarks/multi_node.py --datasets products, then benchmarks/multi_gpu.py --gpus 2 (one shared host
#             copy)  (a 2-GPU kind; T_B5_TESTS, T_B5, T_B5_RUN, T_B5_SHM: timeouts; tests ~70 s, the bench 135 s; the
#             committed multi_node.json: --no-tests --bench "multi_node --datasets products --caches none,own:50%
#             --name multi_node_products --data-dir bench-disk --timeout 80", then multi_node.py --merge)
#   (scripts/gpu_fsdp2_diag.py: an FSDP2 step's memory at every layer boundary, keep vs offloaded; 2 GPUs, ~40 s)
#   hetero    relational layers vs PyG + R-GAT igbh-small epoch, 25% GPU cache vs resident: benchmarks/hetero.py
#             after tests/hetero's GPU tests (~5 min; HETERO_ARGS=--quick for a trial)
#   b5-papers B5 on the papers shape (6 GiB)                               (nvidia-h200-x2 only; ~8 min)
#   b5-hang   how often the strong 2-node products run without a cache hangs (it did once on 2x H100): 3 runs
#             with CUDA's lazy module loading (the default), 3 with CUDA_MODULE_LOADING=EAGER; 2 epochs each, a
#             hung run killed after T_B5_RUN (60) s with its thread stacks in the log     (a 2-GPU kind; ~4-6 min)
#             then here: benchmarks/multi_node.py --merge OUT1/multi_node_products.json OUT2/multi_node_papers.json
#
# Diagnostics (not suites; run one with --bench "NAME ARGS"): benchmarks/gather_probe.py (grids, visit orders,
# launchers of the row gather), kernel_profile.py (aggregation kernels vs cuSPARSE), gnn_trace.py (B2 batches'
# timeline per stream/thread), gnn_pieces.py (a batch's loader and step alone and together, by batch size: what
# strong scaling must shrink; ~2 min), offload_memtrace.py (where B4's activation peak forms).
#
# Examples:
#   scripts/gpu_check.sh                                   # every GPU test, no benchmark (~20 min on an H100:
#                                                          # more than one call allows; run it by directory)
#   scripts/gpu_check.sh --tests tests/offload             # (failures' tracebacks reach the log as they happen)
#   scripts/gpu_check.sh --no-tests --bench "gather_probe --launchers"
#   scripts/gpu_check.sh --tests tests/memory --suite b1
#   scripts/gpu_check.sh --no-tests --suite b4
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
L="$OUT/logs"
mkdir -p "$L"
export PYTHONUNBUFFERED=1 DATAPATH_INSTANT_FAILURES=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$SECONDS

tests="tests"
run_tests=1
suites=()
benches=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) tests="$2"; shift 2 ;;
    --no-tests) run_tests=0; shift ;;
    --suite) suites+=("$2"); shift 2 ;;
    --bench) benches+=("$2"); shift 2 ;;
    *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

if ls .whl/*.whl >/dev/null 2>&1; then  # kvikio (+ libkvikio, rapids-logger, cuda-pathfinder), torchtune (+ torchao),
  # megatron-core: no network there
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export BENCH_RESULTS_DIR="$OUT"

python3 -m datapath.cli info | tee "$L/info.txt"  # also builds the native launcher before anything is timed
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv >> "$L/info.txt" 2>&1

status=0
if [ "$run_tests" = 1 ]; then
  # shellcheck disable=SC2086
  timeout "${T_TESTS:-420}" python3 -m pytest $tests -m gpu -q -rfEs -p no:cacheprovider > "$L/gpu_tests.log" 2>&1
  rc=$?; [ "$rc" = 0 ] || status=1
  echo "gpu tests rc=$rc ($((SECONDS - T0)) s)"; tail -n 2 "$L/gpu_tests.log"
  grep -E "^(FAILED|ERROR)" "$L/gpu_tests.log" | head -n 30
fi

bench() {  # timeout name args...
  local t=$1 name=$2; shift 2
  echo "== $name $* ($((SECONDS - T0)) s)"
  # shellcheck disable=SC2068
  timeout "$t" python3 "benchmarks/$name.py" $@ > "$L/bench_${name}.log" 2>&1
  local rc=$?; [ "$rc" = 0 ] || status=1
  echo "$name rc=$rc"; tail -n "${TAIL:-25}" "$L/bench_${name}.log"
}

for s in "${suites[@]}"; do
  case "$s" in
    b1) bench 330 gather ;;
    b2) bench 170 gnn_epoch --datasets products --models sage --ways datapath,datapath_cache,gpu_resident,datapath_disk \
          --name gnn_epoch_products --disk-dir "$PWD/bench-disk" ;;
    b2-papers) bench 420 gnn_epoch --datasets papers --models sage \
          --ways datapath,datapath_cache,gpu_resident,datapath_disk --rounds 3 --batches 100 --warmup 3 \
          --eval-nodes 1024 --profile-batches 2 --disk-batches 15 --verify-batches 3 --name gnn_epoch_papers \
          --disk-dir "$PWD/bench-disk" ;;
    b2-disk|b2-disk-quarter)
      timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/features/test_superbatch_gpu.py \
        > "$L/superbatch_gpu_tests.log" 2>&1
      rc=$?; [ "$rc" = 0 ] || status=1
      echo "superbatch GPU tests rc=$rc"; tail -n 3 "$L/superbatch_gpu_tests.log"
      if [ "$s" = b2-disk ]; then size=(); name=gnn_epoch_papers_disk; t=540
      else size=(--papers-feature-gb 10); name=gnn_epoch_papers_quarter; t=300; fi
      bench "$t" gnn_epoch --datasets papers "${size[@]}" --models sage --ways gpu_resident,datapath_disk --rounds 1 \
        --batches 100 --warmup 3 --eval-nodes 1024 --profile-batches 1 --verify-batches 1 --disk-full-epoch \
        --name "$name" --disk-dir "$PWD/bench-disk" ;;
    b3) bench 260 aggregate --repeat 5; bench 120 full_graph ;;
    b4) bench "${B4_TIMEOUT:-560}" offload ${B4_ARGS:---time-budget 170} ;;
    b6-lora88k) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench 585 offload_scale --methods \
          checkpoint,datapath-budget --seqs 90112 --timed 90112 --check-seq 0 --datapath-budgets device \
          --datapath-compile --log-plans --steps 1 --warmup 1 --budget-warmup 6 --compile-cost 100 --time-budget 575 \
          --name offload_scale_88k_budget_attn ;;
    b6-fsdp2)  # two GPUs (a 2-GPU kind): two ranks of torchrun
      echo "== offload_scale fsdp2 ($((SECONDS - T0)) s)"
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 575 torchrun --standalone --nproc-per-node 2 \
          benchmarks/offload_scale.py --mode fsdp2 --methods \
          checkpoint,keep,selective_checkpoint,checkpoint_compiled,compile_budget,datapath-budget \
          --compile-budgets 0.5,0.25,0.1 --datapath-budgets checkpoint --datapath-compile --datapath-partition \
          --check-seq 0 --seqs 8192 \
          --timed 8192 --steps 3 --warmup 1 --budget-warmup 30 --time-budget 530 --compile-cost 70 --log-plans \
          --name offload_scale_fsdp2_8k \
          > "$L/bench_offload_scale_fsdp2.log" 2>&1 || status=1
      tail -n 25 "$L/bench_offload_scale_fsdp2.log" ;;
    rok) bench 160 rok ;;
    fuzz) bench "${T_FUZZ:-590}" kernel_fuzz ${FUZZ_ARGS:-}
      # activation offloading on random models and configurations, on the GPU: bit-identical gradients
      timeout "${T_OFFLOAD_FUZZ:-240}" python3 -m datapath.testing.fuzz_offload --device cuda --count 120 \
        > "$L/offload_fuzz.log" 2>&1
      rc=$?; [ "$rc" = 0 ] || status=1
      echo "offload fuzz rc=$rc"; tail -n 3 "$L/offload_fuzz.log" ;;
    two-gpu)
      timeout "${T_TESTS:-500}" python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
        tests/offload/test_offload_parallel_gpu.py tests/offload/test_offload_distributed.py \
        tests/apps/test_distributed.py tests/apps/test_multi_node.py tests/features > "$L/two_gpu_tests.log" 2>&1
      rc=$?; [ "$rc" = 0 ] || status=1
      echo "2-GPU tests rc=$rc"; grep -E "^(FAILED|ERROR)|passed|failed" "$L/two_gpu_tests.log" | tail -n 20 ;;
    b5)
      timeout "${T_B5_TESTS:-150}" python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/features/test_sharded_gpu.py \
        tests/apps/test_multi_node.py > "$L/b5_tests.log" 2>&1
      rc=$?; [ "$rc" = 0 ] || status=1
      echo "B5 GPU tests rc=$rc"; grep -E "^(FAILED|ERROR)|passed|failed" "$L/b5_tests.log" | tail -n 20
      bench "${T_B5:-420}" multi_node --datasets products --caches none,any:25%,own:50% --name multi_node_products \
        --data-dir "$PWD/bench-disk" --timeout "${T_B5_RUN:-120}"
      # the same 2 GPUs as data parallelism over ONE shared host copy (/dev/shm): multi_gpu.json (weak and strong)
      bench "${T_B5_SHM:-120}" multi_gpu --gpus 2 ;;
    hetero)  # relational layers vs PyG, R-GAT epoch with a 25% GPU cache vs resident (issue 41; ~4 min)
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/hetero > "$L/hetero_gpu_tests.log" 2>&1
      rc=$?; [ "$rc" = 0 ] || status=1
      echo "hetero GPU tests rc=$rc"; tail -n 3 "$L/hetero_gpu_tests.log"
      bench "${T_HETERO:-420}" hetero ${HETERO_ARGS:-} ;;
    b5-hang)
      for mode in LAZY EAGER; do
        CUDA_MODULE_LOADING=$mode bench "${T_B5:-230}" multi_node --datasets products --modes strong --caches none \
          --repeat 3 --epochs 2 --name "multi_node_hang_${mode,,}" --data-dir "$PWD/bench-disk" \
          --timeout "${T_B5_RUN:-60}"
        mv "$L/bench_multi_node.log" "$L/bench_multi_node_hang_${mode,,}.log"
      done ;;
    b5-papers) bench 560 multi_node --datasets papers --papers-gb 6 --caches none,own:25% --name multi_node_papers \
        --data-dir "$PWD/bench-disk" ;;
    *) echo "unknown suite: $s" >&2; status=2 ;;
  esac
done
for b in "${benches[@]}"; do
  name="${b%% *}"; args=""; [ "$name" != "$b" ] && args="${b#* }"
  # shellcheck disable=SC2086
  bench "${T_BENCH:-500}" "$name" $args
done
rm -rf "$PWD/bench-disk"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "total $((SECONDS - T0)) s"
exit "$status"
