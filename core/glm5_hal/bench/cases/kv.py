"""Benchmark cases of the paged-KV ops: a prefill chunk written into, and the decode batch
gathered out of, caches of the decode batch's size."""
from __future__ import annotations

import math

import torch

from ..runner import BenchCase
from . import I32, Shapes, bench_case, paged, randn, seeded


def _slots(s: Shapes) -> int:
    return s.batch * math.ceil(s.context / s.block_size) * s.block_size


def _decode(s: Shapes) -> str:
    return f"B={s.batch} ctx={s.context}"


@bench_case("kv_cache_write")
def kv_cache_write(s: Shapes) -> BenchCase:
    T = s.tokens

    def make():
        g = seeded("kvw")
        cache, _, _ = paged(g, s.batch, s.context, s.block_size, s.d_qk)
        return cache, randn(g, (T, s.d_qk)), torch.randperm(_slots(s), generator=g)[:T].to(I32)

    return BenchCase(f"{T} rows of {s.d_qk} bf16 into {_decode(s)}", make, nbytes=4 * T * s.d_qk)


@bench_case("indexer_k_cache_write")
def indexer_k_cache_write(s: Shapes) -> BenchCase:
    T, Di = s.tokens, s.index_dim

    def make():
        g = seeded("ikw")
        (kc, ksc), _, _ = paged(g, s.batch, s.context, s.block_size, Di, fp8=True)
        return randn(g, (T, Di)), kc, ksc, torch.randperm(_slots(s), generator=g)[:T].to(I32), "ue8m0"

    return BenchCase(f"{T} keys of {Di} bf16 -> fp8", make, nbytes=T * Di * 3 + 4 * T)


@bench_case("kv_cache_gather")
def kv_cache_gather(s: Shapes) -> BenchCase:
    return BenchCase(f"{_decode(s)} rows of {s.d_qk} bf16",
                     lambda: paged(seeded("gather"), s.batch, s.context, s.block_size, s.d_qk),
                     nbytes=4 * s.batch * s.context * s.d_qk)
