#!/usr/bin/env bash
# Issue 18 (features sharded over nodes) on a machine with 2 GPUs (nvidia-h200-x2): the suites of the one GPU
# script, scripts/gpu_check.sh, that this work needs.  Logs and results under $OUT.
#
#   scripts/gpu_multi_node.sh call1   # the sharded store's GPU tests (NCCL, two torchrun nodes with one GPU each)
#                                     # + B5 on products: 1 GPU vs 2 nodes (multi_node_products.json)
#   scripts/gpu_multi_node.sh call2   # B5 on the papers shape (multi_node_papers.json)
#
# Then, here:  PYTHONPATH=src:. python benchmarks/multi_node.py --merge OUT1/multi_node_products.json \
#                OUT2/multi_node_papers.json      # -> benchmarks/results/multi_node.json and multi_node.png
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-call1}" in
  call1) exec scripts/gpu_check.sh --no-tests --suite b5 ;;
  call2) exec scripts/gpu_check.sh --no-tests --suite b5-papers ;;
  *) echo "usage: $0 call1|call2" >&2; exit 2 ;;
esac
