"""The MoE and int8 quantization helpers the vendor adapters share (glm5_hal.vendor_ops.moe and
.quant) read no device data per call (tests/no_sync.py): their data-dependent checks run on CPU
tensors and, on a device, only under GLM5_HAL_CHECKS=full; their results are unchanged."""
from __future__ import annotations

import pytest
import torch

import glm5_hal as hal
from glm5_hal.vendor_backend import host_reads_allowed
from glm5_hal.vendor_ops.moe import permuted_in_contract_order, repeated_slot, sigmoid_underflow, spare_expert_ids
from glm5_hal.vendor_ops.quant import reciprocal_overflow

from no_sync import to_device, to_host, watch


@pytest.fixture
def full_checks(monkeypatch):
    monkeypatch.setenv("GLM5_HAL_CHECKS", "full")
    hal.reload()
    yield
    monkeypatch.undo()
    hal.reload()


def test_host_reads_are_allowed_on_cpu_and_under_full_checks_only(full_checks):
    assert host_reads_allowed(torch.zeros(1)) and host_reads_allowed(to_device(torch.zeros(1)))


def test_host_reads_are_not_allowed_on_a_device_by_default():
    assert host_reads_allowed(torch.zeros(1)) and not host_reads_allowed(to_device(torch.zeros(1)))


def test_spare_expert_ids_read_nothing_and_always_add_the_spare_expert():
    ids = torch.tensor([[0, 3], [-1, 2]], dtype=torch.int32)
    with watch() as syncs:
        routed, expert_num = spare_expert_ids(to_device(ids), 3)
    assert not syncs, syncs.report()
    assert to_host(routed).tolist() == [[0, 3], [3, 2]] and expert_num == 4
    assert spare_expert_ids(torch.tensor([[0, 1]]), 3)[1] == 4  # nothing dropped: the spare group is empty


def test_permuted_in_contract_order_reads_nothing_and_orders_rows():
    # a kernel grouped (token, slot) pairs by expert (slots 0 and 2: expert 0, slot 1: expert 1)
    # but left expert 0's rows out of slot order
    x_perm = torch.tensor([[2.0], [0.0], [1.0]])
    slot_to_row = torch.tensor([1, 2, 0, 3], dtype=torch.int32)      # flat slot -> row; slot 3 dropped
    counts = torch.tensor([2, 1], dtype=torch.int32)
    with watch() as syncs:
        got = permuted_in_contract_order(*to_device((x_perm, slot_to_row, counts)))
    assert not syncs, syncs.report()
    rows, tokens_per_expert, src = to_host(got)
    assert src.tolist() == [0, 2, 1] and rows.view(-1).tolist() == [0.0, 2.0, 1.0]
    assert tokens_per_expert.tolist() == [2, 1]


def test_data_checks_decline_on_cpu_but_read_nothing_on_a_device():
    logits, src = torch.tensor([[-100.0, 1.0]]), torch.tensor([1, 1, 0], dtype=torch.int32)
    tiny_row = torch.tensor([[1e-38, 0.0], [1.0, 2.0]])
    assert sigmoid_underflow(logits, "k").startswith("logits below -80")
    assert repeated_slot(src, 4, "k").startswith("src repeats a (token, slot) index")
    assert reciprocal_overflow(tiny_row, "k").startswith("a row's absmax is below")
    assert reciprocal_overflow(torch.tensor([[0.0, 0.0], [1.0, 2.0]]), "k") is None  # a zero row does not overflow
    with watch() as syncs:
        assert sigmoid_underflow(to_device(logits), "k") is None
        assert repeated_slot(to_device(src), 4, "k") is None
        assert reciprocal_overflow(to_device(tiny_row), "k") is None
    assert not syncs, syncs.report()


def test_data_checks_run_on_a_device_under_full_checks(full_checks):
    logits, src = to_device(torch.tensor([[-100.0, 1.0]])), to_device(torch.tensor([1, 1, 0], dtype=torch.int32))
    assert sigmoid_underflow(logits, "k").startswith("logits below -80")
    assert repeated_slot(src, 4, "k").startswith("src repeats a (token, slot) index")
    assert reciprocal_overflow(to_device(torch.tensor([[1e-38, 0.0]])), "k").startswith("a row's absmax is below")
