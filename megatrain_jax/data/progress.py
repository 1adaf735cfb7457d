"""``prepare``'s progress line, shared by the text path (``pipeline.py``) and the JSONL path (``jsonl.py``)."""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatrain_jax.data.packed import PackedWriter


class Progress:
    """Prints a progress line to stderr at most every few seconds (silent for short runs).
    Public: the jsonl and pipeline preparers report through it."""

    def __init__(self, total_bytes: int, quiet: bool, every: float = 5.0):
        self.total, self.quiet, self.every = max(total_bytes, 1), quiet, every
        self.t0 = self.last = time.time()
        self.bytes = 0

    def update(self, nbytes: int, writer: "PackedWriter", file_i: int, n_files: int) -> None:
        self.bytes += nbytes
        now = time.time()
        if self.quiet or now - self.last < self.every:
            return
        self.last = now
        secs = max(now - self.t0, 1e-9)
        frac = min(1.0, self.bytes / self.total)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        eta = secs * (1 - frac) / max(frac, 1e-9)
        print(f"prepare: [{bar}] {100 * frac:3.0f}% file {file_i}/{n_files}, {writer.n_docs:,} docs, "
              f"{writer.n_tokens:,} tokens, {self.bytes / secs / 1e6:.1f} MB/s, {writer.n_tokens / secs:,.0f} tokens/s, "
              f"eta {eta:.0f}s", file=sys.stderr, flush=True)
