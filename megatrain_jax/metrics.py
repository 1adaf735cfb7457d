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
               "step_time_s", "host_rss_gb", "host_peak_rss_gb", "gpu_peak_gb", "gpu_in_use_gb",
               "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")  # (preference objectives)

    # held-out evaluation (evaluate.py); a preference objective's as TRL logs them (its eval loss: eval/loss)
    EVAL_SCALARS = {"eval_loss": "eval/loss", "eval_ppl": "eval/perplexity",
                    **{f"eval/{k}": f"eval/{k}" for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                                          "rewards/margins", "logps/chosen", "logps/rejected")}}

    def __init__(self, path: str, tensorboard: bool = True, log=None):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path, self.tb_dir = path, os.path.join(os.path.dirname(path) or ".", "tensorboard")
        self._f: TextIO = open(path, "a")
        self._tb = None
        self.tb_error: OSError | None = None  # the TensorBoard writer's failure (its thread writes): raised by write()
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                if log is not None:
                    log("metrics: tensorboardX is not installed; TensorBoard event files are not written "
                        "(pip install tensorboardX); metrics.jsonl has every figure")
            else:
                self._tb = SummaryWriter(self.tb_dir, flush_secs=10)
                _guard_event_writer(self._tb, self)

    def write(self, record: dict[str, Any]) -> None:
        """One record; an ``OSError`` (a full disk) of either file is raised here, in the caller's thread."""
        try:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        except OSError as e:  # named: the error of a write to an open file has no file name
            raise OSError(e.errno, e.strerror or str(e), self.path) from None
        if self.tb_error is not None:
            raise self.tb_error
        if self._tb is not None and "step" in record:
            for k in self.SCALARS:
                v = record.get(k)
                if isinstance(v, (int, float)) and v == v:
                    self._tb.add_scalar(f"train/{k}", v, int(record["step"]))
            for k, tag in self.EVAL_SCALARS.items():
                v = record.get(k)
                if isinstance(v, (int, float)) and v == v:
                    self._tb.add_scalar(tag, v, int(record["step"]))

    def close(self) -> None:
        """Close both files (each, whatever the other does); then raise the first ``OSError`` met."""
        err = None
        try:
            self._f.close()
        except OSError as e:
            err = OSError(e.errno, e.strerror or str(e), self.path)
        if self._tb is not None:
            self._tb.close()  # (guarded: a failure is kept in tb_error, never raised from its thread)
        err = err or self.tb_error
        if err is not None:
            raise err


class _GuardedEvents:
    """tensorboardX's event-file writer, whose failures (a full disk) are kept in ``owner.tb_error`` instead of
    ending its background thread with a traceback; nothing more is written once one failed."""

    def __init__(self, inner, owner: MetricsWriter):
        self._inner, self._owner = inner, owner

    def _call(self, name: str, *args):
        if self._owner.tb_error is not None:
            return None
        try:
            return getattr(self._inner, name)(*args)
        except OSError as e:
            self._owner.tb_error = OSError(e.errno, e.strerror or str(e), self._owner.tb_dir)
            return None

    def write_event(self, event):
        return self._call("write_event", event)

    def flush(self):
        return self._call("flush")

    def close(self):
        return self._call("close")

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _guard_event_writer(tb, owner: MetricsWriter) -> None:
    """Put ``_GuardedEvents`` between the SummaryWriter and its event file (both its thread and ``flush``/``close``
    write through it). A tensorboardX without these attributes is left as it is."""
    try:
        fw = tb._get_file_writer().event_writer
        guarded = _GuardedEvents(fw._ev_writer, owner)
        fw._ev_writer = guarded
        if fw._worker is not None:
            fw._worker._record_writer = guarded
    except AttributeError:
        pass
