#!/usr/bin/env bash
# One GPU-machine call: every GPU test, then the B4 offload, B2 epoch and ROK benchmarks.
# Logs are packed into $OUT/logs.tgz (the device tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DATAPATH_RESULTS="$OUT"
L="$OUT/logs"
python3 -m datapath.cli info > "$L/info.txt" 2>&1
timeout "${T_TESTS:-170}" python3 -m pytest tests -m gpu -q -p no:cacheprovider ${PYTEST_EXTRA:-} > "$L/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$L/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests.log" | head -30
run_bench() {  # name timeout args...
  local name=$1 t=$2; shift 2
  echo "== $name $*"
  timeout "$t" python3 "benchmarks/$name.py" "$@" > "$L/bench_$name.log" 2>&1
  echo "$name rc=$?"; tail -"${TAIL:-25}" "$L/bench_$name.log"
}
[ -n "${NO_OFFLOAD:-}" ] || run_bench offload "${T_OFFLOAD:-170}" --time-budget 140
[ -n "${NO_GNN:-}" ] || run_bench gnn_epoch "${T_GNN:-80}"
[ -n "${NO_ROK:-}" ] || run_bench rok "${T_ROK:-150}"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
