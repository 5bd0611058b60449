"""Public quantization ops (OPS.md section 3)."""
from __future__ import annotations

__all__: list[str] = []
