"""The result of one conformance item: what every report is made of."""
from __future__ import annotations

import dataclasses
import math

PASS, FAIL, SKIP, FALLBACK, ERROR = "pass", "fail", "skip", "fallback", "error"
CONTRACT = "contract"   # certification runs only (glm5_hal.conformance.certify)
STATUSES = (PASS, FAIL, ERROR, FALLBACK, SKIP, CONTRACT)   # report order: worst news first after pass

#: what each status means (reports and docs use these words)
MEANING = {
    PASS: "the backend's own implementation ran and every check passed",
    FAIL: "the backend's own implementation ran and a check failed (or it returned where "
          "InvalidInputError was required)",
    ERROR: "the backend raised something other than an expected InvalidInputError",
    FALLBACK: "the backend did not take the call (op, dtype or supports() declined): the "
              "reference would run; not a pass",
    SKIP: "the backend is unavailable here, or its device does not support the dtype",
    CONTRACT: "an expected-error case the op's own checks rejected before any backend ran "
              "(certification runs): the contract's result, not the backend's pass",
}


@dataclasses.dataclass
class Record:
    backend: str
    device: str
    op: str
    case: str            # stable id op/preset/case/dtype ("op/*" for a whole-op skip)
    preset: str
    dtype: str
    status: str
    reason: str = ""
    impl: str = ""       # the implementation dispatch chose
    max_abs: float | None = None
    max_rel: float | None = None
    atol: float | None = None
    rtol: float | None = None
    margin: float | None = None   # max |err| / bound over the worst output; <= 1 passes
    swaps: int | None = None
    duration_ms: float = 0.0      # the whole case: inputs, backend call, reference, checks
    worst: dict | None = None
    outputs: list = dataclasses.field(default_factory=list)  # one entry per checked target
    inputs: str = ""     # the arguments as the op saw them: dtype[shape], layout, scalars
    note: str = ""       # what the case is about (Case.note)

    def to_dict(self) -> dict:
        return json_safe(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def json_safe(v):
    """Strict JSON has no NaN/Infinity: non-finite floats become strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v
