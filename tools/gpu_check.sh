#!/usr/bin/env bash
# GPU check: the whole test suite (GPU-marked tests included), the demo, then every
# benchmark, on a machine whose python3 already has JAX with CUDA (no network, no installs).
#
#   [STAGES="tests demo bench"] [BENCHMARKS="ssd conv1d attention model"] \
#   [BENCH_TIMEOUT=300] [TESTS_TIMEOUT=3000] tools/gpu_check.sh OUT_DIR [pytest args...]
#
# Writes env.txt, tests.log, demo.log, bench.log and, through benchmarks.run_all, the
# results store results/<device>/<module>.json with its PNG plots under OUT_DIR (copy
# results/ over benchmarks/results/ to commit them).
# Exits non-zero when the tests fail (later stages still run, so one call gives everything).
set -uo pipefail
out=${1:?usage: tools/gpu_check.sh OUT_DIR [pytest args...]}
shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=. JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python=${PYTHON:-python3}
stages=${STAGES:-tests demo bench}
benchmarks=${BENCHMARKS:-ssd conv1d attention model}
bench_timeout=${BENCH_TIMEOUT:-300}
tests_timeout=${TESTS_TIMEOUT:-3000}
status=0

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
} 2>&1 | tee "$out/env.txt"

for stage in $stages; do
  case $stage in
    tests)
      # pytest-timeout is on the GPU image: a hung test fails alone instead of eating the lease.
      timeout "$tests_timeout" $python -m pytest -q -p no:cacheprovider --timeout=240 \
        --durations=15 -rfE "$@" > "$out/tests.log" 2>&1
      status=$?
      tail -n 40 "$out/tests.log"
      ;;
    demo)
      timeout 300 $python -m flax_models.demo > "$out/demo.log" 2>&1
      tail -n 30 "$out/demo.log"
      ;;
    bench)
      # One module per call, so each gets its own time limit. Seeded with the committed
      # store: a module keeps the rows of its earlier file that this run does not re-measure.
      mkdir -p "$out/results"
      cp -rn benchmarks/results/. "$out/results/" 2>/dev/null || true
      for module in $benchmarks; do
        timeout $((bench_timeout + 10)) $python -m benchmarks.run_all --out-dir "$out/results" \
          --modules "$module" --timeout "$bench_timeout" >> "$out/bench.log" 2>&1 \
          || echo "benchmarks.$module failed ($?)" >> "$out/bench.log"
      done
      grep -v '^\s*$' "$out/bench.log" | tail -n 80
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
echo "tests exit status: $status"
exit "$status"
