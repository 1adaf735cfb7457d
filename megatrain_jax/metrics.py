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
    """The family's ``flops_per_token``: 6 x the non-embedding parameters a token uses (for a mixture
    of experts, only the experts it is routed to: active-parameter model FLOPs, whatever the
    formulation computes)."""
    return cfg.flops_per_token()


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 12.0 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head * seq_len


class MetricsWriter:
    """Appends one JSON object per line (flushed every record so a crash loses nothing) and, when
    ``tensorboard`` is on and ``tensorboardX`` is installed, the same scalars as TensorBoard event
    files in ``<dir>/tensorboard`` (``tensorboard --logdir <train.out_dir>/tensorboard``)."""

    SCALARS = ("loss", "aux_loss", "grad_norm", "lr", "tokens_per_s", "model_tflops", "model_tflops_with_attention",
               "step_time_s", "host_rss_gb", "host_peak_rss_gb", "gpu_peak_gb", "gpu_in_use_gb")

    def __init__(self, path: str, tensorboard: bool = True, log=None):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._f: TextIO = open(path, "a")
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                if log is not None:
                    log("metrics: tensorboardX is not installed; TensorBoard event files are not written "
                        "(pip install tensorboardX); metrics.jsonl has every figure")
            else:
                self._tb = SummaryWriter(os.path.join(os.path.dirname(path) or ".", "tensorboard"), flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb is not None and "step" in record:
            for k in self.SCALARS:
                v = record.get(k)
                if isinstance(v, (int, float)) and v == v:
                    self._tb.add_scalar(f"train/{k}", v, int(record["step"]))

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
