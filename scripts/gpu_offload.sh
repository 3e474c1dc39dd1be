#!/usr/bin/env bash
# The offload helper's GPU calls (issue 15).  Everything lands under $OUT (logs packed into one tgz).
#   scripts/gpu_offload.sh dev     budget/compile GPU tests, where a datapath-all step's time goes, a short B4
#   scripts/gpu_offload.sh final   B4, every peer, repeats trimmed to fit one call (B4_ARGS, B4_TIMEOUT override)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
L="$OUT/logs"
mkdir -p "$L"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DATAPATH_RESULTS="$OUT"
T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
tests() {  # timeout pytest-args...
  local t=$1; shift
  timeout "$t" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu "$@" > "$L/tests.log" 2>&1
  echo "tests rc=$? ($((SECONDS - T0)) s)"; grep -E "^(FAILED|ERROR)|passed|failed" "$L/tests.log" | tail -n 25
}
case "${1:-dev}" in
  dev)
    tests 230 tests/offload/test_offload_models_gpu.py -k "budget or compiled or floor or gpt2"
    timeout 100 python3 scripts/gpu_offload_compiled.py > "$L/compiled.log" 2>&1
    echo "compiled rc=$? ($((SECONDS - T0)) s)"; grep -E "^step|budget" "$L/compiled.log" | cut -c1-400 | head -n 30
    timeout 170 python3 benchmarks/offload.py --models llama,gpt2 --methods keep,checkpoint,save_on_cpu,datapath-all,datapath-budget \
      --steps 3 --warmup 1 --time-budget 80 > "$L/b4.log" 2>&1
    echo "b4 rc=$? ($((SECONDS - T0)) s)"; grep -E "^  (llama|gpt2)" "$L/b4.log" | cut -c1-200
    python3 - "$OUT/offload.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if r.get("method") == "datapath-budget":
        print(r["model"], round(r["budget_gb"], 2), r.get("step_ms"), r.get("peak_gb"), r.get("step_peaks_gb"),
              {k: r["plan"][k] for k in ("cut_segment", "recompute", "offload_bytes", "predicted_time")} if r.get("plan") else None)
    elif r.get("method") == "datapath-all":
        print(r["model"], "all", r.get("step_ms"), r.get("peak_gb"), r.get("write_GBps"), r.get("read_GBps"),
              r.get("store_wait_s"), r.get("unpack_wait_s"), r.get("offloaded_gb_per_step"))
PY
    ;;
  final)
    # B4 alone, every peer; repeats trimmed to fit the call (median of --steps after --warmup)
    timeout "${B4_TIMEOUT:-320}" python3 benchmarks/offload.py ${B4_ARGS:---steps 3 --warmup 1 --time-budget 120} \
      > "$L/b4.log" 2>&1
    echo "b4 rc=$? ($((SECONDS - T0)) s)"; grep -E "^  (llama|gpt2|gpt-h8192)" "$L/b4.log" | cut -c1-200
    tail -n 45 "$L/b4.log" | grep -v "^  (llama|gpt2|gpt-h8192)"
    ;;
esac
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "total $((SECONDS - T0)) s"
