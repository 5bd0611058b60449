"""The Moore Threads MUSA backend: probe reasons, capabilities per generation, and every
adapter run end to end against the MUSA emulator (tests/emulators/musa.py) on CPU tensors,
compared with glm5_hal.reference; calls outside the vendor constraints must be declined
with a reason (dispatch then moves on) and never reach the vendor function."""
from __future__ import annotations

import contextlib
import math
import sys
import types
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backends._cuda_dialect import GpuKernelLibrary
from glm5_hal.backends.musa import MusaBackend
from emulators.musa import MATE_VERSIONS, MusaEmulator

from conftest import seeded

EMU = "musa_emu"
F32, F16, BF16, I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32


def as_plugin(backend) -> types.ModuleType:
    module = types.ModuleType("musa_emulated_plugin")
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    return module


def emulated(card: str = "S4000", **runtime_kwargs) -> MusaBackend:
    return MusaBackend(runtime=MusaEmulator(card, **runtime_kwargs), name=EMU, device_type="cpu", priority=1000)


def register(hal_state, monkeypatch, card: str = "S4000", **runtime_kwargs) -> MusaBackend:
    """An emulated backend registered at run time. The cpu backend is disabled so that, as on a
    real MUSA device (where it cannot take musa tensors), a declined call runs the reference."""
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    backend = emulated(card, **runtime_kwargs)
    hal_state(as_plugin(backend), EMU)
    assert backend.availability().available, backend.availability().reason
    return backend


@pytest.fixture
def s4000(hal_state, monkeypatch) -> MusaBackend:
    return register(hal_state, monkeypatch, "S4000")


@pytest.fixture
def s5000(hal_state, monkeypatch) -> MusaBackend:
    return register(hal_state, monkeypatch, "S5000")


def chosen(op, *args) -> str:
    return hal.explain(op, *args).chosen


def rejection(op, *args) -> str:
    return dict(hal.explain(op, *args).rejected).get(f"{EMU}.{op}", "")


@contextlib.contextmanager
def expect_fallback(reason: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    messages = [str(w.message) for w in caught if issubclass(w.category, hal.FallbackWarning)]
    assert any(f"'{EMU}' declined: " in m and reason in m for m in messages), messages


def randn(*shape, g, dtype=F32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# -- probe -----------------------------------------------------------------------------------------
def test_without_torch_musa_the_registered_backend_says_the_bridge_is_missing():
    row = next(r for r in hal.backends() if r.name == "musa")
    assert (row.available, row.reason, row.device_type) == (False, "bridge torch_musa not installed", "musa")
    assert {"rms_norm", "apply_rope", "grouped_gemm", "sparse_mla_attention", "sparse_mla_decode_paged",
            "indexer_topk_paged"} <= set(row.ops)


@pytest.fixture
def fake_torch_musa(tmp_path, monkeypatch):
    """Installs a package named torch_musa whose __init__ is the given source."""
    def install(body: str) -> None:
        pkg = tmp_path / "torch_musa"
        pkg.mkdir()
        (pkg / "__init__.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_musa", raising=False)
    yield install
    sys.modules.pop("torch_musa", None)


def test_a_missing_musa_runtime_library_is_named(fake_torch_musa):
    fake_torch_musa("raise ImportError('libmusart.so.3: cannot open shared object file: No such file or directory')\n")
    reason = MusaBackend().availability().reason
    assert reason.startswith("runtime library missing: libmusart.so.3 (torch_musa is installed")
    assert "MUSA_HOME" in reason


def test_other_import_failures_of_the_bridge_are_quoted(fake_torch_musa):
    fake_torch_musa("raise ImportError('Please try running Python from a different directory!')\n")
    assert MusaBackend().availability().reason == (
        "importing torch_musa failed: ImportError: Please try running Python from a different directory!")


def test_a_bridge_that_does_not_register_the_device_is_refused(fake_torch_musa):
    fake_torch_musa("__version__ = '2.9.1'\n")
    reason = MusaBackend().availability().reason
    assert reason.startswith("torch_musa imported but did not register the musa device (torch.musa is missing)")


FLASH_MLA_VERSIONS = [v for v in MATE_VERSIONS if v >= "0.2.0"]   # flash_mla_sparse_fwd exists from v0.2.0


@pytest.mark.parametrize("card,kwargs,expected", [
    ("S4000", {"devices": 0}, "no MUSA device visible (torch.musa.device_count() == 0; check `mthreads-gmi` and "
                              "MUSA_VISIBLE_DEVICES)"),
    ("S4000", {"version": "2.5.0+1a2b3c4"}, "torch_musa 2.5.0+1a2b3c4 is too old: the adapters use the torch_musa "
                                            "2.7 API"),
    ("S4000", {"version": "dev"}, "the torch_musa version could not be read ('dev')"),
    ("S2000", {}, "unsupported MUSA architecture mp_11 (MTT S2000); the musa backend supports mp_21 (MTT S80/S3000), "
                  "mp_22 (MTT S4000), mp_31 (MTT S5000)"),
])
def test_probe_gives_a_specific_reason(card, kwargs, expected):
    availability = emulated(card, **kwargs).availability()
    assert not availability.available
    assert availability.reason.startswith(expected)


@pytest.mark.parametrize("card,arch_name,dtypes,dist,mate", [
    ("S80", "mp_21", {F32, F16}, None, False),
    ("S3000", "mp_21", {F32, F16}, None, False),
    ("S4000", "mp_22", {F32, F16, BF16}, "mccl", False),
    ("S5000", "mp_31", {F32, F16, BF16, torch.float8_e4m3fn}, "mccl", True),
])
def test_capabilities_per_generation(card, arch_name, dtypes, dist, mate):
    backend = emulated(card)
    availability = backend.availability()
    name = backend.runtime.device_name
    assert availability.reason == f"EMULATED (MusaEmulator): 8 x {name} ({arch_name}), torch_musa 2.7.1, mate 0.2.2"
    caps = backend.cached_capabilities()
    assert (set(caps.dtypes), caps.dist_backend, caps.device_name) == (dtypes, dist, name)
    assert caps.limits["arch"] == arch_name and caps.limits["mate"] is mate
    assert ("dist" in caps.limits) is (dist is None)
    assert caps.limits["musa_kernels"].startswith("MUSA kernel not built")
    assert backend.versions()["chip"] == f"{name} ({arch_name})" and backend.versions()["muDNN"] == "3100"


def test_real_and_emulated_instances_keep_their_own_adapters():
    a, b = emulated("S4000"), MusaBackend(runtime=MusaEmulator("S5000"), name="musa_emu5", device_type="cpu")
    assert a.impls["rms_norm"].fn is not b.impls["rms_norm"].fn
    a.availability(), b.availability()
    x, w = torch.ones(2, 8), torch.ones(8)
    a.impls["rms_norm"].fn(x, w, 1e-6)
    assert (a.runtime.calls["rms_norm"], b.runtime.calls["rms_norm"]) == (1, 0)


# -- rms_norm --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 129), (1, 1)])
def test_rms_norm_matches_the_reference(s4000, dtype, shape):
    g = seeded(1)
    x, w = randn(*shape, g=g, dtype=dtype), randn(shape[-1], g=g, dtype=dtype)
    assert chosen("rms_norm", x, w, 1e-6) == f"{EMU}.rms_norm"
    torch.testing.assert_close(hal.ops.rms_norm(x, w, 1e-6), hal.reference.rms_norm(x, w, 1e-6), rtol=1.6e-2, atol=1e-5)
    assert s4000.runtime.calls["rms_norm"] == 1


def test_rms_norm_is_served_from_the_remembered_call_key(s4000):
    # its predicate reads only metadata and backend state (supports_metadata): evaluated once
    # per call key, the adapter remembered with it, so later calls go straight to the kernel
    x, w = randn(4, 32, g=seeded(3)), randn(32, g=seeded(4))
    op = hal.ops.rms_norm.op
    op.clear()
    for _ in range(3):
        hal.ops.rms_norm(x, w, 1e-6)
    assert s4000.runtime.calls["rms_norm"] == 3
    (hit,) = op._passed.values()
    assert hit[2] is s4000.impls["rms_norm"].fn


def test_rms_norm_of_float32_takes_a_narrower_weight_exactly(s4000):
    g = seeded(2)
    x, w = randn(4, 32, g=g), randn(32, g=g, dtype=BF16)
    torch.testing.assert_close(hal.ops.rms_norm(x, w, 1e-6), hal.reference.rms_norm(x, w, 1e-6))


def test_rms_norm_with_a_wider_weight_is_declined_for_half_inputs(s4000):
    x, w = torch.ones(4, 32, dtype=BF16), torch.ones(32)
    assert "takes the weight in x's dtype; casting the float32 weight to bfloat16 would round it" in \
        rejection("rms_norm", x, w, 1e-6)
    with expect_fallback("would round it"):
        hal.ops.rms_norm(x, w, 1e-6)
    assert s4000.runtime.calls["rms_norm"] == 0


def test_bf16_on_an_s80_is_refused_by_capabilities(hal_state, monkeypatch):
    register(hal_state, monkeypatch, "S80")
    x = torch.ones(2, 8, dtype=BF16)
    assert rejection("rms_norm", x, torch.ones(8, dtype=BF16), 1e-6) == (
        "device MTT S80 does not support bfloat16 (capabilities: {float16, float32})")


# -- apply_rope ------------------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_apply_rope_matches_the_reference(s4000, interleaved, dtype):
    g = seeded(3)
    x = randn(9, 5, 64, g=g, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 17, 100, 1000, 4095, 3, 3], dtype=torch.int64)
    args = (x, positions, 1e6, interleaved)
    assert chosen("apply_rope", *args) == f"{EMU}.apply_rope"
    tol = {F32: (2e-5, 1e-5), F16: (1e-3, 1e-3), BF16: (1.6e-2, 1e-2)}[dtype]
    torch.testing.assert_close(hal.ops.apply_rope(*args), hal.reference.apply_rope(*args), rtol=tol[0], atol=tol[1])
    assert s4000.runtime.calls["rope"] == 1


def test_interleaved_rope_needs_the_mla_flag_of_a_recent_mudnn(hal_state, monkeypatch):
    backend = register(hal_state, monkeypatch, "S4000", mudnn=2900)
    x, positions = torch.ones(3, 2, 8), torch.arange(3)
    assert rejection("apply_rope", x, positions, 1e4, True) == (
        "interleaved rope uses F.rope's multi_latent_attention flag, which needs muDNN >= 3000 (have 2900)")
    assert chosen("apply_rope", x, positions, 1e4, False) == f"{EMU}.apply_rope"
    torch.testing.assert_close(hal.ops.apply_rope(x, positions, 1e4, False),
                               hal.reference.apply_rope(x, positions, 1e4, False))
    assert backend.runtime.calls["rope"] == 1


def test_rope_on_an_s80_is_declined(hal_state, monkeypatch):
    register(hal_state, monkeypatch, "S80")
    assert rejection("apply_rope", torch.ones(3, 2, 8), torch.arange(3), 1e4, False) == (
        "torch.nn.functional.rope needs mp_22 or later (torch_musa tests it only there); this is mp_21 (MTT S80/S3000)")


# -- versioned behaviours ---------------------------------------------------------------------------
def test_the_versions_the_behaviours_were_read_from_are_reported():
    backend = emulated("S5000", mate="0.2.1")
    assert backend.availability().available
    assert backend.versions()["mate"] == "0.2.1" and backend.versions()["torch_musa"] == "2.7.1"
    versioned = backend.cached_capabilities().limits["versioned"]
    assert versioned["flash_mla_lse"].base == math.e and versioned["mate_gemm"].startswith("per_expert")
    old = emulated("S5000", mate="0.2.0")
    assert old.availability().available and old.cached_capabilities().limits["versioned"]["flash_mla_lse"].base == 2.0


@pytest.mark.parametrize("kwargs,narrowed", [
    ({"mate": "0.3.0"}, "flash_mla_lse: mate 0.3.0 is newer than 0.2.2, the newest version flash_mla_lse was verified "
                        "against; mate_gemm: mate 0.3.0 is newer than 0.2.2"),
    ({"mate": "0.1.0"}, "flash_mla_lse: mate 0.1.0 is older than 0.2.0, the oldest version flash_mla_lse was read "
                        "from; mate_gemm: mate 0.1.0 is older than 0.1.3"),
    ({"mate": None}, "flash_mla_lse: mate is not installed; mate_gemm: mate is not installed"),
    ({"version": "2.9.1"}, "torch_musa_ops: torch_musa 2.9.1 is newer than 2.7.1, the newest version torch_musa_ops "
                           "was verified against"),
])
def test_a_version_outside_the_verified_range_narrows_the_backend_and_says_so(kwargs, narrowed):
    availability = emulated("S5000", **kwargs).availability()
    assert availability.available
    assert "; narrowed to what is verified (" in availability.reason and narrowed in availability.reason


def test_the_backend_list_shows_the_narrowing(hal_state, monkeypatch, capsys):
    """What `glm5-hal backends` (and `glm5-hal doctor`, through the same rows) prints."""
    from glm5_hal import cli
    register(hal_state, monkeypatch, "S5000", mate="0.3.0")
    row = next(r for r in hal.backends() if r.name == EMU)
    assert row.available and "narrowed to what is verified (flash_mla_lse: mate 0.3.0 is newer than 0.2.2" in row.reason
    cli.main(["backends"])
    assert "narrowed to what is verified (flash_mla_lse: mate 0.3.0" in capsys.readouterr().out


def test_unverified_torch_musa_ops_are_declined(hal_state, monkeypatch):
    backend = register(hal_state, monkeypatch, "S4000", version="2.9.1")
    x, w = torch.ones(2, 8), torch.ones(8)
    assert rejection("rms_norm", x, w, 1e-6) == ("torch_musa_ops unverified here: torch_musa 2.9.1 is newer than "
                                                 "2.7.1, the newest version torch_musa_ops was verified against")
    assert rejection("apply_rope", torch.ones(3, 2, 8), torch.arange(3), 1e4, False).startswith(
        "torch_musa_ops unverified here")
    with expect_fallback("torch_musa_ops unverified here"):
        hal.ops.rms_norm(x, w, 1e-6)
    assert backend.runtime.calls["rms_norm"] == 0


# -- grouped_gemm: mate's per-expert GEMM on the S5000 ----------------------------------------------
@pytest.mark.parametrize("mate", MATE_VERSIONS)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_grouped_gemm_on_an_s5000_uses_mates_per_expert_gemm(hal_state, monkeypatch, mate, dtype):
    backend = register(hal_state, monkeypatch, "S5000", mate=mate)
    g = seeded(4)
    counts = torch.tensor([3, 0, 5, 1, 0], dtype=I32)
    x, w = randn(int(counts.sum()), 21, g=g, dtype=dtype), randn(5, 17, 21, g=g, dtype=dtype)
    assert chosen("grouped_gemm", x, w, counts) == f"{EMU}.grouped_gemm"
    torch.testing.assert_close(hal.ops.grouped_gemm(x, w, counts), hal.reference.grouped_gemm(x, w, counts),
                               rtol=1.6e-2, atol=1e-3)
    assert backend.runtime.calls["ragged_m_moe_gemm_16bit"] == 1
    assert hal.ops.grouped_gemm(x[:0], w, torch.zeros(5, dtype=I32)).shape == (0, 17)


def test_grouped_gemm_is_not_claimed_through_torch_grouped_mm(s4000):
    """No public torch_musa (v1.0.0-v2.7.1) registers a MUSA kernel for torch._grouped_mm, and
    v2.7.1 is built on torch 2.7, which has none: the adapter no longer claims it."""
    assert not hasattr(s4000.runtime.torch, "_grouped_mm")
    args = (torch.ones(2, 16, dtype=BF16), torch.ones(1, 4, 16, dtype=BF16), torch.tensor([2], dtype=I32))
    assert rejection("grouped_gemm", *args) == (
        "mate's grouped GEMM needs an MTT S5000 (mp_31; mate builds for MP31 only); this is mp_22 (MTT S4000)")
    assert rejection("grouped_gemm", torch.ones(2, 16), torch.ones(1, 4, 16), args[2]) == (
        "implements grouped_gemm for {bfloat16, float16}, not float32")


def test_grouped_gemm_declines_without_a_verified_mate(hal_state, monkeypatch):
    args = (torch.ones(2, 16, dtype=BF16), torch.ones(1, 4, 16, dtype=BF16), torch.tensor([2], dtype=I32))
    register(hal_state, monkeypatch, "S5000", mate=None)
    assert rejection("grouped_gemm", *args) == "mate not installed (MooreThreads' MUSA kernels: FlashMLA, MoE and " \
                                               "FP8 GEMMs)"
    hal.unload_plugin(EMU)
    register(hal_state, monkeypatch, "S5000", mate="0.1.0")
    assert rejection("grouped_gemm", *args) == ("mate_gemm unverified here: mate 0.1.0 is older than 0.1.3, the oldest "
                                                "version mate_gemm was read from")


# -- sparse MLA (mate's FlashMLA on the S5000) --------------------------------------------------------
def mla_inputs(g, tokens=5, heads=16, keys=40, topk=20, dtype=BF16):
    q = randn(tokens, heads, 576, g=g, dtype=dtype, scale=0.5)
    kv = randn(keys, 576, g=g, dtype=dtype, scale=0.5)
    indices = torch.randint(0, keys, (tokens, topk), generator=g, dtype=I32)
    indices[0, :7] = -1
    indices[1, 3] = keys          # == S: ignored
    indices[1, 4] = -7            # any negative: ignored
    indices[2, 5] = indices[2, 6]  # duplicates count twice
    indices[3] = -1               # no valid entry
    return q, kv, indices


def assert_attention_close(got, want, dtype=BF16):
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.dtype == dtype and lse.dtype == F32
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1.6e-2, atol=2e-3)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and bool((lse[torch.isinf(lse)] < 0).all())
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite].float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mate", FLASH_MLA_VERSIONS)
@pytest.mark.parametrize("heads,topk", [(16, 20), (64, 64), (128, 130)])
def test_sparse_mla_attention_on_an_s5000_uses_flash_mla(hal_state, monkeypatch, mate, heads, topk):
    """The lse in the contract's natural log for every mate version: mate <= 0.2.0 returns
    log2, mate >= 0.2.1 the natural log (converting it again made it 0.693x too small)."""
    backend = register(hal_state, monkeypatch, "S5000", mate=mate)
    g = seeded(6)
    q, kv, indices = mla_inputs(g, heads=heads, topk=topk)
    args = (q, kv, indices, 256 ** -0.5, 512)
    assert chosen("sparse_mla_attention", *args) == f"{EMU}.sparse_mla_attention"
    out = hal.ops.sparse_mla_attention(*args)
    assert_attention_close(out, hal.reference.sparse_mla_attention(*args))
    assert backend.runtime.calls["flash_mla_sparse_fwd"] == 1
    assert bool((out[0][3] == 0).all()) and bool((out[1][3] == float("-inf")).all())


@pytest.mark.parametrize("mate,base,empty_lse_finite,max_logits", [
    ("0.2.0", 2.0, True, None), ("0.2.1", math.e, False, True), ("0.2.2", math.e, False, True)])
def test_the_flash_mla_emulator_models_each_versions_conventions(mate, base, empty_lse_finite, max_logits):
    """What the adapter converts: the lse base, the answer for a row without a valid index,
    max_logits; topk in tiles of 64, one KV head, MP31 only."""
    flashmla = MusaEmulator("S5000", mate=mate).mate.flashmla
    g = seeded(7)
    q, kv = randn(2, 64, 576, g=g, dtype=BF16), randn(9, 1, 576, g=g, dtype=BF16)
    indices = torch.full((2, 1, 64), -1, dtype=I32)
    indices[0, 0, :3] = torch.tensor([0, 4, 8], dtype=I32)
    out, got_max, lse = flashmla.flash_mla_sparse_fwd(q, kv, indices, 0.1)
    scores = 0.1 * torch.einsum("hd,kd->hk", q[0].float(), kv[[0, 4, 8], 0].float())
    torch.testing.assert_close(lse[0], torch.logsumexp(scores, -1) / math.log(base), rtol=1e-5, atol=1e-5)
    assert bool(torch.isfinite(lse[1]).all()) is empty_lse_finite and bool((out[1] == 0).all())
    if max_logits is None:
        assert got_max is None
    else:
        torch.testing.assert_close(got_max[0], scores.amax(-1), rtol=1e-5, atol=1e-5)
        assert bool((got_max[1] == float("-inf")).all()) and bool((lse[1] == float("inf")).all())
    with pytest.raises(AssertionError, match="otherwise will load some index=0"):
        flashmla.flash_mla_sparse_fwd(q, kv, indices[..., :20].contiguous(), 0.1)
    with pytest.raises(RuntimeError, match="MP31 only"):
        MusaEmulator("S4000", mate=mate).mate.flashmla.flash_mla_sparse_fwd(q, kv, indices, 0.1)
    assert not hasattr(MusaEmulator("S5000", mate="0.1.3").mate.flashmla, "flash_mla_sparse_fwd")


@pytest.mark.parametrize("mate", FLASH_MLA_VERSIONS)
def test_sparse_mla_decode_paged_on_an_s5000_uses_flash_mla(hal_state, monkeypatch, mate):
    backend = register(hal_state, monkeypatch, "S5000", mate=mate)
    g = seeded(8)
    batch, queries, heads, block_size, num_blocks = 3, 2, 16, 16, 9
    q = randn(batch, queries, heads, 576, g=g, dtype=BF16, scale=0.5)
    cache = randn(num_blocks, block_size, 576, g=g, dtype=BF16, scale=0.5)
    table = torch.tensor([[4, 0, 7], [2, -1, -1], [8, 1, 3]], dtype=I32)
    lens = torch.tensor([40, 5, 0], dtype=I32)
    indices = torch.randint(-2, 45, (batch, queries, 24), generator=g, dtype=I32)
    args = (q, cache, table, lens, indices, 256 ** -0.5, 512)
    assert chosen("sparse_mla_decode_paged", *args) == f"{EMU}.sparse_mla_decode_paged"
    assert_attention_close(hal.ops.sparse_mla_decode_paged(*args), hal.reference.sparse_mla_decode_paged(*args))
    assert backend.runtime.calls["flash_mla_sparse_fwd"] == 1


def test_a_block_id_outside_the_cache_is_never_handed_to_flash_mla(hal_state, monkeypatch):
    """glm5_hal.ops checks block tables on CPU tensors only; on a device the adapter masks a block
    id outside the cache on the device (the shared sparse_decode_by_rows), so FlashMLA, which
    trusts its rows, never reads past the cache: the position reads as if it were not selected."""
    from glm5_hal.backends.musa import ops as musa_ops
    backend = register(hal_state, monkeypatch, "S5000", mate="0.2.2")
    g = seeded(11)
    q = randn(1, 1, 16, 576, g=g, dtype=BF16, scale=0.5)
    cache = randn(4, 16, 576, g=g, dtype=BF16, scale=0.5)
    lens = torch.tensor([30], dtype=I32)
    indices = torch.tensor([[[0, 17, 20, 3]]], dtype=I32)   # 17 and 20 lie in block 1
    flashmla = backend.runtime.mate.flashmla
    handed, fwd = [], flashmla.flash_mla_sparse_fwd
    monkeypatch.setattr(flashmla, "flash_mla_sparse_fwd", lambda q, kv, idx, *a, **k: (
        handed.append((int(idx.max()), kv.shape[0])), fwd(q, kv, idx, *a, **k))[1])
    outside = musa_ops.sparse_mla_decode_paged(backend, q, cache, torch.tensor([[3, 99]], dtype=I32), lens, indices,
                                               0.1, 512)
    assert handed and all(top < rows for top, rows in handed), handed
    unselected = musa_ops.sparse_mla_decode_paged(backend, q, cache, torch.tensor([[3, 0]], dtype=I32), lens,
                                                  torch.tensor([[[0, -1, -1, 3]]], dtype=I32), 0.1, 512)
    assert torch.equal(outside[0], unselected[0]) and torch.equal(outside[1], unselected[1])


def test_sparse_mla_declines_what_flash_mla_cannot_run(s5000):
    g = seeded(9)
    q, kv, indices = mla_inputs(g, dtype=F16)
    reason = rejection("sparse_mla_attention", q, kv, indices, 0.1, 512)
    assert reason.startswith("FlashMLA: flash_mla_sparse_fwd takes bfloat16 only, got float16; MUSA kernel not built")
    q, kv, indices = mla_inputs(g)
    assert rejection("sparse_mla_attention", q, kv, indices, 0.1, 256).startswith(
        "FlashMLA: flash_mla_sparse_fwd needs Dqk 576 and d_v 512, got Dqk 576, d_v 256; MUSA kernel not built")
    with expect_fallback("MUSA kernel not built"):
        hal.ops.sparse_mla_attention(q, kv, indices, 0.1, 256)
    assert s5000.runtime.calls["flash_mla_sparse_fwd"] == 0


@pytest.mark.parametrize("card,mate,reason", [
    ("S4000", "0.2.2", "FlashMLA sparse attention needs an MTT S5000 (mp_31; mate builds for MP31 only); this is mp_22 "
                       "(MTT S4000)"),
    ("S5000", None, "mate not installed (MooreThreads' MUSA kernels: FlashMLA, MoE and FP8 GEMMs)"),
    ("S5000", "0.1.3", "flash_mla_lse unverified here: mate 0.1.3 is older than 0.2.0, the oldest version "
                       "flash_mla_lse was read from"),
    ("S5000", "0.2.3", "flash_mla_lse unverified here: mate 0.2.3 is newer than 0.2.2, the newest version "
                       "flash_mla_lse was verified against"),
])
def test_sparse_mla_without_a_verified_flash_mla_is_declined(hal_state, monkeypatch, card, mate, reason):
    q, kv, indices = mla_inputs(seeded(10))
    backend = register(hal_state, monkeypatch, card, mate=mate)
    assert rejection("sparse_mla_attention", q, kv, indices, 0.1, 512).startswith(
        f"FlashMLA: {reason}; MUSA kernel not built (libglm5_hal_musa_kernels.so not found")
    with expect_fallback(reason):
        hal.ops.sparse_mla_attention(q, kv, indices, 0.1, 512)
    assert backend.runtime.calls["flash_mla_sparse_fwd"] == 0


# -- the backend's own kernels -----------------------------------------------------------------------
@pytest.mark.parametrize("op,args", [
    ("silu_and_mul", (torch.ones(3, 8),)),
    ("kv_cache_write", (torch.zeros(2, 4, 8), torch.ones(3, 8), torch.tensor([0, -1, 5]))),
    ("indexer_topk", (torch.ones(2, 4, 16), torch.ones(5, 16), torch.ones(2, 4), torch.zeros(2, dtype=I32),
                      torch.full((2,), 5, dtype=I32), 3)),
    ("indexer_topk_paged", (torch.ones(1, 1, 4, 16), torch.ones(2, 4, 16), torch.ones(1, 1, 4),
                            torch.tensor([[0, 1]], dtype=I32), torch.tensor([6], dtype=I32), 3)),
    ("moe_permute", (torch.ones(3, 8), torch.zeros(3, 2, dtype=I32), 4)),
    ("moe_unpermute", (torch.ones(2, 8), torch.tensor([0, 3], dtype=I32), torch.ones(2, 2))),
])
def test_kernel_ops_are_declined_while_the_musa_kernels_are_not_built(s4000, op, args):
    assert rejection(op, *args).startswith("MUSA kernel not built (libglm5_hal_musa_kernels.so not found")
    assert "GLM5_HAL_WITH_MUSA" in rejection(op, *args)


class StandInKernels:
    """Takes the place of the kernel library: records what the adapters hand it and answers
    with the contract computed here in plain torch (not glm5_hal.reference)."""

    decode_limits = GpuKernelLibrary.decode_limits

    def __init__(self):
        self.calls = []

    def missing(self):
        return None

    def status(self):
        return "stand-in"

    def sparse_mla_decode_paged(self, q, kv_cache, block_table, context_lens, indices, sm_scale, d_v, stream):
        self.calls.append(("sparse_mla_decode", tuple(q.shape), tuple(kv_cache.shape), block_table.tolist(),
                           context_lens.tolist(), stream))
        batch, queries, heads, _ = q.shape
        out = torch.zeros(batch, queries, heads, d_v, dtype=q.dtype)
        lse = torch.full((batch, queries, heads), float("-inf"))
        block_size = kv_cache.shape[1]
        for b in range(batch):
            for n in range(queries):
                p = [int(v) for v in indices[b, n] if 0 <= v < int(context_lens[b])]
                if not p:
                    continue
                rows = torch.stack([kv_cache[int(block_table[b, v // block_size]), v % block_size] for v in p]).double()
                z = sm_scale * (q[b, n].double() @ rows.T)
                lse[b, n] = torch.logsumexp(z, -1).float()
                out[b, n] = (torch.softmax(z, -1) @ rows[:, :d_v]).to(q.dtype)
        return out, lse


def test_sparse_mla_attention_reaches_the_kernel_as_one_sequence_of_one_block(s4000):
    s4000.kernels = StandInKernels()
    g = seeded(11)
    q, kv, indices = mla_inputs(g, dtype=F32)
    args = (q, kv, indices, 0.0625, 512)
    assert chosen("sparse_mla_attention", *args) == f"{EMU}.sparse_mla_attention"
    out = hal.ops.sparse_mla_attention(*args)
    torch.testing.assert_close(out, hal.reference.sparse_mla_attention(*args))
    assert s4000.kernels.calls == [("sparse_mla_decode", (1, 5, 16, 576), (1, 40, 576), [[0]], [40], 0x4D55)]


# -- conformance -------------------------------------------------------------------------------------
def vendor_ops(card: str, mate: str | None) -> set[str]:
    """The ops the emulated backend serves through vendor functions (the rest need the MUSA
    kernels): torch_musa's everywhere, mate's on the S5000 where the mate version has them."""
    ops = {"rms_norm", "apply_rope"}
    if card == "S5000" and mate in MATE_VERSIONS:
        ops |= {"grouped_gemm", "fp8_block_gemm", "fp8_grouped_gemm"}
        if mate in FLASH_MLA_VERSIONS:
            ops |= {"sparse_mla_attention", "sparse_mla_decode_paged"}
    return ops


@pytest.mark.parametrize("card,mate", [("S4000", "0.2.2")] + [("S5000", v) for v in MATE_VERSIONS])
def test_conformance_tiny_preset_on_the_emulated_backend(hal_state, monkeypatch, card, mate):
    """Every case of every op the adapters implement, against every emulated mate version:
    nothing fails or errors; the ops served by vendor functions pass through the backend's own
    implementation; every decline is a vendor constraint of those ops, an unverified vendor
    version or the MUSA kernels not being built; skips are dtypes the card lacks (FP8 caches on
    an S4000)."""
    from glm5_hal.conformance import cases, plan, run_all
    backend = register(hal_state, monkeypatch, card, mate=mate)
    ops = [op for op in sorted(backend.impls) if op in cases.ops_with_cases()]
    assert "rms_norm" in ops
    records = run_all(plan([EMU], ops, ["tiny"]))
    assert not [(r.case, r.status, r.reason) for r in records if r.status not in ("pass", "fallback", "skip")]
    assert not [r for r in records if r.status == "fallback" and "supports() raised" in r.reason]
    assert all(r.reason.startswith("device ") for r in records if r.status == "skip")
    served = vendor_ops(card, mate)
    own = {r.op for r in records if r.status == "pass" and r.impl == f"{EMU}.{r.op}"}
    assert own == served & set(ops)
    declined = [r for r in records if r.status == "fallback"]
    vendor_reasons = ("MUSA kernel not built", "mate builds for MP31 only", "unverified here", "implements ",
                      "writes bfloat16 or float16 only")
    assert all(r.op in served or any(why in r.reason for why in vendor_reasons) for r in declined), declined


# -- the checkpoints' FP8 GEMMs: mate on the S5000 -------------------------------------------------
def fp8_gemm_inputs(g, m=7, n=200, k=384, experts=None):
    """DeepSeek-V3 block-scaled FP8 operands, made by the contract's own quantizer."""
    a, a_scale = hal.reference.fp8_block_quant(randn(m, k, g=g), 128)
    shape = (n, k) if experts is None else (experts, n, k)
    w = (randn(*shape, g=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_scale = torch.rand(*shape[:-2], -(-n // 128), k // 128, generator=g) * 0.01 + 0.001
    return a, a_scale, w, w_scale


@pytest.mark.parametrize("mate", MATE_VERSIONS)
@pytest.mark.parametrize("out_dtype", [BF16, F16])
def test_fp8_block_gemm_on_an_s5000_uses_mates_groupwise_gemm(hal_state, monkeypatch, mate, out_dtype):
    backend = register(hal_state, monkeypatch, "S5000", mate=mate)
    a, a_scale, w, w_scale = fp8_gemm_inputs(seeded(20))   # N = 200: a partial last weight block
    args = (a, a_scale, w, w_scale, out_dtype)
    assert chosen("fp8_block_gemm", *args) == f"{EMU}.fp8_block_gemm"
    torch.testing.assert_close(hal.ops.fp8_block_gemm(*args), hal.reference.fp8_block_gemm(*args),
                               rtol=1.6e-2, atol=1e-2)
    assert backend.runtime.calls["gemm_fp8_nt_groupwise"] == 1


@pytest.mark.parametrize("mate", MATE_VERSIONS)
def test_fp8_grouped_gemm_on_an_s5000_uses_mates_per_expert_gemm(hal_state, monkeypatch, mate):
    backend = register(hal_state, monkeypatch, "S5000", mate=mate)
    g = seeded(21)
    counts = torch.tensor([3, 0, 5, 1], dtype=I32)
    a, a_scale, w, w_scale = fp8_gemm_inputs(g, m=9, n=130, k=256, experts=4)
    args = (a, a_scale, w, w_scale, counts, BF16)
    assert chosen("fp8_grouped_gemm", *args) == f"{EMU}.fp8_grouped_gemm"
    torch.testing.assert_close(hal.ops.fp8_grouped_gemm(*args), hal.reference.fp8_grouped_gemm(*args),
                               rtol=1.6e-2, atol=1e-2)
    assert backend.runtime.calls["ragged_m_moe_gemm_8bit"] == 1


def test_fp8_gemms_decline_what_mate_cannot_write_or_run(hal_state, monkeypatch):
    a, a_scale, w, w_scale = fp8_gemm_inputs(seeded(22))
    register(hal_state, monkeypatch, "S5000")
    assert rejection("fp8_block_gemm", a, a_scale, w, w_scale, F32) == (
        "mate's gemm_fp8_nt_groupwise writes bfloat16 or float16 only (mate/gemm.py: \"Only bf16 and fp16 are "
        "supported for out_type!\"), not float32")
    hal.unload_plugin(EMU)
    register(hal_state, monkeypatch, "S4000")
    assert rejection("fp8_block_gemm", a, a_scale, w, w_scale, BF16) == (
        "device MTT S4000 does not support float8_e4m3fn (capabilities: {bfloat16, float16, float32})")
    hal.unload_plugin(EMU)
    register(hal_state, monkeypatch, "S5000", mate="0.1.0")
    assert rejection("fp8_block_gemm", a, a_scale, w, w_scale, BF16).startswith("mate_gemm unverified here")


def test_no_int8_gemm_is_claimed_on_musa():
    """Neither torch_musa (<= v2.7.1: _scaled_mm takes float8 only) nor mate (<= v0.2.2: its
    8-bit GEMMs are FP8) documents an int8 GEMM."""
    assert not {"int8_gemm", "int8_grouped_gemm", "int8_quant"} & set(emulated("S5000").impls)
