#!/usr/bin/env bash
# The offload tests that need two GPUs, for the lead's 2-GPU machine (nvidia-h200-x2):
#   FSDP2 fully_shard of a Hugging Face Llama within a memory budget, DDP/FSDP/FSDP2 per-rank offloading,
#   megatron-core GPTModel (local layer spec) with tensor parallelism 2 through Megatron's own schedule
#   (and TP1 on one GPU).  Needs the megatron-core wheel in .whl/ (pip download --no-deps megatron-core==0.16.1).
# Usage (device tool, carry [".whl"]):  bash scripts/gpu_offload_2gpu.sh      logs: $OUT/offload_2gpu.log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-offload \
    .whl/megatron_core-*.whl >/dev/null 2>&1 || echo "megatron-core wheel did not install"
fi
export PYTHONPATH="$PWD/src:$PWD:/tmp/site-offload${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; print('GPUs:', torch.cuda.device_count(), torch.cuda.get_device_name())"
timeout "${T_TESTS:-500}" python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
  tests/offload/test_offload_parallel_gpu.py tests/offload/test_offload_distributed.py > "$OUT/offload_2gpu.log" 2>&1
rc=$?
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/offload_2gpu.log" | tail -20
exit $rc
