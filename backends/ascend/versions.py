"""What changed between torch_npu and CANN versions that the adapters depend on: one
`Behaviour` per fact, each era citing the vendor artifact it was read from. The probe picks
the era of the installed version; outside [oldest era, verified_up_to] the adapters that depend
on a behaviour decline, saying so (glm5_hal.vendor_backend.Behaviour).

Sources:
* torch-npu wheels from PyPI, file `torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`
  (SCHEMAS): every wheel from 2.6.0 to 2.14.0 was read (locally: tests/test_ascend_schemas.py
  runs the adapters against the schemas of each wheel unpacked under build/torch_npu; CI
  against the pinned 2.13.0). Release numbers that are not linear in features (post releases
  of older lines gained ops later than newer base releases) are why the eras below step back.
* Ascend's ops-transformer repository (the CANN attention kernels; read from its mirror
  github.com/cannmirror/ops-transformer) at tags v8.5.0 (commit 6ead121a), v9.0.0 (afe72144)
  and v9.1.0.pre (121f37de): `attention/lightning_indexer/README.md` (LI_README) and
  `attention/sparse_flash_attention/README.md` (SFA_README), 约束说明 and 产品支持情况. That a tag
  vX.Y is what CANN X.Y ships is inferred from the naming; nothing public describes these
  kernels before v8.5.0 (the earliest tag carrying them), so older CANN is outside the range.
"""
from __future__ import annotations

import dataclasses

from glm5_hal.vendor_backend import Behaviour, Era

SCHEMAS = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
OPS_TRANSFORMER = "Ascend ops-transformer (github.com/cannmirror/ops-transformer)"
LI_README = "attention/lightning_indexer/README.md"
SFA_README = "attention/sparse_flash_attention/README.md"
_POW2_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclasses.dataclass(frozen=True)
class KernelRules:
    """Where a CANN attention kernel runs and with how many query heads, per product line
    (chips.Generation.key: "A2", "A3", "950")."""
    heads: tuple[tuple[str, tuple[int, ...]], ...]   # (product, the query head counts accepted)
    large_counts: tuple[int, ...] = ()              # indexer sparse_count values beyond 1..2048
    fp32_weights: tuple[str, ...] = ()              # products whose indexer takes float32 weights

    def products(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.heads)

    def head_counts(self, product: str) -> tuple[int, ...]:
        return dict(self.heads).get(product, ())

    def padded_heads(self, product: str, heads: int) -> int | None:
        """The smallest accepted head count >= heads (None: none is)."""
        return next((n for n in self.head_counts(product) if n >= heads), None)


#: npu_lightning_indexer / npu_sparse_flash_attention exist (the SFA one returning
#: (out, softmax_max, softmax_sum) with keyword-only sparse_block_size in every wheel that has it).
DSA_OPS = Behaviour("npu_dsa_ops", "torch_npu", (
    Era((2, 6), False, f"torch-npu 2.6.0 and 2.6.0.post3 wheels, {SCHEMAS}: neither op declared"),
    Era((2, 6, 0, 5), True, f"torch-npu 2.6.0.post5 wheel, {SCHEMAS}: both declared"),
    Era((2, 7, 1), False, f"torch-npu 2.7.1 wheel, {SCHEMAS}: neither op declared"),
    Era((2, 7, 1, 2), True, f"torch-npu 2.7.1.post2 to 2.7.1.post11 wheels, {SCHEMAS}: both declared"),
    Era((2, 8, 0), False, f"torch-npu 2.8.0 wheel, {SCHEMAS}: neither op declared"),
    Era((2, 8, 0, 2), True, f"torch-npu 2.8.0.post2 to 2.8.0.post5 wheels, {SCHEMAS}: both declared"),
    Era((2, 9, 0), True, f"torch-npu 2.9.0 to 2.14.0 wheels (every release since), {SCHEMAS}: both declared"),
), verified_up_to=(2, 14, 0))

#: Every adapter's call (op names, argument names and kinds) matches the wheel's schemas.
ADAPTER_SCHEMAS = Behaviour("npu_op_schemas", "torch_npu", (
    Era((2, 6), True, f"torch-npu 2.6.0 to 2.14.0 wheels, {SCHEMAS}: each adapter call parsed against them "
                      "(tests/test_ascend_schemas.py)"),
), verified_up_to=(2, 14, 0))

#: LightningIndexer (npu_lightning_indexer) per CANN release.
INDEXER_RULES = Behaviour("indexer_rules", "CANN", (
    Era((8, 5), KernelRules(heads=(("A2", (64,)), ("A3", (64,)))),
        f"{OPS_TRANSFORMER} v8.5.0 (6ead121a), {LI_README}: A2/A3 only; N1 only 64; weights in q's dtype; "
        "sparse_count [1, 2048]"),
    Era((9, 0), KernelRules(heads=(("A2", tuple(range(1, 65))), ("A3", tuple(range(1, 65)))),
                            large_counts=(3072, 4096, 5120, 6144, 7168, 8192), fp32_weights=("A2", "A3")),
        f"{OPS_TRANSFORMER} v9.0.0 (afe72144), {LI_README}: A2/A3 only (950 not supported); N1 [1, 64]; "
        "weights bfloat16/float16/float32; sparse_count [1, 2048] and 3072, 4096, ..., 8192"),
    Era((9, 1), KernelRules(heads=(("A2", tuple(range(1, 65))), ("A3", tuple(range(1, 65))),
                                   ("950", (8, 16, 24, 32, 64))),
                            large_counts=(3072, 4096, 5120, 6144, 7168, 8192), fp32_weights=("A2", "A3")),
        f"{OPS_TRANSFORMER} v9.1.0.pre (121f37de), {LI_README}: adds Ascend 950 with Q_N 8, 16, 24, 32, 64 "
        "and no float32 weights"),
), verified_up_to=(9, 1))

#: SparseFlashAttention (npu_sparse_flash_attention) per CANN release.
ATTENTION_RULES = Behaviour("sparse_attention_rules", "CANN", (
    Era((8, 5), KernelRules(heads=(("A2", _POW2_HEADS), ("A3", _POW2_HEADS))),
        f"{OPS_TRANSFORMER} v8.5.0 (6ead121a) and v9.0.0 (afe72144), {SFA_README}: A2/A3 only; "
        "N1 1/2/4/8/16/32/64/128"),
    Era((9, 1), KernelRules(heads=(("A2", _POW2_HEADS), ("A3", _POW2_HEADS), ("950", tuple(range(1, 129))))),
        f"{OPS_TRANSFORMER} v9.1.0.pre (121f37de), {SFA_README}: adds Ascend 950 with Q_N 1 to 128 "
        "(sparse_block_size only 1 there)"),
), verified_up_to=(9, 1))

BEHAVIOURS = (ADAPTER_SCHEMAS, DSA_OPS, INDEXER_RULES, ATTENTION_RULES)
