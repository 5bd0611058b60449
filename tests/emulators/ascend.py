"""A CPU emulator of the parts of `torch_npu` 2.13.0 that glm5_hal's Ascend adapters call.

Written from the vendor's documentation (the wheel's `_op_plugin_docs.py`, its meta
registrations and codegen YAML schemas, the op-plugin markdown docs, and the CANN kernel
sources' index handling), summarised with sources in /work/notes/ascend_ops.md. It models:

* the exact Python signatures (keyword-only arguments after `*` as in the schemas),
* the vendor layouts (BSND, TND with prefix-sum lengths, PA_BSND with a block table) and
  index conventions (logical positions, `-1` padding at the tail, score-descending order
  from the indexer, the sparse attention kernel stopping at the first negative index),
* the documented constraints: a violated one raises `NpuOpError` (a RuntimeError, which is
  what the real op raises from aclnn's parameter check), so an adapter that forgets to
  decline a call fails its test,
* the probe surface: `npu.is_available`, `npu.device_count`, `npu.get_soc_version`,
  `npu.get_device_name`, `npu.utils.get_cann_version`, for a configurable chip.

It never calls `glm5_hal.reference`; numerics are float32 like the kernels' accumulators.
Documented behaviour this emulator does not model (quantised modes, hash routing, sinks)
raises `NotEmulatedError` instead of guessing.
"""
from __future__ import annotations

import collections
import contextlib
import math
import types
from typing import Sequence

import torch
from torch import Tensor

INT64_MAX = 9223372036854775807
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: npu_lightning_indexer's sparse_count: 1..2048 plus these (wheel docs).
LARGE_SPARSE_COUNTS = (3072, 4096, 5120, 6144, 7168, 8192)
#: The kernels' initial running max (softmax_max of a row with no valid key).
SOFTMAX_MAX_INIT = -2e38

#: chip key -> (SocVersion enum value, aclrtGetSocName string), from NpuVariables.h and
#: the strings in libtorch_npu.so.
CHIPS = {
    "910B": (221, "Ascend910B2"),
    "910B1": (220, "Ascend910B1"),
    "910B4": (224, "Ascend910B4"),
    "A3": (250, "Ascend910_9391"),
    "910_9362": (255, "Ascend910_9362"),
    "950": (260, "Ascend950PR_9579"),
    "950DT": (260, "Ascend950DT_9591"),
    "310P": (202, "Ascend310P3"),
    "910A": (102, "Ascend910A"),
}


class NpuOpError(RuntimeError):
    """What the real op raises when aclnn's parameter check rejects a call."""


class NotEmulatedError(RuntimeError):
    """A documented vendor feature this emulator does not model."""


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise NpuOpError(f"{op}: {message}")


def _tensor(op: str, name: str, t: object, dtypes: Sequence[torch.dtype] | None = None,
            contiguous: bool = False, ndim: int | Sequence[int] | None = None) -> Tensor:
    _require(isinstance(t, Tensor), op, f"{name} must be a Tensor, got {type(t).__name__}")
    if dtypes is not None:
        _require(t.dtype in dtypes, op, f"{name} dtype {t.dtype} not supported (supported: "
                 f"{', '.join(str(d) for d in dtypes)})")
    if contiguous:
        _require(t.is_contiguous(), op, f"{name} does not support non-contiguous tensors")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        _require(t.dim() in dims, op, f"{name} must be {'/'.join(map(str, dims))}-D, got shape "
                 f"{list(t.shape)}")
    return t


def _int32_vector(op: str, name: str, t: object, length: int | None = None) -> list[int]:
    _tensor(op, name, t, (torch.int32,), ndim=1)
    if length is not None:
        _require(t.shape[0] == length, op, f"{name} must have {length} elements, got {t.shape[0]}")
    return [int(v) for v in t.tolist()]


def _segments_from_prefix_sums(op: str, name: str, t: object, total: int) -> list[tuple[int, int]]:
    """TND: element b is the token count of batches 0..b (a prefix sum)."""
    _require(t is not None, op, f"{name} is required for the TND layout")
    sums = _int32_vector(op, name, t)
    previous = 0
    segments = []
    for value in sums:
        _require(value >= previous, op, f"{name} must be a non-decreasing prefix sum, got {sums}")
        segments.append((previous, value))
        previous = value
    _require(previous <= total, op, f"{name} ends at {previous}, beyond the {total} tokens given")
    return segments


def _per_batch_lengths(op: str, name: str, t: object, batch: int, size: int) -> list[int]:
    if t is None:
        return [size] * batch
    lengths = _int32_vector(op, name, t, batch)
    _require(all(0 <= v <= size for v in lengths), op, f"{name} values must be in [0, {size}], got {lengths}")
    return lengths


def _check_block_table(op: str, block_table: object, batch: int, lengths: list[int], block_size: int,
                       num_blocks: int) -> Tensor:
    _require(block_table is not None, op, "block_table is required for the PA_BSND layout")
    _tensor(op, "block_table", block_table, (torch.int32,), ndim=2)
    _require(block_table.shape[0] == batch, op, f"block_table dim 0 must be B={batch}, got {block_table.shape[0]}")
    need = max((-(-n // block_size) for n in lengths), default=0)
    _require(block_table.shape[1] >= need, op, f"block_table dim 1 ({block_table.shape[1]}) is smaller "
             f"than maxBlockNumPerSeq ({need})")
    for b, n in enumerate(lengths):
        used = block_table[b, : -(-n // block_size)]
        # The kernel does not validate block ids; reading outside the cache is an illegal
        # address on the device, so the emulator refuses instead of inventing data.
        _require(bool(((used >= 0) & (used < num_blocks)).all()), op,
                 f"block_table[{b}] names blocks outside [0, {num_blocks}) within its {n} tokens")
    return block_table


def _paged_rows(cache: Tensor, block_table: Tensor, b: int, positions: Tensor) -> Tensor:
    """Rows of a PA_BSND cache [num_blocks, block_size, N, D] at logical `positions` of batch b."""
    block_size = cache.shape[1]
    flat = cache.reshape(cache.shape[0] * block_size, *cache.shape[2:])
    blocks = block_table[b].long()[positions // block_size]
    return flat[blocks * block_size + positions % block_size]


class _NpuUtils:
    def __init__(self, emulator: "NpuEmulator") -> None:
        self._emulator = emulator

    def get_cann_version(self, module: str = "CANN") -> str:
        modules = ("CANN", "RUNTIME", "COMPILER", "HCCL", "TOOLKIT", "OPP", "OPP_KERNEL", "DRIVER")
        if module not in modules:
            raise RuntimeError(f"get_cann_version: module must be one of {modules}, got {module!r}")
        return self._emulator.cann_version


class _NpuModule:
    """The `torch_npu.npu` functions the probe uses."""

    def __init__(self, emulator: "NpuEmulator") -> None:
        self._emulator = emulator
        self.utils = _NpuUtils(emulator)

    def is_available(self) -> bool:
        return self._emulator.devices > 0

    def device_count(self) -> int:
        return self._emulator.devices

    def _lazy_init(self) -> None:
        if self._emulator.devices == 0:
            raise RuntimeError("npuSynchronizeDevice: no NPU device found (ERR00100 PTA call acl api failed)")

    def get_soc_version(self) -> int:
        self._lazy_init()
        return self._emulator.soc_version

    def get_device_name(self, device: object = None) -> str:
        self._lazy_init()
        return self._emulator.device_name

    def current_device(self) -> int:
        self._lazy_init()
        return 0

    def is_bf16_supported(self) -> bool:
        return self._emulator.soc_version >= 220

    def device(self, device: object) -> contextlib.AbstractContextManager:
        """torch_npu.npu.device: makes `device` current inside the block."""
        self._lazy_init()
        return contextlib.nullcontext()

    def current_stream(self, device: object = None) -> types.SimpleNamespace:
        """torch_npu.npu.current_stream: a Stream whose `npu_stream` is the aclrtStream handle."""
        self._lazy_init()
        return types.SimpleNamespace(npu_stream=0x5151, device=device)


class NpuEmulator:
    """Stands in for the `torch_npu` module. `chip` is a key of CHIPS; `devices`,
    `version` and `cann` configure what the probe sees. `calls` counts vendor op calls."""

    EMULATOR = True

    def __init__(self, chip: str = "910B", *, devices: int = 8, version: str = "2.13.0",
                 cann: str = "8.5.0") -> None:
        if chip not in CHIPS:
            raise ValueError(f"unknown chip {chip!r}; known: {sorted(CHIPS)}")
        self.chip = chip
        self.soc_version, self.device_name = CHIPS[chip]
        self.devices = devices
        self.__version__ = version
        self.cann_version = cann
        self.npu = _NpuModule(self)
        self.calls: collections.Counter = collections.Counter()

    def __repr__(self) -> str:
        return f"NpuEmulator(chip={self.chip!r}, soc_version={self.soc_version})"

    @property
    def is_950(self) -> bool:
        return self.soc_version >= 260

    def _cann_at_least(self, major: int, minor: int) -> bool:
        parts = []
        for piece in self.cann_version.split("."):
            if not piece.isdigit():
                break
            parts.append(int(piece))
        return tuple(parts[:2]) >= (major, minor)

    # -- npu_rms_norm ----------------------------------------------------------------------
    def npu_rms_norm(self, self_tensor: Tensor, gamma: Tensor, epsilon: float = 1e-06) -> tuple[Tensor, Tensor]:
        """y = x / sqrt(mean(x^2 over gamma's dims) + eps) * gamma, and rstd (float32)."""
        op = "npu_rms_norm"
        self.calls[op] += 1
        x = _tensor(op, "self", self_tensor, FLOAT_DTYPES, ndim=range(2, 9))
        _tensor(op, "gamma", gamma, (x.dtype,))
        dims = gamma.dim()
        _require(1 <= dims < x.dim() + 1 and tuple(x.shape[-dims:]) == tuple(gamma.shape), op,
                 f"gamma shape {list(gamma.shape)} must equal the last dims of self {list(x.shape)}")
        reduce = tuple(range(x.dim() - dims, x.dim()))
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(dim=reduce, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    # -- npu_lightning_indexer -------------------------------------------------------------
    def npu_lightning_indexer(self, query: Tensor, key: Tensor, weights: Tensor, *,
                              actual_seq_lengths_query: Tensor | None = None,
                              actual_seq_lengths_key: Tensor | None = None,
                              block_table: Tensor | None = None, layout_query: str = "BSND",
                              layout_key: str = "BSND", sparse_count: int = 2048, sparse_mode: int = 3,
                              pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
                              return_value: bool = False) -> tuple[Tensor, Tensor]:
        """Per query token: score[s] = sum_h weights[h] * relu(q[h] . k[s]) over the batch's
        logical keys (causal, bottom-right aligned for sparse_mode 3), the top sparse_count
        positions by descending score, -1 after the last valid one. Returns int32
        [B, S1, 1, K] (BSND) or [T, 1, K] (TND), and the scores when return_value."""
        op = "npu_lightning_indexer"
        self.calls[op] += 1
        for name, t in (("query", query), ("key", key), ("weights", weights)):
            _tensor(op, name, t, HALF_DTYPES, contiguous=True)
        _require(query.dtype == key.dtype == weights.dtype, op, "query, key and weights must share a dtype")
        _require(layout_query in ("BSND", "TND"), op, f"layout_query {layout_query!r} not supported")
        _require(layout_key in ("PA_BSND", "BSND", "TND"), op, f"layout_key {layout_key!r} not supported")
        if layout_key != "PA_BSND":
            _require(layout_key == layout_query, op, "outside PageAttention layout_key must equal layout_query")
        _require((1 <= sparse_count <= 2048) or sparse_count in LARGE_SPARSE_COUNTS, op,
                 f"sparse_count {sparse_count} not supported (1-2048, {LARGE_SPARSE_COUNTS})")
        _require(sparse_mode in (0, 3), op, f"sparse_mode {sparse_mode} not supported (0 or 3)")
        _require(pre_tokens == INT64_MAX and next_tokens == INT64_MAX, op,
                 "pre_tokens/next_tokens only support the default")
        _require(not (return_value and layout_key == "PA_BSND"), op,
                 "return_value is not supported with layout_key PA_BSND")

        query_rows, q_flat = self._query_batches(op, query, layout_query, actual_seq_lengths_query)
        heads, dim = q_flat.shape[1], q_flat.shape[2]
        _require(tuple(weights.shape) == tuple(query.shape[:-1]), op, f"weights must be "
                 f"{'[B, S1, N1]' if layout_query == 'BSND' else '[T, N1]'} = {list(query.shape[:-1])}, "
                 f"got {list(weights.shape)}")
        w_flat = weights.reshape(q_flat.shape[0], heads)
        _require(heads == 64, op, f"N1 (query heads) only supports 64, got {heads}")
        _require(dim == 128, op, f"D only supports 128, got {dim}")
        batch = len(query_rows)
        key_rows = self._key_batches(op, key, layout_key, actual_seq_lengths_key, block_table, batch,
                                     dim, layout_query)

        total = q_flat.shape[0]
        indices = torch.full((total, sparse_count), -1, dtype=torch.int32)
        values = torch.full((total, sparse_count), float("-inf"))
        for b, rows in enumerate(query_rows):
            if not rows:
                continue
            keys = key_rows(b)                                            # [Skv, 128] float32
            skv, sq = keys.shape[0], len(rows)
            q = q_flat[rows].float()                                      # [Sq, 64, 128]
            scores = (torch.relu(q @ keys.T) * w_flat[rows].float().unsqueeze(-1)).sum(1)  # [Sq, Skv]
            for i, row in enumerate(rows):
                limit = min(max(skv - sq + i + 1, 0), skv) if sparse_mode == 3 else skv
                count = min(sparse_count, limit)
                if count == 0:
                    continue
                order = torch.sort(scores[i, :limit], descending=True, stable=True)
                indices[row, :count] = order.indices[:count].to(torch.int32)
                values[row, :count] = order.values[:count]
        out_shape = ((query.shape[0], query.shape[1], 1, sparse_count) if layout_query == "BSND"
                     else (query.shape[0], 1, sparse_count))
        value_out = values.to(query.dtype).reshape(out_shape) if return_value else torch.empty([0])
        return indices.reshape(out_shape), value_out

    def _query_batches(self, op: str, query: Tensor, layout: str,
                       lengths: Tensor | None) -> tuple[list[list[int]], Tensor]:
        """Flat query rows per batch, and query as [rows, N1, D]."""
        if layout == "BSND":
            _tensor(op, "query", query, ndim=4)
            b, s1, n1, d = query.shape
            lens = _per_batch_lengths(op, "actual_seq_lengths_query", lengths, b, s1)
            rows = [[bi * s1 + i for i in range(lens[bi])] for bi in range(b)]
            return rows, query.reshape(b * s1, n1, d)
        _tensor(op, "query", query, ndim=3)
        segments = _segments_from_prefix_sums(op, "actual_seq_lengths_query", lengths, query.shape[0])
        return [list(range(a, e)) for a, e in segments], query

    def _key_batches(self, op: str, key: Tensor, layout: str, lengths: Tensor | None,
                     block_table: Tensor | None, batch: int, dim: int, layout_query: str):
        """A function b -> the batch's logical keys [Skv, D] (float32)."""
        if layout == "PA_BSND":
            _tensor(op, "key", key, ndim=4)
            num_blocks, block_size, n2, d = key.shape
            _require(block_size % 16 == 0 and 16 <= block_size <= 1024, op,
                     f"block_size must be a multiple of 16 in [16, 1024], got {block_size}")
            _require(lengths is not None, op, "actual_seq_lengths_key is required for PA_BSND")
            lens = _int32_vector(op, "actual_seq_lengths_key", lengths, batch)
            _require(all(v >= 0 for v in lens), op, "actual_seq_lengths_key must be >= 0")
            table = _check_block_table(op, block_table, batch, lens, block_size, num_blocks)
            _require(n2 == 1 and d == dim, op, f"key must be [block_count, block_size, 1, {dim}], got "
                     f"{list(key.shape)}")
            return lambda b: _paged_rows(key, table, b, torch.arange(lens[b]))[:, 0].float()
        if layout == "BSND":
            _tensor(op, "key", key, ndim=4)
            _require(key.shape[0] == batch, op, f"key batch {key.shape[0]} != query batch {batch}")
            _require(key.shape[2] == 1 and key.shape[3] == dim, op, f"key must be [B, S2, 1, {dim}]")
            lens = _per_batch_lengths(op, "actual_seq_lengths_key", lengths, batch, key.shape[1])
            return lambda b: key[b, : lens[b], 0].float()
        _tensor(op, "key", key, ndim=3)
        _require(key.shape[1] == 1 and key.shape[2] == dim, op, f"key must be [T2, 1, {dim}]")
        segments = _segments_from_prefix_sums(op, "actual_seq_lengths_key", lengths, key.shape[0])
        _require(len(segments) == batch, op, f"actual_seq_lengths_key has {len(segments)} batches, "
                 f"query has {batch}")
        return lambda b: key[segments[b][0]: segments[b][1], 0].float()

    # -- npu_sparse_flash_attention --------------------------------------------------------
    def npu_sparse_flash_attention(self, query: Tensor, key: Tensor, value: Tensor | None,
                                   sparse_indices: Tensor, scale_value: float, *,
                                   block_table: Tensor | None = None,
                                   actual_seq_lengths_query: Tensor | None = None,
                                   actual_seq_lengths_kv: Tensor | None = None,
                                   query_rope: Tensor | None = None, key_rope: Tensor | None = None,
                                   sparse_block_size: int = 1, layout_query: str = "BSND",
                                   layout_kv: str = "BSND", sparse_mode: int = 3,
                                   pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
                                   attention_mode: int = 0, return_softmax_lse: bool = False,
                                   sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """MLA-absorb sparse attention: for each query token and head, over the selected
        logical positions (walked in order, stopping at the first negative index; positions
        at or past the batch's limit dropped), z = scale * (q.k + q_rope.k_rope),
        out = softmax(z) @ value. Returns (out like query, softmax_max, softmax_sum), the
        last two float32 [1, T, N1] (TND) / [B, 1, S1, N1] (BSND) when return_softmax_lse."""
        op = "npu_sparse_flash_attention"
        self.calls[op] += 1
        _require(attention_mode == 2, op, f"attention_mode only supports 2 (MLA-absorb), got {attention_mode}")
        if value is None:
            _require(self._cann_at_least(9, 2), op, "value=None needs CANN >= 9.2.0")
            value = key
        for name, t in (("query", query), ("key", key), ("value", value), ("query_rope", query_rope),
                        ("key_rope", key_rope)):
            _require(t is not None, op, f"{name} is required in MLA-absorb mode")
            _tensor(op, name, t, HALF_DTYPES, contiguous=True)
        _require(len({query.dtype, key.dtype, value.dtype, query_rope.dtype, key_rope.dtype}) == 1, op,
                 "query, key, value, query_rope and key_rope must share a dtype")
        _require(value.shape == key.shape, op, "value must have key's shape")
        _tensor(op, "sparse_indices", sparse_indices, (torch.int32,), contiguous=True)
        _require(layout_query in ("BSND", "TND"), op, f"layout_query {layout_query!r} not supported")
        _require(layout_kv in ("PA_BSND", "BSND", "TND"), op, f"layout_kv {layout_kv!r} not supported")
        _require(not (layout_query == "TND" and layout_kv == "BSND"), op, "TND query with BSND kv is not supported")
        if layout_kv != "PA_BSND":
            _require(layout_kv == layout_query, op, "outside PageAttention layout_kv must equal layout_query")
        _require(sparse_mode in (0, 3), op, f"sparse_mode {sparse_mode} not supported (0 or 3)")
        _require(pre_tokens == INT64_MAX and next_tokens == INT64_MAX, op,
                 "pre_tokens/next_tokens only support the default")
        _require(1 <= sparse_block_size <= 128 and sparse_block_size & (sparse_block_size - 1) == 0, op,
                 f"sparse_block_size must be a power of 2 in [1, 128], got {sparse_block_size}")
        _require(not (return_softmax_lse and layout_kv == "PA_BSND"), op,
                 "return_softmax_lse is not supported with layout_kv PA_BSND")
        if sinks is not None:
            raise NotEmulatedError(f"{op}: sinks (undocumented in 2.13) are not emulated")

        query_rows, q_flat = self._query_batches(op, query, layout_query, actual_seq_lengths_query)
        _require(tuple(query_rope.shape[:-1]) == tuple(query.shape[:-1]), op,
                 f"query_rope shape {list(query_rope.shape)} does not match query {list(query.shape)}")
        qr_flat = query_rope.reshape(q_flat.shape[0], q_flat.shape[1], -1)
        heads, dn, dr = q_flat.shape[1], q_flat.shape[2], qr_flat.shape[2]
        _require(heads in (1, 2, 4, 8, 16, 32, 64, 128), op, f"N1 must be one of 1,2,4,...,128, got {heads}")
        _require(dn == 512 and dr == 64, op, f"query D must be 512 and query_rope D 64, got {dn} and {dr}")
        batch = len(query_rows)
        rows_of = self._attention_kv(op, key, value, key_rope, layout_kv, actual_seq_lengths_kv,
                                     block_table, batch, sparse_block_size, layout_query)
        total = q_flat.shape[0]
        _require(sparse_indices.dim() == (4 if layout_query == "BSND" else 3), op,
                 f"sparse_indices has shape {list(sparse_indices.shape)}")
        _require(tuple(sparse_indices.shape[:-1]) == (tuple(query.shape[:2]) + (1,) if layout_query == "BSND"
                                                     else (query.shape[0], 1)), op,
                 f"sparse_indices shape {list(sparse_indices.shape)} does not match query {list(query.shape)}")
        _require(sparse_indices.shape[-1] > 0, op, "sparse_size must be > 0")
        idx_flat = sparse_indices.reshape(total, -1).long()

        out = torch.zeros(total, heads, dn)
        row_max = torch.full((total, heads), SOFTMAX_MAX_INIT)
        row_sum = torch.zeros(total, heads)
        for b, rows in enumerate(query_rows):
            if not rows:
                continue
            skv, k_nope, k_rope, v = rows_of(b)
            sq = len(rows)
            idx = idx_flat[rows]                                            # [Sq, K]
            walked = torch.cumprod((idx >= 0).long(), dim=1).bool()         # stops at the first -1
            offsets = torch.arange(sparse_block_size)
            pos = (idx.unsqueeze(-1) * sparse_block_size + offsets).flatten(1)  # [Sq, K*sbs]
            walked = walked.repeat_interleave(sparse_block_size, dim=1)
            limit = torch.arange(sq) + (skv - sq + 1) if sparse_mode == 3 else torch.full((sq,), skv)
            keep = walked & (pos >= 0) & (pos < limit.clamp(0, skv).unsqueeze(-1))
            safe = torch.where(keep, pos, 0)
            if skv == 0:
                continue
            kn, kr, vv = k_nope(safe), k_rope(safe), v(safe)                # [Sq, K*sbs, D]
            z = (q_flat[rows].float() @ kn.transpose(1, 2) + qr_flat[rows].float() @ kr.transpose(1, 2))
            z = (z * scale_value).masked_fill(~keep.unsqueeze(1), float("-inf"))  # [Sq, N1, K*sbs]
            any_valid = keep.any(dim=1)                                     # [Sq]
            m = torch.where(any_valid.unsqueeze(-1), z.amax(dim=-1), torch.tensor(SOFTMAX_MAX_INIT))
            p = torch.exp(z - m.unsqueeze(-1)).masked_fill(~keep.unsqueeze(1), 0.0)
            s = p.sum(-1)
            o = (p @ vv) / s.clamp(min=1e-30).unsqueeze(-1)
            out[rows] = torch.where(any_valid.view(-1, 1, 1), o, 0.0)
            row_max[rows], row_sum[rows] = m, s
        out = out.to(query.dtype).reshape(query.shape)
        if not return_softmax_lse:
            return out, torch.empty([0]), torch.empty([0])
        if layout_query == "TND":
            return out, row_max.unsqueeze(0), row_sum.unsqueeze(0)
        b_, s1 = query.shape[0], query.shape[1]
        return (out, row_max.reshape(b_, s1, 1, heads).transpose(1, 2),
                row_sum.reshape(b_, s1, 1, heads).transpose(1, 2))

    def _attention_kv(self, op: str, key: Tensor, value: Tensor, key_rope: Tensor, layout: str,
                      lengths: Tensor | None, block_table: Tensor | None, batch: int,
                      sparse_block_size: int, layout_query: str):
        """A function b -> (Skv, gather_nope, gather_rope, gather_value); each gather maps
        logical positions [Sq, K] to float32 rows [Sq, K, D]."""
        if layout == "PA_BSND":
            _tensor(op, "key", key, ndim=4)
            num_blocks, block_size, n2, dn = key.shape
            _require(block_size % 16 == 0 and 16 <= block_size <= 1024, op,
                     f"block_size must be a multiple of 16 in [16, 1024], got {block_size}")
            _require(block_size % sparse_block_size == 0, op, "sparse_block_size must divide block_size")
            _require(tuple(key_rope.shape) == (num_blocks, block_size, n2, 64), op,
                     f"key_rope must be [block_num, block_size, 1, 64], got {list(key_rope.shape)}")
            _require(lengths is not None, op, "actual_seq_lengths_kv is required for PA_BSND")
            lens = _int32_vector(op, "actual_seq_lengths_kv", lengths, batch)
            _require(all(v >= 0 for v in lens), op, "actual_seq_lengths_kv must be >= 0")
            table = _check_block_table(op, block_table, batch, lens, block_size, num_blocks)

            def paged(b: int):
                def gather(cache: Tensor):
                    return lambda pos: _paged_rows(cache, table, b, pos.reshape(-1)).reshape(
                        *pos.shape, cache.shape[-1]).float()
                return lens[b], gather(key), gather(key_rope), gather(value)
            n_kv = n2
            result = paged
        elif layout == "BSND":
            _tensor(op, "key", key, ndim=4)
            _require(key.shape[0] == batch, op, f"key batch {key.shape[0]} != query batch {batch}")
            lens = _per_batch_lengths(op, "actual_seq_lengths_kv", lengths, batch, key.shape[1])
            n_kv = key.shape[2]

            def dense(b: int):
                def gather(t: Tensor):
                    return lambda pos: t[b, :, 0][pos].float()
                return lens[b], gather(key), gather(key_rope), gather(value)
            result = dense
        else:
            _tensor(op, "key", key, ndim=3)
            _require(lengths is not None, op, "actual_seq_lengths_kv is required for the TND layout")
            segments = _segments_from_prefix_sums(op, "actual_seq_lengths_kv", lengths, key.shape[0])
            _require(len(segments) == batch, op, f"actual_seq_lengths_kv has {len(segments)} batches, "
                     f"query has {batch}")
            _require(tuple(key_rope.shape) == (key.shape[0], key.shape[1], 64), op,
                     f"key_rope must be [T2, 1, 64], got {list(key_rope.shape)}")
            n_kv = key.shape[1]

            def packed(b: int):
                start, end = segments[b]

                def gather(t: Tensor):
                    return lambda pos: t[start:end, 0][pos].float()
                return end - start, gather(key), gather(key_rope), gather(value)
            result = packed
        _require(n_kv == 1, op, f"KV_N only supports 1, got {n_kv}")
        _require(key.shape[-1] == 512, op, f"key D must be 512, got {key.shape[-1]}")
        return result

    # -- MoE: npu_moe_init_routing_v2 / npu_moe_finalize_routing ---------------------------
    def npu_moe_init_routing_v2(self, x: Tensor, expert_idx: Tensor, *, scale: Tensor | None = None,
                                offset: Tensor | None = None, active_num: int = -1,
                                expert_capacity: int = -1, expert_num: int = -1, drop_pad_mode: int = 0,
                                expert_tokens_num_type: int = 0, expert_tokens_num_flag: bool = False,
                                quant_mode: int = -1, active_expert_range: Sequence[int] = (),
                                row_idx_type: int = 0, x_dtype: int | None = None
                                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Dropless sort of the (token, k) pairs by expert (golden CPU reference of the
        op-plugin tests): flat index j = token*K + k, ids below the range start sorted last,
        a stable argsort, ids inside [start, end) valid. Returns (expanded_x, expanded_row_idx,
        per-expert counts or (expert, count) pairs int64, expanded_scale)."""
        op = "npu_moe_init_routing_v2"
        self.calls[op] += 1
        _tensor(op, "x", x, FLOAT_DTYPES + (torch.int8,), ndim=2)
        _tensor(op, "expert_idx", expert_idx, (torch.int32,), ndim=2)
        rows, k = expert_idx.shape
        _require(x.shape[0] == rows, op, f"x has {x.shape[0]} rows, expert_idx {rows}")
        _require(0 < expert_num <= 10240, op, f"expert_num must be in (0, 10240], got {expert_num}")
        _require(drop_pad_mode == 0, op, "drop_pad_mode only supports 0 (dropless)")
        _require(expert_tokens_num_type in (1, 2), op, "expert_tokens_num_type only supports 1 and 2")
        _require(expert_tokens_num_flag, op, "expert_tokens_num_flag only supports True")
        _require(quant_mode in (-1, 1), op, f"quant_mode {quant_mode} not supported (-1 or 1)")
        _require(row_idx_type in (0, 1), op, f"row_idx_type must be 0 or 1, got {row_idx_type}")
        _require(offset is None, op, "offset is not supported in the non-quant / dynamic-quant modes")
        if quant_mode == 1:
            raise NotEmulatedError(f"{op}: quant_mode 1 (dynamic int8) is not emulated")
        start, end = (0, expert_num) if len(active_expert_range) == 0 else tuple(active_expert_range)
        _require(0 <= start < end <= expert_num, op, f"active_expert_range {list(active_expert_range)} must "
                 f"satisfy 0 <= start < end <= expert_num ({expert_num})")
        _require(active_num >= -1, op, f"active_num must be >= -1, got {active_num}")
        _require(bool((expert_idx < expert_num).all()), op, f"expert ids must be < expert_num ({expert_num})")

        flat = expert_idx.reshape(-1).long()
        sort_key = torch.where(flat < start, torch.iinfo(torch.int32).max, flat)
        order = torch.sort(sort_key, stable=True).indices
        in_range = (flat >= start) & (flat < end)
        n_valid = int(in_range.sum())
        total = rows * k
        capacity = total if active_num <= 0 else min(active_num, total)
        active = n_valid if active_num <= 0 else min(active_num, n_valid)
        expanded_x = torch.full((capacity, x.shape[1]), float("nan") if x.is_floating_point() else 0,
                                dtype=x.dtype)
        expanded_x[:active] = x[order[:active] // k]
        if row_idx_type == 1:
            # valid entries first; the rest is undefined (poisoned so readers of it fail)
            expanded_row_idx = torch.full((total,), torch.iinfo(torch.int32).min, dtype=torch.int32)
            expanded_row_idx[:n_valid] = order[:n_valid].to(torch.int32)
        else:
            expanded_row_idx = torch.full((total,), -1, dtype=torch.int32)
            expanded_row_idx[order[:n_valid]] = torch.arange(n_valid, dtype=torch.int32)
        sorted_ids = flat[order[:n_valid]]
        counts = torch.bincount(sorted_ids - start, minlength=end - start).to(torch.int64)
        if expert_tokens_num_type == 2:
            pairs = torch.zeros((expert_num, 2), dtype=torch.int64)
            nonzero = counts.nonzero().flatten()
            pairs[: nonzero.numel(), 0] = nonzero + start
            pairs[: nonzero.numel(), 1] = counts[nonzero]
            counts = pairs
        expanded_scale = torch.full((total,), float("nan"))
        if scale is not None:
            _tensor(op, "scale", scale, (torch.float32,), ndim=1)
            _require(scale.shape[0] == rows, op, "scale must be [NUM_ROWS] in the non-quant mode")
            expanded_scale[:active] = scale[order[:active] // k]
        return expanded_x, expanded_row_idx, counts, expanded_scale

    def npu_moe_finalize_routing(self, expanded_permuted_rows: Tensor, skip1: Tensor | None,
                                 skip2: Tensor | None, bias: Tensor | None, scales: Tensor | None,
                                 expanded_src_to_dst_row: Tensor, export_for_source_row: Tensor | None,
                                 drop_pad_mode: int | None = 0, k: int | None = 1) -> Tensor:
        """out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[idx(i, k)] + bias[expert(i, k)]),
        idx(i, k) = expanded_src_to_dst_row[i + k*NUM_ROWS] (mode 0, K-major) or
        [i*K + k] (mode 2, token-major, as produced by npu_moe_init_routing_v2)."""
        op = "npu_moe_finalize_routing"
        self.calls[op] += 1
        rows_in = _tensor(op, "expanded_permuted_rows", expanded_permuted_rows, FLOAT_DTYPES, ndim=2)
        dtype = rows_in.dtype
        _tensor(op, "expanded_src_to_dst_row", expanded_src_to_dst_row, (torch.int32,), ndim=1)
        _require(drop_pad_mode in (0, 2), op, f"drop_pad_mode {drop_pad_mode}: only the dropless modes 0 "
                 "and 2 are emulated" if drop_pad_mode in (1, 3) else f"drop_pad_mode {drop_pad_mode} invalid")
        if scales is not None:
            _tensor(op, "scales", scales, (dtype,), ndim=2)
            num_rows, top_k = scales.shape
        else:
            _require(k is not None and k >= 1, op, "k must be given when scales is None")
            top_k = k
            num_rows = expanded_src_to_dst_row.shape[0] // top_k
        _require(expanded_src_to_dst_row.shape[0] == num_rows * top_k, op,
                 f"expanded_src_to_dst_row must have NUM_ROWS*K = {num_rows * top_k} elements")
        _require(rows_in.shape[0] == num_rows * top_k, op,
                 f"expanded_permuted_rows must be [NUM_ROWS*K = {num_rows * top_k}, H], got {list(rows_in.shape)}")
        _require(skip2 is not None or skip1 is None, op, "skip1 must be None when skip2 is None")
        hidden = rows_in.shape[1]
        out = torch.zeros(num_rows, hidden)
        for name, skip in (("skip1", skip1), ("skip2", skip2)):
            if skip is not None:
                _tensor(op, name, skip, (dtype,))
                _require(tuple(skip.shape) == (num_rows, hidden), op, f"{name} must be [{num_rows}, {hidden}]")
                out += skip.float()
        idx = expanded_src_to_dst_row.long()
        _require(bool(((idx >= 0) & (idx < rows_in.shape[0])).all()), op,
                 f"expanded_src_to_dst_row values must be in [0, {rows_in.shape[0] - 1}]")
        if drop_pad_mode == 0:
            idx = idx.reshape(top_k, num_rows).T                      # K-major
        else:
            idx = idx.reshape(num_rows, top_k)
        gathered = rows_in.float()[idx]                               # [NUM_ROWS, K, H]
        if bias is not None:
            _require(export_for_source_row is not None, op, "bias needs export_for_source_row")
            _tensor(op, "bias", bias, (dtype,), ndim=2)
            _tensor(op, "export_for_source_row", export_for_source_row, (torch.int32,), ndim=2)
            gathered = gathered + bias.float()[export_for_source_row.long()]
        weight = scales.float() if scales is not None else torch.ones(num_rows, top_k)
        out += (weight.unsqueeze(-1) * gathered).sum(1)
        return out.to(dtype)

    # -- npu_grouped_matmul ----------------------------------------------------------------
    def npu_grouped_matmul(self, x: list[Tensor], weight: list[Tensor], *, bias: list[Tensor] | None = None,
                           scale: list[Tensor] | None = None, offset: list[Tensor] | None = None,
                           antiquant_scale: list[Tensor] | None = None,
                           antiquant_offset: list[Tensor] | None = None,
                           per_token_scale: list[Tensor] | None = None, group_list: Tensor | None = None,
                           activation_input: list[Tensor] | None = None,
                           activation_quant_scale: list[Tensor] | None = None,
                           activation_quant_offset: list[Tensor] | None = None, split_item: int | None = 0,
                           group_type: int | None = None, group_list_type: int | None = 0,
                           act_type: int | None = 0, tuning_config: list[int] | None = None,
                           output_dtype: int | None = None, x_dtype: int | None = None,
                           weight_dtype: int | None = None, scale_dtype: int | None = None,
                           per_token_scale_dtype: int | None = None) -> list[Tensor]:
        """Non-quantised grouped matmul y_i = x_i @ w_i (+ b_i), weights [K, N] per group.
        group_type 0 splits the rows of one x over the groups by group_list (counts for
        group_list_type 1, a cumulative sum for 0); -1 pairs list entries."""
        op = "npu_grouped_matmul"
        self.calls[op] += 1
        quantised = (scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
                     activation_quant_scale, activation_quant_offset)
        if any(q is not None for q in quantised) or output_dtype is not None:
            raise NotEmulatedError(f"{op}: quantised / output_dtype modes are not emulated")
        _require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op,
                 "x and weight must be lists of tensors")
        _require(1 <= len(x) <= 128 and 1 <= len(weight) <= 128, op, "at most 128 tensors per list")
        _require(group_type in (-1, 0), op, f"group_type {group_type} not supported on A2/A3 (-1 or 0)")
        _require(act_type == 0, op, "activations are only supported with per-token quantisation")
        _require(split_item in (0, 1, 2, 3), op, f"split_item must be 0..3, got {split_item}")
        dtype = x[0].dtype
        for t in list(x) + list(weight):
            _tensor(op, "x/weight", t, FLOAT_DTYPES)
            _require(t.dtype == dtype, op, "x and weight must share a dtype")
            _require(t.shape[-1] < 65536, op, f"the last dim of every x/weight must be < 65536, got {list(t.shape)}")
        if group_type == -1:
            _require(len(x) == len(weight), op, "group_type -1 pairs x[i] with weight[i]")
            outs = [(xi.float() @ wi.float()) for xi, wi in zip(x, weight)]
            if bias is not None:
                outs = [o + b.float() for o, b in zip(outs, bias)]
            outs = [o.to(dtype) for o in outs]
            return [torch.cat(outs)] if split_item in (2, 3) else outs
        _require(len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3, op,
                 "group_type 0 is emulated for one x [M, K] and one weight [E, K, N]")
        xs, w = _tensor(op, "x[0]", x[0], ndim=2), weight[0]
        experts, k_dim, n_dim = w.shape
        _require(xs.shape[1] == k_dim, op, f"x [M, {xs.shape[1]}] does not match weight [E, {k_dim}, N]")
        _require(experts <= 1024, op, f"at most 1024 groups with a single weight, got {experts}")
        _require(group_list is not None, op, "group_list is required for group_type 0")
        _tensor(op, "group_list", group_list, (torch.int64,), ndim=1)
        _require(group_list.shape[0] == experts, op, f"group_list must have E={experts} entries")
        _require(group_list_type in (0, 1), op, f"group_list_type must be 0 or 1, got {group_list_type}")
        values = [int(v) for v in group_list.tolist()]
        if group_list_type == 1:
            _require(all(v >= 0 for v in values) and sum(values) == xs.shape[0], op,
                     f"group_list counts must be >= 0 and sum to M={xs.shape[0]}, got {values}")
            ends = list(torch.tensor(values).cumsum(0).tolist()) if values else []
        else:
            _require(all(b >= a for a, b in zip([0] + values, values)) and values[-1] == xs.shape[0], op,
                     f"group_list must be a non-decreasing cumsum ending at M={xs.shape[0]}, got {values}")
            ends = values
        out = torch.empty(xs.shape[0], n_dim)
        start = 0
        for e, end in enumerate(ends):
            out[start:end] = xs[start:end].float() @ w[e].float()
            if bias is not None:
                out[start:end] += bias[0][e].float()
            start = end
        return [out.to(dtype)]

    # -- KV writes -------------------------------------------------------------------------
    def npu_scatter_nd_update_(self, self_tensor: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
        """In place: self[tuple(indices[i])] = updates[i]. Out-of-range indices are not
        supported (they are not skipped)."""
        op = "npu_scatter_nd_update_"
        self.calls[op] += 1
        self._scatter_nd(op, self_tensor, indices, updates)
        return self_tensor

    def npu_scatter_nd_update(self, self_tensor: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
        op = "npu_scatter_nd_update"
        self.calls[op] += 1
        out = self_tensor.clone()
        self._scatter_nd(op, out, indices, updates)
        return out

    def _scatter_nd(self, op: str, target: Tensor, indices: Tensor, updates: Tensor) -> None:
        allowed = (torch.float32, torch.float16, torch.bool, torch.bfloat16, torch.int64, torch.int8)
        _tensor(op, "self", target, allowed)
        _require(1 <= target.dim() <= 8, op, "self must be 1-8 dimensional")
        _tensor(op, "indices", indices, (torch.int32, torch.int64))
        _tensor(op, "updates", updates, (target.dtype,))
        _require(indices.dim() >= 2, op, "indices must be at least 2-D")
        depth = indices.shape[-1]
        _require(1 <= depth <= target.dim(), op, f"indices' last dim ({depth}) must be <= self.dim()")
        expected = tuple(indices.shape[:-1]) + tuple(target.shape[depth:])
        _require(tuple(updates.shape) == expected, op, f"updates must have shape {list(expected)}, got "
                 f"{list(updates.shape)}")
        flat_idx = indices.reshape(-1, depth).long()
        bounds = torch.tensor(target.shape[:depth])
        _require(bool(((flat_idx >= 0) & (flat_idx < bounds)).all()), op,
                 f"indices out of range for self of shape {list(target.shape)} (not supported)")
        flat_upd = updates.reshape(flat_idx.shape[0], *target.shape[depth:])
        for row, upd in zip(flat_idx.tolist(), flat_upd):
            target[tuple(row)] = upd

    # -- routing ---------------------------------------------------------------------------
    def npu_moe_gating_top_k(self, x: Tensor, k: int, *, bias: Tensor | None = None,
                             input_ids: Tensor | None = None, tid2eid: Tensor | None = None,
                             k_group: int = 1, group_count: int = 1, group_select_mode: int = 0,
                             renorm: int = 0, norm_type: int = 0, out_flag: bool = False,
                             routed_scaling_factor: float = 1.0, eps: float = 1e-20
                             ) -> tuple[Tensor, Tensor, Tensor]:
        """DeepSeek-V3-style gate (CANN moe_gating_top_k README): norm = softmax/sigmoid(x),
        selection on norm + bias with group pruning (group score = max, or sum of the top 2),
        weights = norm at the selected experts (without the bias), renormalised for sigmoid,
        times routed_scaling_factor. Returns (y like x, expert_idx int32, norm_out float32)."""
        op = "npu_moe_gating_top_k"
        self.calls[op] += 1
        if input_ids is not None or tid2eid is not None:
            raise NotEmulatedError(f"{op}: hash routing (input_ids/tid2eid) is not emulated")
        _tensor(op, "x", x, FLOAT_DTYPES, ndim=2)
        tokens, experts = x.shape
        _require(experts <= 2048, op, f"the expert count (last dim of x) must be <= 2048, got {experts}")
        _require(group_count >= 1 and experts % group_count == 0, op,
                 f"expert count {experts} must be divisible by group_count {group_count}")
        per_group = experts // group_count
        _require(per_group > 2, op, f"experts per group must be > 2, got {per_group}")
        _require(-(-per_group // 32) * 32 * group_count <= 2048, op, "Align32(E/group_count)*group_count must be <= 2048")
        _require(1 <= k_group <= group_count, op, f"k_group must be in [1, group_count], got {k_group}")
        _require(1 <= k <= per_group * k_group, op, f"k must be in [1, E/group_count*k_group], got {k}")
        _require(group_select_mode in (0, 1), op, "group_select_mode must be 0 or 1")
        _require(renorm == 0, op, "renorm only supports 0 (norm first, then top-k) in this release")
        _require(norm_type in (0, 1), op, "norm_type must be 0 (softmax) or 1 (sigmoid)")
        xf = x.float()
        norm = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
        select = norm
        if bias is not None:
            _tensor(op, "bias", bias, (x.dtype,), ndim=1)
            _require(bias.shape[0] == experts, op, f"bias must be [{experts}]")
            select = norm + bias.float()
        if group_count > 1:
            grouped = select.reshape(tokens, group_count, per_group)
            if group_select_mode == 0:
                group_score = grouped.amax(-1)
            else:
                group_score = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(k_group, dim=-1).indices, True)
            select = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).reshape(tokens, experts)
        expert_idx = select.topk(k, dim=-1).indices
        gathered = norm.gather(1, expert_idx)
        if norm_type == 1:
            gathered = gathered / (gathered.sum(-1, keepdim=True) + eps)
        y = (gathered * routed_scaling_factor).to(x.dtype)
        return y, expert_idx.to(torch.int32), norm if out_flag else torch.empty((tokens, experts))

    # -- elementwise -----------------------------------------------------------------------
    def npu_swiglu(self, self_tensor: Tensor, dim: int = -1) -> Tensor:
        """swish(A) * B with A, B the two halves of x along dim (A first)."""
        op = "npu_swiglu"
        self.calls[op] += 1
        x = _tensor(op, "self", self_tensor, FLOAT_DTYPES, ndim=range(1, 9))
        _require(x.shape[dim] % 2 == 0, op, f"the size of dim {dim} must be even, got {x.shape[dim]}")
        a, b = x.float().chunk(2, dim=dim)
        return (a * torch.sigmoid(a) * b).to(x.dtype)

    def npu_rotary_mul(self, self_tensor: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half",
                       rotate: Tensor | None = None) -> Tensor:
        """out = r1 * x + r2 * x_new; 'half': x_new = cat(-x2, x1) of the two halves,
        'interleave': x_new = stack(-x[1::2], x[::2]) interleaved back."""
        op = "npu_rotary_mul"
        self.calls[op] += 1
        x = _tensor(op, "self", self_tensor, FLOAT_DTYPES, ndim=4)
        _tensor(op, "r1", r1, (x.dtype,), ndim=4)
        _tensor(op, "r2", r2, (x.dtype,), ndim=4)
        _require(r1.shape == r2.shape, op, "r1 and r2 must have the same shape")
        if rotate is not None:
            raise NotEmulatedError(f"{op}: the rotate matrix mode is not emulated")
        d = x.shape[-1]
        _require(r1.shape[-1] == d, op, f"r1's last dim must be D={d}")
        _require(all(r in (1, s) for r, s in zip(r1.shape[:3], x.shape[:3])), op,
                 f"r1 shape {list(r1.shape)} does not broadcast to x {list(x.shape)}")
        xf = x.float()
        if rotary_mode == "half":
            _require(d % 2 == 0 and d < 896, op, f"half mode needs an even D < 896, got {d}")
            _require(x.shape[0] < 1000 and x.shape[2] < 1000, op, "B and N must be < 1000")
            x1, x2 = xf.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
        elif rotary_mode == "interleave":
            _require(d % 2 == 0, op, f"interleave mode needs an even D, got {d}")
            _require(sum(s != 1 for s in r1.shape[:3]) <= 1, op,
                     f"interleave mode needs r1 of shape 11SD, 1S1D or S11D, got {list(r1.shape)}")
            non_seq = [s for s, r in zip(x.shape[:3], r1.shape[:3]) if r == 1]
            _require(math.prod(non_seq) < 1000, op, "interleave mode needs B*N < 1000")
            rotated = torch.stack((-xf[..., 1::2], xf[..., ::2]), dim=-1).flatten(-2)
        else:
            raise NpuOpError(f"{op}: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
        return (r1.float() * xf + r2.float() * rotated).to(x.dtype)

    # -- quantisation ----------------------------------------------------------------------
    def npu_dynamic_block_quant(self, x: Tensor, *, min_scale: float = 0.0, round_mode: str = "rint",
                                dst_type: "int | torch.dtype" = 1, row_block_size: int = 1,
                                col_block_size: int = 128, dst_type_max: float = 0.0) -> tuple[Tensor, Tensor]:
        """Per (row_block x col_block) block: scale = max(blockmax|x| / DTYPE_MAX, min_scale),
        y = x / scale rounded to nearest-even (int8, or float8_e4m3fn on Ascend 950).
        Returns (y like x in dst_type, scale float32 [..., rows, ceil(cols / 128)])."""
        op = "npu_dynamic_block_quant"
        self.calls[op] += 1
        _tensor(op, "x", x, HALF_DTYPES, ndim=(2, 3))
        _require(min_scale >= 0.0, op, f"min_scale must be >= 0, got {min_scale}")
        _require(round_mode == "rint", op, "round_mode only supports 'rint'")
        _require(row_block_size == 1, op, "row_block_size only supports 1")
        _require(col_block_size == 128, op, "col_block_size only supports 128")
        target = {1: torch.int8, torch.int8: torch.int8, 24: torch.float8_e4m3fn,
                  torch.float8_e4m3fn: torch.float8_e4m3fn, 292: torch.float8_e4m3fn}.get(dst_type)
        _require(target is not None, op, f"dst_type {dst_type!r} not supported")
        if target != torch.int8:
            _require(self.is_950, op, f"dst_type {target} is only supported on Ascend 950; dst_type only "
                     "supports torch.int8 on 910B/910C")
        limit = 127.0 if target == torch.int8 else 448.0
        if dst_type_max:
            limit = float(dst_type_max)
        cols = x.shape[-1]
        blocks = -(-cols // col_block_size)
        padded = torch.nn.functional.pad(x.float(), (0, blocks * col_block_size - cols))
        view = padded.reshape(*x.shape[:-1], blocks, col_block_size)
        scale = torch.clamp(view.abs().amax(-1) / limit, min=min_scale)
        safe = torch.where(scale > 0, scale, 1.0)
        q = (view / safe.unsqueeze(-1)).clamp(-limit, limit)
        q = q.reshape(*x.shape[:-1], blocks * col_block_size)[..., :cols]
        y = torch.round(q).to(torch.int8) if target == torch.int8 else q.to(torch.float8_e4m3fn)
        return y, scale

