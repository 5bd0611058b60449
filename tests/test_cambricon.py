"""The cambricon backend: probe reasons, capabilities per MLU generation, and every adapter run
end to end against the torch_mlu_ops emulator (tests/emulators/cambricon.py) on CPU tensors,
compared with glm5_hal.reference; calls outside the vendor constraints must be declined with
a reason (dispatch then moves on) and never reach the vendor op."""
from __future__ import annotations

import contextlib
import sys
import types
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal import reference as ref
from glm5_hal.backends import cambricon as cambricon_pkg
from glm5_hal.backends.cambricon import CambriconBackend, chips, ops as mlu_ops
from emulators.cambricon import MluEmulator, MluOpError, NotEmulatedError
from emulators.sparse_decode import SparseDecodeKernelStandIn

from conftest import seeded
from emulated_helpers import remembered, same_call_key

EMU = "cambricon_emu"
BF16, F16, F32, FP8, I32 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int32


def as_plugin(backend) -> types.ModuleType:
    module = types.ModuleType("cambricon_emulated_plugin")
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    return module


def emulated(chip: str = "MLU590", kernel_library=None, **runtime_kwargs) -> CambriconBackend:
    return CambriconBackend(runtime=MluEmulator(chip, **runtime_kwargs), name=EMU, device_type="cpu",
                            priority=1000, kernel_library=kernel_library)


@pytest.fixture
def register(hal_state, monkeypatch):
    """Registers an emulated backend at run time with the cpu backend disabled, as on an
    MLU host: declined calls then reach the reference (a FallbackWarning), not cpu kernels."""
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")

    def load(backend):
        hal_state(as_plugin(backend), EMU)
        assert backend.availability().available, backend.availability().reason
        return backend
    return load


@pytest.fixture
def mlu(register):
    """An emulated MLU590 backend registered at run time; yields its runtime."""
    return register(emulated("MLU590")).runtime


@contextlib.contextmanager
def expect_fallback(reason: str):
    """The block runs the reference with a FallbackWarning naming `reason`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    messages = [str(w.message) for w in caught if issubclass(w.category, hal.FallbackWarning)]
    assert any(f"'{EMU}' declined: " in m and reason in m for m in messages), messages


def chosen(op, *args):
    return hal.explain(op, *args).chosen


def rejection(op, *args) -> str:
    return dict(hal.explain(op, *args).rejected).get(f"{EMU}.{op}", "")


def close(out, expected, dtype):
    tol = {F32: (1.3e-6, 1e-5), F16: (1e-3, 1e-5), BF16: (1.6e-2, 1e-5)}[dtype]
    torch.testing.assert_close(out.double(), expected.double(), rtol=tol[0], atol=tol[1])


def up(t):
    return t.double() if t.is_floating_point() else t


# -- probe ---------------------------------------------------------------------------------------
def test_without_torch_mlu_the_registered_backend_says_the_bridge_is_missing():
    row = next(r for r in hal.backends() if r.name == "cambricon")
    assert (row.available, row.reason, row.device_type) == (False, "bridge torch_mlu not installed", "mlu")
    assert {"rms_norm", "moe_permute", "indexer_topk_paged", "sparse_mla_decode_paged"} <= set(row.ops)


def fake_module(tmp_path, monkeypatch, name: str, body: str) -> None:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Recorded as absent, so the fake module leaves sys.modules again after the test.
    monkeypatch.setitem(sys.modules, name, None)
    del sys.modules[name]


def test_missing_neuware_library_is_named_before_importing_the_bridge(tmp_path, monkeypatch):
    fake_module(tmp_path, monkeypatch, "torch_mlu", "raise SystemExit('imported torch_mlu')\n")
    monkeypatch.setattr(chips, "NEUWARE_LIBRARIES", ("libcnrt_not_here_glm5.so",))
    availability = CambriconBackend().availability()
    assert not availability.available
    assert availability.reason.startswith("runtime library missing: libcnrt_not_here_glm5.so")
    assert "NEUWARE_HOME" in availability.reason
    assert "torch_mlu" not in sys.modules


def test_this_machine_has_no_libcnrt():
    reason = CambriconBackend().missing_runtime_library()
    assert reason is not None and reason.startswith("runtime library missing: libcnrt.so")


def test_import_error_of_the_bridge_names_the_library(tmp_path, monkeypatch):
    fake_module(tmp_path, monkeypatch, "torch_mlu", "raise ImportError('libcndev.so: cannot open shared object "
                                                    "file: No such file or directory')\n")
    monkeypatch.setattr(chips, "NEUWARE_LIBRARIES", ("libc.so.6",))   # the pre-check passes here
    reason = CambriconBackend().availability().reason
    assert reason.startswith("runtime library missing: libcndev.so (torch_mlu is installed")


@pytest.mark.parametrize("tmo_body,expected", [
    (None, "torch_mlu_ops not installed (Cambricon's fused-op library"),
    ("raise ImportError('undefined symbol: cnnlCreate')\n",
     "importing torch_mlu_ops failed: ImportError: undefined symbol: cnnlCreate"),
    ("__version__ = '1.12.1'\n", "torch_mlu imported but registered no torch.mlu device module"),
])
def test_the_fused_op_library_and_the_device_module_are_required(tmp_path, monkeypatch, tmo_body, expected):
    assert not hasattr(torch, "mlu")
    fake_module(tmp_path, monkeypatch, "torch_mlu", "__version__ = '1.26.0'\n")
    if tmo_body is not None:
        fake_module(tmp_path, monkeypatch, "torch_mlu_ops", tmo_body)
    else:
        monkeypatch.setattr(cambricon_pkg, "TMO_MODULE", "torch_mlu_ops_not_installed_glm5")
        expected = expected.replace("torch_mlu_ops", "torch_mlu_ops_not_installed_glm5")
    monkeypatch.setattr(chips, "NEUWARE_LIBRARIES", ("libc.so.6",))
    availability = CambriconBackend().availability()
    assert not availability.available
    assert availability.reason.startswith(expected)


@pytest.mark.parametrize("chip,kwargs,expected", [
    ("MLU590", {"devices": 0}, "no MLU device visible (torch.mlu.device_count() == 0; check `cnmon` and "
                               "MLU_VISIBLE_DEVICES)"),
    ("MLU590", {"tmo_version": "1.11.3+torch2.5.0"},
     "torch_mlu_ops 1.11.3+torch2.5.0 is too old: the adapters follow the torch_mlu_ops 1.12 op semantics"),
    ("MLU590", {"tmo_version": ""}, "torch_mlu_ops (no __version__) is too old"),
    ("MLU290", {}, "unsupported MLU MLU290-M5 (capability 2.0); the cambricon backend needs capability >= 3.0 "
                   "(MLU370 or newer)"),
])
def test_probe_gives_a_specific_reason(chip, kwargs, expected):
    availability = emulated(chip, **kwargs).availability()
    assert not availability.available
    assert availability.reason.startswith(expected)


@pytest.mark.parametrize("chip,label,bf16,fp8", [
    ("MLU370", "MLU370 class (mtp_372)", False, False),
    ("MLU590", "MLU590 class (mtp_592)", True, False),
    ("cap6", "capability 6.x", True, True),
])
def test_capabilities_per_generation(chip, label, bf16, fp8):
    backend = emulated(chip)
    emulator = backend.runtime
    assert backend.availability().reason == (
        f"EMULATED (MluEmulator): 8 x {emulator.device_name} ({label}, capability "
        f"{emulator.capability[0]}.{emulator.capability[1]}), torch_mlu_ops 1.12.1+torch2.11.0")
    caps = backend.cached_capabilities()
    assert caps.dist_backend == "cncl" and caps.device_name == emulator.device_name
    assert caps.dtypes == {F32, F16, torch.int8} | ({BF16} if bf16 else set()) | ({FP8} if fp8 else set())
    assert (caps.limits["generation"], caps.limits["bf16"], caps.limits["fp8"]) == (label, bf16, fp8)
    assert caps.limits["fp8_source"] == ("torch.mlu.is_fp8_supported() is True" if fp8 else
                                         "this torch_mlu has no is_fp8_supported() (the public torch_mlu @d578002c "
                                         "has none), so none is declared")
    assert caps.limits["bang_kernels"].startswith("cambricon kernel not built")
    assert backend.versions()["torch_mlu_ops"] == "1.12.1+torch2.11.0"


def test_fp8_is_declared_only_by_the_installed_torch_mlu(register):
    """No public source ties FP8 to a capability major: a capability-6 MLU whose torch_mlu
    has no is_fp8_supported() (like the public one) gets no FP8; one that says False neither."""
    for query in (None, False):
        backend = emulated("cap6", fp8_query=query)
        assert backend.availability().available and FP8 not in backend.cached_capabilities().dtypes


@pytest.mark.parametrize("version,why", [
    ("1.12.0", "torch_mlu_ops 1.12.0 is older than 1.12.1, the oldest version tmo_api was read from"),
    ("1.13.0+torch2.12.0", "torch_mlu_ops 1.13.0+torch2.12.0 is newer than 1.12.1, the newest version tmo_api was "
                           "verified against"),
])
def test_a_torch_mlu_ops_other_than_the_public_one_narrows_every_tmo_adapter(register, version, why):
    """Only torch_mlu_ops 1.12.1 is public, so the argument orders of other versions are
    unknown: every adapter calling tmo declines, saying so; glm5_hal's own kernel stays."""
    backend = register(emulated("MLU590", tmo_version=version))
    assert backend.availability().reason.endswith(f"; narrowed to what is verified (tmo_api: {why})")
    x = torch.randn(3, 16)
    for op, args in (("rms_norm", (x, torch.ones(16), 1e-5)), ("silu_and_mul", (x,)),
                     ("moe_permute", (x, torch.zeros(3, 1, dtype=I32), 2)),
                     ("grouped_gemm", (x, torch.randn(1, 4, 16), torch.tensor([3], dtype=I32)))):
        assert rejection(op, *args) == f"tmo_api unverified here: {why}", op
    assert not backend.runtime.tmo.calls


def test_bf16_is_refused_on_an_mlu370_with_a_capability_reason(register):
    register(emulated("MLU370"))
    x, w = torch.randn(3, 16).to(BF16), torch.ones(16, dtype=BF16)
    assert rejection("rms_norm", x, w, 1e-5) == ("device MLU370-X8 does not support bfloat16 "
                                                 "(capabilities: {float16, float32, int8})")
    with expect_fallback("does not support bfloat16"):
        out = hal.ops.rms_norm(x, w, 1e-5)
    close(out, ref.rms_norm(up(x), up(w), 1e-5), BF16)
    assert chosen("rms_norm", x.to(F16), w.to(F16), 1e-5) == f"{EMU}.rms_norm"


def test_the_emulated_chip_rejects_dtypes_it_lacks():
    tmo = MluEmulator("MLU370").tmo
    with pytest.raises(MluOpError, match="bfloat16 is not supported on capability 3"):
        tmo.active(torch.ones(2, 4, dtype=BF16), "silu", True)


# -- common ops ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_rms_norm(mlu, dtype):
    g = seeded(1)
    x = torch.randn(2, 5, 96, generator=g).to(dtype)[:, :, :80]   # non-contiguous
    w = (torch.rand(80, generator=g) + 0.5).to(dtype)
    assert chosen("rms_norm", x, w, 1e-5) == f"{EMU}.rms_norm"
    close(hal.ops.rms_norm(x, w, 1e-5), ref.rms_norm(up(x), up(w), 1e-5), dtype)
    assert mlu.tmo.calls["fused_rms_norm"] == 1
    assert hal.ops.rms_norm(x[:0], w, 1e-5).shape == (0, 5, 80)


def test_rms_norm_takes_any_weight_for_float32_but_declines_a_rounding_cast(mlu):
    g = seeded(2)
    x = torch.randn(4, 32, generator=g)
    w = torch.rand(32, generator=g).to(BF16)
    assert chosen("rms_norm", x, w, 1e-6) == f"{EMU}.rms_norm"
    close(hal.ops.rms_norm(x, w, 1e-6), ref.rms_norm(up(x), up(w), 1e-6), F32)
    half = x.to(F16)
    assert rejection("rms_norm", half, w.float(), 1e-6) == ("tmo.fused_rms_norm takes gamma in x's dtype; casting "
                                                            "the float32 weight to float16 would round it")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_silu_and_mul_keeps_the_gate_first(mlu, dtype):
    x = torch.randn(3, 4, 2 * 24, generator=seeded(3)).to(dtype)
    close(hal.ops.silu_and_mul(x), ref.silu_and_mul(up(x)), dtype)
    assert mlu.tmo.calls["active"] == 1


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_apply_rope_is_exact_at_large_and_negative_positions(mlu, interleaved, dtype):
    g = seeded(4)
    x = torch.randn(6, 3, 64, generator=g).to(dtype)
    pos = torch.tensor([0, 1, 4097, 131071, -5, 202751])
    before = x.clone()
    out = hal.ops.apply_rope(x, pos, 1e6, interleaved)
    assert torch.equal(x, before), "the caller's x must not be rotated in place"
    close(out, ref.apply_rope(up(x), pos, 1e6, interleaved), dtype)
    assert mlu.tmo.calls["apply_rotary"] == 1


def test_apply_rope_declines_a_head_size_over_256(mlu):
    x, pos = torch.randn(2, 1, 258), torch.arange(2)
    assert rejection("apply_rope", x, pos, 1e4, True) == "tmo.apply_rotary takes head_size <= 256, got a rotary dim of 258"


# -- MoE -----------------------------------------------------------------------------------------
def route_matches(logits, args):
    weights, ids = hal.ops.moe_route(logits, *args)
    ref_weights, ref_ids = ref.moe_route(up(logits), *args)
    assert torch.equal(ids.sort(dim=1).values, ref_ids.sort(dim=1).values)
    order, ref_order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    torch.testing.assert_close(weights.gather(1, order).double(), ref_weights.gather(1, ref_order),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("args", [
    ("bias", 8, 4, 2, 2.5, True, "sigmoid"),       # DeepSeek-V3 style grouped routing
    ("bias", 8, 1, 1, 2.5, True, "sigmoid"),       # GLM-5: one group
    (None, 8, 4, 2, 1.0, False, "sigmoid"),
    ("bias", 3, 1, 1, 1.5, True, "softmax"),
    (None, 3, 1, 1, 1.0, False, "softmax"),
])
def test_moe_route(mlu, args):
    g = seeded(5)
    logits = torch.randn(33, 32, generator=g)
    bias = torch.randn(32, generator=g) * 0.3
    route_matches(logits, (bias if args[0] == "bias" else None, *args[1:]))


def test_grouped_sigmoid_routing_without_bias_scores_groups_by_their_best_two(mlu):
    # Group 0 holds one high score, group 1 two medium ones: by best-one group 0 wins, by
    # best-two (the contract) group 1 does.
    logits = torch.tensor([[3.0, -4.0, -4.0, -4.0, 1.5, 1.5, -4.0, -4.0]])
    args = (None, 2, 2, 1, 1.0, True, "sigmoid")
    _, ids = hal.ops.moe_route(logits, *args)
    assert sorted(ids[0].tolist()) == [4, 5] == sorted(ref.moe_route(logits, *args)[1][0].tolist())


def test_renormalised_sigmoid_routing_declines_underflowing_scores(mlu):
    logits = torch.full((2, 8), -200.0)
    assert rejection("moe_route", logits, None, 2, 1, 1, 1.0, True, "sigmoid") == (
        "logits below -80: their float32 sigmoid scores underflow, and tmo.moe_sigmoid_topk renormalises by a "
        "plain sum (0/0 is NaN; the contract adds 1e-20)")
    assert chosen("moe_route", logits, None, 2, 1, 1, 1.0, False, "sigmoid") == f"{EMU}.moe_route"
    weights, _ = MluEmulator().tmo.moe_sigmoid_topk(logits, 2, normalize=True)
    assert bool(weights.isnan().all())   # what the decline avoids


def test_grouped_softmax_routing_is_declined(mlu):
    logits = torch.randn(2, 8)
    reason = rejection("moe_route", logits, None, 2, 2, 1, 1.0, True, "softmax")
    assert reason.startswith("tmo.moe_softmax_topk scores an expert group by its best expert")


@pytest.mark.parametrize("order", ["stable", "reversed"])
def test_moe_permute_matches_the_contract_order(register, order):
    backend = register(emulated("MLU590", gen_idx_order=order))
    g = seeded(6)
    x = torch.randn(17, 24, generator=g).to(BF16)
    ids = torch.randint(0, 6, (17, 3), generator=g, dtype=I32)
    ids[2, 1], ids[5, 0], ids[9, 2] = -1, 6, 11     # dropped: padding and other ranks' experts
    out, expected = hal.ops.moe_permute(x, ids, 6), ref.moe_permute(x, ids, 6)
    for got, want in zip(out, expected):
        assert torch.equal(got, want)
    assert backend.runtime.tmo.calls["moe_gen_idx"] == backend.runtime.tmo.calls["moe_expand_input"] == 1


def test_moe_permute_edge_cases(mlu):
    x = torch.randn(4, 8)
    for ids in (torch.full((4, 2), -1, dtype=I32), torch.zeros((0, 2), dtype=I32)):
        xs = x[: ids.shape[0]]
        for got, want in zip(hal.ops.moe_permute(xs, ids, 3), ref.moe_permute(xs, ids, 3)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_moe_unpermute(mlu, dtype):
    g = seeded(7)
    ids = torch.randint(-1, 5, (11, 4), generator=g, dtype=I32)
    _, _, src = ref.moe_permute(torch.zeros(11, 1), ids, 5)
    y = torch.randn(src.shape[0], 40, generator=g).to(dtype)
    weights = torch.rand(11, 4, generator=g)
    close(hal.ops.moe_unpermute(y, src, weights), ref.moe_unpermute(up(y), src, weights.double()), dtype)
    assert mlu.tmo.calls["moe_combine_result"] == 1


def test_moe_unpermute_declines_repeated_slots(mlu):
    y, src, weights = torch.randn(3, 4), torch.tensor([0, 2, 2], dtype=I32), torch.rand(2, 2)
    assert rejection("moe_unpermute", y, src, weights) == ("src repeats a (token, slot) index; "
                                                            "tmo.moe_combine_result combines one row per pair")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_grouped_gemm_with_empty_experts(mlu, dtype):
    g = seeded(8)
    counts = torch.tensor([3, 0, 5, 0, 1], dtype=I32)
    x = torch.randn(9, 48, generator=g).to(dtype)
    w = torch.randn(5, 20, 48, generator=g).to(dtype)
    close(hal.ops.grouped_gemm(x, w, counts), ref.grouped_gemm(up(x), up(w), counts), dtype)
    assert mlu.tmo.calls["group_gemm"] == 1


def test_grouped_gemm_declines_float32_while_tf32_is_on(register):
    register(emulated("MLU590", fp32_precision="tf32"))
    x, w, counts = torch.randn(4, 8), torch.randn(2, 3, 8), torch.tensor([1, 3], dtype=I32)
    assert rejection("grouped_gemm", x, w, counts) == ("tmo.group_gemm would run this float32 GEMM in TF32 "
                                                       "(torch.backends.mlu.matmul.fp32_precision is 'tf32')")
    assert chosen("grouped_gemm", x.to(BF16), w.to(BF16), counts) == f"{EMU}.grouped_gemm"


def test_the_emulated_group_gemm_really_rounds_to_tf32():
    emulator = MluEmulator("MLU590", fp32_precision="tf32")
    a, b = torch.full((1, 1), 1 + 2**-12), torch.ones(1, 1, 1)
    assert emulator.tmo.group_gemm(a, b, torch.tensor([1], dtype=I32), None, None, None, None, 1).item() == 1.0


# -- KV cache ------------------------------------------------------------------------------------
def test_kv_cache_write_compares_the_whole_cache(mlu):
    g = seeded(9)
    cache = torch.randn(5, 4, 36, generator=g).to(BF16)
    values = torch.randn(6, 36, generator=g).to(BF16)
    for slots in (torch.tensor([3, -1, 19, 0, -1, 8], dtype=I32), torch.tensor([1, 2, -1, 4, 5, 6])):
        got, want = cache.clone(), cache.clone()
        hal.ops.kv_cache_write(got, values, slots)
        ref.kv_cache_write(want, values, slots)
        assert torch.equal(got, want)
    assert mlu.tmo.calls["reshape_paged_cache"] == 2


def test_kv_cache_write_and_gather_move_fp8_rows_as_bytes(register):
    backend = register(emulated("cap6"))
    g = seeded(10)
    cache = torch.randn(3, 4, 16, generator=g).to(FP8)
    values = torch.randn(5, 16, generator=g).to(FP8)
    slots = torch.tensor([11, 0, -1, 5, 6], dtype=I32)
    got, want = cache.clone(), cache.clone()
    hal.ops.kv_cache_write(got, values, slots)
    ref.kv_cache_write(want, values, slots)
    assert torch.equal(got.view(torch.int8), want.view(torch.int8))
    table, lens = torch.tensor([[2, 0], [1, -1]], dtype=I32), torch.tensor([7, 3], dtype=I32)
    assert torch.equal(hal.ops.kv_cache_gather(got, table, lens).view(torch.int8),
                       ref.kv_cache_gather(want, table, lens).view(torch.int8))
    assert backend.runtime.tmo.calls["reshape_from_cache"] == 1


def test_kv_cache_gather(mlu):
    g = seeded(11)
    cache = torch.randn(6, 4, 12, generator=g).to(F16)
    table = torch.tensor([[5, 1, -1], [0, 3, 2], [4, -1, -1]], dtype=I32)
    lens = torch.tensor([6, 9, 0], dtype=I32)
    assert torch.equal(hal.ops.kv_cache_gather(cache, table, lens), ref.kv_cache_gather(cache, table, lens))
    strided = torch.randn(6, 4, 24)[:, :, :12]
    assert rejection("kv_cache_gather", strided, table, lens).startswith(
        "tmo.reshape_from_cache reads a contiguous paged cache")


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_indexer_k_cache_write_on_an_fp8_mlu(register, scale_fmt):
    """Quantised on the device by the contract's rule (scale floor, ue8m0 when asked), rows and
    scales written with tmo.reshape_paged_cache, which skips -1 slots: no host read, nothing
    declined (tmo.quant_to_paged_cache has no floor, no ue8m0 and no documented -1 slots)."""
    backend = register(emulated("cap6"))
    g = seeded(12)
    k = torch.randn(5, 128, generator=g).to(BF16)
    k[3] = 1e-6                                   # below the 1e-4 amax floor
    slots = torch.tensor([3, -1, 0, 9, 4], dtype=I32)
    got = (torch.zeros(3, 4, 128, dtype=FP8), torch.zeros(3, 4))
    want = (got[0].clone(), got[1].clone())
    assert chosen("indexer_k_cache_write", k, got[0], got[1], slots, scale_fmt) == f"{EMU}.indexer_k_cache_write"
    hal.ops.indexer_k_cache_write(k, got[0], got[1], slots, scale_fmt)
    ref.indexer_k_cache_write(k, want[0], want[1], slots, scale_fmt)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.int8), want[0].view(torch.int8))
    assert backend.runtime.tmo.calls["reshape_paged_cache"] == 2


def test_indexer_k_cache_write_needs_a_declared_fp8_mlu(mlu):
    k, cache, scale = torch.randn(2, 128).to(BF16), torch.zeros(2, 4, 128, dtype=FP8), torch.zeros(2, 4)
    assert rejection("indexer_k_cache_write", k, cache, scale, torch.tensor([0, 1], dtype=I32), None) == (
        "MLU590 (capability 5.0) has no FP8: this torch_mlu has no is_fp8_supported() (the public torch_mlu "
        "@d578002c has none), so none is declared")


# -- DSA -----------------------------------------------------------------------------------------
def check_topk_rows(out, logits, counts, topk, tau):
    """The conformance rule for top-k outputs: distinct in-range entries, left-packed, -1 after,
    min(topk, count) valid, each within tau of the k-th best score."""
    assert out.dtype == I32 and out.shape[-1] == topk
    for row, scores, count in zip(out.reshape(-1, topk), logits.reshape(-1, logits.shape[-1]), counts.reshape(-1)):
        n = min(topk, int(count))
        assert bool((row[:n] >= 0).all()) and bool((row[n:] == -1).all()), (row, n)
        keys = row[:n].long()
        assert keys.unique().numel() == n
        if n:
            assert bool(torch.isfinite(scores[keys]).all())
            assert bool((scores[keys] >= scores.topk(n).values[-1] - tau).all())


def paged_keys(g, lens, block_size, dim, dtype):
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(lens), max(blocks_per_seq)), -1, dtype=I32)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        table[b, :nb] = perm[used:used + nb].to(I32)
        used += nb
    cache = torch.randn(num_blocks, block_size, dim, generator=g).to(dtype)
    return cache, table


@pytest.mark.parametrize("heads", [8, 32, 48])
def test_indexer_topk_paged(mlu, heads):
    g = seeded(13)
    lens = [37, 5, 70]
    cache, table = paged_keys(g, lens, 16, 128, BF16)
    q = torch.randn(3, 2, heads, 128, generator=g).to(BF16)
    weights = torch.randn(3, 2, heads, generator=g).to(F16).float()
    context = torch.tensor(lens, dtype=I32)
    topk = 16
    out = hal.ops.indexer_topk_paged(q, cache, weights, table, context, topk)
    assert mlu.tmo.calls["masked_indexer_select_paged_kv"] == 1
    keys = ref.kv_cache_gather(cache, table, context).double()
    starts = torch.tensor([0, 37, 42])
    logits = torch.full((3, 2, max(lens)), float("-inf"), dtype=torch.float64)
    counts = torch.zeros(3, 2, dtype=torch.long)
    for b, n in enumerate(lens):
        for i in range(2):
            visible = n - 2 + i + 1
            k = keys[starts[b]:starts[b] + visible]
            logits[b, i, :visible] = (torch.relu(up(q[b, i]) @ k.T) * weights[b, i, :, None].double()).sum(0)
            counts[b, i] = visible
    check_topk_rows(out, logits, counts, topk, tau=1e-3 * logits[torch.isfinite(logits)].abs().max())


def test_indexer_topk_paged_declines(mlu):
    g = seeded(14)
    cache, table = paged_keys(g, [20], 16, 128, BF16)
    context = torch.tensor([20], dtype=I32)
    q, w = torch.randn(1, 2, 8, 128).to(BF16), torch.rand(1, 2, 8)
    assert rejection("indexer_topk_paged", q, (cache.to(FP8), torch.ones(cache.shape[:2])), w, table, context, 4) \
        .startswith("FP8 keys: tmo.masked_indexer_select_paged_kv takes a quantised key cache together with")
    q64 = torch.randn(1, 2, 8, 64).to(BF16)
    assert rejection("indexer_topk_paged", q64, cache[..., :64].contiguous(), w, table, context, 4) == (
        "tmo.masked_indexer_select_paged_kv needs head_size 128, got 64")
    many = torch.randn(1, 2, 65, 128).to(BF16)
    assert rejection("indexer_topk_paged", many, cache, torch.rand(1, 2, 65), table, context, 4) == (
        "tmo.masked_indexer_select_paged_kv takes at most 64 heads, got 65")


def test_indexer_topk_paged_with_contexts_shorter_than_the_queries(mlu):
    """Query i of N sees [0, ctx - N + i + 1): with ctx < N the first queries see nothing. Each
    (sequence, query) is its own decode row, so no row asks the op for more queries than keys,
    and nothing about the lengths is read on the host."""
    g = seeded(15)
    cache, table = paged_keys(g, [2, 9], 16, 128, BF16)
    context = torch.tensor([2, 0], dtype=I32)
    q, w = torch.randn(2, 3, 8, 128, generator=g).to(BF16), torch.rand(2, 3, 8, generator=g)
    assert chosen("indexer_topk_paged", q, cache, w, table, context, 4) == f"{EMU}.indexer_topk_paged"
    out = hal.ops.indexer_topk_paged(q, cache, w, table, context, 4)
    assert out[0, 0].tolist() == [-1] * 4 and bool(out[1].eq(-1).all())
    assert sorted(out[0, 1].tolist()) == [-1, -1, -1, 0] and sorted(out[0, 2].tolist()) == [-1, -1, 0, 1]


def sparse_decode_inputs(g, dtype):
    lens = [9, 40]
    cache, table = paged_keys(g, lens, 8, 96, dtype)
    q = torch.randn(2, 2, 5, 96, generator=g).to(dtype)
    indices = torch.randint(-3, 45, (2, 2, 12), generator=g, dtype=I32)
    indices[0, 1] = -1                                         # a row with nothing valid
    return q, cache, table, torch.tensor(lens, dtype=I32), indices


def test_sparse_mla_decode_paged_declines_until_the_kernel_is_built(mlu):
    q, cache, table, lens, indices = sparse_decode_inputs(seeded(15), BF16)
    assert rejection("sparse_mla_decode_paged", q, cache, table, lens, indices, 0.1, 64).startswith(
        "cambricon kernel not built (libglm5_hal_cambricon_kernels.so not found")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_sparse_mla_decode_paged_through_the_kernel_interface(register, dtype):
    stand_in = SparseDecodeKernelStandIn()
    register(emulated("MLU590", kernel_library=stand_in))
    q, cache, table, lens, indices = sparse_decode_inputs(seeded(16), dtype)
    out, lse = hal.ops.sparse_mla_decode_paged(q, cache, table, lens, indices, 96 ** -0.5, 64)
    want_out, want_lse = ref.sparse_mla_decode_paged(up(q), up(cache), table, lens, indices, 96 ** -0.5, 64)
    close(out, want_out, dtype)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert stand_in.launches == 1
    too_wide = torch.randn(1, 1, 2, 1032).to(dtype)
    one_block = torch.tensor([[0]], dtype=I32), torch.tensor([8], dtype=I32)
    assert rejection("sparse_mla_decode_paged", too_wide, torch.randn(1, 8, 1032).to(dtype), *one_block,
                     indices[:1, :1], 0.1, 64) == "the BANG C sparse decode kernel takes Dqk <= 1024, got 1032"


def test_every_vendor_limit_is_reported(mlu):
    limits = hal.get_backend(EMU).cached_capabilities().limits
    assert set(mlu_ops.OP_LIMITS) <= set(limits)


# -- the conformance suite over the emulated backend -----------------------------------------------
@pytest.mark.parametrize("chip", ["MLU370", "MLU590", "cap6"])
def test_conformance_tiny_preset_on_the_emulated_backend(register, chip):
    """Every case of every op the adapters implement passes, or is declined (a vendor
    constraint, an undeclared dtype or a dtype the chip lacks: a `fallback` or `skip` with the
    reason), and every op with cases passes at least one. Nothing fails or errors."""
    from glm5_hal.conformance import cases, plan, run_all
    backend = register(emulated(chip))
    ops = [op for op in sorted(backend.impls) if op in cases.ops_with_cases()]
    assert "rms_norm" in ops
    records = run_all(plan([EMU], ops, ["tiny"]))
    broken = [(r.case, r.status, r.reason) for r in records if r.status not in ("pass", "fallback", "skip")]
    assert not broken
    assert not [r for r in records if "supports() raised" in r.reason]
    # expected-error cases pass before any implementation runs (impl ""): not the adapter's pass
    passed = {r.op for r in records if r.status == "pass" and r.impl}
    assert passed == {r.op for r in records} - declined_everywhere(chip), passed
    assert all(r.impl == f"{EMU}.{r.op}" for r in records if r.status == "pass" and r.impl)


def declined_everywhere(chip: str) -> set[str]:
    """Ops this emulated backend declines for every tiny input: the BANG C kernel is not built
    here, FP8 needs an MLU that declares it."""
    ops = {"sparse_mla_decode_paged",
           "fp8_grouped_gemm"}   # per-block FP8 needs N % 128 == 0: no tiny grouped case has it
    if chip != "cap6":
        ops |= {"indexer_k_cache_write", "fp8_block_gemm"}
    return ops


# -- the tiny GLM-5 model on the emulated backend --------------------------------------------------
def run_tiny_model(backend_name: str, dtype=torch.float32, **overrides):
    from glm5_hal.models import GLM5Config, GLM5ForCausalLM
    model = GLM5ForCausalLM(GLM5Config.tiny(**overrides), seed=3, dtype=dtype)
    prompts = [torch.randint(0, 512, (n,), generator=seeded(n)).tolist() for n in (9, 4)]
    with hal.use(backend_name), warnings.catch_warnings():
        warnings.simplefilter("ignore", hal.FallbackWarning)
        cache = model.new_cache(12, 4)
        out = [model.prefill(cache, ["a", "b"], prompts)]
        out += [model.decode(cache, ["a", "b"], [t, t]) for t in (5, 77, 301)]
    return torch.cat(out).float()


@pytest.mark.slow
def test_the_tiny_glm5_model_runs_on_the_emulated_backend(mlu):
    logits = run_tiny_model(EMU)
    for op in ("fused_rms_norm", "apply_rotary", "active", "moe_sigmoid_topk", "moe_gen_idx", "moe_expand_input",
               "group_gemm", "moe_combine_result", "reshape_paged_cache"):
        assert mlu.tmo.calls[op] > 0, op
    torch.testing.assert_close(logits, run_tiny_model("reference"), atol=1e-3, rtol=1e-3)


@pytest.mark.slow
def test_the_tiny_glm5_model_uses_the_vendor_indexer_in_bfloat16(mlu):
    logits = run_tiny_model(EMU, torch.bfloat16, index_head_dim=128)
    assert mlu.tmo.calls["masked_indexer_select_paged_kv"] > 0
    reference = run_tiny_model("reference", torch.bfloat16, index_head_dim=128)
    assert torch.nn.functional.cosine_similarity(logits, reference, dim=-1).min() > 0.99


# -- the ctypes side of kernels.py, against a compiled stand-in library ------------------------------
STUB_SOURCE = r"""
#include "glm5_hal_kernel_abi.h"
int glm5_hal_sparse_mla_decode_paged(const glm5_hal_sparse_mla_decode_args* a, void* queue) {
  /* Echo the scalar arguments into lse (host memory here) so the test can read what arrived. */
  float got[12] = {(float)a->batch, (float)a->queries_per_seq, (float)a->heads, (float)a->dqk, (float)a->d_v,
                   (float)a->topk, (float)a->num_blocks, (float)a->block_size, (float)a->max_blocks, a->sm_scale,
                   (float)a->dtype, (float)(a->context_lens[0] + a->indices[0])};
  for (int i = 0; i < 12; ++i) a->lse[i] = got[i];
  return queue == (void*)0 ? 0 : 7;
}
"""


@pytest.fixture
def stub_library(tmp_path):
    import shutil
    import subprocess
    from glm5_hal.kernel_library import INCLUDE_DIR
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in kernel library")
    source, library = tmp_path / "stub.c", tmp_path / "libstub.so"
    source.write_text(STUB_SOURCE)
    subprocess.run([compiler, "-shared", "-fPIC", "-O0", "-I", str(INCLUDE_DIR), str(source), "-o", str(library)],
                   check=True)
    return library


def test_kernels_py_passes_pointers_sizes_and_the_queue(stub_library):
    from glm5_hal.backends.cambricon.kernels import KernelLibrary
    library = KernelLibrary(stub_library)
    assert library.missing() is None and library.status() == f"built ({stub_library.name})"
    q, cache = torch.zeros(2, 3, 4, 20, dtype=BF16), torch.zeros(7, 16, 20, dtype=BF16)
    table, lens = torch.zeros(2, 5, dtype=I32), torch.tensor([9, 2], dtype=I32)
    indices = torch.full((2, 3, 6), 4, dtype=I32)
    out, lse = library.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.25, 12, 0)
    assert lse.flatten()[:12].tolist() == [2, 3, 4, 20, 12, 6, 7, 16, 5, 0.25, 2, 13]
    with pytest.raises(RuntimeError, match="failed with status 7"):
        library.sparse_mla_decode_paged(q, cache, table, lens, indices, 0.25, 12, 1)


def test_a_kernel_library_that_does_not_load_is_a_reason(tmp_path):
    from glm5_hal.backends.cambricon.kernels import KernelLibrary
    broken = tmp_path / "libglm5_hal_cambricon_kernels.so"
    broken.write_text("not an ELF file")
    assert KernelLibrary(broken).missing().startswith("cambricon kernel library does not load: ")


# -- the checkpoints' quantized GEMMs: tmo.smooth_quant_group_gemm ---------------------------------
def int8_inputs(g, m=9, n=24, k=40, experts=None):
    x, x_scale = ref.int8_quant(torch.randn(m, k, generator=g))
    shape = (n, k) if experts is None else (experts, n, k)
    w = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    return x, x_scale, w, torch.rand(*shape[:-1], generator=g) * 0.01 + 0.001


def fp8_inputs(g, m=7, n=256, k=384, experts=None):
    a, a_scale = ref.fp8_block_quant(torch.randn(m, k, generator=g), 128)
    shape = (n, k) if experts is None else (experts, n, k)
    w = (torch.randn(*shape, generator=g) * 100).clamp(-448, 448).to(FP8)
    return a, a_scale, w, torch.rand(*shape[:-2], -(-n // 128), k // 128, generator=g) * 0.01 + 0.001


@pytest.mark.parametrize("out_dtype", [BF16, F16])
def test_int8_gemms_through_smooth_quant_group_gemm(mlu, out_dtype):
    g = seeded(40)
    x, x_scale, w, w_scale = int8_inputs(g)
    args = (x, x_scale, w, w_scale, out_dtype, None)
    assert chosen("int8_gemm", *args) == f"{EMU}.int8_gemm"
    close(hal.ops.int8_gemm(*args), ref.int8_gemm(*args), out_dtype)
    counts = torch.tensor([4, 0, 3, 2], dtype=I32)
    x, x_scale, w, w_scale = int8_inputs(g, experts=4)
    grouped = (x, x_scale, w, w_scale, counts, out_dtype)
    assert chosen("int8_grouped_gemm", *grouped) == f"{EMU}.int8_grouped_gemm"
    close(hal.ops.int8_grouped_gemm(*grouped), ref.int8_grouped_gemm(*grouped), out_dtype)
    assert mlu.tmo.calls["smooth_quant_group_gemm"] == 2


def test_int8_gemms_decline_a_float32_output_or_bias(mlu):
    x, x_scale, w, w_scale = int8_inputs(seeded(41))
    assert rejection("int8_gemm", x, x_scale, w, w_scale, F32, None) == (
        "tmo.smooth_quant_group_gemm writes half or bfloat16 only (its dtype argument), not float32")
    assert rejection("int8_gemm", x, x_scale, w, w_scale, BF16, torch.zeros(24)) == (
        "tmo.smooth_quant_group_gemm takes its bias in half/bfloat16 (Type: bias): the float32 bias would round "
        "before it is added")


def test_fp8_gemms_through_the_per_block_mode_on_an_fp8_mlu(register):
    backend = register(emulated("cap6"))
    g = seeded(42)
    a, a_scale, w, w_scale = fp8_inputs(g)
    args = (a, a_scale, w, w_scale, BF16)
    assert chosen("fp8_block_gemm", *args) == f"{EMU}.fp8_block_gemm"
    close(hal.ops.fp8_block_gemm(*args), ref.fp8_block_gemm(*args), BF16)
    counts = torch.tensor([2, 0, 5], dtype=I32)
    a, a_scale, w, w_scale = fp8_inputs(g, experts=3)
    grouped = (a, a_scale, w, w_scale, counts, F16)
    close(hal.ops.fp8_grouped_gemm(*grouped), ref.fp8_grouped_gemm(*grouped), F16)
    assert backend.runtime.tmo.calls["smooth_quant_group_gemm"] == 2
    a, a_scale, w, w_scale = fp8_inputs(g, n=200)
    assert rejection("fp8_block_gemm", a, a_scale, w, w_scale, BF16) == (
        "tmo.smooth_quant_group_gemm's per-block FP8 mode needs N a whole number of blocks (n_block * "
        "n_block_size == n), got N = 200")


# -- what dispatch remembers with a call key ----------------------------------------------------------
def test_a_metadata_predicate_is_remembered_with_the_call_key_and_the_tf32_switch_is_read_per_call(mlu):
    """rms_norm's predicate reads dtypes and the probed tmo version only (supports_metadata):
    the adapter is remembered with the call key. grouped_gemm's reads the MLU's TF32 switch,
    which can change between two calls with one key: turned on, the next float32 call is
    declined."""
    backend = hal.get_backend(EMU)
    g = seeded(41)
    x, w = torch.randn(4, 80, generator=g), torch.rand(80, generator=g) + 0.5
    assert remembered(hal.ops.rms_norm, x, w, 1e-5) is backend.impls["rms_norm"].fn
    hal.ops.rms_norm(x, w, 1e-5)
    assert mlu.tmo.calls["fused_rms_norm"] == 2

    x, w, counts = torch.randn(4, 8, generator=g), torch.randn(2, 3, 8, generator=g), torch.tensor([1, 3], dtype=I32)
    assert remembered(hal.ops.grouped_gemm, x, w, counts) is None
    assert mlu.tmo.calls["group_gemm"] == 1
    mlu.backends.mlu.matmul.fp32_precision = "tf32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hal.FallbackWarning)
        got = hal.ops.grouped_gemm(x, w, counts)
    assert same_call_key(hal.ops.grouped_gemm) and mlu.tmo.calls["group_gemm"] == 1
    torch.testing.assert_close(got, ref.grouped_gemm(x, w, counts))
