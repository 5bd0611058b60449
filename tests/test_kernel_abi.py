"""The C interface the vendor kernel libraries share (core/glm5_hal/include/glm5_hal_kernel_abi.h)
and its Python mirror (glm5_hal.kernel_library, glm5_hal.vendor_ops.dsa): what a C compiler lays out is what ctypes
passes, and every implementation of the paged decode kernel refuses exactly the sizes its
Python limits decline."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest
import torch

from glm5_hal import kernel_library as kl
from glm5_hal.backends._cuda_dialect import GpuKernelLibrary
from glm5_hal.backends.cambricon.kernels import KernelLibrary as BangKernels
from glm5_hal.backends.kunlun.kernels import KernelLibrary as XpuKernels
from glm5_hal.vendor_ops import dsa

from conftest import REPO

HEADER = kl.ABI_HEADER.read_text()
_C_TYPE_NAMES = {ctypes.c_void_p: "pointer", ctypes.c_int64: "int64_t", ctypes.c_float: "float",
                 ctypes.c_int32: "int32_t"}

_LAYOUT_DRIVER = r"""
#include <stddef.h>
#include <stdio.h>
#include "glm5_hal_kernel_abi.h"
#define KIND(x) _Generic((x), int64_t: "int64_t", int32_t: "int32_t", float: "float", default: "pointer")
int main(void) {
  glm5_hal_sparse_mla_decode_args a;
  printf("size %zu\n", sizeof(a));
FIELDS
  return 0;
}
"""


def test_the_args_struct_has_the_layout_ctypes_passes(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    names = [name for name, _ in dsa.SparseMlaDecodeArgs._fields_]
    fields = "\n".join(f'  printf("{n} %zu %s\\n", offsetof(glm5_hal_sparse_mla_decode_args, {n}), KIND(a.{n}));'
                       for n in names)
    (tmp_path / "layout.c").write_text(_LAYOUT_DRIVER.replace("FIELDS", fields))
    subprocess.run([compiler, "-std=c11", "-Wall", "-Werror", "-I", str(kl.INCLUDE_DIR), str(tmp_path / "layout.c"),
                    "-o", str(tmp_path / "layout")], check=True, timeout=60)
    lines = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout.split("\n")
    assert lines[0] == f"size {ctypes.sizeof(dsa.SparseMlaDecodeArgs)}"
    want = [f"{name} {getattr(dsa.SparseMlaDecodeArgs, name).offset} {_C_TYPE_NAMES[kind]}"
            for name, kind in dsa.SparseMlaDecodeArgs._fields_]
    assert lines[1:-1] == want


def test_the_struct_declares_no_field_the_mirror_lacks():
    body = re.search(r"typedef struct glm5_hal_sparse_mla_decode_args \{(.*?)\}", HEADER, re.S).group(1)
    declared = re.findall(r"(\w+);", re.sub(r"//.*", "", body))
    assert declared == [name for name, _ in dsa.SparseMlaDecodeArgs._fields_]


def test_the_codes_and_the_entry_point_match_the_mirror():
    def enum(name):
        return int(re.search(rf"\b{name} = (-?\d+)", HEADER).group(1))

    assert {d: enum(f"GLM5_HAL_{n}") for d, n in ((torch.float32, "F32"), (torch.float16, "F16"),
                                                  (torch.bfloat16, "BF16"), (torch.float8_e4m3fn, "FP8_E4M3"))
            } == kl.DTYPE_CODE
    assert (enum("GLM5_HAL_OK"), enum("GLM5_HAL_EINVAL")) == (kl.OK, kl.EINVAL)
    prototype = re.search(r"^int (glm5_hal_\w+)\(const glm5_hal_sparse_mla_decode_args\* args, void\* stream\);",
                          HEADER, re.M)
    assert prototype.group(1) == dsa.SPARSE_MLA_DECODE
    assert dsa.SparseMlaDecodeLibrary.signatures == {dsa.SPARSE_MLA_DECODE: (ctypes.c_int, [ctypes.c_void_p] * 2)}


@pytest.mark.parametrize("library,source", [
    (BangKernels, "backends/cambricon/csrc/sparse_mla_decode.mlu"),
    (XpuKernels, "backends/kunlun/csrc/paged_kernels.xpu"),
])
def test_the_vendor_decode_limits_are_the_kernels_host_checks(library, source):
    """Neither kernel compiles here: its host check is read from the source instead."""
    text = (REPO / source).read_text()
    limits = library.decode_limits
    assert int(re.search(r"constexpr int kMaxDqk = (\d+);", text).group(1)) == limits.max_dqk
    check = re.search(r"= \*args;(.*?)return GLM5_HAL_EINVAL", text, re.S).group(1)
    assert f"a.heads > {limits.max_heads}" in check and "a.d_v > a.dqk" in check
    assert limits.max_d_v is None and limits.int32_rows


def test_the_limits_decline_in_the_order_of_the_checks():
    limits = GpuKernelLibrary.decode_limits
    assert limits.declined(heads=128, dqk=1024, d_v=1024, cache_rows=2**40) is None
    assert limits.declined(heads=128, dqk=1025, d_v=1025, cache_rows=1) == \
        "the sparse MLA kernel takes Dqk <= 1024, got 1025"
    assert BangKernels.decode_limits.declined(129, 576, 512, 2**31) == \
        "the BANG C sparse decode kernel takes H <= 128, got 129"
    assert XpuKernels.decode_limits.declined(128, 576, 512, 2**31) == \
        "the XPU sparse decode kernel addresses cache rows with int32"


def test_a_refused_or_failed_launch_is_a_kernel_error(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    (tmp_path / "status.c").write_text("int glm5_hal_sparse_mla_decode_paged(const void* a, void* s) "
                                       "{ return s == (void*)0 ? -22 : 719; }\n")
    subprocess.run([compiler, "-shared", "-fPIC", str(tmp_path / "status.c"), "-o", str(tmp_path / "libstatus.so")],
                   check=True, timeout=60)
    library = BangKernels(tmp_path / "libstatus.so")
    q, cache = torch.zeros(1, 1, 2, 8), torch.zeros(1, 4, 8)
    table, lens, indices = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), \
        torch.zeros(1, 1, 3, dtype=torch.int32)
    with pytest.raises(kl.KernelError, match=r"refused by the kernel's size checks \(EINVAL\)"):
        library.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.5, 8, 0)
    with pytest.raises(kl.KernelError, match="failed with status 719: the cambricon kernel launch failed with "
                                             "runtime error 719"):
        library.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.5, 8, 1)
    empty = library.sparse_mla_decode_paged(q[:0], cache, table[:0], lens[:0], indices[:0], 0.5, 8, 1)
    assert [tuple(t.shape) for t in empty] == [(0, 1, 2, 8), (0, 1, 2)]   # nothing to launch
