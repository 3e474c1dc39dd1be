#!/usr/bin/env bash
# GPU check: installs what the GPU machine lacks, runs the GPU tests and the
# benchmarks, and writes every log and result under $OUT (default ./out).
#
#   scripts/gpu_check.sh [--tests "PATHS"] [--bench "NAME ARGS"]... [--no-tests]
#
# Examples:
#   scripts/gpu_check.sh                                  # all GPU tests, no benchmarks
#   scripts/gpu_check.sh --tests tests/unified_tensor --bench "gather --quick"
#   scripts/gpu_check.sh --no-tests --bench gather --bench "offload --quick"
#
# Wheels that the machine cannot download (kvikio) are installed from ./.whl when
# that folder exists (see README, "GPU machine").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

tests="tests"
run_tests=1
benches=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) tests="$2"; shift 2 ;;
    --no-tests) run_tests=0; shift ;;
    --bench) benches+=("$2"); shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"

python3 -m datapath.cli info | tee "$OUT/info.txt"
python3 -m datapath.cli info --json > "$OUT/info.json" 2>/dev/null

status=0
if [ "$run_tests" = 1 ]; then
  # shellcheck disable=SC2086
  python3 -m pytest $tests -m gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
export DATAPATH_RESULTS="$OUT"
for b in "${benches[@]}"; do
  name="${b%% *}"
  args=""
  [ "$name" != "$b" ] && args="${b#* }"
  echo "== benchmark $name $args"
  # shellcheck disable=SC2086
  python3 "benchmarks/$name.py" $args 2>&1 | tee "$OUT/bench_$name.log" || status=1
done
exit "$status"
