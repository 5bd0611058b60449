"""The cpu backend implements every op of the registry for every dtype the op takes, so no
op falls back to the reference on CPU tensors (no FallbackWarning)."""
from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal.opdef import OPS
from glm5_hal.registry import FallbackWarning

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
# The dtype the dispatch argument takes, where it is not the activation floats.
DISPATCH_DTYPES = {"int4_unpack": frozenset({torch.int32}),
                   "fp8_block_gemm": frozenset({torch.float8_e4m3fn}), "fp8_grouped_gemm": frozenset({torch.float8_e4m3fn}),
                   "int8_gemm": frozenset({torch.int8}), "int8_grouped_gemm": frozenset({torch.int8})}
# The DSA kernels live in backends/cpu/dsa.py, written on a branch of their own; until it is
# merged those ops are the only ones allowed to be missing.
DSA_OPS = {"indexer_logits", "indexer_topk", "indexer_topk_paged", "sparse_mla_attention",
           "sparse_mla_decode_paged", "dense_mla_decode_paged"}
HAVE_DSA = importlib.util.find_spec("glm5_hal.backends.cpu.dsa") is not None


def test_cpu_backend_implements_every_op_for_every_dtype():
    hal.ops.rms_norm  # noqa: B018  (defines every op)
    cpu = hal.get_backend("cpu")
    assert cpu.availability().available
    impls = cpu.impls
    missing = sorted(op for op in OPS if op not in impls and (HAVE_DSA or op not in DSA_OPS))
    assert not missing, f"ops without a cpu implementation: {missing}"
    for op, impl in impls.items():
        wanted = DISPATCH_DTYPES.get(op, FLOATS)
        assert impl.dtypes is None or wanted <= impl.dtypes, (op, impl.dtypes)
        assert impl.supports is None, f"{op}: a supports() predicate could decline calls"


@pytest.mark.parametrize("dtype", sorted(FLOATS, key=str), ids=str)
def test_a_moe_layer_on_cpu_never_falls_back(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        weights, ids = hal.ops.moe_route(torch.randn(6, 16, generator=g).to(dtype), None, 4)
        xp, counts, src = hal.ops.moe_permute(hal.ops.rms_norm(x, torch.ones(64), 1e-5), ids, 16)
        h = hal.ops.silu_and_mul(hal.ops.grouped_gemm(xp, torch.randn(16, 32, 64, generator=g).to(dtype), counts))
        y = hal.ops.grouped_gemm(h, torch.randn(16, 64, 16, generator=g).to(dtype), counts)
        out = hal.ops.moe_unpermute(y, src, weights)
    assert out.shape == x.shape and out.dtype == dtype
    assert not any(k[1] == "cpu" for k in hal.fallback_stats())
