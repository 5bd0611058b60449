#!/usr/bin/env bash
# Unpacks the torch-npu wheel into build/torch_npu/torch_npu-$VERSION (cached; never into .venv,
# where it would break `import torch` for everything else) and prints that folder.
#
# What uses it: the Ascend emulator registers the wheel's op schemas
# (torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml) with torch.library, so every adapter
# call is parsed against them (tests/emulators/npu_schemas.py), and
# scripts/check_torch_npu_without_cann.sh runs glm5-hal against the installed wheel.
# TORCH_NPU_VERSION picks another release (each one the schema tests find here is checked too).
# Needs PyPI (or a mirror) on the first run only.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VERSION=${TORCH_NPU_VERSION:-2.13.0}
TARGET=${TORCH_NPU_TARGET:-build/torch_npu/torch_npu-$VERSION}

if [ ! -f "$TARGET/.complete" ]; then
  rm -rf "$TARGET"
  mkdir -p "$(dirname "$TARGET")"
  "$VENV/bin/python" -m pip install -q --no-deps --target "$TARGET" "torch-npu==$VERSION" >&2
  touch "$TARGET/.complete"
fi
echo "$TARGET"
