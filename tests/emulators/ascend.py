"""A CPU emulator of the `torch_npu` functions glm5_hal's Ascend adapters call, for a chosen
chip, torch_npu version and CANN version.

Written from the vendor's public artifacts only (the constraint a check enforces is cited
next to it; "inferred" marks what they imply without saying):
* the torch-npu wheels on PyPI, 2.13.0 unless a comment names another version:
  `torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml` -- the op schemas, registered
  with torch.library under a test-only namespace (npu_schemas.py), so every call is parsed by
  torch's schema parser exactly as `torch.ops.npu` parses it; `torch_npu/_op_plugin_docs.py`
  -- per-op formulas, supported values and constraints (stale for the DSA ops: the yaml is
  authoritative for their signatures); `torch_npu/op_plugin/meta/_meta_registrations.py` --
  output shapes; `torch_npu/include/torch_npu/csrc/core/npu/NpuVariables.h` -- the SocVersion
  enum; the SoC name strings of `torch_npu/lib/libtorch_npu.so`;
* Ascend's ops-transformer repository (the CANN attention kernels; read from its mirror
  github.com/cannmirror/ops-transformer), tags v8.5.0 (6ead121a), v9.0.0 (afe72144) and
  v9.1.0.pre (121f37de): `attention/lightning_indexer/README.md` and
  `attention/sparse_flash_attention/README.md` give the constraints per CANN version and chip
  (the tags are taken to be the CANN versions they ship in: inferred), and the vendor's golden
  references of v9.1.0.pre, `attention/lightning_indexer/tests/pytest/lightning_indexer_golden.py`
  and `attention/sparse_flash_attention/tests/pytest/sparse_flash_attention_golden.py`, are
  ported below: their semantics, down to the rounding, are what this emulator computes.

It models the vendor layouts (BSND, TND with prefix-sum lengths, PA_BSND with a block
table), index conventions (logical positions, -1 tails, the attention walk stopping at the
first -1) and documented constraints: a violated one raises `NpuOpError` (a RuntimeError, as
aclnn's parameter checks do), so an adapter that forgets to decline a call fails its test.
Documented behaviour it does not model, and anything the sources leave undefined, raises
`NotEmulatedError` instead of guessing. It never calls glm5_hal.reference; numerics are
float32 like the kernels' accumulators. The probe surface (`npu.is_available`,
`npu.device_count`, `npu.get_soc_version`, `npu.get_device_name`,
`npu.utils.get_cann_version`) reports the configured chip and versions.
"""
from __future__ import annotations

import collections
import contextlib
import math
import threading
import types
from typing import Any, Sequence

import torch
from torch import Tensor

from . import npu_schemas

INT64_MAX = 9223372036854775807
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: npu_lightning_indexer's sparse_count beyond 1..2048, from CANN 9.0 (ops-transformer v9.0.0
#: attention/lightning_indexer/README.md; v8.5.0 allows [1, 2048] only).
LARGE_SPARSE_COUNTS = (3072, 4096, 5120, 6144, 7168, 8192)

#: chip key -> (SocVersion enum value, aclrtGetSocName string): NpuVariables.h and the SoC
#: names in libtorch_npu.so of the torch-npu 2.13.0 wheel.
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

#: c10::ScalarType numbers (c10/core/ScalarType.h): what a torch.dtype passed to an `int`
#: schema argument arrives as.
SCALAR_TYPES = {1: torch.int8, 3: torch.int32, 5: torch.float16, 6: torch.float32, 15: torch.bfloat16,
                23: torch.float8_e5m2, 24: torch.float8_e4m3fn}


def product(soc_version: int) -> str | None:
    """The product line the op documentation names for a SoC: "A2" (Ascend910B*, 220-225),
    "A3" (Ascend910_93xx, 250-256), "950" (260), per NpuVariables.h's enum blocks."""
    if 220 <= soc_version <= 225:
        return "A2"
    if 250 <= soc_version <= 256:
        return "A3"
    if soc_version == 260:
        return "950"
    return None


def scalar_type(value: Any) -> torch.dtype | None:
    """A dtype argument as torch passes it: a torch.dtype (`ScalarType?` schemas) or its
    ScalarType number (`int?` schemas, from the 2026-04 wheels on)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    return SCALAR_TYPES.get(int(value))


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


#: The ops this emulator implements (each a method of NpuEmulator named like the op, its
#: parameters named like the schema's arguments, `self` as `self_tensor`).
EMULATED_OPS = ("npu_rms_norm", "npu_swiglu", "npu_rotary_mul", "npu_lightning_indexer",
                "npu_sparse_flash_attention", "npu_moe_gating_top_k", "npu_moe_init_routing_v2",
                "npu_moe_finalize_routing", "npu_grouped_matmul", "npu_scatter_nd_update_",
                "npu_scatter_nd_update", "npu_dynamic_block_quant", "npu_dynamic_quant", "npu_quant_matmul")


class _Active(threading.local):
    emulator: "NpuEmulator | None" = None


_ACTIVE = _Active()


def _schema_kernel(overload: str, bound: dict) -> Any:
    """The CPU kernel of every registered op: the emulator that made the call runs it, with
    every schema argument by name. A schema argument the emulator's method does not know is
    accepted only as None (the method cannot honour anything else; tests/test_ascend_schemas.py
    checks that every argument of each wheel is known)."""
    emulator = _ACTIVE.emulator
    name = overload.split(".", 1)[0]
    method = getattr(NpuEmulator, name)
    known = method.__code__.co_varnames[1: method.__code__.co_argcount + method.__code__.co_kwonlyargcount]
    kwargs = {}
    for arg, value in bound.items():
        key = "self_tensor" if arg == "self" else arg
        if key in known:
            kwargs[key] = value
        elif value is not None:
            raise NotEmulatedError(f"{name}: argument {arg} (given {type(value).__name__}) is not emulated")
    return method(emulator, **kwargs)


class NpuEmulator:
    """Stands in for the `torch_npu` module. `chip` is a key of CHIPS; `devices`, `version`
    (torch_npu) and `cann` configure what the probe sees and which documented rules the ops
    follow. When the torch-npu wheel of `version` is unpacked under build/torch_npu
    (scripts/fetch_torch_npu.sh), every `npu_*` attribute is the wheel's schema registered
    with torch.library (`schemas`), an op the wheel does not declare is missing as it is from
    torch_npu; without the wheel the methods are called directly (`schemas` is None).
    `calls` counts vendor op calls."""

    EMULATOR = True

    def __init__(self, chip: str = "910B", *, devices: int = 8, version: str = npu_schemas.PINNED,
                 cann: str = "9.1.0") -> None:
        if chip not in CHIPS:
            raise ValueError(f"unknown chip {chip!r}; known: {sorted(CHIPS)}")
        self.chip = chip
        self.soc_version, self.device_name = CHIPS[chip]
        self.product = product(self.soc_version)
        self.devices = devices
        self.__version__ = version
        self.cann_version = cann
        self.npu = _NpuModule(self)
        self.calls: collections.Counter = collections.Counter()
        #: (dtype, shape) of the weight scale of every per-token npu_grouped_matmul call
        self.grouped_matmul_scales: list = []
        self.schemas = (npu_schemas.schemas(version, _schema_kernel, EMULATED_OPS)
                        if npu_schemas.available(version) else None)

    def __repr__(self) -> str:
        return f"NpuEmulator(chip={self.chip!r}, soc_version={self.soc_version}, torch_npu={self.__version__}, " \
               f"CANN={self.cann_version})"

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("npu_"):
            schemas = object.__getattribute__(self, "schemas")
            if schemas is not None:
                return object.__getattribute__(self, "_through_schema")(schemas, name)
        return object.__getattribute__(self, name)

    def _through_schema(self, schemas: "npu_schemas.Schemas", name: str) -> Any:
        op = schemas.op(name)
        if op is None:
            raise AttributeError(f"module 'torch_npu' has no attribute '{name}' ({schemas.source} does not "
                                 "declare it)")
        if name not in EMULATED_OPS:
            raise NotEmulatedError(f"{name} is declared by {schemas.source} but not emulated")

        def call(*args: Any, **kwargs: Any) -> Any:
            previous, _ACTIVE.emulator = _ACTIVE.emulator, self
            try:
                return op(*args, **kwargs)
            finally:
                _ACTIVE.emulator = previous
        call.__name__ = name
        return call

    @property
    def is_950(self) -> bool:
        return self.product == "950"

    def cann(self) -> tuple[int, ...]:
        """The CANN version as numbers ("9.1.0" -> (9, 1, 0), "8.5.RC1" -> (8, 5))."""
        parts = []
        for piece in self.cann_version.split("."):
            if not piece.isdigit():
                break
            parts.append(int(piece))
        return tuple(parts)

    def _cann_at_least(self, major: int, minor: int) -> bool:
        return self.cann()[:2] >= (major, minor)

    def _attention_release(self, op: str) -> tuple[int, int]:
        """The ops-transformer release whose README rules apply to this CANN: (8, 5), (9, 0)
        or (9, 1). Nothing public describes these kernels outside that range."""
        version = self.cann()[:2]
        if not (8, 5) <= version <= (9, 1):
            raise NotEmulatedError(f"{op}: CANN {self.cann_version} is outside the releases whose "
                                   "ops-transformer documentation this emulator follows (8.5 to 9.1)")
        return (9, 1) if version >= (9, 1) else (9, 0) if version >= (9, 0) else (8, 5)

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
        """The golden (lightning_indexer_golden.py, v9.1.0.pre): per query token
        score[s] = sum_h weights[h] * relu(q[h] . k[s]) in float32 over the batch's logical
        keys, the keys past the bottom-right causal limit masked under sparse_mode 3, the
        scores rounded to bfloat16 and stably sorted descending (ties: the lower position
        first); the first min(S2, sparse_count) positions, -1 after the valid ones. Returns
        int32 [B, S1, 1, K] (BSND) or [T, 1, K] (TND), and the scores when return_value.
        Constraints per CANN release and chip: attention/lightning_indexer/README.md."""
        op = "npu_lightning_indexer"
        self.calls[op] += 1
        release = self._attention_release(op)
        supported = ("A2", "A3", "950") if release >= (9, 1) else ("A2", "A3")
        _require(self.product in supported, op, f"{self.device_name} is not supported by CANN {self.cann_version} "
                 f"(products: {', '.join(supported)})")
        for name, t in (("query", query), ("key", key)):
            _tensor(op, name, t, HALF_DTYPES, contiguous=True)
        _require(query.dtype == key.dtype, op, "query and key must share a dtype")
        fp32_weights = release >= (9, 0) and not self.is_950
        _tensor(op, "weights", weights, (query.dtype, torch.float32) if fp32_weights else (query.dtype,),
                contiguous=True)
        _require(layout_query in ("BSND", "TND"), op, f"layout_query {layout_query!r} not supported")
        _require(layout_key in ("PA_BSND", "BSND", "TND"), op, f"layout_key {layout_key!r} not supported")
        if layout_key != "PA_BSND":
            _require(layout_key == layout_query, op, "outside PageAttention layout_key must equal layout_query")
        large = LARGE_SPARSE_COUNTS if release >= (9, 0) else ()
        _require((1 <= sparse_count <= 2048) or sparse_count in large, op,
                 f"sparse_count {sparse_count} not supported (1-2048{', ' + str(large) if large else ''})")
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
        if release < (9, 0):
            _require(heads == 64, op, f"N1 (query heads) only supports 64, got {heads}")
        elif self.is_950:
            _require(heads in (8, 16, 24, 32, 64), op, f"N1 (query heads) supports 8, 16, 24, 32, 64 on "
                     f"Ascend 950, got {heads}")
        else:
            _require(1 <= heads <= 64, op, f"N1 (query heads) supports 1 to 64, got {heads}")
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
            q = q_flat[rows].float()                                      # [Sq, N1, 128]
            scores = (torch.relu(q @ keys.T) * w_flat[rows].float().unsqueeze(-1)).sum(1)  # [Sq, Skv]
            ranked = scores.to(torch.bfloat16)                            # the golden sorts bf16 scores
            for i, row in enumerate(rows):
                limit = min(max(skv - sq + i + 1, 0), skv) if sparse_mode == 3 else skv
                count = min(sparse_count, limit)
                if count == 0:
                    continue
                order = torch.sort(ranked[i, :limit], descending=True, stable=True)
                indices[row, :count] = order.indices[:count].to(torch.int32)
                values[row, :count] = order.values[:count].float()
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
        """The golden (sparse_flash_attention_golden.py, v9.1.0.pre, `gatherKV` and
        `_t_increattention_bnsd`), MLA-absorb mode: for each query token, with threshold =
        the batch's kv length (sparse_mode 0) or its bottom-right causal limit (3), the first
        min(sparse_size, ceil(threshold / sparse_block_size)) index entries are walked in
        order, stopping at the first -1; a block starting at or past the threshold is
        skipped, the last one clipped to it. Over the positions gathered (repeats count
        again), z = scale * (q . k + q_rope . k_rope) in float32, p = softmax(z) rounded to
        the query's dtype, out = p @ value[..., :512]. softmax_max = max z and softmax_sum =
        sum exp(z - max) start at 0: a row with no position (or before the causal diagonal)
        gets out 0, softmax_max 0, softmax_sum 0. Returns (out like query, softmax_max,
        softmax_sum), the last two float32 [1, T, N1] (TND) / [B, 1, S1, N1] (BSND) when
        return_softmax_lse. Constraints per CANN release and chip:
        attention/sparse_flash_attention/README.md."""
        op = "npu_sparse_flash_attention"
        self.calls[op] += 1
        release = self._attention_release(op)
        supported = ("A2", "A3", "950") if release >= (9, 1) else ("A2", "A3")
        _require(self.product in supported, op, f"{self.device_name} is not supported by CANN {self.cann_version} "
                 f"(products: {', '.join(supported)})")
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
        if self.is_950:
            _require(sparse_block_size == 1, op, f"sparse_block_size only supports 1 on Ascend 950, got "
                     f"{sparse_block_size}")
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
        if self.is_950:
            _require(1 <= heads <= 128, op, f"N1 must be in [1, 128] on Ascend 950, got {heads}")
        else:
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
        row_max = torch.zeros(total, heads)                                 # the golden's initial 0
        row_sum = torch.zeros(total, heads)
        sbs = sparse_block_size
        for b, rows in enumerate(query_rows):
            if not rows:
                continue
            skv, k_nope, k_rope, v = rows_of(b)
            sq, width = len(rows), idx_flat.shape[1]
            idx = idx_flat[rows]                                            # [Sq, K]
            threshold = (torch.arange(sq) + (skv - sq + 1) if sparse_mode == 3
                         else torch.full((sq,), skv))                       # per query row
            walk = torch.clamp(-(-threshold // sbs), 0, width)              # min(K, ceil(threshold / sbs))
            entries = (torch.arange(width) < walk.unsqueeze(-1)) & torch.cumprod((idx != -1).long(), 1).bool()
            if bool((entries & (idx < -1)).any()):
                raise NotEmulatedError(f"{op}: an index below -1 is walked (the golden reads it as a negative "
                                       "position; undefined)")
            begin = idx * sbs
            entries &= begin < threshold.unsqueeze(-1)                      # blocks past the threshold: skipped
            pos = (begin.unsqueeze(-1) + torch.arange(sbs)).flatten(1)      # [Sq, K*sbs]
            keep = entries.repeat_interleave(sbs, dim=1) & (pos < threshold.clamp(max=skv).unsqueeze(-1))
            if skv == 0 or not bool(keep.any()):
                continue
            safe = torch.where(keep, pos, 0)
            kn, kr, vv = k_nope(safe), k_rope(safe), v(safe)                # [Sq, K*sbs, D]
            z = (q_flat[rows].float() @ kn.transpose(1, 2) + qr_flat[rows].float() @ kr.transpose(1, 2))
            z = (z * scale_value).masked_fill(~keep.unsqueeze(1), float("-inf"))  # [Sq, N1, K*sbs]
            any_valid = keep.any(dim=1)                                     # [Sq]
            m = torch.where(any_valid.unsqueeze(-1), z.amax(dim=-1), 0.0)
            e = torch.exp(z - m.unsqueeze(-1)).masked_fill(~keep.unsqueeze(1), 0.0)
            total_e = e.sum(-1)
            p = (e / total_e.clamp(min=1e-30).unsqueeze(-1)).to(query.dtype).float()
            o = p @ vv
            out[rows] = torch.where(any_valid.view(-1, 1, 1), o, 0.0)
            row_max[rows] = torch.where(any_valid.unsqueeze(-1), m, 0.0)
            row_sum[rows] = torch.where(any_valid.unsqueeze(-1), total_e, 0.0)
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
        """The documented formula: out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] *
        (rows[expanded_src_to_dst_row[i + k*NUM_ROWS]] + bias[export_for_source_row[i, k]])
        (K-major indices). `k` (2026-10 wheels) gives K when scales is None."""
        op = "npu_moe_finalize_routing"
        self.calls[op] += 1
        rows_in = _tensor(op, "expanded_permuted_rows", expanded_permuted_rows, FLOAT_DTYPES, ndim=2)
        dtype = rows_in.dtype
        _tensor(op, "expanded_src_to_dst_row", expanded_src_to_dst_row, (torch.int32,), ndim=1)
        # _op_plugin_docs.py, npu_moe_finalize_routing: "drop_pad_mode ... 取值范围为0" (only 0), in
        # every wheel; the kernel's other modes (aclnnMoeFinalizeRoutingV2) are not documented for it
        _require(drop_pad_mode == 0, op, f"drop_pad_mode only supports 0, got {drop_pad_mode}")
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
        idx = idx.reshape(top_k, num_rows).T                          # K-major
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
        """_op_plugin_docs.py, npu_grouped_matmul, group_list a Tensor (A2/A3): y_i = x_i @ w_i
        (+ bias_i) unquantised (formula 1), or per-token quantised (formula 3: x, weight int8,
        int32 accumulation (+ int32 bias), times the per-channel `scale` and the per-token
        `per_token_scale` -- the formula writes "+ pertokenscale"; a product is what a
        per-token scale is: inferred), output bfloat16/float16. group_type 0 splits the rows of
        one x over the groups of one weight [E, K, N] by group_list (counts for
        group_list_type 1, a cumulative sum for 0); -1 pairs list entries. The per-token
        scale of one weight is [E, N] (vllm-ascend @182b75ea passes its W8A8 scales of that shape,
        vllm_ascend/quantization/methods/w8a8_dynamic.py, device/device_op.py:279-290), in the
        dtype DOCS pair with the output: bfloat16 for a bfloat16 y, float32 for a float16 y."""
        op = "npu_grouped_matmul"
        self.calls[op] += 1
        unsupported = (offset, antiquant_scale, antiquant_offset, activation_input, activation_quant_scale,
                       activation_quant_offset)
        if any(q is not None for q in unsupported) or any(
                d is not None for d in (x_dtype, weight_dtype, scale_dtype, per_token_scale_dtype)):
            raise NotEmulatedError(f"{op}: offsets, antiquant, activation inputs and explicit input dtypes are "
                                   "not emulated")
        _require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op,
                 "x and weight must be lists of tensors")
        _require(1 <= len(x) <= 128 and 1 <= len(weight) <= 128, op, "at most 128 tensors per list")
        _require(group_type in (-1, 0), op, f"group_type {group_type} not supported on A2/A3 (-1 or 0)")
        _require(act_type == 0, op, "activations are not emulated")
        _require(split_item in (0, 1, 2, 3), op, f"split_item must be 0..3, got {split_item}")
        quantised = x[0].dtype == torch.int8
        out_dtype = scalar_type(output_dtype)
        if quantised:
            _require(scale is not None and per_token_scale is not None, op,
                     "int8 x needs scale and per_token_scale (the per-token quantised mode is the one emulated)")
            _require(out_dtype in (torch.bfloat16, torch.float16), op, f"the per-token quantised mode outputs "
                     f"bfloat16 or float16, got output_dtype {out_dtype}")
        else:
            _require(scale is None and per_token_scale is None, op, f"{x[0].dtype} x takes no scale")
            _require(out_dtype in (None, x[0].dtype), op, f"output_dtype must be None or x's dtype, got {out_dtype}")
            out_dtype = x[0].dtype
        for t in list(x) + list(weight):
            _tensor(op, "x/weight", t, (torch.int8,) if quantised else FLOAT_DTYPES)
            _require(t.dtype == x[0].dtype, op, "x and weight must share a dtype")
            _require(t.shape[-1] < 65536, op, f"the last dim of every x/weight must be < 65536 (InnerLimit), got "
                     f"{list(t.shape)}")
        if group_type == -1:
            _require(not quantised, op, "the quantised mode is emulated for group_type 0")
            _require(len(x) == len(weight), op, "group_type -1 pairs x[i] with weight[i]")
            outs = [(xi.float() @ wi.float()) for xi, wi in zip(x, weight)]
            if bias is not None:
                outs = [o + b.float() for o, b in zip(outs, bias)]
            outs = [o.to(out_dtype) for o in outs]
            return [torch.cat(outs)] if split_item in (2, 3) else outs
        _require(split_item in (2, 3), op, f"group_type 0 only supports split_item 2 or 3, got {split_item}")
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
            # "当group_list_type为1时, group_list必须为非负数列, 且长度不能为1"
            _require(len(values) != 1, op, "group_list_type 1 needs a group_list longer than 1")
            _require(all(v >= 0 for v in values) and sum(values) == xs.shape[0], op,
                     f"group_list counts must be >= 0 and sum to M={xs.shape[0]}, got {values}")
            ends = list(torch.tensor(values).cumsum(0).tolist()) if values else []
        else:
            _require(all(b >= a for a, b in zip([0] + values, values)) and values[-1] == xs.shape[0], op,
                     f"group_list must be a non-decreasing cumsum ending at M={xs.shape[0]}, got {values}")
            ends = values
        if quantised:
            _require(len(scale) == 1 and len(per_token_scale) == 1, op, "one scale and one per_token_scale")
            w_scale, t_scale = scale[0], per_token_scale[0]
            # DOCS' per-token table (group_list a Tensor, A2): scale bfloat16 -> y bfloat16, scale
            # float32 -> y float16. The [E, N] shape is vllm-ascend's (@182b75ea); DOCS say 1-D.
            # The emulator follows the adapter's choice: README "npu_grouped_matmul's per-token scale".
            paired = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}[out_dtype]
            _tensor(op, "scale[0]", w_scale, (paired,), ndim=2)
            self.grouped_matmul_scales.append((w_scale.dtype, tuple(w_scale.shape)))
            _require(tuple(w_scale.shape) == (experts, n_dim), op, f"scale must be [E, N] = [{experts}, {n_dim}], "
                     f"got {list(w_scale.shape)}")
            _tensor(op, "per_token_scale[0]", t_scale, (torch.float32,), ndim=1)
            _require(t_scale.shape[0] == xs.shape[0], op, f"per_token_scale must be [M = {xs.shape[0]}]")
        out = torch.empty(xs.shape[0], n_dim)
        start = 0
        for e, end in enumerate(ends):
            if quantised:  # exact int32 accumulation (float64 holds it), then the two scales
                acc = xs[start:end].double() @ w[e].double()
                if bias is not None:
                    acc = acc + bias[0][e].double()
                out[start:end] = acc.float() * w_scale[e].float() * t_scale[start:end].unsqueeze(-1)
            else:
                out[start:end] = xs[start:end].float() @ w[e].float()
                if bias is not None:
                    out[start:end] += bias[0][e].float()
            start = end
        return [out.to(out_dtype)]

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
        # _op_plugin_docs.py, npu_rotary_mul, jit_compile=False: both modes "D < 896, 且D为2的倍数";
        # half mode B, N < 1000; interleave mode B * N < 1000 and r1/r2 as 11SD / 1S1D / S11D
        if rotary_mode == "half":
            _require(d % 2 == 0 and d < 896, op, f"half mode needs an even D < 896, got {d}")
            _require(x.shape[0] < 1000 and x.shape[2] < 1000, op, "B and N must be < 1000")
            x1, x2 = xf.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
        elif rotary_mode == "interleave":
            _require(d % 2 == 0 and d < 896, op, f"interleave mode needs an even D < 896, got {d}")
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
                                dst_type: int = 1, row_block_size: int = 1,
                                col_block_size: int = 128, dst_type_max: float = 0.0) -> tuple[Tensor, Tensor]:
        """Per 1 x 128 block: scale = max(blockmax|x| / 127, min_scale) (how min_scale enters is
        inferred: the docs only say it is "the smallest scale taking part"), y = rint(x / scale)
        int8. Returns (y like x, scale float32 [..., rows, ceil(cols / 128)]).
        _op_plugin_docs.py: "dst_type ... 当前仅支持取值1" -- int8 output only, products Atlas
        A2/A3 (the meta registration maps other dst_type values to FP8 dtypes, but no wheel
        documents them, on any chip); row_block_size only 1, col_block_size only 128."""
        op = "npu_dynamic_block_quant"
        self.calls[op] += 1
        _require(self.product in ("A2", "A3"), op, f"documented for Atlas A2/A3 only, not {self.device_name}")
        _tensor(op, "x", x, HALF_DTYPES, ndim=(2, 3))
        _require(min_scale >= 0.0, op, f"min_scale must be >= 0, got {min_scale}")
        _require(round_mode == "rint", op, "round_mode only supports 'rint'")
        _require(row_block_size == 1, op, "row_block_size only supports 1")
        _require(col_block_size == 128, op, "col_block_size only supports 128")
        _require(scalar_type(dst_type) == torch.int8, op, f"dst_type only supports 1 (int8), got {dst_type!r}")
        if dst_type_max:
            raise NotEmulatedError(f"{op}: dst_type_max (undocumented) is not emulated")
        limit = 127.0
        cols = x.shape[-1]
        blocks = -(-cols // col_block_size)
        padded = torch.nn.functional.pad(x.float(), (0, blocks * col_block_size - cols))
        view = padded.reshape(*x.shape[:-1], blocks, col_block_size)
        scale = torch.clamp(view.abs().amax(-1) / limit, min=min_scale)
        safe = torch.where(scale > 0, scale, 1.0)
        q = (view / safe.unsqueeze(-1)).clamp(-limit, limit)
        q = q.reshape(*x.shape[:-1], blocks * col_block_size)[..., :cols]
        return torch.round(q).to(torch.int8), scale

    def npu_dynamic_quant(self, input: Tensor, *, smooth_scales: Tensor | None = None,
                          group_index: Tensor | None = None, dst_type: int | None = None,
                          quant_mode: str = "pertoken", dst_type_max: float = 0.0) -> tuple[Tensor, Tensor]:
        """_op_plugin_docs.py, npu_dynamic_quant: per-token symmetric dynamic quantisation,
        scale = rowMax(|x|) / DTYPE_MAX, y = round(x / scale); x float16/bfloat16 with more
        than one dim, y like x in dst_type (None: int8; A2/A3 document int8 and quint4x2), scale
        float32 of x's shape without the last dim. round() is taken as rint (half to even), the
        one round_mode npu_dynamic_block_quant documents: inferred. A row of zeros has scale 0
        and 0 / 0 for y, which the docs leave undefined: the emulator writes 127 there, so that
        code relying on it fails."""
        op = "npu_dynamic_quant"
        self.calls[op] += 1
        x = input
        _require(self.product in ("A2", "A3"), op, f"documented for Atlas A2/A3 only, not {self.device_name}")
        _tensor(op, "x", x, HALF_DTYPES)
        _require(x.dim() > 1, op, f"x must have more than one dim, got {list(x.shape)}")
        if smooth_scales is not None or group_index is not None:
            raise NotEmulatedError(f"{op}: smooth_scales / group_index (MoE smoothing) are not emulated")
        target = scalar_type(dst_type) or torch.int8
        _require(target in (torch.int8,), op, f"dst_type {dst_type!r}: only torch.int8 is emulated (A2/A3 document "
                 "int8 and quint4x2)")
        _require(quant_mode == "pertoken", op, f"quant_mode {quant_mode!r} is not emulated")
        if dst_type_max:
            raise NotEmulatedError(f"{op}: dst_type_max (undocumented) is not emulated")
        xf = x.float()
        scale = xf.abs().amax(-1) / 127.0
        y = torch.round(xf / scale.unsqueeze(-1))
        y = torch.where(scale.unsqueeze(-1) > 0, y, 127.0)
        return y.to(torch.int8), scale

    def npu_quant_matmul(self, x1: Tensor, x2: Tensor, scale: Tensor, *, offset: Tensor | None = None,
                         pertoken_scale: Tensor | None = None, bias: Tensor | None = None,
                         output_dtype: int | None = None, x1_dtype: int | None = None,
                         x2_dtype: int | None = None, pertoken_scale_dtype: int | None = None,
                         scale_dtype: int | None = None, group_sizes: list[int] | None = None,
                         y_scale: Tensor | None = None) -> Tensor:
        """_op_plugin_docs.py, npu_quant_matmul, the per-token row of its A2/A3 dtype table:
        x1 int8 [M, K], x2 int8 [K, N] (a transposed view of [N, K] is the documented weight
        layout), scale float32/bfloat16 [N] (or [1]), pertoken_scale float32 [M], output
        bfloat16 or float16. out = int32(x1 @ x2) * scale * pertoken_scale (the formula is
        npu_grouped_matmul's per-token one; the bias modes are not emulated). The last dims of
        x1 and x2 must not exceed 65535."""
        op = "npu_quant_matmul"
        self.calls[op] += 1
        _require(self.product in ("A2", "A3"), op, f"documented for Atlas A2/A3 (and inference cards) only, "
                 f"not {self.device_name}")
        if any(v is not None for v in (offset, bias, x1_dtype, x2_dtype, pertoken_scale_dtype, scale_dtype,
                                       group_sizes, y_scale)):
            raise NotEmulatedError(f"{op}: offset, bias, explicit dtypes, group_sizes and y_scale are not emulated")
        _tensor(op, "x1", x1, (torch.int8,), ndim=2)
        _tensor(op, "x2", x2, (torch.int8,), ndim=2)
        m, k = x1.shape
        _require(x2.shape[0] == k, op, f"x2 must be [K = {k}, N], got {list(x2.shape)}")
        n = x2.shape[1]
        _require(k <= 65535 and n <= 65535, op, f"the last dims of x1 and x2 must not exceed 65535, got K={k}, N={n}")
        _tensor(op, "scale", scale, (torch.float32, torch.bfloat16), ndim=1)
        _require(scale.shape[0] in (1, n), op, f"scale must be [1] or [N = {n}], got {list(scale.shape)}")
        _require(pertoken_scale is not None, op, "the per-token mode is the one emulated: pertoken_scale is required")
        _tensor(op, "pertoken_scale", pertoken_scale, (torch.float32,), ndim=1)
        _require(pertoken_scale.shape[0] == m, op, f"pertoken_scale must be [M = {m}]")
        out_dtype = scalar_type(output_dtype)
        _require(out_dtype in (torch.bfloat16, torch.float16), op, f"with pertoken_scale the output is bfloat16 or "
                 f"float16, got output_dtype {out_dtype}")
        if out_dtype == torch.float16:
            _require(scale.dtype == torch.float32, op, "float16 output takes a float32 scale")
        acc = (x1.double() @ x2.double()).float()          # exact int32 accumulation
        return (acc * scale.float() * pertoken_scale.unsqueeze(-1)).to(out_dtype)
