"""Helpers the vendor adapters (backends/<vendor>/ops.py) share, one module per op family,
named as the ops' own modules (glm5_hal/ops/<family>.py) and contracts (docs/ops/<family>.md):

  common  rms_norm's weight cast, apply_rope's angles and vLLM's rotary_embedding schema
  dsa     attention head padding; the paged sparse MLA decode kernel several vendor libraries
          export (its ABI struct, launcher, size limits and adapter)
  kv      paged-cache writes: int32 slot limits, block-strided page views, vLLM's
          reshape_and_cache schema
  moe     sigmoid underflow, dropped expert ids, the contract's row order, repeated slots
  quant   int8 quantization's 127 / absmax overflow

The data checks here (and paged_view_declined, which reads strides) read what the call key
does not hold: a predicate calling one is a per-call `supports`, not `supports_metadata`.

The generic machinery (Adapter, VendorBackend, probing, versions, first_reason) stays in
glm5_hal.vendor_backend, the generic kernel-library loading in glm5_hal.kernel_library.
"""
