"""Public dsa ops (see OPS.md)."""
from __future__ import annotations

__all__: list[str] = []
