#!/usr/bin/env bash
# scripts/gpu_check.sh OUTDIR [--quick] [--no-compile] [--skip-build] [--budget SECONDS] [--dry-run]
#
# The cuda backend on a machine with an NVIDIA GPU, in one command (backends/cuda/README.md):
#   1. build         pip install --no-build-isolation --no-deps -e . (nothing from the network),
#                    the CUDA kernels for this GPU's architecture only (GLM5_HAL_CUDA_ARCHS)
#   2. environment   torch, CUDA, nvcc, driver, the GPU's properties, FlashMLA / DeepGEMM versions
#   3. backends      glm5-hal backends --json: the cuda backend must be available
#   4. conformance   --backend cuda --ref cuda (float64 on the GPU), preset tiny
#   5. bench         the issue targets: sparse_mla_decode_paged (B=64, 64 heads, top-2048, d_qk
#                    576, d_v 512, bf16) and indexer_topk_paged (B=64, 32K context): cuda vs the
#                    reference vs torch.compile of it, % of the measured and the datasheet limits;
#                    with FlashMLA / DeepGEMM installed, the ops they serve once more on the own
#                    kernels (GLM5_HAL_CUDA_DISABLE)
#   6. conformance   preset glm5; with FlashMLA installed, the sparse attention ops once more on
#                    the own kernels
#   7. bench         the DSA, MoE and GEMM ops at the glm5 preset, one step each
#   8. summary       OUTDIR/summary.json and OUTDIR/summary.md (scripts/gpu_check_report.py)
# Every step's output goes to OUTDIR/<step>.log, its JSON / Markdown next to it, and its time
# to OUTDIR/steps.tsv. Meant to finish in under 8 minutes on one H200: each step has a time
# limit within --budget (default 450 s); a step over it is stopped and marked so, the later ones
# still run if time is left. --quick: steps 1-5 only;
# --no-compile: no torch.compile (the slowest part of the bench); --skip-build: use the install
# that is there; --dry-run: print each step's command and limit instead of running it (on any
# machine, as if it had an sm_90 GPU; tests/test_gpu_check.py checks the commands).
#
# Without an NVIDIA GPU it says so and exits 0 (CI runs it that way). Exit status otherwise:
# 0 when every step ran (conformance failures are results, reported in the summary), 2 when a
# prerequisite is missing (nvcc, torch >= 2.11 with CUDA) or the backend is not available.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2p' "$0" | sed 's/^# //'; }
OUT="" QUICK=0 COMPILE=1 BUILD=1 BUDGET=450 DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --no-compile) COMPILE=0 ;;
    --skip-build) BUILD=0 ;;
    --dry-run) DRY=1 ;;
    --budget) shift; BUDGET=${1:?--budget needs seconds} ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_check: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { usage >&2; exit 2; }; OUT=$1 ;;
  esac
  shift
done
[ -n "$OUT" ] || { usage >&2; exit 2; }
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# -- is there an NVIDIA GPU? (torch's own answer; a ROCm / DCU torch also says "cuda") ------------
probe="YES 90 2.11.0+cu130 (dry run)"
[ "$DRY" = 1 ] || probe=$("$PYTHON" - <<'EOF' 2>&1
try:
    import torch
except Exception as exc:
    print(f"NO torch does not import ({type(exc).__name__}: {exc})")
    raise SystemExit
v = torch.version
if getattr(v, "hip", None) or not getattr(v, "cuda", None):
    print(f"NO torch {torch.__version__} is not a CUDA build for NVIDIA (torch.version.cuda = {v.cuda}, "
          f"torch.version.hip = {getattr(v, 'hip', None)})")
elif not torch.cuda.is_available() or torch.cuda.device_count() == 0:
    print(f"NO torch {torch.__version__} (CUDA {v.cuda}) sees no GPU (torch.cuda.is_available() is False)")
else:
    major, minor = torch.cuda.get_device_capability(0)
    print(f"YES {major}{minor} {torch.__version__} {torch.cuda.get_device_name(0)}")
EOF
)
case "$probe" in
  YES*) ;;
  *)
    echo "gpu_check: no NVIDIA GPU here: ${probe#NO }; nothing to check (exit 0)." | tee "$OUT/summary.md"
    exit 0 ;;
esac
read -r _ ARCH TORCH_VERSION GPU_NAME <<<"$probe"
echo "gpu_check: $GPU_NAME (sm_$ARCH), torch $TORCH_VERSION -> $OUT"

"$PYTHON" - "$TORCH_VERSION" <<'EOF' || { echo "gpu_check: needs a CUDA build of torch >= 2.11" >&2; exit 2; }
import re, sys
numbers = tuple(int(n) for n in re.findall(r"\d+", sys.argv[1])[:2])
sys.exit(0 if numbers >= (2, 11) else 1)
EOF
NVCC=$(command -v nvcc || { [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] && echo "$CUDA_HOME/bin/nvcc"; } || true)
[ "$DRY" = 1 ] && NVCC=${NVCC:-nvcc}
if [ -z "$NVCC" ] && [ "$BUILD" = 1 ]; then
  echo "gpu_check: nvcc not found (PATH, CUDA_HOME): the CUDA kernels cannot be built" >&2
  exit 2
fi

# -- steps -----------------------------------------------------------------------------------------
START=$(date +%s)
printf 'step\tseconds\tstatus\n' > "$OUT/steps.tsv"
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# run STEP LIMIT CMD...: runs CMD with at most LIMIT seconds (and never past the budget)
run() {
  local step=$1 limit=$2 t0 status seconds remaining
  shift 2
  if [ "$DRY" = 1 ]; then
    printf 'DRY %s %s:' "$step" "$limit"
    printf ' %q' "$@"
    printf '\n'
    return 0
  fi
  remaining=$(left)
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  if [ "$limit" -lt 10 ]; then
    printf '%s\t0\tskipped: budget of %ss spent\n' "$step" "$BUDGET" >> "$OUT/steps.tsv"
    echo "== $step: skipped (budget of ${BUDGET}s spent)"
    return 0
  fi
  echo "== $step (limit ${limit}s; $(( $(date +%s) - START ))s so far)"
  t0=$(date +%s)
  timeout --kill-after=15 "$limit" "$@" > "$OUT/$step.log" 2>&1
  status=$?
  seconds=$(( $(date +%s) - t0 ))
  case $status in
    0) printf '%s\t%s\tok\n' "$step" "$seconds" >> "$OUT/steps.tsv" ;;
    124|137) printf '%s\t%s\tstopped at its %ss limit\n' "$step" "$seconds" "$limit" >> "$OUT/steps.tsv" ;;
    *) printf '%s\t%s\texit %s\n' "$step" "$seconds" "$status" >> "$OUT/steps.tsv" ;;
  esac
  echo "   ${seconds}s, exit $status; tail of $OUT/$step.log:"
  tail -n 4 "$OUT/$step.log" | sed 's/^/   | /'
  return 0
}

if [ "$BUILD" = 1 ]; then
  export GLM5_HAL_CUDA_ARCHS=$ARCH
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  run build 240 "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -e . \
    -Ccmake.define.GLM5_HAL_CUDA_ARCHS="$ARCH" -Ccmake.define.GLM5_HAL_WITH_CUDA=ON -Ccmake.define.GLM5_HAL_NVCC="$NVCC"
fi
GLM5=("$PYTHON" -m glm5_hal.cli)
run environment 60 "$PYTHON" scripts/gpu_check_report.py environment "$OUT/environment.json"

run backends 60 bash -c '"${@:2}" > "$1"' _ "$OUT/backends.json" "${GLM5[@]}" backends --json
if [ "$DRY" = 0 ] && ! "$PYTHON" -c "import json,sys; rows=json.load(open(sys.argv[1])); sys.exit(0 if any(r['name']=='cuda' and r['available'] for r in rows) else 1)" "$OUT/backends.json" 2>/dev/null; then
  echo "gpu_check: the cuda backend is not available here; see $OUT/backends.log" >&2
  "$PYTHON" scripts/gpu_check_report.py summary "$OUT" || true
  exit 2
fi
LIBS=${GPU_CHECK_LIBS-$("$PYTHON" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("flash_mla", "deep_gemm") if importlib.util.find_spec(m)))
EOF
)}

# in order of importance: the budget cuts from the end
WORKERS=${GPU_CHECK_WORKERS:-4}
CONFORMANCE=("${GLM5[@]}" conformance --backend cuda --ref cuda -n "$WORKERS")
run conformance_tiny 150 "${CONFORMANCE[@]}" --preset tiny \
  --json "$OUT/conformance_tiny.json" --markdown "$OUT/conformance_tiny.md" --junit "$OUT/conformance_tiny.xml"

BENCH=("${GLM5[@]}" bench --device cuda --backend cuda --repeats 5)
[ "$COMPILE" = 0 ] && BENCH+=(--no-compile)
run bench_target_sparse_mla_decode_paged 120 "${BENCH[@]}" --preset glm5 --batch 64 \
  --op sparse_mla_decode_paged --json "$OUT/bench_target_sparse_mla_decode_paged.json"
run bench_target_indexer_topk_paged 150 "${BENCH[@]}" --preset long --batch 64 \
  --op indexer_topk_paged --json "$OUT/bench_target_indexer_topk_paged.json"
if [ -n "$LIBS" ]; then  # the ops FlashMLA / DeepGEMM serve, once more on the own kernels
  run bench_own_kernels 90 env GLM5_HAL_CUDA_DISABLE="$(tr ' ' ',' <<<"$LIBS")" "${BENCH[@]}" --no-compile \
    --preset glm5 --batch 64 --op sparse_mla_decode_paged --op sparse_mla_attention \
    --json "$OUT/bench_own_kernels.json"
fi
[ "$QUICK" = 1 ] && { [ "$DRY" = 1 ] && exit 0; "$PYTHON" scripts/gpu_check_report.py summary "$OUT"; exit 0; }

run conformance_glm5 150 "${CONFORMANCE[@]}" --preset glm5 \
  --json "$OUT/conformance_glm5.json" --markdown "$OUT/conformance_glm5.md" --junit "$OUT/conformance_glm5.xml"
if [[ " $LIBS " == *" flash_mla "* ]]; then
  run conformance_own_kernels 90 env GLM5_HAL_CUDA_DISABLE=flash_mla "${CONFORMANCE[@]}" --preset tiny \
    --preset glm5 --op sparse_mla_attention --op sparse_mla_decode_paged \
    --json "$OUT/conformance_own_kernels.json" --markdown "$OUT/conformance_own_kernels.md"
fi
# the DSA, MoE and GEMM ops at the glm5 preset, one step (and JSON) each
for op in $("$PYTHON" - <<'EOF'
import glm5_hal.ops  # noqa: F401  (defines every op)
from glm5_hal.bench.cases import cases
wanted = ["indexer_topk", "sparse_mla_attention", "dense_mla_decode_paged", "moe_route", "moe_permute",
          "moe_unpermute", "grouped_gemm", "fp8_block_gemm", "fp8_grouped_gemm", "w4a16_gemm"]
have = {case.op for case in cases("glm5")}   # the ops with a bench case
print(" ".join(op for op in wanted if op in have))
EOF
); do
  run "bench_$op" 60 "${BENCH[@]}" --preset glm5 --op "$op" --json "$OUT/bench_$op.json"
done

[ "$DRY" = 1 ] && exit 0
"$PYTHON" scripts/gpu_check_report.py summary "$OUT"
echo "gpu_check: done in $(( $(date +%s) - START ))s; $OUT/summary.md"
