"""The Ascend backend: probe reasons, capabilities per chip generation, and every adapter
run end to end against the torch_npu emulator (tests/emulators/ascend.py) on CPU tensors,
compared with glm5_hal.reference; calls outside the vendor constraints must be declined
with a reason (dispatch then moves on) and never reach the vendor op."""
from __future__ import annotations

import contextlib
import sys
import types
import warnings

import pytest
import torch

import glm5_hal as hal
from glm5_hal.backends.ascend import AscendBackend, chips
from emulators.ascend import NpuEmulator

from conftest import seeded
from emulated_helpers import assert_page_view_write_declined_per_call, remembered, verdict

EMU = "ascend_emu"


def as_plugin(backend) -> types.ModuleType:
    module = types.ModuleType("ascend_emulated_plugin")
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    return module


def emulated(chip: str = "910B", vendor_precision: bool = True, **runtime_kwargs) -> AscendBackend:
    """An emulated backend; by default accepting the vendor kernels' documented precision
    (ops.PRECISION), so the adapter tests run the adapters; the default backend's declines are
    tested on their own."""
    return AscendBackend(runtime=NpuEmulator(chip, **runtime_kwargs), name=EMU, device_type="cpu",
                         priority=1000, vendor_precision=vendor_precision)


@pytest.fixture
def npu(hal_state, monkeypatch):
    """An emulated 910B backend registered at run time; yields its emulator. The cpu backend
    is disabled so that, as on a real NPU (where it cannot take npu tensors), a declined call
    falls back to the reference."""
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    backend = emulated("910B")
    hal_state(as_plugin(backend), EMU)
    assert backend.availability().available, backend.availability().reason
    return backend.runtime


@pytest.fixture
def npu_default(hal_state, monkeypatch):
    """As `npu`, but the backend as registered: declining what the vendor computes more
    coarsely than the contract (ops.PRECISION)."""
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    backend = emulated("910B", vendor_precision=False)
    hal_state(as_plugin(backend), EMU)
    assert backend.availability().available, backend.availability().reason
    return backend.runtime


@contextlib.contextmanager
def expect_fallback(reason: str):
    """The block runs the reference with a FallbackWarning naming `reason` (other backends'
    declines warn too and are swallowed)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    messages = [str(w.message) for w in caught if issubclass(w.category, hal.FallbackWarning)]
    assert any(f"'{EMU}' declined: " in m and reason in m for m in messages), messages


def chosen(op, *args):
    return hal.explain(op, *args).chosen


def rejection(op, *args) -> str:
    e = hal.explain(op, *args)
    return dict(e.rejected).get(f"{EMU}.{op}", "")


# -- probe ---------------------------------------------------------------------------------------
def test_without_torch_npu_the_registered_backend_says_the_bridge_is_missing():
    row = next(r for r in hal.backends() if r.name == "ascend")
    assert (row.available, row.reason, row.device_type) == (False, "bridge torch_npu not installed", "npu")
    assert "rms_norm" in row.ops


def fake_torch_npu(tmp_path, monkeypatch, body: str) -> None:
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)


def test_missing_cann_library_is_named_before_importing_the_bridge(tmp_path, monkeypatch):
    # the bridge would crash the test if imported: the library pre-check must answer first
    fake_torch_npu(tmp_path, monkeypatch, "raise SystemExit('imported torch_npu')\n")
    monkeypatch.setattr(chips, "CANN_LIBRARIES", ("libhccl_not_here_glm5.so",))
    availability = AscendBackend().availability()
    assert not availability.available
    assert availability.reason.startswith("runtime library missing: libhccl_not_here_glm5.so")
    assert "ASCEND_HOME_PATH" in availability.reason
    assert "torch_npu" not in sys.modules


def test_this_machine_has_no_libhccl():
    reason = AscendBackend().missing_runtime_library()
    assert reason is not None and reason.startswith("runtime library missing: libhccl.so")


def test_import_error_of_the_bridge_names_the_library(tmp_path, monkeypatch):
    fake_torch_npu(tmp_path, monkeypatch, "raise ImportError('libhccl.so: cannot open shared object file: "
                                          "No such file or directory')\n")
    monkeypatch.setattr(chips, "CANN_LIBRARIES", ("libc.so.6",))  # pre-check passes here
    reason = AscendBackend().availability().reason
    assert reason.startswith("runtime library missing: libhccl.so (torch_npu is installed")


@pytest.mark.parametrize("kwargs,expected", [
    ({"devices": 0}, "no NPU device visible (torch_npu.npu.device_count() == 0; check `npu-smi info` "
                     "and ASCEND_RT_VISIBLE_DEVICES)"),
    ({"version": "2.5.1"}, "torch_npu 2.5.1 is too old: each torch_npu requires its own torch release and "
                           "glm5_hal needs torch >= 2.6"),
    ({"chip": "310P"}, "unsupported chip Ascend310P3 (soc_version 202); the ascend backend supports "
                       "Atlas A2 (Ascend 910B): soc 220-225, Atlas A3 (Ascend 910C, 910_93xx): soc 250-256, "
                       "Ascend 950PR/950DT: soc 260"),
    ({"chip": "910A"}, "unsupported chip Ascend910A (soc_version 102)"),
])
def test_probe_gives_a_specific_reason(kwargs, expected):
    chip = kwargs.pop("chip", "910B")
    availability = emulated(chip, **kwargs).availability()
    assert not availability.available
    assert availability.reason.startswith(expected)


@pytest.mark.parametrize("chip,generation,fp8", [
    ("910B", "Atlas A2 (Ascend 910B)", False),
    ("910B4", "Atlas A2 (Ascend 910B)", False),
    ("A3", "Atlas A3 (Ascend 910C, 910_93xx)", False),
    ("910_9362", "Atlas A3 (Ascend 910C, 910_93xx)", False),
    ("950", "Ascend 950PR/950DT", True),
    ("950DT", "Ascend 950PR/950DT", True),
])
def test_capabilities_per_generation(chip, generation, fp8):
    backend = emulated(chip)
    availability = backend.availability()
    emulator = backend.runtime
    assert availability.available
    assert availability.reason == (f"EMULATED (NpuEmulator): 8 x {emulator.device_name} ({generation}), "
                                   f"torch_npu 2.13.0, CANN 9.1.0")
    caps = backend.cached_capabilities()
    assert caps.dist_backend == "hccl" and caps.device_name == emulator.device_name
    assert caps.limits["generation"] == generation and caps.limits["fp8"] is fp8
    assert (torch.float8_e4m3fn in caps.dtypes) is fp8
    assert {torch.float32, torch.float16, torch.bfloat16} <= caps.dtypes
    assert backend.versions()["chip"] == f"{emulator.device_name} (soc {emulator.soc_version})"


# -- versioned behaviours (versions.py) --------------------------------------------------------------
DSA = ("indexer_topk_paged", "sparse_mla_decode_paged", "sparse_mla_attention", "indexer_topk")


def dsa_rejections(backend) -> dict[str, str]:
    """Why each DSA adapter declines a GLM-5-shaped call on `backend` ("" when it serves it)."""
    g = seeded(40)
    block_table, context_lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    q, k_cache = randn(1, 1, 32, 128, g=g), randn(2, 16, 128, g=g)
    w = fp16_weights(1, 1, 32, g=g)
    mla_q, kv_cache = randn(1, 1, 16, 576, g=g), randn(2, 16, 576, g=g)
    idx = torch.arange(8, dtype=torch.int32).view(1, 1, 8)
    calls = {
        "indexer_topk_paged": (q, k_cache, w, block_table, context_lens, 32),
        "sparse_mla_decode_paged": (mla_q, kv_cache, block_table, context_lens, idx, 0.1, 512),
        "sparse_mla_attention": (mla_q[0], kv_cache[0], idx[0], 0.1, 512),
        "indexer_topk": (q[0], k_cache[0], w[0], torch.zeros(1, dtype=torch.int32),
                         torch.full((1,), 9, dtype=torch.int32), 16),
    }
    out = {}
    for op, args in calls.items():
        answer = verdict(backend.impls[op], *args)
        out[op] = "" if answer is True else answer
    return out


@pytest.mark.parametrize("chip,cann", [("910B", "8.5.0"), ("A3", "8.5.RC1"), ("910B", "9.0.0"), ("910B", "9.1.0"),
                                       ("A3", "9.1.0"), ("950", "9.1.0")])
def test_the_dsa_adapters_serve_every_verified_cann_release(chip, cann):
    backend = emulated(chip, cann=cann)
    assert backend.availability().reason.endswith(f"CANN {cann}")  # nothing narrowed
    assert dsa_rejections(backend) == dict.fromkeys(DSA, "")


@pytest.mark.parametrize("kwargs,narrowed,declines", [
    ({"cann": "8.3.RC1"}, "indexer_rules: CANN 8.3.RC1 is older than 8.5, the oldest version indexer_rules was read "
                          "from", "indexer_rules unverified here: CANN 8.3.RC1 is older than 8.5"),
    ({"cann": "9.2.0"}, "sparse_attention_rules: CANN 9.2.0 is newer than 9.1, the newest version "
                        "sparse_attention_rules was verified against", "unverified here: CANN 9.2.0 is newer than 9.1"),
    ({"cann": ""}, "indexer_rules: the CANN version could not be read ('')", "the CANN version could not be read"),
])
def test_a_cann_outside_the_verified_releases_narrows_the_dsa_adapters(hal_state, kwargs, narrowed, declines):
    backend = emulated("910B", **kwargs)
    availability = backend.availability()
    assert availability.available and "narrowed to what is verified (" in availability.reason
    assert narrowed in availability.reason
    assert all(declines.split(": ", 1)[-1] in why for why in dsa_rejections(backend).values())
    assert backend.cached_capabilities().limits["versioned"]["indexer_rules"].startswith("unverified: ")
    # what does not depend on CANN still runs
    hal_state(as_plugin(backend), EMU)
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    assert chosen("rms_norm", x, w, 1e-6) == f"{EMU}.rms_norm"


def test_the_dsa_ops_follow_the_torch_npu_release_not_its_number():
    """torch-npu 2.7.1 has no npu_lightning_indexer, 2.7.1.post2 has (versions.DSA_OPS): a
    version gate like the old `MIN_TORCH_NPU = (2, 13)` is wrong both ways."""
    old, post = emulated("910B", version="2.7.1"), emulated("910B", version="2.7.1.post2")
    assert old.availability().available and post.availability().available
    assert dsa_rejections(old)["indexer_topk_paged"] == (
        "torch_npu 2.7.1 has no npu_lightning_indexer (versions.DSA_OPS)")
    assert dsa_rejections(post) == dict.fromkeys(DSA, "")
    assert old.cached_capabilities().limits["versioned"]["npu_dsa_ops"] is False


def test_a_torch_npu_newer_than_verified_narrows_every_adapter():
    backend = emulated("910B", version="2.15.0")
    assert "npu_op_schemas: torch_npu 2.15.0 is newer than 2.14.0" in backend.availability().reason
    answer = verdict(backend.impls["rms_norm"], torch.zeros(2, 8), torch.ones(8), 1e-6)
    assert answer.startswith("npu_op_schemas unverified here: torch_npu 2.15.0 is newer than 2.14.0")


def test_real_and_emulated_instances_keep_their_own_adapters():
    a, b = emulated("910B"), AscendBackend(runtime=NpuEmulator("950"), name="ascend_emu950", device_type="cpu")
    assert a.impls["rms_norm"].fn is not b.impls["rms_norm"].fn
    a.availability(), b.availability()
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    a.impls["rms_norm"].fn(x, w, 1e-6)
    assert (a.runtime.calls["npu_rms_norm"], b.runtime.calls["npu_rms_norm"]) == (1, 0)


def test_the_ascend_c_kernels_are_reported_as_not_built():
    backend = emulated()
    backend.availability()
    assert backend.cached_capabilities().limits["ascend_c_kernels"].startswith("Ascend C kernel not built")


# -- rms_norm --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,dtype", [((3, 17), torch.float32), ((5,), torch.bfloat16),
                                         ((2, 3, 6144), torch.bfloat16), ((4, 6144), torch.float16),
                                         ((0, 8), torch.float32)])
def test_rms_norm_matches_the_reference(npu, shape, dtype):
    g = seeded(1)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    assert chosen("rms_norm", x, w, 1e-6) == f"{EMU}.rms_norm"
    out = hal.ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, hal.reference.rms_norm(x, w, 1e-6))
    assert npu.calls["npu_rms_norm"] == (1 if x.numel() else 0)


def test_rms_norm_with_a_wider_weight_is_declined_for_half_inputs(npu):
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8)
    assert rejection("rms_norm", x, w, 1e-6).startswith("npu_rms_norm takes gamma in x's dtype")
    assert chosen("rms_norm", x, w, 1e-6) == "reference.rms_norm"
    hal.ops.rms_norm(x, w, 1e-6)
    assert npu.calls["npu_rms_norm"] == 0
    x32 = torch.randn(2, 8)
    assert chosen("rms_norm", x32, w.to(torch.bfloat16), 1e-6) == f"{EMU}.rms_norm"


# -- helpers for the adapter tests ---------------------------------------------------------------------
def randn(*shape, g, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def assert_topk_selects_the_best(out, logits, topk, counts, tau_rel=1e-2):
    """The conformance rule for top-k outputs: per row, distinct in-range entries,
    left-packed, -1 after, min(topk, count) valid, each within tau of the k-th best score."""
    assert out.dtype == torch.int32 and out.shape[-1] == topk
    out, logits, counts = out.reshape(-1, topk), logits.reshape(-1, logits.shape[-1]), counts.reshape(-1)
    for row, scores, count in zip(out, logits, counts.tolist()):
        n = min(topk, count)
        assert bool((row[:n] >= 0).all()) and bool((row[n:] == -1).all()), (row, n)
        chosen_keys = row[:n].long()
        assert chosen_keys.unique().numel() == n
        if n == 0:
            continue
        assert bool(torch.isfinite(scores[chosen_keys]).all()), "selected a key outside the row's range"
        kth = scores.topk(n).values[-1]
        tau = tau_rel * scores[torch.isfinite(scores)].abs().max()
        assert bool((scores[chosen_keys] >= kth - tau).all())


def fp16_weights(*shape, g):
    """float32 weights exactly representable in float16 and bfloat16 (k/64 with |k| < 128): the
    indexer takes weights in q's dtype, and the adapter declines weights that would round."""
    return torch.randint(-127, 128, shape, generator=g).float() / 64


# -- indexer_topk ----------------------------------------------------------------------------------
def packed_causal_ranges(lengths, context=()):
    """k_start/k_end of a packed prefill: sequence b (after `context[b]` cached tokens) at
    offset o_b, token p sees [o_b, o_b + context + p + 1)."""
    starts, ends, offset = [], [], 0
    for b, n in enumerate(lengths):
        ctx = context[b] if context else 0
        starts += [offset] * n
        ends += [offset + ctx + p + 1 for p in range(n)]
        offset += ctx + n
    return torch.tensor(starts, dtype=torch.int32), torch.tensor(ends, dtype=torch.int32), offset


INDEXER_CASES = {
    "packed_prefill": lambda T: packed_causal_ranges([5, 7]),
    "chunked_prefill_with_context": lambda T: packed_causal_ranges([4, 3], context=[6, 9]),
    "same_range_for_all": lambda T: (torch.full((6,), 2, dtype=torch.int32), torch.full((6,), 11, dtype=torch.int32), 13),
    "arbitrary_ranges": lambda T: (torch.tensor([0, 3, 3, 1, 7, 0, 9], dtype=torch.int32),
                                   torch.tensor([4, 9, 5, 1, 12, 12, 10], dtype=torch.int32), 12),
}


@pytest.mark.parametrize("case", sorted(INDEXER_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_indexer_topk_matches_the_reference(npu, case, dtype):
    """A topk that takes every key (the one the vendor kernel ranks exactly: see
    test_indexer_declines_a_topk_that_ranks_bfloat16_scores); the batches, offsets and -1 tails
    are what is checked."""
    g = seeded(2)
    k_start, k_end, num_keys = INDEXER_CASES[case](None)
    tokens, heads, topk = k_start.shape[0], 8, num_keys + 3
    q, k = randn(tokens, heads, 128, g=g, dtype=dtype), randn(num_keys, 128, g=g, dtype=dtype)
    w = fp16_weights(tokens, heads, g=g)
    args = (q, k, w, k_start, k_end, topk)
    assert chosen("indexer_topk", *args) == f"{EMU}.indexer_topk"
    out = hal.ops.indexer_topk(*args)
    logits = hal.reference.indexer_logits(q.double(), k.double(), w.double(), k_start, k_end)
    assert_topk_selects_the_best(out, logits, topk, k_end - k_start)
    assert torch.equal(out.sort(-1).values, hal.reference.indexer_topk(*args).sort(-1).values)
    assert npu.calls["npu_lightning_indexer"] >= 1


def test_indexer_declines_a_topk_that_ranks_bfloat16_scores(npu_default):
    """The vendor golden ranks bfloat16-rounded scores: two keys 2^-8 apart in float32 tie, and
    the lower position wins -- a swap the contract's float32 tolerance does not allow. With
    topk below the key count the backend as registered declines; the emulated kernel shows why."""
    npu = npu_default
    q = torch.zeros(1, 64, 128, dtype=torch.bfloat16)
    q[0, 0, 0] = q[0, 1, 1] = 1.0
    k = torch.zeros(2, 128, dtype=torch.bfloat16)
    k[:, 0] = 1.0
    k[1, 1] = 2.0 ** -8                                  # key 1 scores 1 + 2^-8, key 0 scores 1
    w = torch.ones(1, 64)
    ks, ke = torch.zeros(1, dtype=torch.int32), torch.full((1,), 2, dtype=torch.int32)
    assert rejection("indexer_topk", q, k, w, ks, ke, 1) == (
        "npu_lightning_indexer ranks bfloat16-rounded scores (the vendor golden), coarser than the contract's "
        "float32 top-k; it runs only when topk covers every key (topk 1 < 2 keys) (set "
        "GLM5_HAL_ASCEND_VENDOR_PRECISION=1 to accept the vendor's precision)")
    assert hal.ops.indexer_topk(q, k, w, ks, ke, 1).tolist() == [[1]]
    found, _ = npu.npu_lightning_indexer(q, k.view(2, 1, 128), w.to(torch.bfloat16),
                                         actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32),
                                         actual_seq_lengths_key=torch.tensor([2], dtype=torch.int32),
                                         layout_query="TND", layout_key="TND", sparse_count=1, sparse_mode=0)
    assert found.view(-1).tolist() == [0]               # what the kernel would have returned


def test_indexer_topk_glm5_shapes_and_a_topk_beyond_2048(npu_default):
    npu = npu_default
    g = seeded(3)
    k_start, k_end, num_keys = packed_causal_ranges([3, 2], context=[2600, 40])
    q, k = randn(5, 32, 128, g=g), randn(num_keys, 128, g=g)
    w = fp16_weights(5, 32, g=g) / 64  # Hi^-0.5 * D^-0.5, exactly
    for topk in (3072, 4096):  # sparse_counts of CANN >= 9.0, both covering the 2645 keys
        out = hal.ops.indexer_topk(q, k, w, k_start, k_end, topk)
        logits = hal.reference.indexer_logits(q.double(), k.double(), w.double(), k_start, k_end)
        assert_topk_selects_the_best(out, logits, topk, k_end - k_start)
    assert npu.calls["npu_lightning_indexer"] == 2
    assert rejection("indexer_topk", q, k, w, k_start, k_end, 2048).startswith(
        "npu_lightning_indexer ranks bfloat16-rounded scores")
    # 3000 would be sparse_count 3072 cut to 3000: that relies on the output order, which
    # the vendor's own test does not check (it compares sorted index sets)
    assert rejection("indexer_topk", q, k, w, k_start, k_end, 3000).startswith(
        "npu_lightning_indexer's sparse_count takes 1-2048 or (3072, 4096, 5120, 6144, 7168, 8192) here")


def test_indexer_sparse_counts_beyond_2048_need_cann_9(hal_state, monkeypatch):
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    hal_state(as_plugin(emulated("910B", cann="8.5.0")), EMU)
    g = seeded(30)
    q, k = randn(2, 64, 128, g=g), randn(3000, 128, g=g)
    ks, ke = torch.zeros(2, dtype=torch.int32), torch.full((2,), 3000, dtype=torch.int32)
    assert rejection("indexer_topk", q, k, torch.zeros(2, 64), ks, ke, 3072) == (
        "npu_lightning_indexer's sparse_count takes 1-2048 here, topk is 3072")


@pytest.mark.parametrize("cann,heads,weights,fp32_weights", [("8.5.0", 64, torch.float32, False),
                                                             ("9.0.0", 5, torch.float32, True),
                                                             ("9.1.0", 32, torch.float32, True)])
def test_indexer_heads_and_weights_follow_the_cann_release(hal_state, monkeypatch, cann, heads, weights,
                                                            fp32_weights):
    """CANN 8.5 runs exactly 64 query heads and weights in q's dtype (fewer heads are
    zero-padded, weights must survive the cast); from 9.0 an A2 runs 1-64 heads and takes
    float32 weights, so any float32 weights go through as they are."""
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    backend = emulated("910B", cann=cann)
    hal_state(as_plugin(backend), EMU)
    g = seeded(31)
    block_table, context_lens = paged_layout([21, 9], 16, 4, g)
    q, k_cache = randn(2, 1, heads, 128, g=g), randn(4, 16, 128, g=g)
    w = torch.randn(2, 1, heads, generator=g)  # not representable in bf16
    args = (q, k_cache, w, block_table, context_lens, 48)  # 3 table columns of 16: every key
    if fp32_weights:
        out = hal.ops.indexer_topk_paged(*args)
        assert torch.equal((out >= 0).sum(-1), hal.reference.indexer_topk_paged(*args).ge(0).sum(-1))
        assert backend.runtime.calls["npu_lightning_indexer"] == 1
    else:
        assert rejection("indexer_topk_paged", *args) == (
            "npu_lightning_indexer takes weights in q's dtype (bfloat16) here; these float32 weights are not exactly "
            "representable in it (rounding would reorder the top-k)")
        exact = fp16_weights(2, 1, heads, g=g)
        assert chosen("indexer_topk_paged", q, k_cache, exact, block_table, context_lens, 48) == (
            f"{EMU}.indexer_topk_paged")


def test_indexer_topk_declines_what_the_vendor_op_cannot_run(npu):
    g = seeded(4)
    ks, ke = torch.zeros(3, dtype=torch.int32), torch.full((3,), 5, dtype=torch.int32)
    k = randn(5, 128, g=g)

    def why(q, key, topk=4, weights=None):
        return rejection("indexer_topk", q, key, torch.zeros(q.shape[:2]) if weights is None else weights, ks, ke, topk)

    assert why(randn(3, 65, 128, g=g), k) == ("npu_lightning_indexer runs at most 64 query heads (N1) here; "
                                              "65 heads do not fit")
    assert why(randn(3, 4, 64, g=g), randn(5, 64, g=g)) == "npu_lightning_indexer needs head dim D = 128, got 64"
    assert why(randn(3, 4, 128, g=g), k, topk=9000).startswith("npu_lightning_indexer's sparse_count takes 1-2048")
    fp8 = (k.float().to(torch.float8_e4m3fn), torch.ones(5))
    assert why(randn(3, 4, 128, g=g), fp8).startswith("npu_lightning_indexer takes bf16/fp16 keys; FP8 key pairs")
    assert why(randn(3, 4, 128, g=g, dtype=torch.float32), k.float()) == (
        "implements indexer_topk for {bfloat16, float16}, not float32")
    with expect_fallback("65 heads do not fit"):
        hal.ops.indexer_topk(randn(3, 65, 128, g=g), k, torch.zeros(3, 65), ks, ke, 4)
    assert npu.calls["npu_lightning_indexer"] == 0


def test_indexer_topk_with_no_tokens(npu):
    g = seeded(5)
    out = hal.ops.indexer_topk(randn(0, 4, 128, g=g), randn(3, 128, g=g), torch.zeros(0, 4),
                               torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 2)
    assert out.shape == (0, 2) and out.dtype == torch.int32


# -- indexer_topk_paged ----------------------------------------------------------------------------
def paged_layout(context_lens, block_size, num_blocks, g, pad=1):
    """A block table handing out shuffled distinct blocks, -1 after each sequence's blocks."""
    free = torch.randperm(num_blocks, generator=g).tolist()
    rows = []
    width = max(-(-n // block_size) for n in context_lens) + pad
    for n in context_lens:
        used = -(-n // block_size)
        rows.append([free.pop() for _ in range(used)] + [-1] * (width - used))
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32)


@pytest.mark.parametrize("queries,heads,block_size,topk", [(1, 32, 16, 64), (2, 64, 32, 130), (3, 7, 16, 2048)])
def test_indexer_topk_paged_matches_the_reference(npu, queries, heads, block_size, topk):
    g = seeded(6)
    block_table, context_lens = paged_layout([0, 20, 37, 2], block_size, 12, g)
    batch = context_lens.shape[0]
    q = randn(batch, queries, heads, 128, g=g)
    k_cache = randn(12, block_size, 128, g=g)
    w = fp16_weights(batch, queries, heads, g=g)
    args = (q, k_cache, w, block_table, context_lens, topk)
    assert chosen("indexer_topk_paged", *args) == f"{EMU}.indexer_topk_paged"
    out = hal.ops.indexer_topk_paged(*args)
    assert out.shape == (batch, queries, topk)
    # the reference's logits over logical positions, -inf outside each query's causal range
    length = int(context_lens.max())
    rows = torch.stack([k_cache.reshape(-1, 128)[[int(block_table[b, p // block_size]) * block_size + p % block_size
                                                  if p < int(context_lens[b]) else 0 for p in range(length)]]
                        for b in range(batch)])
    visible = (context_lens.view(-1, 1) - queries + torch.arange(queries) + 1).clamp(min=0)
    logits = torch.einsum("bnhd,bsd->bnhs", q.double(), rows.double()).relu()
    logits = (logits * w.double().unsqueeze(-1)).sum(2)
    logits = logits.masked_fill(torch.arange(length) >= visible.unsqueeze(-1), float("-inf"))
    assert_topk_selects_the_best(out, logits, topk, visible)
    reference = hal.reference.indexer_topk_paged(q, k_cache, w, block_table, context_lens, topk)
    assert torch.equal((out >= 0).sum(-1), (reference >= 0).sum(-1))


def test_indexer_topk_paged_declines_unsupported_block_sizes(npu):
    g = seeded(7)
    for block_size in (8, 2048):
        block_table, context_lens = paged_layout([5], block_size, 2, g)
        args = (randn(1, 1, 4, 128, g=g), randn(2, block_size, 128, g=g), torch.zeros(1, 1, 4), block_table,
                context_lens, 2048)
        assert rejection("indexer_topk_paged", *args) == (
            f"npu_lightning_indexer's PA_BSND cache needs block_size a multiple of 16 up to 1024, got {block_size}")
        with expect_fallback("block_size a multiple of 16"):
            hal.ops.indexer_topk_paged(*args)
    assert npu.calls["npu_lightning_indexer"] == 0


# -- sparse MLA attention -------------------------------------------------------------------------
def assert_attention_close(got, want, dtype):
    out, lse = got
    ref_out, ref_lse = want
    tol = {torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}[dtype]
    torch.testing.assert_close(out, ref_out, rtol=tol[0], atol=tol[1])
    assert lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("heads,d_v,dtype", [(3, 512, torch.bfloat16), (16, 100, torch.float16),
                                             (130, 512, torch.bfloat16)])
def test_sparse_mla_attention_matches_the_reference(npu, heads, d_v, dtype):
    g = seeded(8)
    tokens, keys = 4 if heads < 100 else 2, 40
    q, kv = randn(tokens, heads, 576, g=g, dtype=dtype, scale=0.3), randn(keys, 576, g=g, dtype=dtype, scale=0.3)
    indices = torch.randint(-3, keys + 5, (tokens, 24), generator=g, dtype=torch.int32)  # -ve and >= S: ignored
    indices[0, :4] = torch.tensor([7, 7, -1, 7])                    # duplicates count per occurrence
    indices[-1] = torch.tensor([-1, keys, keys + 3, -2] * 6)         # a row with nothing valid
    args = (q, kv, indices, 256 ** -0.5, d_v)
    assert chosen("sparse_mla_attention", *args) == f"{EMU}.sparse_mla_attention"
    got = hal.ops.sparse_mla_attention(*args)
    assert got[0].shape == (tokens, heads, d_v) and got[0].dtype == dtype
    assert_attention_close(got, hal.reference.sparse_mla_attention(*args), dtype)
    assert bool((got[0][-1] == 0).all()) and bool(torch.isneginf(got[1][-1]).all())
    assert npu.calls["npu_sparse_flash_attention"] == (2 if heads > 128 else 1)


def test_sparse_mla_attention_with_more_indices_than_keys_counts_every_repeat(npu):
    """The kernel walks at most min(topk, batch length) index entries (the golden's gatherKV):
    8 entries over 4 keys must still count all 8 (the contract: repeats count per occurrence)."""
    g = seeded(32)
    q, kv = randn(2, 4, 576, g=g, scale=0.3), randn(4, 576, g=g, scale=0.3)
    indices = torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3], [3, -1, 3, 3, 9, 3, 3, 3]], dtype=torch.int32)
    args = (q, kv, indices, 256 ** -0.5, 512)
    assert_attention_close(hal.ops.sparse_mla_attention(*args), hal.reference.sparse_mla_attention(*args),
                           torch.bfloat16)
    assert npu.calls["npu_sparse_flash_attention"] == 1


def test_the_default_backend_declines_what_the_vendor_computes_more_coarsely(hal_state, monkeypatch):
    """ops.PRECISION: the vendor's indexer golden ranks bfloat16 scores; the registered backend
    declines such calls (topk leaving keys out) and says how to accept them; a topk covering
    every key is exact whatever the ranking and is served. The attention
    golden's P rounded to the query dtype is within the contract: served."""
    monkeypatch.delenv("GLM5_HAL_ASCEND_VENDOR_PRECISION", raising=False)
    backend = AscendBackend(runtime=NpuEmulator("910B"), name=EMU, device_type="cpu", priority=1000)
    assert backend.vendor_precision is False
    backend.availability()
    why = dsa_rejections(backend)
    assert why["sparse_mla_attention"] == why["sparse_mla_decode_paged"] == ""
    # the indexer's decline (topk leaving keys out): test_indexer_declines_a_topk_that_ranks_bfloat16_scores
    assert why["indexer_topk_paged"] == ""  # topk covers every key: exact whatever the ranking
    monkeypatch.setenv("GLM5_HAL_ASCEND_VENDOR_PRECISION", "1")
    assert AscendBackend(runtime=NpuEmulator("910B")).vendor_precision is True
    monkeypatch.setenv("GLM5_HAL_ASCEND_VENDOR_PRECISION", "yes")
    with pytest.raises(ValueError, match="GLM5_HAL_ASCEND_VENDOR_PRECISION: expected 0 or 1"):
        AscendBackend(runtime=NpuEmulator("910B"))


def test_sparse_mla_attention_declines_non_mla_shapes(npu):
    g = seeded(9)
    q, kv = randn(2, 4, 64, g=g), randn(8, 64, g=g)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    assert rejection("sparse_mla_attention", q, kv, idx, 0.1, 32) == (
        "npu_sparse_flash_attention runs MLA-absorb mode only: Dqk = 512 + 64, got 64")
    q, kv = randn(2, 4, 576, g=g), randn(8, 576, g=g)
    assert rejection("sparse_mla_attention", q, kv, idx, 0.1, 576) == (
        "npu_sparse_flash_attention returns the 512 latent dims, d_v 576 is larger")
    with expect_fallback("d_v 576 is larger"):
        hal.ops.sparse_mla_attention(q, kv, idx, 0.1, 576)
    assert npu.calls["npu_sparse_flash_attention"] == 0


@pytest.mark.parametrize("queries,heads", [(1, 64), (2, 5)])
def test_sparse_mla_decode_paged_matches_the_reference(npu, queries, heads):
    g = seeded(10)
    block_table, context_lens = paged_layout([9, 30, 0], 16, 8, g)
    batch, topk = 3, 12
    q = randn(batch, queries, heads, 576, g=g, scale=0.3)
    kv_cache = randn(8, 16, 576, g=g, scale=0.3)
    indices = torch.randint(-2, 34, (batch, queries, topk), generator=g, dtype=torch.int32)
    args = (q, kv_cache, block_table, context_lens, indices, 256 ** -0.5, 512)
    assert chosen("sparse_mla_decode_paged", *args) == f"{EMU}.sparse_mla_decode_paged"
    got = hal.ops.sparse_mla_decode_paged(*args)
    assert got[0].shape == (batch, queries, heads, 512)
    assert_attention_close(got, hal.reference.sparse_mla_decode_paged(*args), torch.bfloat16)
    assert bool(torch.isneginf(got[1][2]).all())  # an empty context: nothing valid
    assert npu.calls["npu_sparse_flash_attention"] == 1


# -- MoE -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts,top_k,n_group,topk_group,score_func,norm", [
    (256, 8, 1, 1, "sigmoid", True),        # GLM-5
    (256, 8, 8, 4, "sigmoid", True),        # DeepSeek-V3 grouping
    (16, 3, 1, 1, "softmax", True),
    (16, 3, 4, 2, "softmax", False),
])
def test_moe_route_matches_the_reference(npu, experts, top_k, n_group, topk_group, score_func, norm):
    g = seeded(11)
    logits, bias = randn(9, experts, g=g), torch.randn(experts, generator=g) * 0.1
    args = (logits, bias, top_k, n_group, topk_group, 2.5, norm, score_func)
    assert chosen("moe_route", *args) == f"{EMU}.moe_route"
    weights, ids = hal.ops.moe_route(*args)
    ref_weights, ref_ids = hal.reference.moe_route(*args)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))
    assert npu.calls["npu_moe_gating_top_k"] == 1


def test_moe_route_declines_what_the_gate_cannot_express(npu):
    g = seeded(12)
    assert rejection("moe_route", randn(2, 16, g=g), None, 2, 1, 1, 1.0, False, "sigmoid").startswith(
        "npu_moe_gating_top_k always renormalises sigmoid scores")
    assert rejection("moe_route", randn(2, 4096, g=g), None, 2, 1, 1, 1.0, True, "sigmoid") == (
        "npu_moe_gating_top_k takes at most 2048 experts, got 4096")
    assert rejection("moe_route", randn(2, 8, g=g), None, 2, 4, 2, 1.0, True, "sigmoid") == (
        "npu_moe_gating_top_k needs more than 2 experts per group, got 2")
    with expect_fallback("always renormalises sigmoid"):
        hal.ops.moe_route(randn(2, 16, g=g), None, 2, 1, 1, 1.0, False, "sigmoid")
    assert npu.calls["npu_moe_gating_top_k"] == 0


@pytest.mark.parametrize("tokens,k,experts,hidden", [(7, 3, 5, 6), (16, 8, 256, 6144), (0, 2, 4, 3)])
def test_moe_permute_and_unpermute_match_the_reference(npu, tokens, k, experts, hidden):
    g = seeded(13)
    x = randn(tokens, hidden, g=g)
    ids = torch.randint(-1, experts + 2, (tokens, k), generator=g, dtype=torch.int32)  # -1, >= E dropped
    assert chosen("moe_permute", x, ids, experts) == f"{EMU}.moe_permute"
    got = hal.ops.moe_permute(x, ids, experts)
    want = hal.reference.moe_permute(x, ids, experts)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    weights = torch.rand(tokens, k, generator=g)
    y = randn(got[0].shape[0], hidden, g=g)
    assert chosen("moe_unpermute", y, got[2], weights) == f"{EMU}.moe_unpermute"
    torch.testing.assert_close(hal.ops.moe_unpermute(y, got[2], weights),
                               hal.reference.moe_unpermute(y, got[2], weights))
    assert npu.calls["npu_moe_init_routing_v2"] == (1 if tokens else 0)


def test_moe_unpermute_adds_repeated_rows(npu):
    g = seeded(14)
    y, weights = randn(4, 8, g=g, dtype=torch.float32), torch.rand(2, 2, generator=g)
    src = torch.tensor([3, 3, 0, 2], dtype=torch.int32)
    torch.testing.assert_close(hal.ops.moe_unpermute(y, src, weights), hal.reference.moe_unpermute(y, src, weights))
    assert npu.calls["npu_moe_finalize_routing"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_matches_the_reference(npu, dtype):
    g = seeded(15)
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    x, w = randn(9, 24, g=g, dtype=dtype), randn(4, 10, 24, g=g, dtype=dtype)
    assert chosen("grouped_gemm", x, w, counts) == f"{EMU}.grouped_gemm"
    torch.testing.assert_close(hal.ops.grouped_gemm(x, w, counts), hal.reference.grouped_gemm(x, w, counts))
    assert npu.calls["npu_grouped_matmul"] == 1


def test_grouped_gemm_with_one_expert_sends_a_cumulative_group_list(npu):
    """DOCS: group_list_type 1 (counts) must not be one entry long; the cumulative form (type 0)
    may, and says the same for one expert."""
    g = seeded(33)
    x, w = randn(5, 24, g=g), randn(1, 10, 24, g=g)
    counts = torch.tensor([5], dtype=torch.int32)
    torch.testing.assert_close(hal.ops.grouped_gemm(x, w, counts), hal.reference.grouped_gemm(x, w, counts))
    assert npu.calls["npu_grouped_matmul"] == 1


def test_grouped_gemm_declines_too_many_experts(npu):
    g = seeded(16)
    x, w = randn(2, 4, g=g), randn(1025, 3, 4, g=g)
    counts = torch.zeros(1025, dtype=torch.int32)
    counts[0] = 2
    assert rejection("grouped_gemm", x, w, counts) == (
        "npu_grouped_matmul takes at most 1024 groups with one weight tensor, got 1025")


# -- elementwise ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(4, 10), (2, 3, 4096), (6,)])
def test_silu_and_mul_matches_the_reference(npu, shape):
    x = randn(*shape, g=seeded(17))
    assert chosen("silu_and_mul", x) == f"{EMU}.silu_and_mul"
    torch.testing.assert_close(hal.ops.silu_and_mul(x), hal.reference.silu_and_mul(x))
    assert npu.calls["npu_swiglu"] == 1


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_rope_matches_the_reference(npu, interleaved, dtype):
    g = seeded(18)
    x = randn(7, 5, 64, g=g, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 17, 100, 4095, 30000], dtype=torch.int64)
    assert chosen("apply_rope", x, positions, 1e6, interleaved) == f"{EMU}.apply_rope"
    torch.testing.assert_close(hal.ops.apply_rope(x, positions, 1e6, interleaved),
                               hal.reference.apply_rope(x, positions, 1e6, interleaved))
    assert npu.calls["npu_rotary_mul"] == 1


def test_apply_rope_declines_too_many_heads(npu):
    x = torch.zeros(1, 1000, 4)
    assert rejection("apply_rope", x, torch.zeros(1, dtype=torch.int32), 1e4, True) == (
        "npu_rotary_mul needs B*N < 1000, got 1000 heads")


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rope_declines_d_896_in_both_modes(npu, interleaved):
    """DOCS, npu_rotary_mul: "D < 896" in half mode and in interleave mode."""
    x, positions = torch.zeros(2, 1, 896), torch.zeros(2, dtype=torch.int32)
    mode = "interleave" if interleaved else "half"
    assert rejection("apply_rope", x, positions, 1e4, interleaved) == (
        f"npu_rotary_mul needs D < 896 in {mode} mode, got 896")
    with expect_fallback("needs D < 896"):
        hal.ops.apply_rope(x, positions, 1e4, interleaved)
    assert npu.calls["npu_rotary_mul"] == 0


def test_hadamard_transform_declines_without_the_ascend_c_kernel(npu):
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    assert rejection("hadamard_transform", x, 128 ** -0.5).startswith(
        "Ascend C kernel not built (libglm5_hal_ascend_kernels.so not found")
    with expect_fallback("Ascend C kernel not built"):
        torch.testing.assert_close(hal.ops.hadamard_transform(x, 1.0), x)


# -- quantisation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("chip", ["910B", "A3", "950"])
def test_no_fp8_quantisation_is_asked_of_any_chip(hal_state, monkeypatch, chip):
    """npu_dynamic_block_quant documents int8 output only ("dst_type ... 当前仅支持取值1"), on
    Atlas A2/A3; no torch_npu op documents an FP8 output on the 950. fp8_block_quant and
    indexer_k_cache_write are not adapted (README, "Not mapped")."""
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    backend = emulated(chip)
    hal_state(as_plugin(backend), EMU)
    assert "fp8_block_quant" not in backend.impls and "indexer_k_cache_write" not in backend.impls
    x = randn(2, 256, g=seeded(19))
    assert rejection("fp8_block_quant", x, 128, None) == "does not implement fp8_block_quant"
    hal.ops.fp8_block_quant(x, 128, None)
    assert backend.runtime.calls["npu_dynamic_block_quant"] == 0


# -- W8A8 GEMMs (issue 12) ----------------------------------------------------------------------------
def int8_operands(m, k, n, g, experts=None):
    x = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    shape = (experts, n, k) if experts else (n, k)
    w = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    x_scale = torch.rand(m, generator=g) * 1e-2
    w_scale = torch.rand(shape[:-1], generator=g) * 1e-2
    return x, x_scale, w, w_scale


@pytest.mark.parametrize("shape", [(4, 256), (2, 3, 128), (5, 7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_quant_matches_the_reference(npu, shape, dtype):
    x = randn(*shape, g=seeded(70), dtype=dtype, scale=3.0)
    x.view(-1, shape[-1])[1] = 0  # a row of zeros: the vendor's 0 / 0 is undefined, the contract's codes 0
    assert chosen("int8_quant", x) == f"{EMU}.int8_quant"
    q, scale = hal.ops.int8_quant(x)
    ref_q, ref_scale = hal.reference.int8_quant(x)
    assert q.dtype == torch.int8 and torch.equal(q, ref_q)
    torch.testing.assert_close(scale, ref_scale)
    assert npu.calls["npu_dynamic_quant"] == 1


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_int8_gemm_matches_the_reference(npu, out_dtype):
    x, x_scale, w, w_scale = int8_operands(7, 256, 48, seeded(71))
    args = (x, x_scale, w, w_scale, out_dtype, None)
    assert chosen("int8_gemm", *args) == f"{EMU}.int8_gemm"
    out = hal.ops.int8_gemm(*args)
    assert out.dtype == out_dtype
    torch.testing.assert_close(out, hal.reference.int8_gemm(*args))
    assert npu.calls["npu_quant_matmul"] == 1


@pytest.mark.parametrize("out_dtype, scale_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("counts", [[3, 0, 4, 2], [9]])
def test_int8_grouped_gemm_matches_the_reference(npu, counts, out_dtype, scale_dtype):
    """The weight scale goes in the dtype the torch-npu 2.13.0 docs pair with the output (scale
    bfloat16 -> y bfloat16, float32 -> float16; vllm-ascend @182b75ea also passes its scales in
    the output's dtype), shaped [E, N] as vllm-ascend passes it (the docs say 1-D): the README's
    choice, which the emulator enforces."""
    x, x_scale, w, w_scale = int8_operands(sum(counts), 128, 24, seeded(72), experts=len(counts))
    args = (x, x_scale, w, w_scale, torch.tensor(counts, dtype=torch.int32), out_dtype)
    assert chosen("int8_grouped_gemm", *args) == f"{EMU}.int8_grouped_gemm"
    torch.testing.assert_close(hal.ops.int8_grouped_gemm(*args), hal.reference.int8_grouped_gemm(*args))
    assert npu.calls["npu_grouped_matmul"] == 1
    assert npu.grouped_matmul_scales == [(scale_dtype, (len(counts), 24))]


def test_the_emulated_grouped_matmul_takes_only_the_documented_scale_and_output_pairs(npu):
    """torch-npu 2.13.0 _op_plugin_docs.py, npu_grouped_matmul, per-token quantisation on A2:
    a float32 scale with a bfloat16 output is not among the documented pairs."""
    g = seeded(74)
    x = torch.randint(-128, 128, (4, 64), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (2, 64, 16), generator=g, dtype=torch.int8)
    counts = torch.tensor([1, 3])
    with pytest.raises(RuntimeError, match="scale"):
        npu.npu_grouped_matmul([x], [w], scale=[torch.rand(2, 16, generator=g)], per_token_scale=[torch.rand(4)],
                               group_list=counts, group_list_type=1, group_type=0, split_item=2,
                               output_dtype=torch.bfloat16)


def test_the_w8a8_adapters_decline_what_the_ops_do_not_document(npu):
    g = seeded(73)
    x, x_scale, w, w_scale = int8_operands(3, 128, 8, g)
    assert rejection("int8_gemm", x, x_scale, w, w_scale, torch.float32, None) == (
        "npu_quant_matmul's per-token mode outputs bfloat16 or float16 (DOCS), not float32")
    assert rejection("int8_gemm", x, x_scale, w, w_scale, torch.bfloat16, torch.zeros(8)).startswith(
        "npu_quant_matmul takes a bias, but DOCS do not say whether it is added before or after the scales")
    ge, gs = int8_operands(3, 128, 8, g, experts=2)[2:]
    counts = torch.tensor([1, 2], dtype=torch.int32)
    assert rejection("int8_grouped_gemm", x, x_scale, ge, gs, counts, torch.float32) == (
        "npu_grouped_matmul's per-token mode outputs bfloat16 or float16 (DOCS), not float32")
    assert rejection("int8_quant", torch.zeros(2, 8)) == "implements int8_quant for {bfloat16, float16}, not float32"
    with expect_fallback("outputs bfloat16 or float16"):
        hal.ops.int8_gemm(x, x_scale, w, w_scale, torch.float32, None)
    assert npu.calls["npu_quant_matmul"] == 0


def test_the_w8a8_adapters_decline_the_950(hal_state, monkeypatch):
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    hal_state(as_plugin(emulated("950")), EMU)
    x, x_scale, w, w_scale = int8_operands(3, 128, 8, seeded(74))
    assert rejection("int8_gemm", x, x_scale, w, w_scale, torch.bfloat16, None) == (
        "npu_quant_matmul is documented for Atlas A2/A3, not Ascend 950PR/950DT")
    assert rejection("int8_quant", randn(2, 8, g=seeded(75))) == (
        "npu_dynamic_quant is documented for Atlas A2/A3, not Ascend 950PR/950DT")


def test_fp8_gemms_are_not_adapted(npu):
    """No torch_npu op documents a 128 x 128 block-scaled FP8 GEMM (README, "Not mapped")."""
    backend = hal.get_backend(EMU)
    assert "fp8_block_gemm" not in backend.impls and "fp8_grouped_gemm" not in backend.impls
    assert backend.cached_capabilities().limits["fp8_block_gemm / fp8_grouped_gemm"].startswith("not adapted")


# -- KV cache ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 576), (torch.float32, 7)])
def test_kv_cache_write_matches_the_reference(npu, dtype, dim):
    g = seeded(22)
    cache = randn(4, 16, dim, g=g, dtype=dtype)
    values = randn(6, dim, g=g, dtype=dtype)
    slots = torch.tensor([5, -1, 63, 0, -1, 17], dtype=torch.int64)
    expected = cache.clone()
    hal.reference.kv_cache_write(expected, values, slots)
    assert chosen("kv_cache_write", cache, values, slots) == f"{EMU}.kv_cache_write"
    assert hal.ops.kv_cache_write(cache, values, slots) is None
    assert torch.equal(cache, expected)  # the whole cache: untouched slots stay untouched
    assert npu.calls["npu_scatter_nd_update_"] == 1


def test_kv_cache_write_of_padding_only_changes_nothing(npu):
    """Whether any row is real is device data: the scatter runs anyway, writing slot 0's own
    content back."""
    cache = torch.arange(2 * 16 * 8, dtype=torch.float32).view(2, 16, 8).to(torch.bfloat16)
    before = cache.clone()
    hal.ops.kv_cache_write(cache, torch.ones(3, 8, dtype=torch.bfloat16), torch.full((3,), -1, dtype=torch.int32))
    assert torch.equal(cache, before) and npu.calls["npu_scatter_nd_update_"] == 1


def test_fp8_caches_are_written_bytewise_on_a_950_and_not_offered_on_a_910b(hal_state):
    g = seeded(23)
    cache = torch.randn(2, 16, 128, generator=g).to(torch.float8_e4m3fn)
    values = torch.randn(3, 128, generator=g).to(torch.float8_e4m3fn)
    slots = torch.tensor([4, -1, 31], dtype=torch.int32)
    expected = cache.clone()
    hal.reference.kv_cache_write(expected, values, slots)
    for chip in ("910B", "950"):
        hal.reload()
        backend = emulated(chip)
        hal_state(as_plugin(backend), f"{EMU}_{chip}")
        e = hal.explain("kv_cache_write", cache, values, slots)
        if chip == "910B":
            assert dict(e.rejected)[f"{EMU}.kv_cache_write"].startswith(
                "device Ascend910B2 does not support float8_e4m3fn")
        else:
            assert e.chosen == f"{EMU}.kv_cache_write"
            hal.ops.kv_cache_write(cache, values, slots)
            assert torch.equal(cache.view(torch.int8), expected.view(torch.int8))
        hal.unload_plugin(f"{EMU}_{chip}")


class FakeKernels:
    """Stands in for the compiled Ascend C library (which cannot be built here), to check the
    adapter's side of the call: row layout, dtype, scale and the stream handle it passes."""

    def __init__(self):
        self.calls = []

    def missing(self):
        return None

    def status(self):
        return "fake"

    def hadamard(self, x, out, scale, stream):
        self.calls.append((tuple(x.shape), x.dtype, x.is_contiguous(), stream))
        y = x.double()
        h = 1
        while h < x.shape[1]:  # butterflies, written out independently of the reference
            y = y.view(x.shape[0], -1, 2, h)
            y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
            h *= 2
        out.copy_((y.reshape(x.shape) * scale).to(out.dtype))


def test_hadamard_transform_adapter_hands_rows_and_the_stream_to_the_kernel(hal_state):
    backend = emulated()
    backend.kernels = FakeKernels()
    hal_state(as_plugin(backend), EMU)
    x = randn(2, 3, 128, g=seeded(26)).transpose(0, 1)  # non-contiguous
    assert chosen("hadamard_transform", x, 128 ** -0.5) == f"{EMU}.hadamard_transform"
    torch.testing.assert_close(hal.ops.hadamard_transform(x, 128 ** -0.5),
                               hal.reference.hadamard_transform(x, 128 ** -0.5))
    assert backend.kernels.calls == [((6, 128), torch.bfloat16, True, 0x5151)]
    assert rejection("hadamard_transform", torch.zeros(2, 8), 1.0) == (
        "the Ascend C Hadamard kernel takes D in [16, 8192], got 8")


def test_causal_runs_split_ranges_into_vendor_batches():
    from glm5_hal.backends.ascend.ops import causal_runs
    # packed prefill of 3 + 2 tokens, then two decode-like tokens over one range, then an
    # empty range and two unrelated ranges
    starts = [0, 0, 0, 3, 3, 0, 0, 4, 2, 2]
    ends = [1, 2, 3, 4, 5, 9, 9, 4, 6, 3]
    assert causal_runs(starts, ends) == [(0, 3, 0, 3, 3), (3, 5, 3, 2, 3), (5, 7, 0, 9, 0), (8, 9, 2, 4, 3),
                                         (9, 10, 2, 1, 3)]


# -- the conformance suite over the emulated backend -----------------------------------------------
@pytest.mark.parametrize("chip", ["910B", "950"])
def test_conformance_tiny_preset_on_the_emulated_backend(hal_state, chip):
    """Every case of every op the adapters implement: passes, or is declined by the adapter
    (a vendor constraint or an undeclared dtype, shown as `fallback` with the reason), and
    every op passes at least one case. Nothing fails or errors."""
    from glm5_hal.conformance import cases, plan, run_all
    backend = emulated(chip, vendor_precision=False)  # the backend as registered
    hal_state(as_plugin(backend), EMU)
    ops = [op for op in sorted(backend.impls) if op in cases.ops_with_cases()]
    assert "rms_norm" in ops
    records = run_all(plan([EMU], ops, ["tiny"]))
    # skip: a dtype the chip lacks (FP8 KV caches on 910B), by its capabilities
    broken = [(r.case, r.status, r.reason) for r in records if r.status not in ("pass", "fallback")
              and not (r.status == "skip" and "does not support float8_e4m3fn" in r.reason)]
    assert not broken
    declined_by_supports = [r for r in records if r.status == "fallback" and "supports() raised" in r.reason]
    assert not declined_by_supports
    # expected-error cases pass before any implementation runs (impl ""): not the adapter's pass
    passed = {r.op for r in records if r.status == "pass" and r.impl}
    assert passed == {r.op for r in records if r.op not in backend_only_declines(backend, chip)}, passed
    assert all(r.impl == f"{EMU}.{r.op}" for r in records if r.status == "pass" and r.impl)


def backend_only_declines(backend, chip):
    """Ops no tiny case reaches the adapter of: the Ascend C kernel is not built here; the
    indexer's ranking computes more coarsely than the contract when topk leaves keys out
    (ops.PRECISION) -- the paged cases either do that or use block sizes the kernel does not
    take."""
    ops = {"hadamard_transform", "indexer_topk_paged"}
    if chip == "950":  # no float32 indexer weights there (the cases' weights would round); W8A8: A2/A3 only
        ops |= {"indexer_topk", "int8_quant", "int8_gemm", "int8_grouped_gemm"}
    return ops


# -- what dispatch remembers with a call key ----------------------------------------------------------
def test_a_metadata_predicate_is_remembered_with_the_call_key_and_the_cache_layout_is_checked_per_call(npu):
    """rms_norm's predicate reads dtypes and the probed versions only (supports_metadata): the
    adapter is remembered with the call key. kv_cache_write's reads whether the cache is
    contiguous, which the key does not hold (only whether it is paged): a block-strided page
    view with the key of a contiguous cache is declined, per call."""
    backend = hal.get_backend(EMU)
    g = seeded(41)
    x, w = randn(4, 64, g=g, dtype=torch.bfloat16), randn(64, g=g, dtype=torch.bfloat16)
    assert remembered(hal.ops.rms_norm, x, w, 1e-6) is backend.impls["rms_norm"].fn
    hal.ops.rms_norm(x, w, 1e-6)
    assert npu.calls["npu_rms_norm"] == 2

    values, slots = randn(3, 16, g=g, dtype=torch.float32), torch.tensor([5, -1, 60], dtype=torch.int64)
    assert_page_view_write_declined_per_call((4, 16, 16), values, slots,
                                             lambda: npu.calls["npu_scatter_nd_update_"])
