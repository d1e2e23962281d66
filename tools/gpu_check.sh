#!/usr/bin/env bash
# GPU check: the whole test suite (GPU-marked tests included), the demo, then every
# benchmark, on a machine whose python3 already has JAX with CUDA (no network, no installs).
#
#   tools/gpu_check.sh OUT_DIR [pytest args...]
#
# Writes env.txt, tests.log, demo.log, bench.log and <benchmark>.json under OUT_DIR.
# Exits non-zero when the tests fail (benchmarks still run, so one call gives everything).
set -uo pipefail
out=${1:?usage: tools/gpu_check.sh OUT_DIR [pytest args...]}
shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=. JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
} 2>&1 | tee "$out/env.txt"

# pytest-timeout is on the GPU image: a hung test fails alone instead of eating the lease.
$python -m pytest -q -p no:cacheprovider --timeout=240 --durations=15 "$@" 2>&1 \
  | tee "$out/tests.log"
status=${PIPESTATUS[0]}

$python -m flax_models.demo 2>&1 | tee "$out/demo.log"

: > "$out/bench.log"
for module in ssd conv1d attention model; do
  if [ -f "benchmarks/$module.py" ]; then
    $python -m "benchmarks.$module" --out "$out/$module.json" 2>&1 | tee -a "$out/bench.log"
  fi
done
echo "tests exit status: $status"
exit "$status"
