"""What the trainer prints, and what each figure counts.

- tokens/s: tokens in the batch (B x S) over the wall time between step starts.
- model TFLOPS: 6 x non-embedding parameters x tokens / step time (the 6·N·T convention; the
  recompute of the streamed backward is *not* counted, so this is model FLOPs, not hardware FLOPs).
- model TFLOPS incl. attention: adds 12 x layers x (heads x head_dim) x seq_len per token
  (PaLM's convention: forward + backward of QK^T and AV, no causal discount).
"""
from __future__ import annotations

import json
import os
from typing import Any, TextIO

from megatrain_jax.config import ModelConfig


def model_flops_per_token(cfg: ModelConfig) -> float:
    return 6.0 * cfg.non_embedding_params()


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 12.0 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head * seq_len


class MetricsWriter:
    """Appends one JSON object per line; flushed every record so a crash loses nothing."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._f: TextIO = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
