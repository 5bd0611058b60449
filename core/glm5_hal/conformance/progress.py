"""Progress of a command-line run, on stderr: one updating line on a terminal, one line per
finished (backend, op) otherwise (CI logs stay short and readable)."""
from __future__ import annotations

import collections
import sys
from typing import TextIO

from .record import STATUSES, Record
from .suite import Item


class Progress:
    def __init__(self, items: list[Item], stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.total = len(items)
        self.done = 0
        self.status: collections.Counter = collections.Counter()
        self.left = collections.Counter((i.backend, i.op) for i in items)
        self.groups: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)

    def __call__(self, index: int, record: Record) -> None:
        self.done += 1
        self.status[record.status] += 1
        key = (record.backend, record.op)
        self.groups[key][record.status] += 1
        self.left[key] -= 1
        if self.tty:
            counts = " ".join(f"{self.status[s]} {s}" for s in STATUSES if self.status[s])
            line = f"[{self.done}/{self.total}] {counts}  {record.backend} {record.case}"
            self.stream.write("\r\x1b[K" + line[:160])
            self.stream.flush()
        elif self.left[key] == 0:
            c = self.groups[key]
            counts = ", ".join(f"{c[s]} {s}" for s in STATUSES if c[s])
            self.stream.write(f"[{self.done}/{self.total}] {record.backend} {record.op}: {counts}\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty and self.done:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
