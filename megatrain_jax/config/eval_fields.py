"""The held-out evaluation fields (``data.eval``, ``data.eval_fraction``, ``train.eval_every``, ``train.eval_tokens``),
checked with the rest of the config before anything is read (``evaluate.py`` builds the eval set)."""
from __future__ import annotations

from typing import Any

from megatrain_jax.errors import UserError


def eval_tokens(cfg: Any) -> int:
    """``train.eval_tokens``, or one training step's tokens when left null."""
    t = cfg.train
    return int(t.eval_tokens) if t.eval_tokens else int(t.batch_size * cfg.data.seq_len)


def has_eval(cfg: Any) -> bool:
    """Whether the run evaluates (a held-out file or a split)."""
    return bool(cfg.data.eval) or cfg.data.eval_fraction is not None


def check_eval_fields(cfg: Any) -> None:
    """The eval fields on their own (before any data is read)."""
    d, t = cfg.data, cfg.train
    if d.eval is not None and (not isinstance(d.eval, str) or not d.eval):
        raise UserError("data.eval", f"must be a path, got {d.eval!r}", "set data.eval to a held-out file, or null")
    if d.eval_fraction is not None:
        f = d.eval_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < 1.0:
            raise UserError("data.eval_fraction", f"must be a fraction strictly between 0 and 1, got {f!r}",
                            "set e.g. data.eval_fraction=0.05, or null (and data.eval) for no split")
        if d.eval:
            raise UserError("data.eval_fraction", "is set together with data.eval",
                            "hold out either a file (data.eval) or a share of the training data (data.eval_fraction)")
    if isinstance(t.eval_every, bool) or not isinstance(t.eval_every, int) or t.eval_every < 0:
        raise UserError("train.eval_every", f"must be an integer >= 0, got {t.eval_every!r}",
                        "set train.eval_every=N (0: evaluate only at the end)")
    if t.eval_tokens is not None and (isinstance(t.eval_tokens, bool) or not isinstance(t.eval_tokens, int)
                                      or t.eval_tokens <= 0):
        raise UserError("train.eval_tokens", f"must be a positive integer, got {t.eval_tokens!r}",
                        "set train.eval_tokens=N tokens per evaluation, or null for one training step's tokens")
    if t.eval_every and not (d.eval or d.eval_fraction):
        raise UserError("train.eval_every", f"is {t.eval_every} but there is nothing to evaluate on",
                        "set data.eval (a held-out file) or data.eval_fraction (a share of the data)")
