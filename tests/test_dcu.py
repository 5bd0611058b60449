"""The Hygon DCU backend: which torch stacks it claims (only a DTK build, never NVIDIA CUDA or
AMD ROCm), probe reasons, capabilities per gfx, lightop's module layout chosen by its version,
and every adapter run end to end against the DCU emulator (tests/emulators/dcu.py) on CPU
tensors, for every emulated lightop version, compared with glm5_hal.reference; declined calls
name the reason and never reach the vendor function."""
from __future__ import annotations

import contextlib
import functools
import sys
import types
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backends._cuda_dialect import per_row_topk
from glm5_hal.backends.dcu import DcuBackend
from glm5_hal.backends.dcu.runtime import DcuRuntime, load_lightop
from emulators.dcu import LIGHTOP_VERSIONS, DcuEmulator

from conftest import seeded
from emulated_helpers import chosen, declined_reason, randn, register_emulated, remembered

EMU = "dcu_emu"
F32, F16, BF16, I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32
rejection = functools.partial(declined_reason, EMU)


def emulated(card: str = "K100_AI", **runtime_kwargs) -> DcuBackend:
    return DcuBackend(runtime=DcuEmulator(card, **runtime_kwargs), name=EMU, device_type="cpu", priority=1000)


def register(hal_state, monkeypatch, card: str = "K100_AI", **runtime_kwargs) -> DcuBackend:
    return register_emulated(hal_state, monkeypatch, emulated(card, **runtime_kwargs))


@pytest.fixture
def k100(hal_state, monkeypatch) -> DcuBackend:
    return register(hal_state, monkeypatch)


@contextlib.contextmanager
def expect_fallback(reason: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    messages = [str(w.message) for w in caught if issubclass(w.category, hal.FallbackWarning)]
    assert any(f"'{EMU}' declined: " in m and reason in m for m in messages), messages


# -- which stack is a DCU --------------------------------------------------------------------------
def test_on_a_cpu_torch_the_registered_backend_says_there_is_no_hip():
    row = next(r for r in hal.backends() if r.name == "dcu")
    assert (row.available, row.device_type) == (False, "cuda")
    assert row.reason == "torch build has no HIP/DCU support (torch.version.hip is None)"
    assert {"rms_norm", "silu_and_mul", "apply_rope", "grouped_gemm", "indexer_topk"} <= set(row.ops)


@pytest.mark.parametrize("card,flavor,expected", [
    ("H100", "cuda", "this is a real NVIDIA GPU stack (torch.version.cuda = 12.8), not a Hygon DCU"),
    ("MI300X", "rocm", "this is a real AMD GPU stack (ROCm, torch.version.hip = 6.4.43482, no torch.__hcu_version__), "
                       "not a Hygon DCU"),
    ("K100_AI", "rocm", "this is a real AMD GPU stack"),  # a DCU card under a torch without Hygon's marker
    ("K100_AI", "cpu", "torch build has no HIP/DCU support (torch.version.hip is None)"),
])
def test_only_a_hygon_torch_build_is_a_dcu(card, flavor, expected):
    availability = emulated(card, flavor=flavor).availability()
    assert not availability.available
    assert availability.reason.startswith(expected)


def fake_torch(**attributes) -> types.SimpleNamespace:
    """A torch module as the probe sees it: version attributes and nothing else."""
    version = types.SimpleNamespace(hip=attributes.pop("hip", None), cuda=attributes.pop("cuda", None))
    return types.SimpleNamespace(version=version, **attributes)


@pytest.mark.parametrize("torch_module,expected", [
    (fake_torch(__version__="2.5.0+corex.4.3.0", cuda="11.8"), "this is an Iluvatar CoreX stack"),
    (fake_torch(__version__="2.9.0", cuda="12.8"), "this is a real NVIDIA GPU stack (torch.version.cuda = 12.8)"),
    (fake_torch(__version__="2.9.0", hip="6.4"), "this is a real AMD GPU stack"),
    (fake_torch(__version__="2.4.1+das.dtk2504", hip="6.2", __hcu_version__="2.4.1"),
     "torch 2.4.1+das.dtk2504 is too old: glm5_hal needs torch >= 2.6"),
])
def test_the_real_runtime_reads_the_torch_attributes(torch_module, expected):
    availability = DcuBackend(runtime=DcuRuntime(torch_module), name="probe", device_type="cpu").availability()
    assert not availability.available and availability.reason.startswith(expected)


@pytest.mark.parametrize("kwargs,expected", [
    ({"devices": 0}, "no DCU device visible (torch.cuda.device_count() == 0; check `hy-smi` and CUDA_VISIBLE_DEVICES)"),
    ({"version": "2.4.1+das.opt1.dtk2504"}, "torch 2.4.1+das.opt1.dtk2504 is too old: glm5_hal needs torch >= 2.6"),
])
def test_probe_gives_a_specific_reason(kwargs, expected):
    availability = emulated(**kwargs).availability()
    assert not availability.available and availability.reason == expected


@pytest.fixture
def fake_lightop(tmp_path, monkeypatch):
    def install(body: str) -> None:
        pkg = tmp_path / "lightop"
        pkg.mkdir()
        (pkg / "__init__.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lightop", raising=False)
    yield install
    sys.modules.pop("lightop", None)


def test_lightop_without_the_dtk_libraries_names_the_missing_one(fake_lightop):
    assert load_lightop()[1] == "lightop not installed (Hygon's fused-op package from DTK / the DAS image)"
    fake_lightop("raise ImportError('libhipblaslt.so.0: cannot open shared object file: No such file or directory')\n")
    module, reason = load_lightop()
    assert module is None and reason.startswith("runtime library missing: libhipblaslt.so.0 (lightop is installed")


@pytest.mark.parametrize("card,gfx,dtypes", [
    ("K100_AI", "gfx928", {F32, F16, BF16}),
    ("K100", "gfx926", {F32, F16, BF16}),
    ("BW1000", "gfx936", {F32, F16, BF16}),
    ("Z100L", "gfx906", {F32, F16}),
])
def test_capabilities_per_generation(card, gfx, dtypes):
    backend = emulated(card)
    availability = backend.availability()
    assert availability.reason.startswith(f"EMULATED (DcuEmulator): 8 x {card} ({gfx}), torch 2.9.0")
    caps = backend.cached_capabilities()
    assert (set(caps.dtypes), caps.dist_backend, caps.device_name) == (dtypes, "nccl", card)
    assert caps.limits["gcn_arch"] == gfx and caps.limits["dcu_kernels"].startswith("DCU kernel not built")
    assert backend.versions()["chip"] == f"{card} ({gfx})"


def test_a_hygon_build_on_an_unknown_gfx_is_still_usable(monkeypatch):
    backend = emulated("K100_AI")
    monkeypatch.setitem(sys.modules["emulators.dcu"].CARDS, "K100_AI", ("K500", "gfx999"))
    availability = backend.availability()
    assert availability.available and "(gfx999, not in glm5_hal's table)" in availability.reason
    assert backend.cached_capabilities().limits["products"] == "unknown"


# -- lightop ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("lightop", LIGHTOP_VERSIONS)
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 129)])
def test_rms_norm_matches_the_reference(hal_state, monkeypatch, lightop, dtype, shape):
    """lightop.op before LightOp 0.6, lightop.norm from 0.6 (where the old code never looked)."""
    backend = register(hal_state, monkeypatch, lightop=lightop)
    g = seeded(1)
    x, w = randn(*shape, g=g, dtype=dtype), randn(shape[-1], g=g, dtype=dtype)
    assert chosen("rms_norm", x, w, 1e-6) == f"{EMU}.rms_norm"
    torch.testing.assert_close(hal.ops.rms_norm(x, w, 1e-6), hal.reference.rms_norm(x, w, 1e-6), rtol=1.6e-2, atol=1e-5)
    assert backend.runtime.calls["rmsnorm_forward_autograd"] == 1


@pytest.mark.parametrize("op, function", [("rms_norm", "rmsnorm_forward_autograd"),
                                          ("silu_and_mul", "silu_and_mul_opt")])
def test_a_lightop_before_0_6_with_top_level_exports_is_used(hal_state, monkeypatch, op, function):
    """The LightOp 0.6 design doc names the top level as well as lightop.op as the deprecated
    places of the norm and activation functions (@63935f8e); the old code looked in lightop.op
    only and declined such a lightop."""
    backend = register(hal_state, monkeypatch, lightop=LIGHTOP_VERSIONS[0], lightop_old_place="top")
    assert not hasattr(backend.runtime.lightop.op, function)
    g = seeded(3)
    x = randn(3, 128, g=g, dtype=BF16)
    args = (x, randn(128, g=g, dtype=BF16), 1e-6) if op == "rms_norm" else (x,)
    assert chosen(op, *args) == f"{EMU}.{op}"
    torch.testing.assert_close(getattr(hal.ops, op)(*args), getattr(hal.reference, op)(*args), rtol=1.6e-2, atol=1e-5)
    assert backend.runtime.calls[function] == 1


def test_a_lightop_without_the_function_names_every_place_looked_in(hal_state, monkeypatch):
    backend = register(hal_state, monkeypatch, lightop=LIGHTOP_VERSIONS[0])
    del backend.runtime.lightop.op.rmsnorm_forward_autograd
    x = torch.ones(2, 64, dtype=BF16)
    assert rejection("rms_norm", x, torch.ones(64, dtype=BF16), 1e-6) == (
        "lightop has no rmsnorm_forward_autograd (looked in lightop.op / lightop (top level))")


def test_rms_norm_declines_float32_a_wider_weight_and_narrow_rows(k100):
    assert rejection("rms_norm", torch.ones(2, 64), torch.ones(64), 1e-6) == (
        "implements rms_norm for {bfloat16, float16}, not float32")
    assert "casting the float32 weight to float16 would round it" in rejection(
        "rms_norm", torch.ones(2, 64, dtype=F16), torch.ones(64), 1e-6)
    narrow = torch.ones(2, 63, dtype=BF16)
    assert rejection("rms_norm", narrow, torch.ones(63, dtype=BF16), 1e-6) == (
        "lightop's RMSNorm rejects reductions narrower than one wave (64); vLLM's DCU plugin routes hidden sizes "
        "below it elsewhere, got 63")
    with expect_fallback("narrower than one wave"):
        hal.ops.rms_norm(narrow, torch.ones(63, dtype=BF16), 1e-6)
    assert k100.runtime.calls["rmsnorm_forward_autograd"] == 0


def test_the_emulated_lightop_rejects_narrow_rows():
    kernels = DcuEmulator().lightop.norm
    with pytest.raises(RuntimeError, match="narrower than one wave"):
        kernels.rmsnorm_forward_autograd(torch.ones(2, 32, dtype=BF16), torch.ones(32, dtype=BF16), 1e-6, False)


@pytest.mark.parametrize("lightop", LIGHTOP_VERSIONS)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_silu_and_mul_matches_the_reference(hal_state, monkeypatch, lightop, dtype):
    backend = register(hal_state, monkeypatch, lightop=lightop)
    x = randn(3, 5, 34, g=seeded(2), dtype=dtype)
    assert chosen("silu_and_mul", x) == f"{EMU}.silu_and_mul"
    torch.testing.assert_close(hal.ops.silu_and_mul(x), hal.reference.silu_and_mul(x), rtol=1.6e-2, atol=1e-5)
    assert backend.runtime.calls["silu_and_mul_opt"] == 1


def test_lightop_ops_decline_without_lightop_or_for_float32(hal_state, monkeypatch):
    register(hal_state, monkeypatch, lightop=None)
    x = torch.ones(2, 64, dtype=BF16)
    assert rejection("rms_norm", x, torch.ones(64, dtype=BF16), 1e-6) == (
        "lightop not installed (Hygon's fused-op package from DTK / the DAS image)")
    assert rejection("silu_and_mul", x).startswith("lightop not installed (Hygon's fused-op package from DTK / the "
                                                   "DAS image); DCU kernel not built")
    hal.unload_plugin(EMU)
    register(hal_state, monkeypatch)
    assert rejection("silu_and_mul", torch.ones(2, 8)).startswith(
        "lightop's silu_and_mul_opt is offered for bf16/fp16, not float32; DCU kernel not built")


@pytest.mark.parametrize("version,why", [
    ("0.7.0", "lightop 0.7.0 is newer than 0.6.0, the newest version lightop_layout was verified against"),
    ("dtk2604", "the lightop version could not be read ('dtk2604')"),
])
def test_an_unverified_lightop_is_declined_and_said(hal_state, monkeypatch, version, why):
    backend = emulated(lightop=version)
    assert backend.availability().reason.endswith(f"; narrowed to what is verified (lightop_layout: {why})")
    register(hal_state, monkeypatch, lightop=version)
    x = torch.ones(2, 64, dtype=BF16)
    assert rejection("rms_norm", x, torch.ones(64, dtype=BF16), 1e-6) == f"lightop_layout unverified here: {why}"


# -- vLLM _C rotary -----------------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_apply_rope_matches_the_reference(k100, interleaved, dtype):
    x = randn(9, 5, 64, g=seeded(3), dtype=dtype)
    positions = torch.tensor([0, 1, 2, 17, 100, 1000, 4095, 3, 3], dtype=torch.int64)
    args = (x, positions, 1e6, interleaved)
    assert chosen("apply_rope", *args) == f"{EMU}.apply_rope"
    tol = {F32: (2e-5, 1e-5), F16: (1e-3, 1e-3), BF16: (1.6e-2, 1e-2)}[dtype]
    before = x.clone()
    torch.testing.assert_close(hal.ops.apply_rope(*args), hal.reference.apply_rope(*args), rtol=tol[0], atol=tol[1])
    assert torch.equal(x, before), "the in-place kernel must work on a copy"
    assert k100.runtime.calls["rotary_embedding"] == 1


def test_apply_rope_declines_without_vllm(hal_state, monkeypatch):
    register(hal_state, monkeypatch, vllm=False)
    assert rejection("apply_rope", torch.ones(2, 1, 8), torch.arange(2), 1e4, True) == (
        "vLLM's _C ops unavailable (vllm not installed)")


# -- torch._grouped_mm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_grouped_gemm_matches_the_reference(k100, dtype):
    g = seeded(4)
    counts = torch.tensor([2, 0, 6, 3], dtype=I32)
    x, w = randn(11, 21, g=g, dtype=dtype), randn(4, 9, 21, g=g, dtype=dtype)
    assert chosen("grouped_gemm", x, w, counts) == f"{EMU}.grouped_gemm"
    torch.testing.assert_close(hal.ops.grouped_gemm(x, w, counts), hal.reference.grouped_gemm(x, w, counts),
                               rtol=1.6e-2, atol=1e-3)
    assert k100.runtime.calls["_grouped_mm"] == 2  # the one-time probe, then the call


def test_grouped_gemm_is_probed_once_per_dtype_on_the_device(hal_state, monkeypatch):
    backend = register(hal_state, monkeypatch, grouped_mm="raises")
    args = (torch.ones(2, 16, dtype=BF16), torch.ones(1, 4, 16, dtype=BF16), torch.tensor([2], dtype=I32))
    reason = "torch._grouped_mm does not run here for bfloat16: DcuOpError: torch._grouped_mm(hip): grouped gemm is " \
             "only supported on ROCm MI300+ devices"
    assert rejection("grouped_gemm", *args) == reason
    with expect_fallback(reason):
        hal.ops.grouped_gemm(*args)
        hal.ops.grouped_gemm(*args)
    assert backend.runtime.calls["_grouped_mm"] == 1


def test_grouped_gemm_declines_without_torch_grouped_mm(hal_state, monkeypatch):
    register(hal_state, monkeypatch, grouped_mm="absent")
    assert rejection("grouped_gemm", torch.ones(2, 16), torch.ones(1, 4, 16), torch.tensor([2], dtype=I32)) == (
        "torch._grouped_mm is not in this torch (it needs torch >= 2.8)")


# -- indexer: torch logits + lightop top-k, sanitised -----------------------------------------------------
def assert_topk_rows(out, logits, topk, counts):
    """The conformance rule: per row distinct in-range entries, left-packed, -1 after,
    min(topk, count) valid, none scoring below the k-th best (exact float64 logits here)."""
    assert out.dtype == I32 and out.shape[-1] == topk
    out, counts = out.reshape(-1, topk), counts.reshape(-1)
    logits = logits.reshape(out.shape[0], logits.shape[-1])
    for row, scores, count in zip(out, logits, counts.tolist()):
        n = min(topk, max(count, 0))
        assert bool((row[:n] >= 0).all()) and bool((row[n:] == -1).all()), (row.tolist(), n)
        keys = row[:n].long()
        assert keys.unique().numel() == n
        if n:
            assert bool(torch.isfinite(scores[keys]).all()), "a key outside the row's range"
            kth = scores[torch.isfinite(scores)].topk(n).values[-1]
            assert bool((scores[keys] >= kth - 1e-9 * kth.abs()).all())


def test_lightops_top_k_fills_the_unused_slots_like_vllms_kernel():
    """vLLM's topKPerRowJob (csrc/sampler.cu @00e831b2) writes 0..len-1 and then -1 for a row
    shorter than top-k; the adapter keeps only slots inside the row whatever the kernel does."""
    emu = DcuEmulator()
    logits = torch.randn(2, 10)
    indices = torch.full((2, 6), 5, dtype=I32)
    emu.lightop.attention.top_k_per_row_prefill(logits, torch.tensor([0, 0], dtype=I32), torch.tensor([3, 10],
                                                dtype=I32), indices, 2, 10, 1, 6)
    assert indices[0].tolist() == [0, 1, 2, -1, -1, -1]
    stale = torch.tensor([[0, 1, 2, 7, 9, -5], [4, 1, 2, 8, 0, 3]], dtype=I32)
    clean = per_row_topk.sanitise_topk(stale, torch.tensor([3, 10]))
    assert clean[0].tolist() == [0, 1, 2, -1, -1, -1] and torch.equal(clean[1], stale[1])


@pytest.mark.parametrize("lightop", LIGHTOP_VERSIONS)
@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_topk_matches_the_reference(hal_state, monkeypatch, lightop, fp8):
    k100 = register(hal_state, monkeypatch, lightop=lightop)
    g = seeded(5)
    starts = torch.tensor([0, 0, 0, 5, 9, 2, 30, 0], dtype=I32)
    ends = torch.tensor([1, 3, 30, 11, 9, 30, 30, 12], dtype=I32)
    tokens, heads, dim, keys_count, topk = 8, 4, 64, 30, 8
    q = randn(tokens, heads, dim, g=g, dtype=BF16)
    weights = torch.rand(tokens, heads, generator=g)
    if fp8:
        k = (randn(keys_count, dim, g=g).to(torch.float8_e4m3fn), torch.rand(keys_count, generator=g) + 0.5)
        dense = k[0].double() * k[1].double()[:, None]
    else:
        k = randn(keys_count, dim, g=g, dtype=BF16)
        dense = k.double()
    args = (q, k, weights, starts, ends, topk)
    assert chosen("indexer_topk", *args) == f"{EMU}.indexer_topk"
    out = hal.ops.indexer_topk(*args)
    logits = hal.reference.indexer_logits(q.double(), dense, weights.double(), starts, ends)
    assert_topk_rows(out, logits, topk, ends - starts)
    assert k100.runtime.calls["top_k_per_row_prefill"] >= 1


@pytest.mark.parametrize("lightop", LIGHTOP_VERSIONS)
def test_indexer_topk_paged_matches_the_reference(hal_state, monkeypatch, lightop):
    k100 = register(hal_state, monkeypatch, lightop=lightop)
    g = seeded(6)
    batch, queries, heads, dim, block_size, topk = 4, 3, 4, 32, 4, 6
    q = randn(batch, queries, heads, dim, g=g, dtype=F16)
    cache = randn(7, block_size, dim, g=g, dtype=F16)
    table = torch.tensor([[6, 2, 0], [1, -1, -1], [3, 4, 5], [-1, -1, -1]], dtype=I32)
    lens = torch.tensor([11, 2, 12, 0], dtype=I32)
    weights = torch.rand(batch, queries, heads, generator=g)
    args = (q, cache, weights, table, lens, topk)
    assert chosen("indexer_topk_paged", *args) == f"{EMU}.indexer_topk_paged"
    out = hal.ops.indexer_topk_paged(*args)
    assert torch.equal(out, hal.ops.indexer_topk_paged(*args))
    for b in range(batch):
        length = int(lens[b])
        keys = torch.stack([cache[int(table[b, p // block_size]), p % block_size] for p in range(length)]) \
            if length else torch.zeros(0, dim, dtype=F16)
        ends = (length - queries + 1 + torch.arange(queries)).clamp(min=0).to(I32)
        logits = hal.reference.indexer_logits(q[b].double(), keys.double(), weights[b].double(),
                                              torch.zeros(queries, dtype=I32), ends)
        assert_topk_rows(out[b], logits, topk, ends)
    assert k100.runtime.calls["top_k_per_row_prefill"] == 2


def test_indexer_declines_without_kernels_or_lightop(hal_state, monkeypatch):
    register(hal_state, monkeypatch, lightop=None)
    args = (torch.ones(2, 4, 16), torch.ones(5, 16), torch.ones(2, 4), torch.zeros(2, dtype=I32),
            torch.full((2,), 5, dtype=I32), 3)
    assert rejection("indexer_topk", *args).startswith("DCU kernel not built (libglm5_hal_dcu_kernels.so not found")
    assert rejection("indexer_topk", *args).endswith("; lightop not installed (Hygon's fused-op package from DTK / the "
                                                     "DAS image)")


# -- the HIP kernels ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("op,args", [
    ("sparse_mla_attention", (torch.ones(2, 4, 576), torch.ones(3, 576), torch.zeros(2, 4, dtype=I32), 0.1, 512)),
    ("sparse_mla_decode_paged", (torch.ones(1, 1, 4, 576), torch.ones(2, 4, 576), torch.tensor([[0, 1]], dtype=I32),
                                 torch.tensor([5], dtype=I32), torch.zeros(1, 1, 4, dtype=I32), 0.1, 512)),
    ("kv_cache_write", (torch.zeros(2, 4, 8), torch.ones(3, 8), torch.tensor([0, -1, 5]))),
    ("moe_permute", (torch.ones(3, 8), torch.zeros(3, 2, dtype=I32), 4)),
    ("moe_unpermute", (torch.ones(2, 8), torch.tensor([0, 3], dtype=I32), torch.ones(2, 2))),
])
def test_kernel_ops_are_declined_while_the_dcu_kernels_are_not_built(k100, op, args):
    reason = rejection(op, *args)
    assert reason.startswith("DCU kernel not built (libglm5_hal_dcu_kernels.so not found") and "GLM5_HAL_WITH_DCU" in reason


# -- conformance -------------------------------------------------------------------------------------------
#: ops the emulated backend serves through lightop, vLLM and torch (the rest need the DCU kernels)
VENDOR_OPS = {"rms_norm", "silu_and_mul", "apply_rope", "grouped_gemm", "indexer_topk", "indexer_topk_paged"}


@pytest.mark.parametrize("card,lightop", [("K100_AI", v) for v in LIGHTOP_VERSIONS] + [("Z100L", LIGHTOP_VERSIONS[-1])])
def test_conformance_tiny_preset_on_the_emulated_backend(hal_state, monkeypatch, card, lightop):
    """Every case of every op the adapters implement: nothing fails or errors; the ops served
    by vendor functions pass through the backend's own implementation; every decline is a
    vendor constraint of those ops or the DCU kernels not being built; skips are dtypes the
    card lacks."""
    from glm5_hal.conformance import cases, plan, run_all
    backend = register(hal_state, monkeypatch, card, lightop=lightop)
    ops = [op for op in sorted(backend.impls) if op in cases.ops_with_cases()]
    assert "rms_norm" in ops
    records = run_all(plan([EMU], ops, ["tiny"]))
    assert not [(r.case, r.status, r.reason) for r in records if r.status not in ("pass", "fallback", "skip")]
    assert not [r for r in records if r.status == "fallback" and "supports() raised" in r.reason]
    assert all(r.reason.startswith("device ") for r in records if r.status == "skip")
    own = {r.op for r in records if r.status == "pass" and r.impl == f"{EMU}.{r.op}"}
    assert own == VENDOR_OPS & set(ops)
    declined = [r for r in records if r.status == "fallback"]
    assert all("DCU kernel not built" in r.reason or r.op in VENDOR_OPS for r in declined), declined


# -- what dispatch remembers with a call key ----------------------------------------------------------
def test_a_metadata_predicate_is_remembered_with_the_call_key(k100):
    """rms_norm's predicate reads dtypes, a size and the probed lightop only
    (supports_metadata): the adapter is remembered with the call key. (The per-call
    kv_cache_write is the shared CUDA-dialect adapter, whose kernels this emulator does not
    build: its per-call check is pinned in tests/test_cuda_backend.py.)"""
    g = seeded(41)
    x, w = randn(4, 64, g=g, dtype=BF16), randn(64, g=g, dtype=BF16)
    assert remembered(hal.ops.rms_norm, x, w, 1e-6) is k100.impls["rms_norm"].fn
    hal.ops.rms_norm(x, w, 1e-6)
    assert k100.runtime.calls["rmsnorm_forward_autograd"] == 2
