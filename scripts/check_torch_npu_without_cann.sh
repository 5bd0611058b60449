#!/usr/bin/env bash
# Checks glm5_hal against the real torch_npu wheel on a machine without CANN (issue 6).
#
# The wheel goes into a private folder (scripts/fetch_torch_npu.sh: `pip install --no-deps
# --target`, cached under build/, never into .venv: there it would break `import torch` for
# everything else) and is put on PYTHONPATH for the two commands under test:
#   1. `glm5-hal doctor` explains why `import torch` fails: torch auto-loads torch_npu from
#      the `torch.backends` entry-point group and torch_npu cannot load libhccl.so;
#   2. with TORCH_DEVICE_BACKEND_AUTOLOAD=0, `glm5-hal backends` lists `ascend` as
#      unavailable with the missing runtime library as the reason.
# Needs PyPI (or a mirror) on the first run; exits non-zero with the output on a mismatch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VERSION=${TORCH_NPU_VERSION:-2.13.0}
TARGET=$(VENV=$VENV TORCH_NPU_VERSION=$VERSION scripts/fetch_torch_npu.sh)
export PYTHONPATH="$PWD/$TARGET${PYTHONPATH:+:$PYTHONPATH}"
unset TORCH_DEVICE_BACKEND_AUTOLOAD

failures=0
expect() {  # expect LABEL TEXT PATTERN...: every fixed-string PATTERN occurs in TEXT
  local label=$1 text=$2
  shift 2
  for pattern in "$@"; do
    if ! grep -qF -- "$pattern" <<<"$text"; then
      echo "FAIL ($label): missing: $pattern"
      failures=$((failures + 1))
    fi
  done
}

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "FAIL: 'import torch' works with torch_npu $VERSION on PYTHONPATH; is CANN installed here?"
  exit 1
fi

doctor=$("$VENV/bin/glm5-hal" doctor)
echo "$doctor"
expect "doctor" "$doctor" \
  "torch       2." "[imports only with TORCH_DEVICE_BACKEND_AUTOLOAD=0]" \
  "torch autoloaded bridges: torch_npu = torch_npu:_autoload" \
  "Failed to load the backend extension: torch_npu" \
  "works with TORCH_DEVICE_BACKEND_AUTOLOAD=0" "torch_npu installed without the CANN" \
  "runtime library missing: libhccl.so"

backends=$(TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$VENV/bin/glm5-hal" backends)
echo "$backends"
ascend_row=$(grep -E '^ascend ' <<<"$backends" || true)
expect "backends" "$ascend_row" "unavailable" "runtime library missing: libhccl.so (torch_npu is installed"

if [ "$failures" -ne 0 ]; then
  echo "check_torch_npu_without_cann: $failures check(s) failed"
  exit 1
fi
echo "check_torch_npu_without_cann: ok (torch_npu $VERSION without CANN is explained)"
