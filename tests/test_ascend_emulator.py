"""The torch_npu emulator itself: its behaviour follows the vendor's documented examples,
index conventions and constraints (tests/emulators/ascend.py). Expected values here are
worked out by hand or by brute-force loops, never with glm5_hal.reference."""
from __future__ import annotations

import pytest
import torch

from emulators.ascend import CHIPS, NpuEmulator, NpuOpError

from conftest import seeded


@pytest.fixture
def rt():
    return NpuEmulator("910B")


def test_probe_surface_reports_the_configured_chip():
    for chip, (soc, name) in CHIPS.items():
        emu = NpuEmulator(chip, devices=2, cann="8.3.RC1")
        assert (emu.npu.get_soc_version(), emu.npu.get_device_name(), emu.npu.device_count()) == (soc, name, 2)
        assert emu.npu.utils.get_cann_version(module="CANN") == "8.3.RC1"
    empty = NpuEmulator("910B", devices=0)
    assert not empty.npu.is_available()
    with pytest.raises(RuntimeError, match="no NPU device"):
        empty.npu.get_soc_version()


# -- npu_lightning_indexer ------------------------------------------------------------------------
def brute_force_indexer(q, keys, w, limit, count):
    """Loops: score[s] = sum_h w[h] relu(q[h] . k[s]) over s < limit, best first, -1 after."""
    scores = []
    for s in range(limit):
        scores.append((sum(float(w[h]) * max(float(q[h].float() @ keys[s].float()), 0.0)
                           for h in range(q.shape[0])), s))
    ranked = [s for _, s in sorted(scores, key=lambda p: (-p[0], p[1]))][:count]
    return ranked + [-1] * (count - len(ranked))


def test_indexer_tnd_is_causal_per_batch_and_pads_with_minus_one(rt):
    g = seeded(0)
    q = torch.randn(5, 64, 128, generator=g).to(torch.float16)
    k = torch.randn(9, 1, 128, generator=g).to(torch.float16)
    w = torch.randn(5, 64, generator=g).to(torch.float16)
    # batch 0: 2 queries over 3 keys; batch 1: 3 queries over 6 keys
    idx, values = rt.npu_lightning_indexer(
        q, k, w, actual_seq_lengths_query=torch.tensor([2, 5], dtype=torch.int32),
        actual_seq_lengths_key=torch.tensor([3, 9], dtype=torch.int32), layout_query="TND", layout_key="TND",
        sparse_count=4, sparse_mode=3)
    assert idx.shape == (5, 1, 4) and idx.dtype == torch.int32 and values.numel() == 0
    segments = [(0, 0, 3, 2), (1, 3, 6, 3)]  # (batch, key offset, key count, query count)
    rows = [0, 1, 2, 3, 4]
    for b, key_offset, skv, sq in segments:
        for i in range(sq):
            row = rows.pop(0)
            limit = skv - sq + i + 1
            expected = brute_force_indexer(q[row], k[key_offset: key_offset + skv, 0], w[row], limit, 4)
            assert idx[row, 0].tolist() == expected


def test_indexer_paged_reads_through_the_block_table(rt):
    g = seeded(1)
    cache = torch.randn(4, 16, 1, 128, generator=g).to(torch.bfloat16)
    q = torch.randn(1, 1, 64, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(1, 1, 64, generator=g).to(torch.bfloat16)
    table = torch.tensor([[2, 0, -1]], dtype=torch.int32)
    idx, _ = rt.npu_lightning_indexer(q, cache, w, actual_seq_lengths_key=torch.tensor([20], dtype=torch.int32),
                                      block_table=table, layout_key="PA_BSND", sparse_count=20)
    logical = torch.cat([cache[2, :, 0], cache[0, :4, 0]])
    assert idx[0, 0, 0].tolist() == brute_force_indexer(q[0, 0], logical, w[0, 0], 20, 20)


@pytest.mark.parametrize("change,message", [
    ({"heads": 32, "cann": "8.5.0"}, r"N1 \(query heads\) only supports 64"),
    ({"heads": 65}, r"N1 \(query heads\) supports 1 to 64"),
    ({"heads": 12, "chip": "950"}, r"N1 \(query heads\) supports 8, 16, 24, 32, 64 on Ascend 950"),
    ({"chip": "950", "cann": "9.0.0"}, "Ascend950PR_9579 is not supported by CANN 9.0.0"),
    ({"sparse_count": 2049}, "sparse_count 2049 not supported"),
    ({"sparse_count": 3072, "cann": "8.5.0"}, "sparse_count 3072 not supported"),
    ({"sparse_mode": 1}, "sparse_mode 1 not supported"),
    ({"block_size": 24}, "block_size must be a multiple of 16"),
    ({"noncontiguous": True}, "does not support non-contiguous"),
    ({"weights": torch.float32, "cann": "8.5.0"}, "weights dtype torch.float32 not supported"),
    ({"weights": torch.float32, "chip": "950"}, "weights dtype torch.float32 not supported"),
])
def test_indexer_rejects_calls_outside_its_constraints(change, message):
    """attention/lightning_indexer/README.md of ops-transformer v8.5.0 / v9.0.0 / v9.1.0.pre."""
    rt = NpuEmulator(change.get("chip", "910B"), cann=change.get("cann", "9.1.0"))
    heads, block_size = change.get("heads", 64), change.get("block_size", 16)
    q = torch.zeros(1, 1, heads, 128, dtype=torch.float16)
    if change.get("noncontiguous"):
        q = torch.zeros(1, 1, 128, heads, dtype=torch.float16).transpose(2, 3)
    with pytest.raises(NpuOpError, match=message):
        rt.npu_lightning_indexer(q, torch.zeros(2, block_size, 1, 128, dtype=torch.float16),
                                 torch.zeros(1, 1, heads, dtype=change.get("weights", torch.float16)),
                                 actual_seq_lengths_key=torch.tensor([3], dtype=torch.int32),
                                 block_table=torch.tensor([[0]], dtype=torch.int32), layout_key="PA_BSND",
                                 sparse_count=change.get("sparse_count", 8), sparse_mode=change.get("sparse_mode", 3))


def test_indexer_accepts_what_later_releases_document():
    """CANN 9.0 (v9.0.0 README) on A2/A3: fewer heads, float32 weights, sparse_count 3072..8192;
    CANN 9.1 (v9.1.0.pre README) adds the 950 with 8/16/24/32/64 heads."""
    for chip, heads, weights in (("910B", 7, torch.float32), ("A3", 64, torch.float32), ("950", 8, torch.float16)):
        rt = NpuEmulator(chip, cann="9.1.0")
        idx, _ = rt.npu_lightning_indexer(
            torch.ones(1, 1, heads, 128, dtype=torch.float16), torch.ones(2, 16, 1, 128, dtype=torch.float16),
            torch.ones(1, 1, heads, dtype=weights), actual_seq_lengths_key=torch.tensor([3], dtype=torch.int32),
            block_table=torch.tensor([[0]], dtype=torch.int32), layout_key="PA_BSND", sparse_count=4096)
        assert idx.shape == (1, 1, 1, 4096) and idx[0, 0, 0, :4].tolist() == [0, 1, 2, -1]


def test_indexer_ranks_bfloat16_scores_ties_to_the_lower_position(rt):
    """lightning_indexer_golden.py rounds the float32 scores to bfloat16 before its stable sort:
    key 1 scores 1 + 2^-8 and key 0 scores 1 in float32, equal in bfloat16: key 0 comes first."""
    q = torch.zeros(1, 1, 64, 128, dtype=torch.bfloat16)
    q[0, 0, 0, 0] = q[0, 0, 1, 1] = 1.0
    k = torch.zeros(1, 16, 1, 128, dtype=torch.bfloat16)
    k[0, 0, 0, 0] = k[0, 1, 0, 0] = 1.0
    k[0, 1, 0, 1] = 2.0 ** -8
    w = torch.ones(1, 1, 64, dtype=torch.bfloat16)
    idx, _ = rt.npu_lightning_indexer(q, k, w, actual_seq_lengths_key=torch.tensor([2], dtype=torch.int32),
                                      block_table=torch.tensor([[0]], dtype=torch.int32), layout_key="PA_BSND",
                                      sparse_count=2, sparse_mode=0)
    assert idx[0, 0, 0].tolist() == [0, 1]


# -- npu_sparse_flash_attention -------------------------------------------------------------------
def sfa_inputs(g, keys=6, heads=2):
    q = torch.randn(1, heads, 512, generator=g).to(torch.bfloat16)
    qr = torch.randn(1, heads, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(keys, 1, 512, generator=g).to(torch.bfloat16)
    kr = torch.randn(keys, 1, 64, generator=g).to(torch.bfloat16)
    return q, qr, k, kr


def run_sfa(rt, q, qr, k, kr, indices, **kw):
    lengths = dict(actual_seq_lengths_query=torch.tensor([q.shape[0]], dtype=torch.int32),
                   actual_seq_lengths_kv=torch.tensor([k.shape[0]], dtype=torch.int32))
    return rt.npu_sparse_flash_attention(q, k, k, torch.tensor(indices, dtype=torch.int32).view(1, 1, -1), 0.1,
                                         query_rope=qr, key_rope=kr, layout_query="TND",
                                         **{"attention_mode": 2, "layout_kv": "TND", **lengths, **kw})


def test_sparse_attention_stops_at_the_first_negative_index(rt):
    q, qr, k, kr = sfa_inputs(seeded(2))
    out, m, s = run_sfa(rt, q, qr, k, kr, [4, -1, 2, 3], sparse_mode=0, return_softmax_lse=True)
    # only key 4 is used: softmax over one score is 1, so the output is that key's row
    torch.testing.assert_close(out[0].float(), k[4, 0].float().expand(2, 512), rtol=1e-2, atol=1e-2)
    z = 0.1 * (q[0].float() @ k[4, 0].float() + qr[0].float() @ kr[4, 0].float())
    torch.testing.assert_close(m[0, 0], z)
    torch.testing.assert_close(s[0, 0], torch.ones(2))


def test_sparse_attention_causal_limit_drops_later_positions(rt):
    q, qr, k, kr = sfa_inputs(seeded(3))
    # one query at the end of 6 keys sees [0, 6); with 2 queries the first sees [0, 5)
    q2, qr2 = torch.cat([q, q]), torch.cat([qr, qr])
    idx = torch.tensor([[5, 1], [5, 1]], dtype=torch.int32).view(2, 1, 2)
    out, _, _ = rt.npu_sparse_flash_attention(
        q2, k, k, idx, 0.1, actual_seq_lengths_query=torch.tensor([2], dtype=torch.int32),
        actual_seq_lengths_kv=torch.tensor([6], dtype=torch.int32), query_rope=qr2, key_rope=kr,
        layout_query="TND", layout_kv="TND", sparse_mode=3, attention_mode=2)
    torch.testing.assert_close(out[0].float(), k[1, 0].float().expand(2, 512), rtol=1e-2, atol=1e-2)
    assert not torch.allclose(out[1].float(), k[1, 0].float().expand(2, 512), rtol=1e-2, atol=1e-2)


def test_sparse_attention_with_nothing_valid_gives_zeros(rt):
    """sparse_flash_attention_golden.py: softmax_max and softmax_sum start at 0, a row with no
    position keeps out 0, max 0, sum 0."""
    q, qr, k, kr = sfa_inputs(seeded(4))
    out, m, s = run_sfa(rt, q, qr, k, kr, [-1, 3], sparse_mode=0, return_softmax_lse=True)
    assert bool((out == 0).all()) and bool((s == 0).all()) and bool((m == 0).all())


def test_sparse_attention_walks_at_most_the_kv_length_of_entries(rt):
    """The golden's gatherKV walks min(sparse_size, ceil(threshold / sparse_block_size)) entries:
    with 3 keys only the first 3 of 5 entries count, the repeated key 2 after them does not."""
    q, qr, k, kr = sfa_inputs(seeded(11), keys=3)
    out, m, s = run_sfa(rt, q, qr, k, kr, [0, 1, 2, 2, 2], sparse_mode=0, return_softmax_lse=True)
    once, _, s_once = run_sfa(rt, q, qr, k, kr, [0, 1, 2], sparse_mode=0, return_softmax_lse=True)
    torch.testing.assert_close(out, once)
    torch.testing.assert_close(s, s_once)


def test_sparse_attention_rounds_probabilities_to_the_query_dtype(rt):
    """The golden multiplies softmax(z) cast to the query's dtype by V in float32."""
    q, qr, k, kr = sfa_inputs(seeded(12), keys=5)
    out, m, s = run_sfa(rt, q, qr, k, kr, [0, 1, 2, 3, 4], sparse_mode=0, return_softmax_lse=True)
    z = 0.1 * (q[0].float() @ k[:, 0].float().T + qr[0].float() @ kr[:, 0].float().T)
    p = (torch.exp(z - m[0, 0].unsqueeze(-1)) / s[0, 0].unsqueeze(-1)).to(torch.bfloat16).float()
    torch.testing.assert_close(out[0].float(), (p @ k[:, 0].float()).to(torch.bfloat16).float())


@pytest.mark.parametrize("kw,message", [
    ({"attention_mode": 0}, "attention_mode only supports 2"),
    ({"layout_kv": "PA_BSND", "return_softmax_lse": True}, "return_softmax_lse is not supported with layout_kv PA_BSND"),
    ({"sparse_block_size": 3}, "sparse_block_size must be a power of 2"),
    ({"heads": 3}, "N1 must be one of"),
    ({"chip": "950", "sparse_block_size": 2}, "sparse_block_size only supports 1 on Ascend 950"),
    ({"chip": "950", "cann": "8.5.0"}, "is not supported by CANN 8.5.0"),
])
def test_sparse_attention_rejects_calls_outside_its_constraints(kw, message):
    rt = NpuEmulator(kw.pop("chip", "910B"), cann=kw.pop("cann", "9.1.0"))
    q, qr, k, kr = sfa_inputs(seeded(5), heads=kw.pop("heads", 2))
    with pytest.raises(NpuOpError, match=message):
        run_sfa(rt, q, qr, k, kr, [0], **kw)


# -- MoE ----------------------------------------------------------------------------------------
def test_init_routing_v2_sorts_token_major_pairs_by_expert_stably(rt):
    x = torch.arange(6, dtype=torch.float32).view(3, 2)
    ids = torch.tensor([[1, 0], [1, 2], [0, 0]], dtype=torch.int32)   # flat j = t*2 + k
    common = dict(active_num=6, expert_num=3, expert_tokens_num_type=1, expert_tokens_num_flag=True,
                  active_expert_range=[0, 3])
    ex, scatter_idx, counts, _ = rt.npu_moe_init_routing_v2(x, ids, row_idx_type=1, **common)
    # expert 0: j = 1, 4, 5; expert 1: j = 0, 2; expert 2: j = 3
    assert scatter_idx.tolist() == [1, 4, 5, 0, 2, 3]
    assert counts.tolist() == [3, 2, 1] and counts.dtype == torch.int64
    assert ex[:, 0].tolist() == [0.0, 4.0, 4.0, 0.0, 2.0, 2.0]
    _, gather_idx, _, _ = rt.npu_moe_init_routing_v2(x, ids, row_idx_type=0, **common)
    assert gather_idx.tolist() == [3, 0, 4, 5, 1, 2]   # source j -> destination row


def test_init_routing_v2_drops_ids_outside_the_active_range(rt):
    x = torch.ones(2, 4)
    ids = torch.tensor([[3, 0], [1, 3]], dtype=torch.int32)
    ex, idx, counts, _ = rt.npu_moe_init_routing_v2(
        x, ids, active_num=4, expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[0, 3], row_idx_type=0)
    assert counts.tolist() == [1, 1, 0] and idx.tolist() == [-1, 0, 1, -1]
    assert bool(torch.isnan(ex[2:]).all())  # rows past the valid ones are undefined
    with pytest.raises(NpuOpError, match="expert ids must be < expert_num"):
        rt.npu_moe_init_routing_v2(x, ids, expert_num=3, expert_tokens_num_type=1, expert_tokens_num_flag=True)
    with pytest.raises(NpuOpError, match="expert_tokens_num_type only supports 1 and 2"):
        rt.npu_moe_init_routing_v2(x, ids, expert_num=4, expert_tokens_num_flag=True)


def test_finalize_routing_reads_k_major_indices_and_only_drop_pad_mode_0(rt):
    """The documented formula indexes expanded_src_to_dst_row[i + k * NUM_ROWS]; drop_pad_mode
    "取值范围为0"."""
    rows = torch.arange(4, dtype=torch.float32).view(4, 1)
    scales = torch.tensor([[1.0, 10.0], [100.0, 1000.0]])
    idx = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    k_major = rt.npu_moe_finalize_routing(rows, None, None, None, scales, idx, None, drop_pad_mode=0)
    assert k_major.view(-1).tolist() == [0 * 1 + 2 * 10, 1 * 100 + 3 * 1000]
    with pytest.raises(NpuOpError, match="drop_pad_mode only supports 0"):
        rt.npu_moe_finalize_routing(rows, None, None, None, scales, idx, None, drop_pad_mode=2)
    with pytest.raises(NpuOpError, match="must be in"):
        rt.npu_moe_finalize_routing(rows, None, None, None, scales, idx + 1, None)


def test_grouped_matmul_splits_rows_by_counts_or_cumsum(rt):
    x = torch.arange(6, dtype=torch.float32).view(3, 2)
    w = torch.stack([torch.eye(2), 2 * torch.eye(2)])
    for group_list, kind in ((torch.tensor([1, 2]), 1), (torch.tensor([1, 3]), 0)):
        (y,) = rt.npu_grouped_matmul([x], [w], group_list=group_list, group_list_type=kind, group_type=0,
                                     split_item=2)
        assert y.tolist() == [[0.0, 1.0], [4.0, 6.0], [8.0, 10.0]]
    with pytest.raises(NpuOpError, match="sum to M=3"):
        rt.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 1]), group_list_type=1, group_type=0,
                              split_item=2)
    # "当group_list_type为1时, group_list必须为非负数列, 且长度不能为1"; the cumsum form has no such rule
    one = w[:1]
    with pytest.raises(NpuOpError, match="group_list_type 1 needs a group_list longer than 1"):
        rt.npu_grouped_matmul([x], [one], group_list=torch.tensor([3]), group_list_type=1, group_type=0, split_item=2)
    (y,) = rt.npu_grouped_matmul([x], [one], group_list=torch.tensor([3]), group_list_type=0, group_type=0,
                                 split_item=2)
    assert torch.equal(y, x)


def test_grouped_matmul_per_token_quantised_formula(rt):
    """Formula 3 with int32 accumulation: (x @ w) * scale[expert, n] * per_token_scale[m]; the
    scale bfloat16 for a bfloat16 output (the documented pair)."""
    g = seeded(13)
    x = torch.randint(-127, 128, (5, 32), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (2, 32, 6), generator=g, dtype=torch.int8)
    scale, per_token = torch.rand(2, 6, generator=g).to(torch.bfloat16), torch.rand(5, generator=g)
    (y,) = rt.npu_grouped_matmul([x], [w], scale=[scale], per_token_scale=[per_token],
                                 group_list=torch.tensor([2, 3]), group_list_type=1, group_type=0, split_item=2,
                                 output_dtype=torch.bfloat16)
    rows = [(x[m].long() * w[0 if m < 2 else 1, :, n].long()).sum().item() * float(scale[0 if m < 2 else 1, n])
            * float(per_token[m]) for m in range(5) for n in range(6)]
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().view(-1), torch.tensor(rows).to(torch.bfloat16).float())
    with pytest.raises(NpuOpError, match="outputs bfloat16 or float16"):
        rt.npu_grouped_matmul([x], [w], scale=[scale], per_token_scale=[per_token], group_list=torch.tensor([2, 3]),
                              group_list_type=1, group_type=0, split_item=2, output_dtype=torch.float32)


def test_gating_top_k_documented_example_and_constraints(rt):
    g = seeded(6)
    x = (torch.rand(16, 256, generator=g) * 2).to(torch.float16)
    bias = (torch.rand(256, generator=g) * 2).to(torch.float16)
    y, idx, _ = rt.npu_moe_gating_top_k(x, 1, bias=bias, k_group=4, group_count=8, group_select_mode=1,
                                        renorm=0, norm_type=1, out_flag=False, routed_scaling_factor=1.0, eps=1e-20)
    assert y.shape == (16, 1) and y.dtype == torch.float16 and idx.dtype == torch.int32
    # one expert renormalised by itself (sigmoid) is 1
    torch.testing.assert_close(y.float(), torch.ones(16, 1), rtol=1e-3, atol=1e-3)
    with pytest.raises(NpuOpError, match="renorm only supports 0"):
        rt.npu_moe_gating_top_k(x, 1, renorm=1)
    with pytest.raises(NpuOpError, match="experts per group must be > 2"):
        rt.npu_moe_gating_top_k(x, 1, group_count=128, k_group=1)


# -- KV writes, elementwise, quantisation -------------------------------------------------------------
def test_scatter_nd_update_documented_example_and_no_skipping(rt):
    var = torch.zeros(24, 128, dtype=torch.float16)
    indices = torch.tensor([[3], [0], [11]], dtype=torch.int32)
    updates = torch.ones(3, 128, dtype=torch.float16)
    assert rt.npu_scatter_nd_update_(var, indices, updates) is var
    assert var.sum(1).nonzero().view(-1).tolist() == [0, 3, 11]
    with pytest.raises(NpuOpError, match="out of range"):
        rt.npu_scatter_nd_update_(var, torch.tensor([[-1]], dtype=torch.int32), updates[:1])


def test_swiglu_and_rotary_mul_formulas(rt):
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    a, b = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0])
    torch.testing.assert_close(rt.npu_swiglu(x), (a * torch.sigmoid(a) * b).view(1, 2))
    v = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    zeros, ones = torch.zeros(1, 1, 1, 4), torch.ones(1, 1, 1, 4)
    assert rt.npu_rotary_mul(v, zeros, ones, "half").view(-1).tolist() == [-3.0, -4.0, 1.0, 2.0]
    assert rt.npu_rotary_mul(v, zeros, ones, "interleave").view(-1).tolist() == [-2.0, 1.0, -4.0, 3.0]
    wide = torch.zeros(1, 1, 1, 896)
    for mode in ("half", "interleave"):  # "D < 896" in both modes
        with pytest.raises(NpuOpError, match="needs an even D < 896"):
            rt.npu_rotary_mul(wide, wide, wide, mode)


def test_dynamic_block_quant_example_and_int8_only():
    """_op_plugin_docs.py: dst_type "当前仅支持取值1" (int8), products Atlas A2/A3."""
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [3.0, 3.0, -6.0, 1.0]], dtype=torch.float16)
    y, scale = NpuEmulator("910B").npu_dynamic_block_quant(x)
    assert scale.shape == (3, 1) and y.dtype == torch.int8
    assert y[0, 3] == 127 and y[2, 2] == -127 and bool((y[1] == 0).all())
    for chip in ("A3", "910B"):
        with pytest.raises(NpuOpError, match="dst_type only supports 1"):
            NpuEmulator(chip).npu_dynamic_block_quant(x, dst_type=torch.float8_e4m3fn)
    with pytest.raises(NpuOpError, match="documented for Atlas A2/A3 only"):
        NpuEmulator("950").npu_dynamic_block_quant(x)


def test_dynamic_quant_per_token_formula(rt):
    """_op_plugin_docs.py, npu_dynamic_quant: scale = rowMax(|x|) / 127, y = round(x / scale); a
    row of zeros (0 / 0, undefined in the docs) comes back poisoned."""
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [3.0, 3.0, -6.0, 1.5]], dtype=torch.bfloat16)
    y, scale = rt.npu_dynamic_quant(x)
    assert y.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3,)
    assert y[0].tolist() == [32, -64, 16, 127] and y[2].tolist() == [64, 64, -127, 32]
    assert y[1].tolist() == [127] * 4 and scale[1] == 0
    with pytest.raises(NpuOpError, match="documented for Atlas A2/A3 only"):
        NpuEmulator("950").npu_dynamic_quant(x)


def test_quant_matmul_per_token_formula(rt):
    """int32(x1 @ x2) * scale[n] * pertoken_scale[m], bfloat16/float16 out; x2 may be the
    transposed view of an [N, K] weight."""
    g = seeded(14)
    x1 = torch.randint(-127, 128, (3, 64), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (5, 64), generator=g, dtype=torch.int8)
    scale, per_token = torch.rand(5, generator=g), torch.rand(3, generator=g)
    out = rt.npu_quant_matmul(x1, w.t(), scale, pertoken_scale=per_token, output_dtype=torch.bfloat16)
    want = (x1.long() @ w.long().t()).float() * scale * per_token.unsqueeze(-1)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    with pytest.raises(NpuOpError, match="with pertoken_scale the output is bfloat16 or float16"):
        rt.npu_quant_matmul(x1, w.t(), scale, pertoken_scale=per_token, output_dtype=torch.float32)
