"""The ``model.lora`` section's checks: the LoRA variant's part of ``validate.py``.

The adapter's own fields, what a family's blocks let adapters attach to, and what a LoRA run does not
do. ``validate.py`` calls ``check_lora_model`` and ``check_lora_run`` on every config; each does
nothing for a model without adapters, so the section is tested for in this one module."""
from __future__ import annotations

import math

from megatrain_jax.config.schema import LORA_BASE_DTYPES, LORA_TARGETS, Config, LoraConfig, ModelConfig
from megatrain_jax.errors import UserError


def validate_lora(lora: LoraConfig) -> None:
    """The adapter's own fields (the family's part: ``check_lora_model``)."""
    r = lora.rank
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise UserError("model.lora.rank", f"must be an integer >= 1, got {r!r}", "set model.lora.rank, e.g. 16")
    for name, v, ok, rule in (("alpha", lora.alpha, lambda x: x > 0, "> 0"),
                              ("dropout", lora.dropout, lambda x: 0 <= x < 1, "in [0, 1)")):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
            raise UserError(f"model.lora.{name}", f"must be a number {rule}, got {v!r}",
                            f"set model.lora.{name} to a number {rule}")
    t = lora.targets
    if (not isinstance(t, (list, tuple)) or not t or any(x not in LORA_TARGETS for x in t)
            or len(set(t)) != len(t)):
        raise UserError("model.lora.targets", f"must be a non-empty list of distinct names from "
                        f"{', '.join(LORA_TARGETS)}, got {t!r}", "e.g. targets: [q, k, v, o, gate, up, down]")
    if lora.base_dtype not in LORA_BASE_DTYPES:
        raise UserError("model.lora.base_dtype", f"{lora.base_dtype!r} is not supported",
                        f"use one of: {', '.join(LORA_BASE_DTYPES)}")


def check_lora_model(m: ModelConfig, fam) -> None:
    """``validate_model``'s part: the adapter's fields, and projections of family ``fam`` that can take one."""
    if m.lora is None:
        return
    validate_lora(m.lora)
    if fam.block.__dict__.get("FUSED") or getattr(fam.block, "FUSED", False):
        raise UserError("model.lora", f"the {m.family} family's fused qkv_proj / gate_up_proj take no adapters yet",
                        "set model.lora: null, or use a family with separate projections (llama, qwen3, gemma)")
    mlp = sorted(set(m.lora.targets) & {"gate", "up", "down"})
    if fam.extra.get("moe") and mlp:
        raise UserError("model.lora.targets", f"the {m.family} family's experts take no adapters ({', '.join(mlp)})",
                        "target the attention projections only: targets: [q, k, v, o]")


def check_lora_run(cfg: Config) -> None:
    """What LoRA training (engine/lora.py: optax on the GPU; data parallel over one process's GPUs) does not
    do; the reference engine trains every weight, never adapters."""
    m, o, t = cfg.model, cfg.optim, cfg.train
    if m.lora is None:
        return
    if t.engine == "reference":
        raise UserError("train.engine", "the reference engine trains every weight, not LoRA adapters",
                        "set train.engine=streamed, or model.lora: null")
    if o.moments != "float32":
        raise UserError("optim.moments", f"{o.moments} moments are the host kernel's; LoRA keeps its optimizer state "
                        "on the GPU in float32", "set optim.moments=float32")
    if m.router_aux_loss_coef:
        raise UserError("model.router_aux_loss_coef", "LoRA training freezes the router and adds no load-balancing loss",
                        "set model.router_aux_loss_coef=0")
    if m.lora.dropout > 0 and m.seq_tile_tokens > 0:
        raise UserError("model.lora.dropout", "adapter dropout over sequence tiles would repeat one mask per tile",
                        "set model.lora.dropout=0, or model.seq_tile=0")
