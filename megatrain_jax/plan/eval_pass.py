"""The eval passes of a run as the plan counts them (``evaluate.py`` runs them): their time, from the step's own
prediction; their GPU memory is under the step's forward (micro-batches of the step's shape, no boundary activation
kept, no gradient), so no row of the plan grows."""
from __future__ import annotations

import math
from typing import Any

from megatrain_jax.config.eval_fields import eval_tokens, has_eval


def plan_eval(cfg: Any, plan: Any) -> dict[str, float] | None:
    """An eval pass's predicted seconds (a forward sweep: its matmuls at the step's rate, the weights streamed
    once) and the passes a run makes; None without an eval set. Its GPU memory is under the step's forward
    (the module docstring)."""
    d, t = cfg.data, cfg.train
    if plan is None or not has_eval(cfg):
        return None
    step = getattr(plan, "step", None) or {}
    tokens = math.ceil(eval_tokens(cfg) / d.seq_len) * d.seq_len
    step_tokens = t.batch_size * d.seq_len
    compute = step.get("compute_s")
    h2d = step.get("h2d_s")
    if compute is None:
        return None
    # the step's compute is about 4x its forward (forward, recompute, backward at 2x); a pass streams the
    # weights once where the step streams them twice
    fwd_s = compute / 4.0 * tokens / step_tokens
    stream_s = (h2d or 0.0) / 2.0
    passes = (t.steps // t.eval_every if t.eval_every else 0) + (0 if t.eval_every and t.steps % t.eval_every == 0
                                                                 else 1)
    return {"eval_pass_s": max(fwd_s, stream_s * math.ceil(tokens / step_tokens)), "eval_passes": passes,
            "eval_tokens": tokens}
