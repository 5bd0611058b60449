"""HF-layout GLM-5 checkpoints: `GLM5ForCausalLM.from_pretrained` and `save_pretrained`.

A checkpoint directory holds `config.json` (HF `glm_moe_dsa` field names) and the weights as
`model.safetensors`, or as shards `model-0000i-of-0000n.safetensors` listed by
`model.safetensors.index.json`. Tensor names are HF's (`GlmMoeDsaForCausalLM`), routed experts
one module per expert. Weights are BF16 (or another float dtype), or FP8 in the DeepSeek-V3 /
GLM-5-FP8 format: a linear layer's `weight` float8_e4m3fn with `weight_scale_inv` float32, one
scale per 128 x 128 block (`quantization_config` says so). See docs/models.md.

Loading reads every file's header first and checks the whole checkpoint against the model (names,
shapes, dtypes, formats) before it allocates anything. The model is built on the meta device,
allocated once on the target device, and filled tensor by tensor from memory-mapped files
(`safe_open`): no state dict is ever materialized, so the process holds one copy of the weights
plus at most one tensor in flight.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import time
import warnings
from contextlib import ExitStack
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from ..errors import InvalidInputError
from .config import GLM5Config
from .hf_config import hf_field
from .layers import Experts, expert_views
from .module_patterns import ModulePattern, PatternError
from .quantized import FP8_BLOCK, Fp8Experts, Fp8Linear, Int8Experts, Int8Linear, ceil_div, write_weight

OP_LOAD = "GLM5ForCausalLM.from_pretrained"
OP_SAVE = "GLM5ForCausalLM.save_pretrained"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = "model-{:05d}-of-{:05d}.safetensors"
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
QUANTIZE = (None, "int8")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: safetensors' names of the dtypes a float tensor may be stored in (converted to the model's)
FLOAT_STORAGE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
FP8_STORAGE, SCALE_STORAGE = "F8_E4M3", "F32"
SCALE = "weight_scale_inv"
#: Linear layers that stay in float under quantize="int8": MLA absorption multiplies kv_b_proj into
#: the query and the latent output as a matrix (no GEMM on activations), and the indexer's head
#: weights stay float as HF keeps them (GlmMoeDsaPreTrainedModel._keep_in_fp32_modules).
INT8_KEPT_FLOAT = ("self_attn.kv_b_proj", "self_attn.indexer.weights_proj")
ABSORBED = "self_attn.kv_b_proj"
LINEARS = (nn.Linear, Fp8Linear, Int8Linear)
EXPERTS = (Experts, Fp8Experts, Int8Experts)
DEFAULT_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


class CheckpointError(InvalidInputError):
    """A checkpoint that does not fit the model or cannot be read as one: a tensor that is
    unknown, missing, of the wrong shape, dtype or format, or stored where it may not be
    (`tensor` names it and `file` the file it is in, or None when missing); or a malformed
    config.json / index value (`kind="field"`: `field` names the key, `file` the file)."""

    def __init__(self, op: str, tensor: str, expected: object, actual: object, file: str | None = None,
                 kind: str = "tensor"):
        self.op, self.arg, self.expected, self.actual, self.backend = op, tensor, expected, actual, None
        self.file, self.kind = file, kind
        self.tensor = tensor if kind == "tensor" else None
        self.field = tensor if kind == "field" else None
        if kind == "field":
            what = f"{file} field '{tensor}'" if file else f"field '{tensor}'"
        else:
            what = f"tensor '{tensor}'" + (f" in {file}" if file else "")
        Exception.__init__(self, f"{op}: {what}: expected {expected}, got {actual}")

    def __reduce__(self):
        return (type(self), (self.op, self.arg, self.expected, self.actual, self.file, self.kind))


def _field_error(key: str, expected: object, actual: object, file: str = "config.json") -> CheckpointError:
    return CheckpointError(OP_LOAD, key, expected, actual, file, kind="field")


class SkippedTensorsWarning(UserWarning):
    """from_pretrained skipped checkpoint tensors the model does not use (the MTP layers)."""


@dataclasses.dataclass
class CheckpointInfo:
    """What `from_pretrained` loaded (`model.checkpoint_info`)."""
    path: str
    files: list[str]
    weights: str                 # "fp8" if the checkpoint holds FP8 weights, else "float"
    quantize: str | None
    dtype: torch.dtype
    tensors: int                 # checkpoint tensors read
    bytes: int                   # their size in the files
    skipped: list[str]           # tensors not read (MTP layers)
    seconds: float
    hf_config: dict[str, Any]    # config.json as read; save_pretrained keeps its other fields
    linear_formats: dict[str, int]   # model format ("float", "fp8", "int8") -> linear weights in it


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """A supported `quantization_config`: DeepSeek-V3 / GLM-5-FP8 block FP8."""
    scale_fmt: str | None                    # activation scales: None or "ue8m0" (powers of two)
    modules_to_not_convert: tuple[str, ...]
    config: dict[str, Any]                   # as read (written back by save_pretrained)

    patterns: tuple[ModulePattern, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.patterns) != len(self.modules_to_not_convert):
            object.__setattr__(self, "patterns", tuple(ModulePattern(k) for k in self.modules_to_not_convert))

    def converts(self, module: str) -> bool:
        """Whether the config lets `module` be FP8: transformers' `should_convert_module`
        (quantizers/quantizers_utils.py, 5.24.0) on modules_to_not_convert, each key a prefix
        ending at a module boundary, a regular expression with that boundary, or a suffix;
        matched by `module_patterns.ModulePattern` in time linear in the name (no backtracking)."""
        return not any(p.matches(module) for p in self.patterns)


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: str
    dtype: str                   # safetensors' name: BF16, F32, F8_E4M3, ...
    shape: tuple[int, ...]


@dataclasses.dataclass
class _Unit:
    """What one checkpoint tensor (plain) or one linear weight with its optional FP8 scale
    (linear) fills in the model."""
    name: str                    # plain: the tensor name; linear: the module path (`<name>.weight`, ...)
    linear: bool
    shape: tuple[int, ...]       # of the tensor, or [out, in] of the linear weight
    format: str                  # the model's: "float", "fp8" or "int8"
    dest: dict[str, Tensor]      # plain: {"": tensor}; linear: checkpoint suffix -> model tensor (a view)
    group: str                   # the module whose weights share one format (the experts of a layer)


# -- loading ------------------------------------------------------------------------------------
def load_pretrained(cls: type, path, dtype=None, quantize: str | None = None, device=None,
                    config_overrides: Mapping[str, Any] | None = None):
    """`cls.from_pretrained`: see GLM5ForCausalLM.from_pretrained."""
    start = time.perf_counter()
    root = _checkpoint_dir(path)
    if quantize not in QUANTIZE:
        raise InvalidInputError(OP_LOAD, "quantize", f"one of {QUANTIZE}", repr(quantize))
    hf = _read_json(root / CONFIG_FILE)
    config = _config(hf, dict(config_overrides or {}))
    scheme = fp8_scheme(hf.get("quantization_config"))
    mtp_layers = _mtp_layers(hf)
    named_dtype = _named_dtype(hf)
    entries = _scan(root)
    entries, skipped = _without_mtp_layers(entries, config, mtp_layers)
    dtype = _model_dtype(dtype, named_dtype, entries)
    device = torch.device(device if device is not None else "cpu")

    with torch.device("meta"):
        model = cls(config, dtype=dtype)
    formats = _choose_formats(model, entries, scheme, quantize)
    _quantize_modules(model, formats, scheme, dtype)
    _check(list(_units(model)), entries)

    model.to_empty(device=device)
    read = _fill(model, entries, root, device)
    for module in model.modules():
        if hasattr(module, "after_load"):
            module.after_load()
    if skipped:
        layers = sorted({int(n.split(".")[2]) for n in skipped})
        warnings.warn(f"{OP_LOAD}: skipped {len(skipped)} tensors of the multi-token-prediction layer "
                      f"{', '.join(f'model.layers.{i}' for i in layers)} in {root} (MTP is not implemented; "
                      "next-token logits do not use it)", SkippedTensorsWarning, stacklevel=3)
    counts: dict[str, int] = {}
    for unit in _units(model):
        if unit.linear:
            counts[unit.format] = counts.get(unit.format, 0) + 1
    model.checkpoint_info = CheckpointInfo(
        path=str(root), files=sorted({e.file for e in entries.values()}),
        weights="fp8" if any(e.dtype == FP8_STORAGE for e in entries.values()) else "float",
        quantize=quantize, dtype=dtype, tensors=len(entries), bytes=read, skipped=skipped,
        seconds=time.perf_counter() - start, hf_config=hf, linear_formats=counts)
    return model


def fp8_scheme(qc) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json `quantization_config`, None without one. Anything but
    DeepSeek-V3 / GLM-5-FP8 block FP8 (quant_method "fp8", fmt "e4m3", weight_block_size
    [128, 128], dynamic activations, float32 scales) raises CheckpointError naming the field.
    Absent fields take transformers' FineGrainedFP8Config defaults."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _field_error("quantization_config", "a JSON object", type(qc).__name__)

    def need(field, default, expected, ok):
        value = qc.get(field, default)
        if not ok(value):
            raise _field_error(f"quantization_config.{field}", expected, repr(value)[:200])
        return value

    need("quant_method", None, "'fp8' (DeepSeek-V3 / GLM-5-FP8 128 x 128 block FP8; no other method is supported)",
         lambda v: v == "fp8")
    need("fmt", "e4m3", "'e4m3' (float8_e4m3fn weights)", lambda v: v == "e4m3")
    need("weight_block_size", [FP8_BLOCK, FP8_BLOCK], f"[{FP8_BLOCK}, {FP8_BLOCK}] (the blocks fp8_block_gemm takes)",
         lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(b) and b == FP8_BLOCK for b in v))
    need("activation_scheme", "dynamic", "'dynamic' (activation scales computed per token and 128 columns)",
         lambda v: v == "dynamic")
    scale_fmt = need("scale_fmt", None, "absent, 'float' or 'ue8m0' (float32 weight scales; 'ue8m0' rounds the "
                     "activation scales up to powers of two, as DeepSeek-V3.2 does)",
                     lambda v: isinstance(v, (str, type(None))) and v in (None, "float", "ue8m0"))
    need("expert_dtype", "fp8", "'fp8' (FP4 experts are not supported)", lambda v: v == "fp8")
    need("modules_to_convert", None, "none (FP8 embeddings are not supported)", lambda v: not v)
    need("dequantize", False, "false (to run FP8 weights in float, dequantize them after loading)",
         lambda v: v is False or v is None)
    key = "modules_to_not_convert" if qc.get("modules_to_not_convert") is not None else "ignored_layers"
    skip = need(key, None, "a list of module names", lambda v: v is None or (
        isinstance(v, list) and all(isinstance(s, str) for s in v)))
    patterns = []
    for i, pattern in enumerate(skip or ()):
        try:
            patterns.append(ModulePattern(pattern))
        except PatternError as e:
            raise _field_error(f"quantization_config.{key}[{i}]", "a module name or a regular expression as "
                               "transformers matches them, without what only backtracking can match "
                               "(backreferences, lookaround, possessive repeats, inline flags, \\b)",
                               f"{pattern[:100]!r}: {e}") from None
    return Fp8Scheme("ue8m0" if scale_fmt == "ue8m0" else None, tuple(skip or ()), dict(qc), tuple(patterns))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _checkpoint_dir(path) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise InvalidInputError(OP_LOAD, "path", "a checkpoint directory (config.json + safetensors weights)",
                                f"{str(root)!r} ({'a file' if root.exists() else 'does not exist'})")
    return root


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidInputError(OP_LOAD, path.name, f"a readable JSON file at {path}",
                                f"{type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise InvalidInputError(OP_LOAD, path.name, "a JSON object", type(data).__name__)
    return data


def _config(hf: dict[str, Any], overrides: dict[str, Any]) -> GLM5Config:
    """The model config of config.json: a malformed or unsupported value is a CheckpointError
    naming its config.json key; a bad override stays an InvalidInputError naming it."""
    try:
        return GLM5Config.from_hf_config(hf, **overrides)
    except InvalidInputError as e:
        if e.arg in overrides:
            raise
        # from_hf_config names config.json's keys; GLM5Config (its range checks) its own fields
        key = hf_field(e.arg, hf) if e.op == "GLM5Config" else e.arg
        raise _field_error(key, e.expected, e.actual) from None


def _mtp_layers(hf: Mapping[str, Any]) -> int:
    """How many multi-token-prediction layers follow the decoder layers (at least 1)."""
    value = hf.get("num_nextn_predict_layers")
    if value is not None and not (_is_int(value) and value >= 0):
        raise _field_error("num_nextn_predict_layers", "an int >= 0 (absent: 1)", repr(value)[:200])
    return max(1, value or 1)


def _named_dtype(hf: Mapping[str, Any]) -> tuple[str, Any]:
    """config.json's `dtype` (`torch_dtype` before transformers 5): (the key, its value or None)."""
    for key in ("dtype", "torch_dtype"):
        value = hf.get(key)
        if value is not None and not isinstance(value, str):
            raise _field_error(key, "a dtype name such as 'bfloat16' (or absent)", repr(value)[:200])
    return next(((k, hf[k]) for k in ("dtype", "torch_dtype") if hf.get(k) is not None), ("dtype", None))


def _weight_file(root: Path, file: str, named_by: str | None) -> Path:
    """The path of a weight file, which must lie inside the checkpoint directory: no absolute
    path or `..` in an index entry, and no symlink leading outside (except, in a Hugging Face
    cache snapshot `.../snapshots/<revision>/`, into the repository's `blobs/`, where the hub's
    own symlinks point)."""
    tensor = named_by or file
    where = INDEX_FILE if named_by else None
    expected = "a weight file inside the checkpoint directory"
    parts = PurePosixPath(file).parts
    if (not file or PurePosixPath(file).is_absolute() or PureWindowsPath(file).is_absolute()
            or PureWindowsPath(file).drive or ".." in parts or "\\" in file or "\0" in file):
        raise CheckpointError(OP_LOAD, tensor, f"{expected} (a relative path without '..', as {INDEX_FILE} "
                              "names its shards)", repr(file)[:200], where)
    path = root / file
    inside = [root.resolve()]
    if inside[0].parent.name == "snapshots":
        inside.append(inside[0].parent.parent / "blobs")
    target = path.resolve()
    if not any(target.is_relative_to(d) for d in inside):
        raise CheckpointError(OP_LOAD, tensor, f"{expected} ({file} must not lead outside {root})",
                              f"a link to {target}", where)
    return path


def _scan(root: Path) -> dict[str, _Entry]:
    """Every tensor of the checkpoint's weight files, from their headers (no data is read):
    model.safetensors, or the shards named by model.safetensors.index.json (each tensor where
    the index says). A directory holding both is refused: it is what an interrupted save
    of another layout leaves, and either could be the stale one."""
    single, indexed = (root / WEIGHTS_FILE), (root / INDEX_FILE)
    if (single.exists() or single.is_symlink()) and (indexed.exists() or indexed.is_symlink()):
        raise InvalidInputError(OP_LOAD, "path", f"either {WEIGHTS_FILE} or {INDEX_FILE} in {root}, not both",
                                f"both {WEIGHTS_FILE} and {INDEX_FILE} (left by an interrupted save, or by two "
                                "saves of different layouts: remove the stale one)")
    if single.is_file():
        files, index = [WEIGHTS_FILE], None
        _weight_file(root, WEIGHTS_FILE, None)
    elif indexed.is_file():
        weight_map = _read_json(indexed).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise _field_error("weight_map", "a non-empty object of tensor name -> file", repr(weight_map)[:200],
                               INDEX_FILE)
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise _field_error(f"weight_map.{name}", "a file name (a string)", repr(file)[:200], INDEX_FILE)
            _weight_file(root, file, name)
        index = weight_map
        files = sorted(set(weight_map.values()))
    else:
        present = sorted(p.name for p in root.iterdir())
        raise InvalidInputError(OP_LOAD, "path", f"{WEIGHTS_FILE} or {INDEX_FILE} in {root}",
                                f"{present[:12]}{' ...' if len(present) > 12 else ''}")
    entries: dict[str, _Entry] = {}
    for file in files:
        if not (root / file).is_file():
            first = next(n for n, f in index.items() if f == file)
            raise CheckpointError(OP_LOAD, first, f"its file {file} (named by {INDEX_FILE})", "no such file")
        try:
            with safe_open(root / file, framework="pt") as f:
                for name in f.keys():
                    if name in entries:
                        raise CheckpointError(OP_LOAD, name, "in one file", f"also in {entries[name].file}", file)
                    tensor = f.get_slice(name)
                    entries[name] = _Entry(file, tensor.get_dtype(), tuple(tensor.get_shape()))
        except SafetensorError as e:
            raise InvalidInputError(OP_LOAD, file, "a readable safetensors file", str(e)) from None
    if index is not None:
        for name, entry in entries.items():
            if name not in index:
                raise CheckpointError(OP_LOAD, name, f"listed in {INDEX_FILE}", "not listed", entry.file)
            if index[name] != entry.file:
                raise CheckpointError(OP_LOAD, name, f"in {index[name]}, where {INDEX_FILE} puts it",
                                      f"in {entry.file}", entry.file)
        for name, file in index.items():
            if name not in entries:
                raise CheckpointError(OP_LOAD, name, f"in {file} (as {INDEX_FILE} says)", "not in that file", file)
    return entries


def _without_mtp_layers(entries: dict[str, _Entry], config: GLM5Config, mtp_layers: int):
    """The entries minus those of the multi-token-prediction layers, which checkpoints store as
    `model.layers.<num_hidden_layers + i>.*` (i < num_nextn_predict_layers, at least 1)."""
    layers = config.num_layers
    mtp = range(layers, layers + mtp_layers)
    kept, skipped = {}, []
    for name, entry in entries.items():
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match and int(match.group(1)) in mtp:
            skipped.append(name)
        else:
            kept[name] = entry
    return kept, sorted(skipped)


def _model_dtype(dtype, named: tuple[str, Any], entries: Mapping[str, _Entry]) -> torch.dtype:
    """dtype, else config.json's `dtype` (`torch_dtype` before transformers 5), else the
    embeddings' storage dtype, else bfloat16."""
    if dtype is None:
        key, name = named
        if name is not None:
            if name not in DTYPES:
                raise _field_error(key, f"one of {sorted(DTYPES)} (or pass dtype= to choose the model dtype)",
                                   repr(name)[:200])
            return DTYPES[name]
        embed = entries.get("model.embed_tokens.weight")
        stored = FLOAT_STORAGE.get(embed.dtype) if embed else None
        return stored if stored in DTYPES.values() else torch.bfloat16
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise InvalidInputError(OP_LOAD, "dtype", "None, torch.bfloat16, torch.float16 or torch.float32 (or its name)",
                                repr(dtype))
    return resolved


def _units(model: nn.Module) -> Iterator[_Unit]:
    """Every checkpoint tensor the model holds, in module order: linear layers inside the
    decoder (and each expert's projections) as linear units, everything else as plain tensors
    (lm_head, the router, norms and embeddings are never quantized)."""
    for path, module in model.named_modules():
        if isinstance(module, LINEARS) and path != "lm_head":
            fixed = getattr(module, "FIXED_DTYPES", ("weight",))
            yield _Unit(path, True, (module.out_features, module.in_features), getattr(module, "FORMAT", "float"),
                        {suffix: getattr(module, suffix) for suffix in fixed}, path)
        elif isinstance(module, EXPERTS):
            views = dict(expert_views(module, path + "."))
            i, h = module.intermediate_size, views[f"{path}.0.down_proj.weight"].shape[0]
            for e in range(module.num_experts):
                for projection, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                    name = f"{path}.{e}.{projection}"
                    yield _Unit(name, True, shape, getattr(module, "FORMAT", "float"),
                                {s: views[f"{name}.{s}"] for s in module.CHECKPOINT_SUFFIXES}, path)
        else:
            tensors = list(module.named_parameters(recurse=False)) + [
                (n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
            for name, tensor in tensors:
                full = f"{path}.{name}" if path else name
                yield _Unit(full, False, tuple(tensor.shape), "float", {"": tensor}, full)


def _source_format(unit: _Unit, entries: Mapping[str, _Entry], scheme: Fp8Scheme | None) -> str | None:
    """"fp8" or "float": how the checkpoint stores a linear unit's weight; None if it is missing."""
    weight, scale = entries.get(unit.name + ".weight"), entries.get(f"{unit.name}.{SCALE}")
    if weight is None:
        return None
    if weight.dtype != FP8_STORAGE and scale is None:
        return "float"
    name, entry = (unit.name + ".weight", weight) if weight.dtype == FP8_STORAGE else (f"{unit.name}.{SCALE}", scale)
    if scheme is None:
        raise CheckpointError(OP_LOAD, name, "float weights (config.json has no FP8 quantization_config)",
                              f"{entry.dtype} {list(entry.shape)}", entry.file)
    if not scheme.converts(unit.name):
        raise CheckpointError(OP_LOAD, name, "a float weight (quantization_config.modules_to_not_convert lists "
                              "its module)", f"{entry.dtype} {list(entry.shape)}", entry.file)
    return "fp8"


def _choose_formats(model: nn.Module, entries, scheme: Fp8Scheme | None, quantize: str | None) -> dict[str, str]:
    """The model format of each linear layer and experts module: FP8 where the checkpoint is
    (unless quantize="int8"), INT8 for every GEMM under quantize="int8", float otherwise."""
    sources: dict[str, tuple[str, str]] = {}          # group -> (source format, first unit of the group)
    for unit in _units(model):
        if not unit.linear:
            continue
        source = _source_format(unit, entries, scheme)
        if source is None:
            continue                                   # missing: _check reports it
        first = sources.setdefault(unit.group, (source, unit.name))
        if first[0] != source:
            entry = entries[unit.name + ".weight"]
            raise CheckpointError(OP_LOAD, unit.name + ".weight", f"{first[0]} like {first[1]}.weight (the "
                                  "experts of a layer are stacked in one format)", source, entry.file)
    formats = {}
    for group, (source, first) in sources.items():
        if quantize == "int8" and not group.endswith(INT8_KEPT_FLOAT):
            formats[group] = "int8"
        elif source == "fp8" and quantize is None:
            formats[group] = "fp8"
            _check_fp8_gemm(model, group, first, entries)
        else:
            formats[group] = "float"
    return formats


def _check_fp8_gemm(model: nn.Module, group: str, first: str, entries) -> None:
    """An FP8 GEMM quantizes its input per 128 columns (fp8_block_gemm needs K % 128 == 0, as
    DeepSeek-V3's act_quant does); only the absorbed kv_b_proj, never a GEMM input, may differ."""
    module, c = model.get_submodule(group), model.config
    if isinstance(module, Experts):
        bad = [d for d in (c.hidden_size, c.moe_intermediate_size) if d % FP8_BLOCK]
        expected = (f"hidden_size and moe_intermediate_size multiples of {FP8_BLOCK} for FP8 experts (each GEMM's "
                    f"input is quantized per {FP8_BLOCK} columns, and an expert's gate and up rows are stacked into "
                    f"one weight whose {FP8_BLOCK}-row scale blocks must not straddle them)")
    elif not group.endswith(ABSORBED):
        bad = [module.in_features] if module.in_features % FP8_BLOCK else []
        expected = (f"an input size that is a multiple of {FP8_BLOCK} for an FP8 linear layer (its input is "
                    f"quantized per {FP8_BLOCK} columns)")
    else:
        return
    if bad:
        name = first + ".weight"
        raise CheckpointError(OP_LOAD, name, expected, f"{bad[0]} ({list(entries[name].shape)})", entries[name].file)


def _quantize_modules(model: nn.Module, formats: Mapping[str, str], scheme: Fp8Scheme | None,
                      dtype: torch.dtype) -> None:
    """Replaces the (meta) float linear layers and experts whose format is not float."""
    for group, fmt in formats.items():
        if fmt == "float":
            continue
        parent_name, _, attr = group.rpartition(".")
        parent, old = model.get_submodule(parent_name), model.get_submodule(group)
        scale_fmt = scheme.scale_fmt if scheme else None
        with torch.device("meta"):
            if isinstance(old, Experts):
                new = Fp8Experts(model.config, scale_fmt) if fmt == "fp8" else Int8Experts(model.config)
            elif fmt == "fp8":
                new = Fp8Linear(old.in_features, old.out_features, scale_fmt, dense=group.endswith(ABSORBED))
            else:
                new = Int8Linear(old.in_features, old.out_features)
        setattr(parent, attr, new.to(dtype=dtype))     # only float buffers change (dense_weight)


def _check(units: list[_Unit], entries: Mapping[str, _Entry]) -> None:
    """Every tensor the model holds is in the checkpoint with its shape and a dtype its format
    reads, and the checkpoint holds nothing else."""
    claimed = set()
    for unit in units:
        if not unit.linear:
            _expect_tensor(unit.name, entries, unit.shape, FLOAT_STORAGE, "a float dtype")
            claimed.add(unit.name)
            continue
        weight = unit.name + ".weight"
        if entries.get(weight, _Entry("", "", ())).dtype == FP8_STORAGE or f"{unit.name}.{SCALE}" in entries:
            n, k = unit.shape
            _expect_tensor(weight, entries, unit.shape, (FP8_STORAGE,), "F8_E4M3 (with weight_scale_inv)")
            _expect_tensor(f"{unit.name}.{SCALE}", entries, (ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)),
                           (SCALE_STORAGE,), f"F32 (one scale per {FP8_BLOCK} x {FP8_BLOCK} block of {weight})")
            claimed.update((weight, f"{unit.name}.{SCALE}"))
        else:
            _expect_tensor(weight, entries, unit.shape, FLOAT_STORAGE,
                           "a float dtype, or F8_E4M3 with weight_scale_inv")
            claimed.add(weight)
    unknown = sorted((e.file, name) for name, e in entries.items() if name not in claimed)
    if unknown:
        file, name = unknown[0]
        more = f" ({len(unknown) - 1} more unknown tensors)" if len(unknown) > 1 else ""
        raise CheckpointError(OP_LOAD, name, "a tensor of the model (HF GlmMoeDsaForCausalLM names for this config)",
                              "a name the model does not have" + more, file)


def _expect_tensor(name: str, entries: Mapping[str, _Entry], shape: tuple[int, ...], dtypes, dtype_text: str) -> None:
    entry = entries.get(name)
    if entry is None:
        raise CheckpointError(OP_LOAD, name, "in the checkpoint", "missing from every weight file")
    if entry.dtype not in dtypes:
        raise CheckpointError(OP_LOAD, name, f"dtype {dtype_text}", entry.dtype, entry.file)
    if entry.shape != tuple(shape):
        raise CheckpointError(OP_LOAD, name, f"shape {list(shape)}", list(entry.shape), entry.file)


@torch.no_grad()
def _fill(model: nn.Module, entries: Mapping[str, _Entry], root: Path, device: torch.device) -> int:
    """Copies every checkpoint tensor into the allocated model, one at a time, from the
    memory-mapped files; returns the bytes read."""
    read = 0
    with ExitStack() as stack:
        files: dict[str, Any] = {}

        def tensor(name: str) -> Tensor:
            nonlocal read
            file = entries[name].file
            if file not in files:
                files[file] = stack.enter_context(safe_open(root / file, framework="pt"))
            t = files[file].get_tensor(name)
            read += t.numel() * t.element_size()
            return t.to(device)

        for unit in _units(model):
            if not unit.linear:
                unit.dest[""].copy_(tensor(unit.name))
                continue
            scale_name = f"{unit.name}.{SCALE}"
            write_weight(unit.format, unit.dest, tensor(unit.name + ".weight"),
                         tensor(scale_name) if scale_name in entries else None)
    return read


# -- saving -------------------------------------------------------------------------------------
#: The files a save owns in its directory: it replaces them, and leaves every other file alone.
def _owned(name: str) -> bool:
    return name in (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE) or bool(_SHARD_PATTERN.fullmatch(name))


def save_pretrained(model: nn.Module, path, max_shard_size: int | str = "5GB") -> list[str]:
    """`model.save_pretrained`: see GLM5ForCausalLM.save_pretrained. Returns the files written.

    Everything that can be refused is checked before the filesystem is touched. The files are
    written into a fresh directory beside the target (`.<name>.saving-<random>`, fsynced), then:
    a target that does not exist is that directory renamed into place (atomic); in an existing
    directory the save's own files are exchanged by renames so that at every moment the
    directory holds the complete old checkpoint, the complete new one, or no weights entry
    point (model.safetensors / index), which from_pretrained refuses: see `_replace_owned`."""
    units = list(_units(model))
    int8 = [u.name for u in units if u.format == "int8"]
    if int8:
        raise InvalidInputError(OP_SAVE, "model", "float or FP8 weights (the formats a checkpoint holds)",
                                f"INT8 W8A8 weights (e.g. {int8[0]}): quantize='int8' is a conversion at load; "
                                "save the checkpoint it was loaded from instead")
    limit = shard_size(max_shard_size)
    dtype_name = next((name for name, d in DTYPES.items() if d == model.dtype), None)
    if dtype_name is None:
        raise InvalidInputError(OP_SAVE, "model", f"weights in one of {sorted(DTYPES)} (the dtypes config.json's "
                                "`dtype` names; convert with model.to(torch.bfloat16) first)",
                                f"{str(model.dtype).removeprefix('torch.')} weights")
    config = json.dumps(_hf_config(model, units, dtype_name), indent=2, sort_keys=True) + "\n"
    target = _save_target(path)

    tensors = [(name, t) for unit in units for name, t in _checkpoint_tensors(unit)]
    shards: list[list[tuple[str, Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    names = [WEIGHTS_FILE] if len(shards) == 1 else [SHARD_FILE.format(i + 1, len(shards)) for i in range(len(shards))]
    written = list(names)
    index = None
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for _, t in tensors)},
                 "weight_map": {name: file for file, shard in zip(names, shards) for name, _ in shard}}
        written.append(INDEX_FILE)
    written.append(CONFIG_FILE)

    # -- nothing was touched up to here ----------------------------------------------------------
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _fresh_dir(target.parent, f".{target.name}.saving-")
    try:
        for file, shard in zip(names, shards):
            # views of one stacked expert tensor share its storage without overlapping, which
            # safetensors >= 0.4 accepts; .to("cpu") copies only tensors on another device
            save_file({name: t.detach().to("cpu").contiguous() for name, t in shard}, str(staging / file),
                      metadata={"format": "pt"})
        if index is not None:
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (staging / CONFIG_FILE).write_text(config)
        for file in written:
            _fsync(staging / file)
        _fsync(staging)
        entry = INDEX_FILE if index is not None else WEIGHTS_FILE
        if target.is_dir():                    # kept, with its other files, mode and owner
            _replace_owned(target, staging, written, entry)
        else:
            try:
                os.rename(staging, target)     # a new directory appears complete, or not at all
            except OSError:
                if not target.is_dir():        # (unless one appeared meanwhile)
                    raise
                _replace_owned(target, staging, written, entry)
            else:
                _fsync(target.parent)
    except BaseException:
        if not any((staging / "replaced").glob("*")):     # never delete an old checkpoint not put back
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return written


def _save_target(path) -> Path:
    """The directory to save into (a symlink to a directory resolved, so that the staging
    directory is on its file system); refuses a file, a dangling link or a file ancestor."""
    root = Path(path)
    if root.is_symlink() and not root.exists():
        raise InvalidInputError(OP_SAVE, "path", "a directory (created if missing)", f"{str(root)!r} is a dangling link")
    if root.exists() and not root.is_dir():
        raise InvalidInputError(OP_SAVE, "path", "a directory (created if missing)", f"{str(root)!r} is a file")
    target = root.resolve() if root.exists() else Path(os.path.abspath(root))
    ancestor = target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InvalidInputError(OP_SAVE, "path", "a directory (created if missing)",
                                f"{str(root)!r}, below the file {str(ancestor)!r}")
    return target


def _fresh_dir(parent: Path, prefix: str) -> Path:
    """A new directory (mode from the umask, as the target's would have) under a random name."""
    for _ in range(100):
        candidate = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"{OP_SAVE}: no free staging directory name {prefix}* in {parent}")


def _fsync(path: Path) -> None:
    """Flushes a file's data, or a directory's entries, to disk (the renames that follow must
    not be persisted before what they publish)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_owned(target: Path, staging: Path, written: list[str], entry: str) -> None:
    """Moves a complete save from `staging` into the existing directory `target`, keeping every
    file the save does not own (tokenizer, README, ...). POSIX renames one entry at a time, so
    the order carries the guarantee:

    1. the old entry points (model.safetensors, the index) move out into `staging/replaced/`;
       from then on from_pretrained refuses the directory (no weights) instead of loading a mix;
    2. the rest of the old save's files (config.json, shards) follow them there;
    3. the new files but the entry point move in;
    4. the new entry point moves in (the commit): the new checkpoint is complete.
    Until step 4 the complete old checkpoint is in `staging/replaced/`; a failure before the
    commit moves it back (a crash leaves it there). After the commit `staging` is removed."""
    replaced = staging / "replaced"
    replaced.mkdir()
    old = [n for n in (WEIGHTS_FILE, INDEX_FILE) if os.path.lexists(target / n)]
    old += sorted(p.name for p in target.iterdir() if _owned(p.name) and p.name not in old)
    moved_in: list[str] = []
    try:
        for name in old:
            os.replace(target / name, replaced / name)
        _fsync(target)
        for name in [n for n in written if n != entry] + [entry]:
            if name == entry:
                _fsync(target)
            os.replace(staging / name, target / name)
            moved_in.append(name)
    except BaseException:
        if entry not in moved_in:              # not committed: put the old checkpoint back
            for name in reversed(moved_in):
                os.replace(target / name, staging / name)
            for name in reversed(old):
                if os.path.lexists(replaced / name):
                    os.replace(replaced / name, target / name)
        raise
    _fsync(target)
    shutil.rmtree(staging, ignore_errors=True)


def _checkpoint_tensors(unit: _Unit) -> Iterator[tuple[str, Tensor]]:
    if not unit.linear:
        yield unit.name, unit.dest[""]
    else:
        for suffix, tensor in unit.dest.items():
            yield f"{unit.name}.{suffix}", tensor


def _hf_config(model: nn.Module, units: list[_Unit], dtype_name: str) -> dict[str, Any]:
    """config.json: the loaded one's other fields (tokens ids, max positions, ...) kept, the
    model's own fields, dtype and quantization_config as the model holds them."""
    info = getattr(model, "checkpoint_info", None)
    hf = {k: v for k, v in (info.hf_config if info else {}).items()
          if k not in ("dtype", "torch_dtype", "quantization_config")}
    hf.update(model.config.to_hf_config())
    hf["dtype"] = dtype_name
    if any(u.format == "fp8" for u in units):
        loaded = (info.hf_config.get("quantization_config") if info else None) or DEFAULT_FP8_CONFIG
        scale_fmt = next((m.scale_fmt for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts))), None)
        hf["quantization_config"] = {**loaded, **({"scale_fmt": scale_fmt} if scale_fmt else {})}
    return hf


def shard_size(value: int | str) -> int:
    """max_shard_size in bytes: an int, or a string such as "5GB" (10^9), "500MiB" (2^20)."""
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]I?B|B)\s*", value, re.IGNORECASE) if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if match and int(match.group(1)) >= 1:
        return int(match.group(1)) * units[match.group(2).upper()]
    raise InvalidInputError(OP_SAVE, "max_shard_size", "an int >= 1 (bytes) or a size such as '5GB' or '500MiB'",
                            repr(value))


__all__ = ["CheckpointError", "CheckpointInfo", "SkippedTensorsWarning", "Fp8Scheme", "fp8_scheme",
           "load_pretrained", "save_pretrained", "shard_size"]
