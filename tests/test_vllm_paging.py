"""glm5_hal.integrations.vllm's batch and page mapping, without vLLM: the runs a step is cut
into, and vLLM's indexer page as glm5_hal's FP8 key pair (the paged ops on it are in
tests/test_ops_kv.py; vLLM end to end in tests/test_integrations_vllm.py)."""
from __future__ import annotations

import types

import pytest
import torch

import glm5_hal as hal
from conftest import run_python
from glm5_hal.integrations.vllm import paging
from glm5_hal.integrations.vllm.paging import Run, indexer_page_views, runs_of


def test_importing_glm5_hal_and_the_integration_imports_no_vllm():
    proc = run_python("import sys, glm5_hal, glm5_hal.integrations.vllm, glm5_hal.integrations.vllm.paging\n"
                      "print('vllm' in sys.modules)")
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


@pytest.mark.parametrize("starts, want", [
    ([0, 1, 2, 3], [Run(0, 3, 1, 0)]),                                   # three decodes: one run
    ([0, 1, 2, 12], [Run(0, 2, 1, 0), Run(2, 1, 10, 2)]),                # decodes, then a prefill
    ([0, 1, 6, 11, 14], [Run(0, 1, 1, 0), Run(1, 2, 5, 1), Run(3, 1, 3, 11)]),
    ([0, 4, 4, 8], [Run(0, 1, 4, 0), Run(2, 1, 4, 4)]),                  # an empty request splits runs
    ([0], []),
])
def test_runs_group_consecutive_requests_of_equal_query_length(starts, want):
    runs = runs_of(starts)
    assert list(runs) == want
    covered = [t for r in runs for t in range(r.start, r.start + r.tokens)]
    assert covered == list(range(starts[-1]))     # every token once, in order


def test_a_step_batch_reads_only_host_query_offsets():
    common = types.SimpleNamespace(
        num_reqs=3, num_actual_tokens=7,
        query_start_loc_cpu=torch.tensor([0, 1, 2, 7, 7], dtype=torch.int32),
        seq_lens=torch.tensor([9, 4, 5, 0], dtype=torch.int32),
        block_table_tensor=torch.tensor([[0, 1], [2, -1], [3, -1], [0, 0]], dtype=torch.int32),
        slot_mapping=torch.arange(9))
    step = paging.build_step_batch(common)
    assert step.runs == (Run(0, 2, 1, 0), Run(2, 1, 5, 2))
    assert step.seq_lens.tolist() == [9, 4, 5] and step.block_table.shape == (3, 2)
    assert step.slot_mapping.tolist() == list(range(7))
    assert step.num_decode_tokens == 7 and step.num_prefills == 0   # all through the sparse path


def test_an_indexer_page_is_an_fp8_pair_of_views_of_the_same_memory():
    nb, bs, d = 3, 4, 8
    pages = torch.zeros(nb, bs, d + 4, dtype=torch.uint8)
    keys, scales = indexer_page_views(pages, d)
    assert keys.dtype == torch.float8_e4m3fn and keys.shape == (nb, bs, d)
    assert scales.dtype == torch.float32 and scales.shape == (nb, bs)
    assert keys.untyped_storage().data_ptr() == pages.untyped_storage().data_ptr()
    with hal.use("cpu"):
        hal.ops.indexer_k_cache_write(torch.ones(2, d), keys, scales, torch.tensor([1, 6]), "ue8m0")
    flat = pages.view(nb, -1)
    # slot 1: block 0 offset 1; slot 6: block 1 offset 2. A row of ones: scale 1/256 (ue8m0 of
    # 1/448), codes 256; the rows sit at their offsets, the scales after the block's rows
    want_row = torch.full((d,), 256.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(flat[0, d:2 * d], want_row) and torch.equal(flat[1, 2 * d:3 * d], want_row)
    assert scales[0, 1] == 2.0 ** -8 and scales[1, 2] == 2.0 ** -8
    assert scales[0, 0] == 0 and flat[0, :d].eq(0).all()
    assert flat[0, bs * d + 4:bs * d + 8].view(torch.float32).item() == 2.0 ** -8


def test_a_page_of_another_width_is_refused():
    with pytest.raises(ValueError, match=r"uint8 \[num_blocks, block_size, 132\]"):
        indexer_page_views(torch.zeros(2, 4, 130, dtype=torch.uint8), 128)
